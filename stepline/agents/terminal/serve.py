"""python -m stepline.agents.terminal.serve: the terminal harness as a long-lived worker (see stepline/agents/common/serve.py).

Each episode runs in a child forked from this worker, so the sandbox's per-episode uid and its
commands' parent-death signal (stepline/agents/terminal/sandbox.py) are the child's: killing the child at the
episode timeout kills the episode's commands, as killing a `run` process does.
"""

from pathlib import Path

from stepline.agents.common import Verdict, verdict_for
from stepline.agents.common.serve import ServedHarness, serve_command, warm_sdk
from stepline.agents.terminal.run import MAX_TURNS, NAME, play
from stepline.agents.terminal.sandbox import detect_mode
from stepline.agents.terminal.tasks import is_task
from stepline.agents.terminal.verify import score


def warm() -> None:
    """Built once before the first fork: the SDK import and the sandbox mode probe (an unshare run)."""
    warm_sdk("anthropic")
    detect_mode()


def verdict(task_id: str, out: Path) -> Verdict:
    return verdict_for(NAME, lambda t, episode: score(out, t, episode), is_task, task_id, out)


HARNESS = ServedHarness(name=NAME, play=play, verdict=verdict, known=is_task, max_turns=MAX_TURNS, warm=warm)
main = serve_command(HARNESS)

if __name__ == "__main__":
    main()
