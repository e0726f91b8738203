"""The long-lived harness worker (`python -m stepline.agents.<name>.serve`, stepline/agents/common/serve.py) as a black
box on its pipes: the same episode.json and verdict as `run` + `verify`, bad requests and broken
endpoints answered as failures, and a clean exit at the end of stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness_helpers import ROOT, cli, endpoint, verdict

from stepline.agents.common import Verdict, read_episode

EXPERT_TASKS = {"search": "search-0004", "ui": "ui-0003", "terminal": "count-fox-1"}


class Worker:
    """A worker process and a blocking JSON-lines client for it."""

    def __init__(self, harness: str):
        self.proc = subprocess.Popen([sys.executable, "-m", f"stepline.agents.{harness}.serve"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.ready = self.read()

    def send(self, message: dict[str, Any] | str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "worker exited"
        return json.loads(line)

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def request(ident: str, task_id: str, out: Path, **kw: Any) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    return {"id": ident, "task_id": task_id, "out": str(out / "episode"), "logs": str(out), "timeout_s": 60,
            "verify_timeout_s": 60, **kw}


@pytest.mark.parametrize("harness", sorted(EXPERT_TASKS))
def test_expert_episode_matches_run_and_verify(harness: str, tmp_path: Path) -> None:
    task_id = EXPERT_TASKS[harness]
    done = cli(f"stepline.agents.{harness}.run", "--task", task_id, "--out", str(tmp_path / "cli"), "--expert")
    assert done.returncode == 0, done.stderr
    worker = Worker(harness)
    assert worker.ready["ready"] is True and worker.ready["harness"] == harness
    worker.send(request("1", task_id, tmp_path / "w", expert=True))
    answer = worker.read()
    assert worker.close() == 0
    assert (answer["id"], answer["outcome"]) == ("1", "ran")
    assert Verdict.model_validate(answer["verdict"]) == verdict(harness, task_id, tmp_path / "cli")  # JSON: str keys
    assert answer["verdict"]["success"] is True
    assert read_episode(tmp_path / "w" / "episode") == read_episode(tmp_path / "cli")


def test_bad_requests_and_a_dead_endpoint_are_failures_and_the_worker_goes_on(tmp_path: Path) -> None:
    worker = Worker("search")
    worker.send("not json")
    worker.send({"id": "x", "task_id": "search-0004"})  # no out, logs, timeouts
    worker.send(request("unknown", "search-9999", tmp_path / "u"))
    worker.send(request("down", "search-0004", tmp_path / "d", env={**endpoint("http://127.0.0.1:9/v1")}))
    answers = {a["id"]: a for a in (worker.read() for _ in range(4))}
    worker.send(request("after", "search-0004", tmp_path / "a", expert=True))
    answers["after"] = worker.read()
    assert worker.close() == 0
    assert answers[None]["reason"].startswith("bad request") and answers["x"]["reason"].startswith("bad request")
    assert (answers["unknown"]["outcome"], answers["unknown"]["reason"]) == ("failed", "unknown task 'search-9999'")
    # What `run` prints as its last stderr line for the same broken endpoint.
    done = cli("stepline.agents.search.run", "--task", "search-0004", "--out", str(tmp_path / "cli"),
               env=endpoint("http://127.0.0.1:9/v1"))
    assert done.returncode == 1
    assert answers["down"]["reason"] == done.stderr.strip().splitlines()[-1]
    assert read_episode(tmp_path / "d" / "episode").error == read_episode(tmp_path / "cli").error
    assert answers["after"]["verdict"]["reward"] == 1.0
