"""Helpers for the search and UI harness tests: the CLIs as subprocesses, scripted endpoints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepline.agents.common import Verdict
from stepline.agents.common.loop import RawCall, Turn
from stepline.agents.common.scripted_server import Reply

ROOT = Path(__file__).resolve().parents[2]


def cli(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m module args…` from the repository root, with the endpoint variables from `env` only."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def verdict(harness: str, task_id: str, out: Path) -> Verdict:
    done = cli(f"stepline.agents.{harness}.verify", "--task", task_id, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return Verdict.model_validate_json(done.stdout)


def endpoint(url: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": url, "OPENAI_API_KEY": "k", "AGENT_MAX_RETRIES": "0"}


def as_reply(turn: Turn) -> Reply:
    return Reply(turn.content, [(c.name, c.arguments) for c in turn.tool_calls])


def server_policy(policy: Callable[[list[dict[str, Any]]], Turn]) -> Callable[[dict[str, Any]], Reply]:
    """A ScriptedServer policy that answers each request with `policy(request messages)`."""
    return lambda body: as_reply(policy(body["messages"]))


def random_policy(rng: random.Random, calls: list[Callable[[random.Random], tuple[str, dict[str, Any]]]]):
    """Each turn: garbage text (1 in 4) or one random tool call from `calls`."""

    def policy(messages: list[dict[str, Any]]) -> Turn:
        if rng.random() < 0.25:
            return Turn("".join(rng.choice("abc xyz{}<>") for _ in range(12)), [])
        name, arguments = rng.choice(calls)(rng)
        return Turn(None, [RawCall(f"r{len(messages)}", name, json.dumps(arguments))])

    return policy
