"""python -m agents.ui.verify --task ID --out DIR  ->  {"reward": 1|0, "success", "reason"}.

The app's final state is rebuilt by replaying the episode's recorded actions on a fresh app (the
harness's own record of the state must agree with it), then compared with the task's goal state.
"""

from agents.common import Episode, Verdict, failed, verify_command
from agents.ui.harness import NAME, known, replay
from agents.ui.world import task_by_id


def score(task_id: str, episode: Episode) -> Verdict:
    task = task_by_id()[task_id]
    data = replay(task, episode.calls).data
    if episode.state is not None and episode.state.get("data") != data:
        return failed("the recorded app state differs from the replayed actions")
    if data != task.target:
        changed = "unchanged" if data == task.data else "changed, but not as asked"
        return failed(f"{task.app} state {changed}")
    return Verdict(reward=1.0, success=True, reason=f"{task.app} state matches the goal")


main = verify_command(NAME, score, known)

if __name__ == "__main__":
    main()
