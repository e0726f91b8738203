"""python -m stepline.agents.ui.verify --task ID --out DIR  ->  {"reward": 0..1, "success", "reason"}.

The app's final state is rebuilt by replaying the episode's recorded actions on a fresh app (the
harness's own record of the state must agree with it), then compared with the task's goal state.
Success (the goal state reached) scores 1; short of it, an episode earns partial credit for the plan
steps it did reach in order (PARTIAL per the whole plan: tapping the right section of two steps scores
0.25), so a group in which nobody finishes still tells the better attempts from the worse.
"""

from stepline.agents.common import Episode, Verdict, failed, verify_command
from stepline.agents.ui.harness import NAME, known, replay_with_progress
from stepline.agents.ui.world import task_by_id

PARTIAL = 0.5  # the reward of reaching every plan step but not the goal state (a later step undid it)


def score(task_id: str, episode: Episode) -> Verdict:
    task = task_by_id()[task_id]
    app, reached = replay_with_progress(task, episode.calls)
    data = app.data
    if episode.state is not None and episode.state.get("data") != data:
        return failed("the recorded app state differs from the replayed actions")
    if data != task.target:
        changed = "unchanged" if data == task.data else "changed, but not as asked"
        reason = f"{task.app} state {changed} ({reached} of {len(task.plan)} plan steps)"
        return Verdict(reward=PARTIAL * reached / len(task.plan), success=False, reason=reason)
    return Verdict(reward=1.0, success=True, reason=f"{task.app} state matches the goal")


main = verify_command(NAME, score, known)

if __name__ == "__main__":
    main()
