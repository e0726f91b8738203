"""python -m stepline.agents.search.serve: the search harness as a long-lived worker (see stepline/agents/common/serve.py)."""

from functools import partial

from stepline.agents.common import verdict_for
from stepline.agents.common.serve import ServedHarness, serve_command, warm_sdk
from stepline.agents.search.harness import MAX_TURNS, NAME, known, play
from stepline.agents.search.index import index
from stepline.agents.search.verify import score
from stepline.agents.search.world import task_by_id


def warm() -> None:
    """Everything an episode needs, built once before the first fork: tasks, the BM25 index, the SDK."""
    import tqdm

    tqdm.tqdm.monitor_interval = 0  # bm25s makes (hidden) tqdm bars; tqdm's monitor thread must not exist at fork
    task_by_id()
    warm_sdk("openai")
    index()


HARNESS = ServedHarness(
    name=NAME, play=lambda task_id, out, max_turns, max_tokens, expert: play(task_id, max_turns, max_tokens, expert),
    verdict=partial(verdict_for, NAME, score, known), known=known, max_turns=MAX_TURNS, warm=warm,
)
main = serve_command(HARNESS)

if __name__ == "__main__":
    main()
