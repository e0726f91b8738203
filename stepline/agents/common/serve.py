"""A long-lived harness worker: many episodes from one warm process (`python -m stepline.agents.<name>.serve`).

Why: `python -m stepline.agents.<name>.run` and `.verify` pay an interpreter start, the openai/anthropic SDK
import and the harness's own caches (the search index, the sandbox probe) on every episode, 1-3 s of
CPU. The worker pays them once, then forks one child per episode (and one per verification) from
that warm state, which costs milliseconds (benchmarks/bench_agents.py measures both paths).

Why a forked child per episode rather than threads or asyncio tasks in the worker itself:

- the episode timeout stays a SIGKILL of the episode's process group, as the driver does to a `run`
  process (stepline/rollout/driver.py); a thread stuck in a tool or an SDK call cannot be killed;
- the episode's endpoint (its session's base URL and key) lives only in that child's environment and
  the SDK client the harness builds there, so no key can reach another episode;
- what the harnesses keep per process stays per episode: the terminal sandbox's uid (1_000_000 + pid)
  and its commands' parent-death signal (stepline/agents/terminal/sandbox.py), module-level state, stdout;
- a harness that crashes, even in C, loses only its own episode.

The worker itself is one asyncio loop (no threads, so forking is safe) that reads requests, forks,
waits on the children's pipes and answers. Protocol, JSON lines (the driver side is
stepline/rollout/worker.py):

    worker -> {"ready": true, "pid": N, "harness": NAME}                       once, after warming up
    driver -> {"id", "task_id", "out", "logs", "max_turns", "max_tokens", "expert", "timeout_s",
               "verify_timeout_s", "verify", "env"}                              one episode (EpisodeRequest)
    driver -> {"cancel": ID}                                                     kill that episode, no answer
    worker -> {"id", "outcome": "ran" | "failed", "reason", "verdict": {reward, success, reason} | null}

"ran" means the episode ran to its end (exit 0 of `run`); "failed" that it broke, timed out or its
child died, with the reason. A verifier that throws, dies or hangs scores 0 ("verifier error: ...").
End of stdin: the worker kills what still runs and exits; if the driver dies, so does the worker
(parent-death signal), and with it every child.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepline.agents.common.cli import Verdict, failed, record_episode
from stepline.agents.common.episode import Episode
from stepline.agents.common.loop import tls_context
from stepline.agents.common.scripted_server import Reply, ScriptedServer

__all__ = ["EpisodeRequest", "ServedHarness", "serve", "serve_command", "warm_sdk"]

FORK = multiprocessing.get_context("fork")
SESSION_KEYS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")
REASON_CHARS = 1000  # of a failure reason sent back
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServedHarness:
    """What a harness's serve module hands to the worker: the same functions its run and verify call."""

    name: str
    play: Callable[[str, Path, int, int, bool], Episode]  # (task_id, out, max_turns, max_tokens, expert)
    verdict: Callable[[str, Path], Verdict]  # (task_id, out); never raises (stepline/agents/common/cli.py verdict_for)
    known: Callable[[str], bool]
    max_turns: int  # the default of `run --max-turns`
    warm: Callable[[], None] = lambda: None  # build per-process caches before the first fork


class EpisodeRequest(BaseModel):
    """One episode, as the driver asks for it: what `run --task --out --max-turns --max-tokens` takes,
    plus the endpoint variables `run` would find in its environment and the two timeouts."""

    model_config = ConfigDict(extra="forbid")

    id: str
    task_id: str
    out: Path = Field(description="episode directory: episode.json (and the terminal sandbox) go here")
    logs: Path = Field(description="where harness.stdout/.stderr and verify.stdout/.stderr go")
    max_turns: int | None = Field(None, ge=1, le=64, description="None: the harness's default")
    max_tokens: int = Field(128, ge=1, le=4096)
    expert: bool = False
    timeout_s: float = Field(gt=0, description="wall time of the episode, then its process group is SIGKILLed")
    verify_timeout_s: float = Field(gt=0)
    verify: bool = Field(True, description="false: the driver runs an external verifier itself")
    env: dict[str, str] = Field(default_factory=dict, description="OPENAI_*/ANTHROPIC_* endpoint, STEPLINE_*")


class ChildFailed(Exception):
    """A child ended without an answer (killed, or crashed outside the harness's own error handling)."""


Outcome = dict[str, Any]


def _answer(outcome: Literal["ran", "failed"], reason: str = "", verdict: Verdict | None = None) -> Outcome:
    return {"outcome": outcome, "reason": reason[:REASON_CHARS], "verdict": verdict.model_dump() if verdict else None}


async def play_and_verify(harness: ServedHarness, request: EpisodeRequest) -> Outcome:
    """One episode in a child, then (if asked) its verifier in another: the answer for the driver."""
    if not harness.known(request.task_id):
        return _answer("failed", f"unknown task {request.task_id!r}")
    try:
        error = await run_child(lambda: _play(harness, request), request, "harness", request.timeout_s)
    except TimeoutError:
        return _answer("failed", f"harness timed out after {request.timeout_s:g}s")
    except ChildFailed as exc:
        return _answer("failed", str(exc))
    if error:
        return _answer("failed", f"episode failed: {error}")
    if not request.verify:
        return _answer("ran")
    try:
        data = await run_child(lambda: harness.verdict(request.task_id, request.out).model_dump(), request, "verify",
                               request.verify_timeout_s)
        verdict = Verdict.model_validate(data)
    except TimeoutError:
        verdict = failed(f"verifier error: verifier timed out after {request.verify_timeout_s:g}s")
    except (ChildFailed, ValidationError) as exc:
        verdict = failed(f"verifier error: {exc}")
    return _answer("ran", verdict=verdict)


def _play(harness: ServedHarness, request: EpisodeRequest) -> str | None:
    """In the child: play, write episode.json, return its error (None: the episode ran)."""
    max_turns = request.max_turns or harness.max_turns
    play = lambda: harness.play(request.task_id, request.out, max_turns, request.max_tokens, request.expert)  # noqa: E731
    return record_episode(harness.name, request.task_id, request.expert, request.out, play).error


async def run_child(target: Callable[[], Any], request: EpisodeRequest, log: str, timeout_s: float) -> Any:
    """`target()` in a forked child with the episode's environment, in a process group of its own,
    output to `logs/<log>.stdout|stderr`. Returns what it returned; TimeoutError at the timeout;
    ChildFailed when it died without answering. Its whole group is SIGKILLed either way, so nothing
    it started outlives it."""
    loop = asyncio.get_running_loop()
    recv, send = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_child_main, args=(target, send, request, log, os.getpid()), name=f"{log}-{request.id}")
    child.start()
    send.close()  # before any other fork: a later child must not hold this pipe's write end
    assert child.pid is not None  # started above
    _own_group(child.pid)
    try:
        async with asyncio.timeout(timeout_s):
            await _first_ready(loop, recv.fileno(), child.sentinel)
        try:
            return recv.recv()  # an answer was sent (the child may still be exiting)
        except EOFError:
            child.join()
            raise ChildFailed(_death(child.exitcode, request.logs / f"{log}.stderr", log)) from None
    finally:
        _kill_group(child.pid)
        await _first_ready(loop, child.sentinel)
        child.join()
        recv.close()


def _child_main(target: Callable[[], Any], send: Connection, request: EpisodeRequest, log: str, worker: int) -> None:
    """The child's first steps: its own group, death with the worker, its own output and endpoint."""
    os.setpgid(0, 0)
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker:  # the worker died before the line above
        os._exit(1)
    _Channel.close_in_child()
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        with open(request.logs / f"{log}.{stream}", "ab") as f:
            os.dup2(f.fileno(), fd)
    for key in SESSION_KEYS:
        os.environ.pop(key, None)
    os.environ.update(request.env)
    send.send(target())


def _own_group(pid: int) -> None:
    """The parent half of the classic setpgid pair: the group exists as soon as start() returns."""
    try:
        os.setpgid(pid, pid)
    except (ProcessLookupError, PermissionError):  # already exited, or the child did it first
        pass


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # os.kill: if the group was never made
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def _first_ready(loop: asyncio.AbstractEventLoop, *fds: int) -> None:
    """Wait until one of the file descriptors is readable (a pipe with data, or a child's sentinel at its exit)."""
    ready: asyncio.Future[None] = loop.create_future()
    for fd in fds:
        loop.add_reader(fd, lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        for fd in fds:
            loop.remove_reader(fd)


def _death(code: int | None, stderr: Path, what: str) -> str:
    """`harness exited with 3: <last stderr line>`, the reason the driver gives a `run` process."""
    try:
        lines = stderr.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return f"{what} exited with {code}: {lines[-1] if lines else '(no stderr)'}"


class _Channel:
    """The protocol's output: JSON lines on the stdout the worker was started with. fd 1 itself then
    points at stderr, so a stray print in harness code cannot corrupt the protocol."""

    fd: int | None = None

    def __init__(self) -> None:
        _Channel.fd = os.dup(1)
        os.dup2(2, 1)
        self.file = os.fdopen(_Channel.fd, "w", buffering=1)

    def send(self, message: dict[str, Any]) -> None:
        self.file.write(json.dumps(message) + "\n")
        self.file.flush()

    @staticmethod
    def close_in_child() -> None:
        """A child must not hold the protocol pipe: the driver sees the worker's death as end of file."""
        if _Channel.fd is not None:
            os.close(_Channel.fd)


async def serve(harness: ServedHarness) -> None:
    """Warm up, say ready, then answer requests concurrently until stdin ends."""
    _die_with_parent()
    channel = _Channel()  # first: what warm-up prints goes to stderr
    harness.warm()
    gc.freeze()  # the warm heap is shared copy-on-write: a child's collections must not walk (and so copy) it
    if threading.active_count() > 1:  # a thread holding a lock at fork time would deadlock the child
        print(f"warning: {harness.name} worker forks with threads {threading.enumerate()}", file=sys.stderr)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[str, asyncio.Task[None]] = {}
    channel.send({"ready": True, "pid": os.getpid(), "harness": harness.name})
    while line := await reader.readline():
        if line.strip():
            _dispatch(harness, channel, running, line)
    for task in running.values():
        task.cancel()
    await asyncio.gather(*running.values(), return_exceptions=True)


def _dispatch(harness: ServedHarness, channel: _Channel, running: dict[str, asyncio.Task[None]], line: bytes) -> None:
    """Start the episode a request line asks for, or cancel one; a bad line is answered as a failure."""
    try:
        message = json.loads(line)
    except ValueError as exc:
        channel.send({"id": None, **_answer("failed", f"bad request: {exc}")})
        return
    if isinstance(message, dict) and "cancel" in message:
        if task := running.get(str(message["cancel"])):
            task.cancel()
        return
    try:
        request = EpisodeRequest.model_validate(message)
    except ValidationError as exc:
        ident = message.get("id") if isinstance(message, dict) else None
        channel.send({"id": ident, **_answer("failed", f"bad request: {exc}")})
        return

    async def episode() -> None:
        try:
            channel.send({"id": request.id, **await play_and_verify(harness, request)})
        finally:
            running.pop(request.id, None)

    running[request.id] = asyncio.create_task(episode())


def _die_with_parent() -> None:
    """SIGKILL this worker when the driver's thread that started it ends; its children follow (their own
    parent-death signal), and their sandbox commands after them."""
    parent = os.getppid()
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


def warm_sdk(api: Literal["openai", "anthropic"]) -> None:
    """One real round trip through the SDK against a loopback ScriptedServer: the SDK imports much of
    itself lazily and builds its response models on first use, which would otherwise cost every
    forked child again (about half of a child's CPU, benchmarks/bench_agents.py)."""
    reply = Reply("ok", [("tool", {"x": "y"})])
    with ScriptedServer(lambda body: reply) as server:
        if api == "openai":
            import openai

            tool = {"type": "function", "function": {"name": "tool", "parameters": {"type": "object"}}}
            with openai.OpenAI(base_url=server.openai_base_url, api_key="warm-up", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=tls_context())) as client:
                client.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": "hi"}],
                                               tools=[tool], max_tokens=1)  # type: ignore[list-item]
        else:
            import anthropic

            with anthropic.Anthropic(base_url=server.url, api_key="warm-up", max_retries=0,
                                     http_client=anthropic.DefaultHttpxClient(verify=tls_context())) as client:
                client.messages.create(model="warm-up", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"name": "tool", "input_schema": {"type": "object"}}])


def serve_command(harness: ServedHarness) -> click.Command:
    """`python -m stepline.agents.<name>.serve`: the worker on stdin/stdout (see the module docstring)."""

    @click.command()
    def main() -> None:
        asyncio.run(serve(harness))

    return main
