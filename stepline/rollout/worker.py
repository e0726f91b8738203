"""The rollout driver's side of a long-lived harness worker, `python -m <module>.serve`.

The worker (stepline/agents/common/serve.py has the protocol) plays many episodes, each in a child forked
from its warm state, so an episode no longer pays an interpreter start and the SDK import. The
harness stays a black box behind a pipe: the driver sends JSON lines (task, out dir, limits and the
session's endpoint) and reads one answer per episode.

Faults become failed episodes with a reason, as a `run` process's would: a worker that exits fails
every episode in flight on it (`harness worker exited with -9: …`); one that does not answer within
the episode's timeouts plus GRACE_S is taken for hung, killed (its whole process group) and fails
its episodes the same way. The next episode starts a fresh worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GRACE_S", "HarnessWorker", "WorkerError", "WorkerMissing"]

GRACE_S = 10.0  # beyond the worker's own timeouts, before the driver takes it for hung
START_TIMEOUT_S = 120.0  # interpreter, SDK import and the harness's warm-up, on a loaded machine
LINE_LIMIT = 1 << 20


class WorkerError(Exception):
    """The worker died, hung or could not start; the episode failed with this reason."""


class WorkerMissing(WorkerError):
    """The module has no `serve` submodule: the harness runs one process per episode instead."""


@dataclass
class _Live:
    """One started worker process and the episodes waiting for its answers."""

    proc: asyncio.subprocess.Process
    pid: int
    pending: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    ended: str | None = None  # why it is gone (None while it runs)


class HarnessWorker:
    """A harness module's worker: started on first use, restarted after it dies or hangs."""

    def __init__(self, module: str, python: str, log: Path, env: Mapping[str, str], cwd: Path):
        self.module, self.python, self.log, self.env, self.cwd = module, python, Path(log), dict(env), Path(cwd)
        self.starts = 0  # how many processes it took so far (restarts show here)
        self._live: _Live | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._live.pid if self._live is not None and self._live.ended is None else None

    async def episode(self, request: dict[str, Any], deadline_s: float) -> dict[str, Any]:
        """Send one request; its answer, or WorkerError when the worker died or hung before answering.
        A cancelled episode is cancelled in the worker too (its child's group is killed)."""
        live = await self._running()
        ident = request.setdefault("id", uuid.uuid4().hex)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        live.pending[ident] = answer
        try:
            if live.ended is not None:
                raise WorkerError(live.ended)
            await self._send(live, request)
            async with asyncio.timeout(deadline_s):
                return await answer
        except TimeoutError:
            await self._end(live, f"harness worker hung: no answer in {deadline_s:g}s; killed, to be restarted")
            raise WorkerError(live.ended) from None
        except asyncio.CancelledError:
            if live.ended is None:
                await self._send(live, {"cancel": ident})
            raise
        finally:
            live.pending.pop(ident, None)

    async def close(self) -> None:
        """End the worker: close its stdin (it kills what runs and exits), then SIGKILL its group."""
        live, self._live = self._live, None
        if live is None or live.ended is not None:
            return
        if live.proc.stdin is not None:
            live.proc.stdin.close()
        try:
            async with asyncio.timeout(5):
                await live.proc.wait()
        except TimeoutError:
            pass
        await self._end(live, "harness worker closed")

    # --- internals ---

    async def _running(self) -> _Live:
        async with self._lock:  # concurrent first episodes start one worker
            if self._live is None or self._live.ended is not None:
                self._live = await self._start()
            return self._live

    async def _start(self) -> _Live:
        self.starts += 1
        self.log.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as stderr:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", f"{self.module}.serve", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, env=self.env, cwd=self.cwd,
                start_new_session=True, limit=LINE_LIMIT,
            )
        live = _Live(proc, proc.pid)
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while (line := await proc.stdout.readline()) and not _is_ready(line):
                    pass  # a harness that prints on stdout while it imports: skipped
        except (TimeoutError, ValueError) as exc:  # ValueError: a line over LINE_LIMIT
            await self._end(live, "no ready line")
            raise WorkerError(f"harness worker gave no ready line in {START_TIMEOUT_S:g}s: {exc!r}") from None
        if not line:
            code = await _exit_code(proc)
            await self._end(live, "no ready line")
            last = _last_line(self.log, offset)
            if f"No module named {self.module}.serve" in last:
                raise WorkerMissing(last)
            raise WorkerError(f"harness worker exited with {code} at start: {last}")
        live.reader = asyncio.create_task(self._read(live, offset))
        return live

    async def _read(self, live: _Live, log_offset: int) -> None:
        """Hand each answer line to its episode; at end of file the worker is gone."""
        assert live.proc.stdout is not None
        try:
            while line := await live.proc.stdout.readline():
                _deliver(live, line)
        except ValueError:  # a line over LINE_LIMIT: the stream cannot be trusted any more
            await self._end(live, f"harness worker wrote a line over {LINE_LIMIT} bytes")
        except asyncio.CancelledError:
            if live.ended is None:  # the event loop ends (asyncio.run's last step) without close(): end it now,
                await self._end(live, "the driver's event loop ended")  # while the loop can still reap it
            raise
        if live.ended is None:
            code = await _exit_code(live.proc)
            await self._end(live, f"harness worker exited with {code}: {_last_line(self.log, log_offset)}")

    async def _send(self, live: _Live, message: dict[str, Any]) -> None:
        assert live.proc.stdin is not None
        try:
            live.proc.stdin.write(json.dumps(message).encode() + b"\n")
            await live.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is gone; the reader ends its episodes with the reason

    async def _end(self, live: _Live, reason: str) -> None:
        """Kill the worker's process group (its children die with it) and fail its waiting episodes."""
        if live.ended is None:
            live.ended = reason
        if live.proc.stdin is not None:
            live.proc.stdin.close()
        _kill_group(live.pid)
        await live.proc.wait()
        for answer in live.pending.values():
            if not answer.done():
                answer.set_exception(WorkerError(live.ended))
        if live.reader is not None and live.reader is not asyncio.current_task():
            live.reader.cancel()


def _deliver(live: _Live, line: bytes) -> None:
    """Resolve the episode an answer line names; the worker writes only JSON objects, so skip anything else."""
    try:
        answer = json.loads(line)
        waiting = live.pending.get(str(answer.get("id")))
    except (ValueError, AttributeError):
        return
    if waiting is not None and not waiting.done():
        waiting.set_result(answer)


def _is_ready(line: bytes) -> bool:
    try:
        return json.loads(line).get("ready") is True
    except (ValueError, AttributeError):
        return False


async def _exit_code(proc: asyncio.subprocess.Process) -> int | None:
    """The exit status of a worker whose stdout ended (a worker may close stdout a moment before exiting)."""
    try:
        async with asyncio.timeout(5):
            return await proc.wait()
    except TimeoutError:
        return None


def _last_line(log: Path, offset: int) -> str:
    """The last line this worker process wrote to its stderr log."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            lines = f.read()[-4000:].decode("utf-8", errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "(no stderr)"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
