"""python -m stepline.agents.bfcl.serve: the BFCL harness as a long-lived worker (see stepline/agents/common/serve.py).

Its warm-up also starts one forking bridge server (client.py) that every episode's child connects to."""

import os
import tempfile
from functools import partial
from pathlib import Path

from stepline.agents.bfcl.client import SOCKET_ENV, start_server
from stepline.agents.bfcl.harness import MAX_TURNS, NAME, all_tasks, known, play
from stepline.agents.bfcl.verify import score
from stepline.agents.common import verdict_for
from stepline.agents.common.serve import ServedHarness, serve_command, warm_sdk


def warm() -> None:
    path = Path(tempfile.mkdtemp(prefix="stepline-bfcl-")) / "bridge.sock"
    start_server(path)  # dies with this worker (the bridge's parent-death signal)
    os.environ[SOCKET_ENV] = str(path)
    all_tasks()
    warm_sdk("openai")


HARNESS = ServedHarness(
    name=NAME, play=lambda task_id, out, max_turns, max_tokens, expert: play(task_id, max_turns, max_tokens, expert),
    verdict=partial(verdict_for, NAME, score, known), known=known, max_turns=MAX_TURNS, warm=warm,
)
main = serve_command(HARNESS)

if __name__ == "__main__":
    main()
