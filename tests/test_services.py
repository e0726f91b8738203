"""stepline/launch/services.py: each service's spec spells its command line once, for `up`, `run` and the Ray parts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from click.testing import CliRunner

from stepline.cli import main
from stepline.launch.job import JobConfig
from stepline.launch.services import EngineSpec, GatewaySpec, PoolSpec, Services, stepline_argv

STEPLINE = [sys.executable, "-m", "stepline.cli"]


def test_a_spec_left_at_its_defaults_passes_only_what_it_must() -> None:
    assert EngineSpec(Path("/m"), 9001).to_argv() == [*STEPLINE, "engine", "--model", "/m", "--port", "9001"]
    assert PoolSpec("sqlite:///p.db", 9002).to_argv() == [*STEPLINE, "pool", "serve", "--db", "sqlite:///p.db",
                                                          "--port", "9002"]
    assert GatewaySpec(("http://e:1",), Path("/m"), "sqlite:///p.db", 9003).to_argv() == [
        *STEPLINE, "gateway", "--engine", "http://e:1", "--engine-kind", "builtin", "--model", "/m",
        "--pool", "sqlite:///p.db", "--port", "9003"]


def test_every_field_becomes_its_flag() -> None:
    engine = EngineSpec(Path("/m"), "{port}", "{host}", context_length=512, dtype="bfloat16", prefix_cache_mb=64.0,
                        threads=2).to_argv()
    assert engine == [*STEPLINE, "engine", "--model", "/m", "--port", "{port}", "--host", "{host}", "--dtype",
                      "bfloat16", "--prefix-cache-mb", "64.0", "--context-length", "512", "--threads", "2"]
    gateway = GatewaySpec(("http://a:1", "http://b:2"), Path("/m"), "postgresql://db", 8000, "vllm", host="0.0.0.0",
                          spill=Path("/s/g.spill"), session_idle_timeout=60.0, context_length=512,
                          responses_truncated="completed").to_argv()
    assert gateway == [*STEPLINE, "gateway", "--engine", "http://a:1", "--engine", "http://b:2", "--engine-kind",
                       "vllm", "--model", "/m", "--pool", "postgresql://db", "--host", "0.0.0.0", "--port", "8000",
                       "--spill", "/s/g.spill", "--session-idle-timeout", "60.0", "--context-length", "512",
                       "--responses-truncated", "completed"]


def test_the_commands_accept_what_the_specs_write(tmp_path: Path) -> None:
    """Each argv parses with its real subcommand (--help after it: parsed, nothing started)."""
    model = tmp_path / "m"
    model.mkdir()
    for spec in (EngineSpec(model, 1, "127.0.0.1", 512, "bfloat16", 64.0, 2), PoolSpec("sqlite:///p.db", 1, "127.0.0.1"),
                 GatewaySpec(("http://a:1",), model, "sqlite:///p.db", 1, "sglang", "127.0.0.1", tmp_path / "s", 5.0,
                             512, responses_truncated="completed")):
        argv = spec.to_argv()
        assert argv[:3] == STEPLINE
        result = CliRunner().invoke(main, [*argv[3:], "--help"])
        assert result.exit_code == 0, (argv, result.output)


def test_the_job_engine_is_the_services_table() -> None:
    from stepline.launch.wiring import engine_spec

    svc = JobConfig.model_validate({"services": {"context_length": 256, "engine_threads": 3,
                                                 "prefix_cache_mb": 0}}).services
    assert engine_spec(svc, Path("/p"), 7).to_argv()[3:] == [
        "engine", "--model", "/p", "--port", "7", "--dtype", "float32", "--prefix-cache-mb", "0.0",
        "--context-length", "256", "--threads", "3"]


STOPPABLE = """
import signal, sys, time
def stop(*_):
    with open(sys.argv[2], "a") as f:
        f.write(sys.argv[1] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
time.sleep(60)
"""


def test_services_stop_in_reverse_start_order(tmp_path: Path) -> None:
    """The gateway started last stops first (it flushes to the pool), the engine started first stops last."""
    order = tmp_path / "order"
    with Services(tmp_path / "logs", timeout=5) as services:
        for name in ("engine", "pool", "gateway"):
            services.start(name, [sys.executable, "-c", STOPPABLE, name, str(order)])
        for name in ("engine", "pool", "gateway"):  # each has its SIGTERM handler before we stop it
            while "up" not in (tmp_path / "logs" / f"{name}.log").read_text():
                time.sleep(0.05)
    assert order.read_text().split() == ["gateway", "pool", "engine"]
    assert [c.proc.returncode for c in services.children] == [0, 0, 0]
    assert stepline_argv("x") == [*STEPLINE, "x"]
