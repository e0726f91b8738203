"""The pieces of `stepline run --ray` that need no Ray: the [cluster] table, argv templates, the weight
fan-out, and that nothing imports ray until a Ray job starts (tests/test_ray_job.py runs the whole job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepline.launch.job import ClusterSection, JobError, load_job
from stepline.launch.ray_parts import fill
from stepline.trainer.weight_sync import FanOutWeightSync, RecordingWeightSync, WeightSyncError

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_engines_must_split_evenly_over_gateways(tmp_path: Path) -> None:
    assert ClusterSection(engines=4, gateways=2).engines == 4
    job = tmp_path / "job.toml"
    job.write_text("[cluster]\nengines = 3\ngateways = 2\n")
    with pytest.raises(JobError, match="multiple of gateways"):
        load_job(job)


def test_cluster_table_rejects_unknown_fields(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[cluster.engine]\nnum_gpu = 1\n")  # num_gpus misspelt
    with pytest.raises(JobError, match="cluster.engine.num_gpu"):
        load_job(job)


def test_fill_replaces_placeholders_and_leaves_other_braces() -> None:
    argv = ["serve", "--model-path", "{model}", "--host={host}", "--port", "{port}", '{"a": 1}']
    assert fill(argv, {"host": "10.0.0.2", "port": "30000", "model": "/m"}) == [
        "serve", "--model-path", "/m", "--host=10.0.0.2", "--port", "30000", '{"a": 1}']


class _Refusing(RecordingWeightSync):
    def push(self, path: Path, version: int) -> None:
        raise WeightSyncError("refused")


def test_fan_out_pushes_to_every_gateway_in_order_and_stops_at_a_failure() -> None:
    first, second = RecordingWeightSync(), RecordingWeightSync()
    FanOutWeightSync([first, second]).push(Path("/w/v000001"), 1)
    assert first.pushes == second.pushes == [(Path("/w/v000001"), 1)]
    after = RecordingWeightSync()
    with pytest.raises(WeightSyncError):
        FanOutWeightSync([first, _Refusing(), after]).push(Path("/w/v000002"), 2)
    assert first.pushes[-1][1] == 2 and after.pushes == []  # the failure is the trainer's, not skipped


def test_no_module_imports_ray_until_a_ray_job_starts() -> None:
    code = "import sys, stepline.cli, stepline.launch.run, stepline.launch.ray_run, stepline.launch.ray_parts; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_address_needs_ray_flag(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from stepline.launch.run import run_command

    job = tmp_path / "job.toml"
    job.write_text("")
    result = CliRunner().invoke(run_command, [str(job), "--ray-address", "auto"])
    assert result.exit_code == 2 and "--ray-address needs --ray" in result.output


SERVER = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer.allow_reuse_address = True
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Ok).serve_forever()
"""


def _wait(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_service_part_restarts_its_process_on_the_same_address_a_bounded_number_of_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from stepline.launch import ray_parts

    monkeypatch.setattr(ray_parts, "node_ip", lambda: "127.0.0.1")  # no Ray here: the part is a plain class
    part = ray_parts.ServicePart("svc", [sys.executable, "-c", SERVER, "{host}", "{port}"], tmp_path, {}, restarts=1)
    url = part.start(timeout=60)
    try:
        first = part.pid()
        os.kill(first, signal.SIGKILL)
        assert _wait(lambda: part.restarts_done() == 1 and part.pid() != first and part.alive())
        assert _wait(lambda: _answers(httpx, url))  # the same address again
        os.kill(part.pid(), signal.SIGKILL)  # no restarts left: it stays down, and the log says so
        assert _wait(lambda: "no restarts left" in (tmp_path / "svc.log").read_text())
        assert not part.alive() and part.restarts_done() == 1
        assert "restart 1 of 1" in (tmp_path / "svc.log").read_text()
    finally:
        part.stop()


def _answers(httpx, url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
