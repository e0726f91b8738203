"""A job whose engine is vLLM (`[services] engine_kind = "vllm"`): what the job file accepts, and the server the
job starts — its command line, its environment, and the gateway driving it with the vLLM adapter.

Without vLLM installed: a stand-in "vLLM python" writes down its argv and environment and then serves
`FakeEngine` (tests/fakes/engine.py) in vLLM's wire format on the port it was given. The real vLLM runs in
tests/engines/test_vllm_job.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import httpx
import pytest

from stepline.launch.job import JobError, load_job
from stepline.launch.phases import RunDir
from stepline.launch.run import services

FAKE_ENGINE = Path(__file__).resolve().parent / "fakes" / "engine.py"
FAKE_VLLM = """#!/bin/sh
# argv: -m vllm.entrypoints.openai.api_server --model DIR --host H --port P ...
printf '%s\\n' "$@" > "$(dirname "$0")/argv"
env > "$(dirname "$0")/env"
while [ "$1" != "--port" ]; do shift; done
exec {python} {fake_engine} --api vllm --port "$2"
"""


def job(tmp_path: Path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_job(path)


def test_a_job_starts_vllm_only_on_a_model_vllm_can_reload(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="model.vllm_compatible"):
        job(tmp_path, '[services]\nengine_kind = "vllm"\n')
    # a tied model trains through vLLM (Stepline's worker extension loads its weights in place)
    job(tmp_path, '[model]\nkind = "smollm2-135m"\n[services]\nengine_kind = "vllm"\n')
    with pytest.raises(JobError, match=r"hidden_size / num_heads .* got 96 / 4"):
        job(tmp_path, '[model]\nvllm_compatible = true\nhidden_size = 96\nnum_heads = 4\n')
    with pytest.raises(JobError, match="services.engine_url of a running SGLang"):
        job(tmp_path, '[services]\nengine_kind = "sglang"\n')
    cfg = job(tmp_path, '[model]\nvllm_compatible = true\nnum_heads = 2\nnum_kv_heads = 1\n'
                        '[services]\nengine_kind = "vllm"\nvllm_args = ["--max-num-seqs", "16"]\n')
    assert (cfg.model.vllm_compatible, cfg.services.vllm_args) == (True, ["--max-num-seqs", "16"])
    # a model folder the job is given, or a running vLLM, is the user's to choose
    job(tmp_path, '[services]\nengine_url = "http://127.0.0.1:1"\nengine_kind = "vllm"\n')


def test_the_job_says_where_vllm_is_missing(tmp_path: Path, tiny_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPLINE_VLLM_PYTHON", raising=False)
    cfg = job(tmp_path, f'[model]\ndir = "{tiny_model_dir}"\n[services]\nengine_kind = "vllm"\n')
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    with pytest.raises(JobError, match="set services.vllm_python"), services(cfg, run, tiny_model_dir, "tok"):
        pass


def test_the_job_starts_vllm_with_what_the_gateway_needs_and_drives_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    fake = tmp_path / "venv" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_VLLM.format(python=sys.executable, fake_engine=FAKE_ENGINE))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cfg = job(tmp_path, f'[model]\ndir = "{tiny_model_dir}"\n[services]\nengine_kind = "vllm"\n'
                        f'vllm_python = "{fake}"\nvllm_args = ["--max-num-seqs", "16"]\nengine_threads = 1\n'
                        'context_length = 2048\nstartup_timeout_s = 60\n')
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    with services(cfg, run, tiny_model_dir, "admin") as gateway:
        started = json.loads((run.root / "services.json").read_text())
        session = httpx.post(f"{gateway}/sessions", json={"task_id": "t", "harness": "h"},
                             headers={"Authorization": "Bearer admin"}).json()
        answer = httpx.post(f"{session['openai_base_url']}/chat/completions",
                            headers={"Authorization": f"Bearer {session['api_key']}"},
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert started["engine_kind"] == "vllm" and started["gateway"] == gateway
    argv = (fake.parent / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[2::2], argv[3::2]))
    assert pairs["--model"] == str(tiny_model_dir) and pairs["--port"] == started["engine"].rsplit(":", 1)[1]
    assert (pairs["--logprobs-mode"], pairs["--generation-config"]) == ("processed_logprobs", "vllm")
    assert (pairs["--dtype"], pairs["--max-model-len"], pairs["--max-num-seqs"]) == ("float32", "2048", "16")
    assert pairs["--worker-extension-cls"] == "stepline.engine.vllm_worker.SteplineWorker"
    env = dict(line.split("=", 1) for line in (fake.parent / "env").read_text().splitlines() if "=" in line)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_API_KEY"] == os.environ["STEPLINE_ENGINE_TOKEN"]  # the token the gateway sends
    # the extension's modules alone on vLLM's path (never this environment's site-packages and its torch)
    shim = Path(env["PYTHONPATH"])
    assert sorted(str(p.relative_to(shim)) for p in shim.rglob("*.py")) == [
        "stepline/__init__.py", "stepline/engine/__init__.py", "stepline/engine/vllm_worker.py", "stepline/weightdelta.py"]
    assert "STEPLINE_PARENT_PID" not in env  # consumed by stepline.launch.lifeline before it became vLLM
