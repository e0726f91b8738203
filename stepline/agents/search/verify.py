"""python -m stepline.agents.search.verify --task ID --out DIR  ->  {"reward": F1, "success": EM, "reason": ...}.

The prediction is the text of the agent's `answer` call as the harness recorded it (or, failing
that, its final message); it is scored against the gold answer kept in the task set.
"""

from stepline.agents.common import Episode, Verdict, exact_match, failed, token_f1, verify_command
from stepline.agents.search.harness import NAME, known
from stepline.agents.search.world import task_by_id


def score(task_id: str, episode: Episode) -> Verdict:
    gold = task_by_id()[task_id].answer
    answers = [str(c.arguments.get("text", "")) for c in episode.calls if c.name == "answer" and not c.error]
    if answers:
        prediction = answers[-1]
    elif episode.finish == "final_message":
        prediction = episode.final or ""
    else:
        return failed(f"no answer ({episode.finish})")
    em, f1 = exact_match(prediction, gold), token_f1(prediction, gold)
    return Verdict(reward=f1, success=em, reason=f"answer {prediction[:80]!r}, gold {gold!r}: EM={int(em)} F1={f1:.2f}")


main = verify_command(NAME, score, known)

if __name__ == "__main__":
    main()
