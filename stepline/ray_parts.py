"""The parts of `stepline run --ray`, as plain classes that Ray turns into actors (`ray.remote(Part)`).

Each part is what it is on one machine: an engine or a gateway is the same `stepline` process speaking the
same HTTP, started by a `ServicePart` on the node Ray placed it on; a `RolloutPart` runs the rollout driver
(`rollout.pacing.BackgroundRollouts`) against one gateway; a `TrainerPart` runs `trainer.loop.train` and
pushes weights to every gateway. Ray only places the parts and carries URLs between them, so nothing here
imports ray at module level (the core never needs it; `stepline[ray]` is an optional extra).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from stepline.lifeline import PARENT_PID_ENV
from stepline.up import Child, stop_all, wait_healthy

__all__ = ["RolloutPart", "ServicePart", "TrainerPart", "fill"]


def node_ip() -> str:
    """This node's address as Ray knows it (what the other nodes reach it by)."""
    import ray

    return str(ray.util.get_node_ip_address())


def free_port_on(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def fill(argv: list[str], values: dict[str, str]) -> list[str]:
    """Replace `{name}` placeholders in each argument (a plain replace: other braces stay as they are)."""
    out = []
    for arg in argv:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


class ServicePart:
    """One service process (`argv` with {host} {port} placeholders) on this actor's node, dying with it."""

    def __init__(self, name: str, argv: list[str], logs: Path, env: dict[str, str], model: str = "") -> None:
        self.name, self.argv, self.logs, self.env, self.model = name, argv, Path(logs), env, model
        self.child: Child | None = None
        self.url = ""

    def start(self, timeout: float) -> str:
        """Start the process, wait for /health; the service's base URL."""
        host = node_ip()
        port = free_port_on(host)
        argv = fill(self.argv, {"host": host, "port": str(port), "model": self.model})
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{self.name}.log"
        with log.open("ab") as out:
            # the lifeline: the process gets SIGTERM when this actor's process goes (ray.kill, a lost node)
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, PARENT_PID_ENV: str(os.getpid()), **self.env})
        self.child, self.url = Child(self.name, proc, log), f"http://{host}:{port}"
        wait_healthy(self.child, self.url, timeout)
        return self.url

    def alive(self) -> bool:
        return self.child is not None and self.child.proc.poll() is None

    def get(self, path: str) -> tuple[int, str]:
        """GET url+path from this node (status, body): how the launcher reads a part's own report."""
        import httpx

        answer = httpx.get(self.url + path, timeout=10.0, headers=_bearer(self.env.get("STEPLINE_ENGINE_TOKEN")))
        return answer.status_code, answer.text

    def stop(self) -> None:
        """SIGTERM (a gateway flushes its records first), then SIGKILL after the grace period."""
        if self.child is not None:
            stop_all([self.child])


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class RolloutPart:
    """The rollout driver on one node, playing its share of the groups against its gateway."""

    def __init__(self, config: Any, gateway_url: str, admin_token: str, work_dir: Path, pool_url: str,
                 batch_groups: int, ahead: int, max_batches: int, peers: int) -> None:
        from datapool import open_pool
        from rollout.pacing import BackgroundRollouts

        self.pool = open_pool(pool_url)
        self.rollouts = BackgroundRollouts(config, gateway_url, admin_token, work_dir, self.pool,
                                           batch_groups=batch_groups, ahead=ahead, max_batches=max_batches,
                                           peers=peers)

    def start(self) -> None:
        self.rollouts.start()

    def running(self) -> bool:
        return self.rollouts.running()

    def finish(self) -> tuple[list[dict[str, Any]], str | None]:
        """Stop starting groups, let the running episodes end; (episode rows, the driver's error or None)."""
        self.rollouts.stop()
        self.pool.close()
        error = self.rollouts.error
        return self.rollouts.history, None if error is None else repr(error)


class TrainerPart:
    """The trainer (one process: multi-rank data parallel is not wired), pushing to every gateway."""

    def __init__(self) -> None:
        import trainer.loop  # noqa: F401  (torch and transformers: started early, it loads while services start)

    def train(self, cfg: Any, pool_url: str, gateway_urls: list[str], admin_token: str,
              rollouts: list[Any]) -> dict[str, int]:
        from datapool import open_pool
        from trainer.loop import train
        from trainer.weight_sync import FanOutWeightSync, GatewayWeightSync

        pool = open_pool(pool_url)
        sync = FanOutWeightSync([GatewayWeightSync(url, admin_token) for url in gateway_urls])
        try:
            state = train(cfg, pool, sync, producing=lambda: any_running(rollouts))
        finally:
            sync.close()
            pool.close()
        return {"update": state.update, "version": state.version}


def any_running(rollouts: list[Any]) -> bool:
    """Whether some rollout actor still produces; a dead actor produces nothing."""
    import ray

    for actor in rollouts:
        try:
            if ray.get(actor.running.remote(), timeout=60):
                return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
    return False
