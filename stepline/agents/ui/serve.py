"""python -m stepline.agents.ui.serve: the UI harness as a long-lived worker (see stepline/agents/common/serve.py)."""

from functools import partial

from stepline.agents.common import verdict_for
from stepline.agents.common.serve import ServedHarness, serve_command, warm_sdk
from stepline.agents.ui.harness import MAX_TURNS, NAME, known, play
from stepline.agents.ui.verify import score
from stepline.agents.ui.world import task_by_id


def warm() -> None:
    """Everything an episode needs, built once before the first fork: the task table and the SDK."""

    task_by_id()
    warm_sdk("openai")


HARNESS = ServedHarness(
    name=NAME, play=lambda task_id, out, max_turns, max_tokens, expert: play(task_id, max_turns, max_tokens, expert),
    verdict=partial(verdict_for, NAME, score, known), known=known, max_turns=MAX_TURNS, warm=warm,
)
main = serve_command(HARNESS)

if __name__ == "__main__":
    main()
