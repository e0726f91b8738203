"""The parts of `stepline run --ray`, as plain classes that Ray turns into actors (`ray.remote(Part)`).

Each part is what it is on one machine: an engine or a gateway is the same `stepline` process speaking the
same HTTP, started by a `ServicePart` on the node Ray placed it on; a `RolloutPart` runs the rollout driver
(`stepline.rollout.pacing.BackgroundRollouts`) against one gateway; a `TrainerPart` runs `stepline.trainer.loop.train` and
pushes weights to every gateway (rank 0 of `cluster.trainers` data-parallel ranks). Ray only places the parts and carries URLs between them, so nothing here
imports ray at module level (the core never needs it; `stepline[ray]` is an optional extra).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepline.launch.services import Child, fill, start, stop_all, wait_healthy

if TYPE_CHECKING:
    from stepline.rollout.pacing import Pacing

__all__ = ["WORKER_KEY", "RolloutPart", "ServicePart", "TrainerPart", "fill"]

WORKER_KEY = "rollout_worker"  # session metadata: the index of the rollout worker that plays the session


def node_ip() -> str:
    """This node's address as Ray knows it (what the other nodes reach it by)."""
    import ray

    return str(ray.util.get_node_ip_address())


def free_port_on(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServicePart:
    """One service process (`argv` with {host} {port} placeholders) on this actor's node, dying with it. With
    `restarts` > 0 the actor watches it and starts it again on the same address when it exits on its own, at
    most `restarts` times (each logged in its log and counted in `restarted`)."""

    def __init__(self, name: str, argv: list[str], logs: Path, env: dict[str, str], restarts: int = 0) -> None:
        self.name, self.argv, self.logs, self.env = name, argv, Path(logs), env
        self.restarts, self.restarted = restarts, 0
        self.child: Child | None = None
        self.url = ""
        self._argv: list[str] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the child is replaced by the watcher and stopped by stop()

    def start(self, timeout: float) -> str:
        """Start the process, wait for /health; the service's base URL."""
        host = node_ip()
        port = free_port_on(host)
        self._argv = fill(self.argv, {"host": host, "port": str(port)})
        self.logs.mkdir(parents=True, exist_ok=True)
        self.url = f"http://{host}:{port}"
        self.child = self._spawn()
        wait_healthy(self.child, self.url, timeout)
        if self.restarts:
            threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()
        return self.url

    def _spawn(self) -> Child:
        # the lifeline: the process gets SIGTERM when this actor's process goes (ray.kill, a lost node)
        return start(self.name, self._argv, self.logs, self.env)

    def _watch(self) -> None:
        """Start the process again when it exits while nobody stopped it (bounded; the service itself
        recovers its state: a gateway loads its current weights into an engine that comes back)."""
        while not self._stopping.wait(1.0):
            with self._lock:
                assert self.child is not None
                code = self.child.proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                if self.restarted >= self.restarts:
                    self._note(f"exited with code {code}; no restarts left ({self.restarts} used)")
                    return
                self.restarted += 1
                self._note(f"exited with code {code}; restart {self.restarted} of {self.restarts}")
                self.child = self._spawn()

    def _note(self, line: str) -> None:
        with (self.logs / f"{self.name}.log").open("a") as out:
            out.write(f"[stepline ray part] {self.name} {line}\n")

    def alive(self) -> bool:
        return self.child is not None and self.child.proc.poll() is None

    def pid(self) -> int:
        """The service process's pid (what a fault test kills)."""
        assert self.child is not None
        return self.child.proc.pid

    def get(self, path: str) -> tuple[int, str]:
        """GET url+path from this node (status, body): how the launcher reads a part's own report."""
        import httpx

        answer = httpx.get(self.url + path, timeout=10.0, headers=_bearer(self.env.get("STEPLINE_ENGINE_TOKEN")))
        return answer.status_code, answer.text

    def restarts_done(self) -> int:
        return self.restarted

    def stop(self) -> None:
        """SIGTERM (a gateway flushes its records first), then SIGKILL after the grace period."""
        self._stopping.set()
        with self._lock:
            if self.child is not None:
                stop_all([self.child])


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class RolloutPart:
    """The rollout driver on one node, playing its share of the groups against its gateway."""

    def __init__(self, index: int, config: Any, gateway_url: str, admin_token: str, work_dir: Path, pool_url: str,
                 pacing: Pacing) -> None:
        from stepline.datapool import open_pool
        from stepline.rollout.pacing import BackgroundRollouts

        self.pool = open_pool(pool_url)
        self.rollouts = BackgroundRollouts(config, gateway_url, admin_token, work_dir, self.pool, pacing,
                                           metadata={WORKER_KEY: index})

    def start(self) -> None:
        self.rollouts.start()

    def running(self) -> bool:
        return self.rollouts.running()

    def set_peers(self, peers: int) -> None:
        self.rollouts.set_peers(peers)

    def finish(self) -> tuple[list[dict[str, Any]], str | None]:
        """Stop starting groups, let the running episodes end; (episode rows, the driver's error or None)."""
        self.rollouts.stop()
        self.pool.close()
        error = self.rollouts.error
        return self.rollouts.history, None if error is None else repr(error)


class TrainerPart:
    """One trainer rank of `world` (data parallel, stepline/trainer/distributed.py). Rank 0 claims groups, pushes each
    version to every gateway and checkpoints; the other ranks forward their share of each batch."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        import stepline.trainer.loop  # noqa: F401  (torch and transformers: started early, it loads while services start)

        self.rank, self.world = rank, world

    def rendezvous(self) -> str:
        """Rank 0's address for the process group: tcp://NODE_IP:FREE_PORT."""
        host = node_ip()
        return f"tcp://{host}:{free_port_on(host)}"

    def train(self, cfg: Any, init_method: str, pool_url: str, gateway_urls: list[str], admin_token: str,
              rollouts: list[Any]) -> dict[str, int]:
        from stepline.trainer.distributed import SINGLE, Ranks
        from stepline.trainer.loop import device_of, follow

        ranks = Ranks.join(self.rank, self.world, init_method, device_of(cfg).type) if self.world > 1 else SINGLE
        try:
            state = follow(cfg, ranks) if self.rank else self._lead(cfg, pool_url, gateway_urls, admin_token,
                                                                     rollouts, ranks)
        finally:
            ranks.leave()
        return {"rank": self.rank, "update": state.update, "version": state.version}

    @staticmethod
    def _lead(cfg: Any, pool_url: str, gateway_urls: list[str], admin_token: str, rollouts: list[Any],
              ranks: Any) -> Any:
        from stepline.datapool import open_pool
        from stepline.trainer.loop import train
        from stepline.trainer.weight_sync import FanOutWeightSync, GatewayWeightSync

        pool = open_pool(pool_url)
        sync = FanOutWeightSync([GatewayWeightSync(url, admin_token) for url in gateway_urls])
        try:
            return train(cfg, pool, sync, producing=lambda: any_running(rollouts), ranks=ranks)
        finally:
            sync.close()
            pool.close()


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
