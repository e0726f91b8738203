"""The rollout driver: runs harness episodes against the gateway, one session per episode.

For each drawn task it opens G sessions (one group, an explicit group id, so GRPO baselines stay
per task × harness; a harness with `tree_search` grows the group as trees of forked sessions instead,
stepline/rollout/trees.py; a task's gold answer, where the harness gives one, goes into every session's
metadata["reference"]; a harness with `expert_per_group` has that many of a training group's episodes played by
its scripted expert, recorded through the gateway as expert sessions), plays the harness once per session with
that session's endpoint, kills it at the episode timeout (its whole process group), runs the verifier, posts the
reward and ends the session. A harness that crashes, hangs or exits non-zero ends as a *failed* episode with a reason
(reward `failed_reward`, or none if not `score_failed`); a verifier that throws or prints garbage
scores 0 and the reason is logged; the job goes on either way.

Two ways to play an episode:

- a module harness with `persistent` (the default) is played by its long-lived worker
  (`python -m <module>.serve`, stepline/rollout/worker.py): one warm process per module forks a child
  per episode, which runs `run` and `verify`'s code in-process, so no episode pays an interpreter
  start or the SDK import. A worker that dies or hangs fails its episodes in flight and is restarted.
- otherwise (an external `command`, `persistent = false`, or a module without `serve`) one `run`
  process and one `verify` process per episode, as below.

Episodes get (harness processes in their environment, worker children in theirs):
OPENAI_BASE_URL/OPENAI_API_KEY, ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY, STEPLINE_SESSION_ID,
STEPLINE_TASK_ID, STEPLINE_OUT_DIR (their own directory) and STEPLINE_REWARD_URL (POST {"value": x}
there with the session key as Bearer, for harnesses without a verifier).

    async with GatewayClient(url, token) as gw, RolloutDriver(config, gw, work_dir) as driver:
        stats = await driver.run(num_groups=32)          # or run(None, stop=event) until stopped
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeGuard

from pydantic import Field, NonNegativeInt, TypeAdapter, ValidationError

from stepline.datapool.records import EXPERT_KEY, HINDSIGHT_KEY, REFERENCE_KEY, Purpose
from stepline.rollout import trees
from stepline.rollout import worker as rollout_worker
from stepline.rollout.client import GatewayClient, GatewayError, SessionHandle
from stepline.rollout.config import HarnessSpec, RolloutConfig, task_references, training_tasks
from stepline.rollout.results import EpisodeResult, HarnessStats
from stepline.rollout.worker import HarnessWorker, WorkerError, WorkerMissing

__all__ = ["EpisodeResult", "HarnessStats", "RolloutDriver", "format_stats", "run_rollouts"]

log = logging.getLogger("stepline.rollout")
TAIL = 400  # bytes of a process's output quoted in a failure reason
SESSION_KEYS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")


@dataclass
class _Outcome:
    returncode: int | None  # None: killed at the timeout
    stdout: str  # tail
    stderr: str  # tail


@dataclass
class _Played:
    """How playing went: `failure` says why the episode failed; `verdict` is the worker's verifier's."""

    failure: str | None = None
    verdict: Score | None = None


async def run_process(argv: list[str], env: Mapping[str, str], cwd: Path, timeout: float, logs: Path) -> _Outcome:
    """Run argv in a new session with output to logs.{stdout,stderr}; SIGKILL the whole group at the
    timeout, and after exit too, so that nothing the process started outlives it."""
    with open(f"{logs}.stdout", "wb") as out, open(f"{logs}.stderr", "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(env), cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
            start_new_session=True,
        )
        code: int | None = None
        try:
            async with asyncio.timeout(timeout):  # unlike wait_for on 3.11, never swallows a cancellation (Ctrl-C)
                code = await proc.wait()
        except TimeoutError:
            pass
        finally:
            _kill_group(proc.pid)
            await proc.wait()
    return _Outcome(code, _tail(Path(f"{logs}.stdout")), _tail(Path(f"{logs}.stderr")))


class Score(NamedTuple):
    """A verifier's verdict as the driver uses it: what training optimises (or evaluation reports), and where."""

    reward: float
    success: bool
    reason: str
    step_rewards: dict[int, float] | None = None  # {call index: reward}, training only
    hindsight: str | None = None  # training only: the first user message under which the failed episode succeeds


# status, the reward posted (None: none), the verdict (a failed episode's: reward 0, its failure as the reason)
Scored = tuple[Literal["completed", "failed"], float | None, Score]
# {call index: finite reward}; JSON's string keys are read as the indices they spell
STEP_REWARDS = TypeAdapter(dict[NonNegativeInt, Annotated[float, Field(strict=True, allow_inf_nan=False)]])


def parse_verdict(stdout: str, train: bool = False) -> Score:
    """The Score of a verifier's last stdout line: {"reward": x, "success"?, "reason"?, "train_reward"?,
    "step_rewards"?}."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("verifier printed nothing")
    return verdict_of(json.loads(lines[-1]), train)


def verdict_of(data: Any, train: bool = False) -> Score:
    """The Score of a verdict object {"reward": x, "success"?, "reason"?, "train_reward"?, "step_rewards"?,
    "hindsight"?}. With `train`, a verdict's train_reward (what training optimises, e.g. the score kept only where the
    agent's reasoning agrees with its actions) replaces its reward, and its step_rewards ({call index: reward}, keys as
    JSON strings or ints) and hindsight (a first user message) come along; success stays the score's."""
    reward = data["reward"] if isinstance(data, dict) else None
    if not _finite(reward):
        raise ValueError(f"no finite numeric reward in {str(data)[:120]!r}")
    success = bool(data.get("success", reward >= 1.0))
    trained = data.get("train_reward") if train else None
    if trained is not None:
        if not _finite(trained):
            raise ValueError(f"train_reward is not a finite number in {str(data)[:120]!r}")
        reward = trained
    steps = data.get("step_rewards") if train else None
    try:
        step_rewards = None if steps is None else STEP_REWARDS.validate_python(steps)
    except ValidationError as exc:
        raise ValueError(f"step_rewards is not {{call index >= 0: finite reward}} ({exc.errors()[0]['msg']}): "
                         f"{str(steps)[:120]!r}") from None
    hindsight = data.get("hindsight") if train else None
    if hindsight is not None and not isinstance(hindsight, str):
        raise ValueError(f"hindsight is not a message's text: {str(hindsight)[:120]!r}")
    return Score(float(reward), success, str(data.get("reason", "")), step_rewards, hindsight)


def _finite(value: object) -> TypeGuard[float]:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


class RolloutDriver:
    """Runs groups of episodes of the configured harnesses through one gateway."""

    def __init__(self, config: RolloutConfig, gateway: GatewayClient, work_dir: Path, python: str = sys.executable,
                 purpose: Purpose = "train"):
        self.config = config
        self.purpose = purpose  # of every session it opens (SessionInfo.purpose): the evaluator's driver says "eval"
        self.gateway = gateway
        self.work_dir = Path(work_dir)
        self.python = python
        self.stats: dict[str, HarnessStats] = {h.name: HarnessStats() for h in config.harnesses}
        self.results: list[EpisodeResult] = []
        self.expert_results: list[EpisodeResult] = []  # expert episodes in training groups (not the policy's stats)
        self.relabelled = 0  # failed episodes recorded again under their hindsight message (`HarnessSpec.hindsight`)
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self._started = time.monotonic()
        self._draw: _TaskDraw | None = None
        self.workers: dict[str, HarnessWorker] = {}  # by module, started on first use
        self._no_worker: set[str] = set()  # modules without a serve submodule
        self._references: dict[tuple[str, str], dict[str, str]] = {}  # (harness, split) -> task id -> gold answer

    async def __aenter__(self) -> RolloutDriver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the harness workers. (Without it they still end: with the driver's thread, via their
        parent-death signal, or at the end of their stdin.)"""
        await asyncio.gather(*(worker.close() for worker in self.workers.values()))

    # --- one episode ---

    async def run_episode(self, spec: HarnessSpec, task_id: str, group_id: str | None,
                          metadata: dict[str, Any] | None = None) -> EpisodeResult:
        """One episode, retried in a new session (same group) while it fails and retries are left."""
        for attempt in range(self.config.retries + 1):
            async with self.slots:
                result = await self._attempt(spec, task_id, group_id, {**(metadata or {}), "attempt": attempt})
            result.attempt = attempt
            self.add_result(spec, result)
            if result.status == "completed":
                break
            log.warning("%s %s failed (attempt %d): %s", spec.name, task_id, attempt, result.reason)
        return result

    async def run_expert_episode(self, spec: HarnessSpec, task_id: str, group_id: str | None,
                                 metadata: dict[str, Any]) -> EpisodeResult:
        """One episode of the harness's scripted expert in a training group: its conversation is recorded through
        the gateway as an expert session's calls (`POST /sessions/<id>/demonstration`), then verified as any."""
        async with self.slots:
            result, _ = await self.played(spec, task_id, lambda: self.open_session(
                spec, task_id, group_id, {**metadata, EXPERT_KEY: True}), expert=True)
        if result.status != "completed":
            log.warning("%s %s: the expert's episode failed: %s", spec.name, task_id, result.reason)
        self.expert_results.append(result)
        return result

    async def _attempt(self, spec: HarnessSpec, task_id: str, group_id: str | None, metadata: dict[str, Any]) -> EpisodeResult:
        relabel = None
        if spec.hindsight and self.purpose == "train":  # opened before the episode's own session ends: one group
            relabel = partial(self.open_session, spec, task_id, group_id, {**metadata, EXPERT_KEY: True,
                                                                            HINDSIGHT_KEY: True})
        result, _ = await self.played(spec, task_id, lambda: self.open_session(spec, task_id, group_id, metadata),
                                      relabel=relabel)
        return result

    def open_session(self, spec: HarnessSpec, task_id: str, group_id: str | None,
                     metadata: dict[str, Any]) -> Awaitable[SessionHandle]:
        """A session of this driver's purpose, sampled at the configured temperature (if any): the harness's own
        for training episodes where it sets one, else the rollouts'."""
        t = spec.temperature if spec.temperature is not None and self.purpose == "train" else self.config.temperature
        return self.gateway.open_session(task_id, spec.name, group_id, metadata, self.purpose,
                                         None if t is None else {"temperature": t})

    async def played(self, spec: HarnessSpec, task_id: str, open_session: Callable[[], Awaitable[SessionHandle]],
                     end: bool = True, expert: bool = False,
                     relabel: Callable[[], Awaitable[SessionHandle]] | None = None,
                     ) -> tuple[EpisodeResult, SessionHandle | None]:
        """Open a session, play and score it, post its reward and (if `end`) end it; with `relabel`, a failed
        episode the verifier relabelled (its `hindsight`) is first recorded under that message in a session `relabel`
        opens, as a demonstration."""
        started = time.monotonic()
        try:
            handle = await open_session()
        except GatewayError as exc:
            return EpisodeResult(spec.name, task_id, None, "failed", None, False, f"no session: {exc}"), None
        out = self.work_dir / handle.session_id
        out.mkdir(parents=True)
        try:
            status, reward, score = await self._play_and_score(spec, task_id, handle, out, expert)
            reason = score.reason
            if relabel is not None and score.hindsight is not None:
                reason += await self._post_hindsight(relabel, out, score.hindsight)
            reason = await self._report(handle, status, reward, reason, end, score.step_rewards)
        finally:
            if not self.config.keep_episodes:
                shutil.rmtree(out, ignore_errors=True)
        result = EpisodeResult(spec.name, task_id, handle.session_id, status, reward, score.success, reason,
                               seconds=time.monotonic() - started)
        return result, handle

    async def _post_hindsight(self, relabel: Callable[[], Awaitable[SessionHandle]], out: Path, message: str) -> str:
        """Record the episode's conversation with its first user message replaced by `message` in a new expert
        session (outcome 1: under that message it succeeds) and count it; a failure is logged and only noted (a session
        it opened ends as failed, unrewarded: its group does not wait for it)."""
        handle = None
        try:
            conversation = _conversation(out)
            messages = [dict(m) for m in conversation["messages"]]
            first = next(m for m in messages if m.get("role") == "user")
            first["content"] = message
            handle = await relabel()
            await self.gateway.post_demonstration(handle.session_id, {**conversation, "messages": messages})
            await self.gateway.post_reward(handle.session_id, 1.0)
            await self.gateway.end_session(handle.session_id, "completed")
        except (OSError, ValueError, KeyError, StopIteration, GatewayError) as exc:
            log.warning("hindsight relabelling not recorded: %s", exc)
            if handle is not None:
                with contextlib.suppress(GatewayError):
                    await self.gateway.end_session(handle.session_id, "failed")
            return f"; hindsight not recorded: {exc}"
        self.relabelled += 1
        return "; relabelled in hindsight"

    async def _play_and_score(self, spec: HarnessSpec, task_id: str, handle: SessionHandle, out: Path,
                              expert: bool = False) -> Scored:
        env = self._episode_env(spec, task_id, handle, out)
        played = await (self._play_expert(spec, task_id, handle, env, out) if expert else self._play(spec, task_id, env, out))
        if played.failure is not None:
            failed_reward = self.config.failed_reward if self.config.score_failed else None
            return "failed", failed_reward, Score(0.0, False, played.failure)
        if played.verdict is not None:
            return "completed", played.verdict.reward, played.verdict
        return await self._verify_in_process(spec, task_id, env, out)

    async def _play(self, spec: HarnessSpec, task_id: str, env: dict[str, str], out: Path) -> _Played:
        """In the module's worker when it has one, else in a process of its own."""
        worker = self._worker(spec)
        if worker is not None:
            try:
                return _from_worker(await worker.episode(self._request(spec, task_id, env, out), self._deadline()),
                                    train=self.purpose == "train")
            except WorkerMissing as exc:
                log.warning("harness %s: %s; one process per episode instead", spec.name, exc)
                self._no_worker.add(worker.module)
            except WorkerError as exc:
                return _Played(failure=str(exc))
        return await self._play_in_process(spec, task_id, env, out)

    async def _play_expert(self, spec: HarnessSpec, task_id: str, handle: SessionHandle, env: dict[str, str],
                           out: Path) -> _Played:
        """The module's `run --expert` in a process of its own, its conversation recorded as the session's calls."""
        played = await self._play_in_process(spec, task_id, env, out, ["--expert"])
        if played.failure is not None:
            return played
        try:
            await self.gateway.post_demonstration(handle.session_id, _conversation(out))
        except (OSError, ValueError, KeyError, GatewayError) as exc:
            return _Played(failure=f"the expert's conversation was not recorded: {exc}")
        return played

    async def _play_in_process(self, spec: HarnessSpec, task_id: str, env: dict[str, str], out: Path,
                               extra: tuple[str, ...] | list[str] = ()) -> _Played:
        played = await run_process([*self._run_argv(spec, task_id, out), *extra], {**os.environ, **env}, Path.cwd(),
                                   self.config.episode_timeout_s, out / "harness")
        if played.returncode is None:
            return _Played(failure=f"harness timed out after {self.config.episode_timeout_s:g}s")
        if played.returncode != 0:
            last = (played.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            return _Played(failure=f"harness exited with {played.returncode}: {last}")
        return _Played()

    async def _verify_in_process(self, spec: HarnessSpec, task_id: str, env: dict[str, str], out: Path) -> Scored:
        argv = self._verify_argv(spec, task_id, out)
        if argv is None:
            return "completed", None, Score(0.0, False, "reward posted by the harness")
        checked = await run_process(argv, {**os.environ, **env}, Path.cwd(), self.config.verify_timeout_s, out / "verify")
        try:
            if checked.returncode is None:
                raise ValueError(f"verifier timed out after {self.config.verify_timeout_s:g}s")
            score = parse_verdict(checked.stdout, train=self.purpose == "train")
        except (ValueError, KeyError) as exc:
            log.warning("verifier of %s %s scored 0: %s (stderr: %s)", spec.name, task_id, exc, checked.stderr[-200:])
            return "completed", 0.0, Score(0.0, False, f"verifier error: {exc}")
        return "completed", score.reward, score

    def _worker(self, spec: HarnessSpec) -> HarnessWorker | None:
        """The module's worker (created on first use), or None where episodes run as processes."""
        if spec.module is None or not spec.persistent or spec.module in self._no_worker:
            return None
        if spec.module not in self.workers:
            # The worker holds no session's endpoint: each request brings its own (stepline/rollout/worker.py).
            env = {k: v for k, v in os.environ.items() if k not in SESSION_KEYS and not k.startswith("STEPLINE_")}
            log_file = self.work_dir / "workers" / f"{spec.module}.stderr"
            self.workers[spec.module] = HarnessWorker(spec.module, self.python, log_file, env, Path.cwd())
        return self.workers[spec.module]

    def _request(self, spec: HarnessSpec, task_id: str, env: dict[str, str], out: Path) -> dict[str, Any]:
        """The worker's request: what `run` would get as options and environment (stepline/agents/common/serve.py)."""
        request: dict[str, Any] = {
            "task_id": task_id, "out": str(out / "episode"), "logs": str(out), "max_turns": spec.max_turns,
            "timeout_s": self.config.episode_timeout_s, "verify_timeout_s": self.config.verify_timeout_s,
            "verify": spec.verify_command is None, "env": env,
        }
        if spec.max_tokens is not None:
            request["max_tokens"] = spec.max_tokens
        return request

    def _deadline(self) -> float:
        """How long an answer may take before the worker is taken for hung: its own two timeouts and a grace."""
        return self.config.episode_timeout_s + self.config.verify_timeout_s + rollout_worker.GRACE_S

    async def _report(self, handle: SessionHandle, status: str, reward: float | None, reason: str,
                      end: bool = True, step_rewards: dict[int, float] | None = None) -> str:
        """Post the reward, then any step rewards, and end the session; a gateway error is logged and noted in the
        reason (a step reward the gateway refuses, say for a call the session does not have, costs only itself)."""
        try:
            if reward is not None:
                await self.gateway.post_reward(handle.session_id, reward)
            for step, value in (step_rewards or {}).items():
                try:
                    await self.gateway.post_reward(handle.session_id, value, step=step)
                except GatewayError as exc:
                    log.error("session %s: step reward of call %d: %s", handle.session_id, step, exc)
                    reason = f"{reason}; step reward of call {step}: {exc}"
            if end:
                await self.gateway.end_session(handle.session_id, status)
        except GatewayError as exc:
            log.error("session %s: %s", handle.session_id, exc)
            return f"{reason}; gateway: {exc}"
        return reason

    def _episode_env(self, spec: HarnessSpec, task_id: str, handle: SessionHandle, out: Path) -> dict[str, str]:
        """The episode's own variables (its session's endpoint and STEPLINE_*), on top of the driver's environment."""
        return {
            **handle.env(), "STEPLINE_TASK_ID": task_id, "STEPLINE_HARNESS": spec.name,
            "STEPLINE_OUT_DIR": str(out), "STEPLINE_REWARD_URL": f"{self.gateway.url}/sessions/{handle.session_id}/reward",
        }

    def _run_argv(self, spec: HarnessSpec, task_id: str, out: Path) -> list[str]:
        if spec.command is not None:
            return ["/bin/sh", "-c", spec.command]
        turns = ["--max-turns", str(spec.max_turns)] if spec.max_turns else []
        tokens = ["--max-tokens", str(spec.max_tokens)] if spec.max_tokens else []
        return [self.python, "-m", f"{spec.module}.run", "--task", task_id, "--out", str(out / "episode"), *turns, *tokens]

    def _verify_argv(self, spec: HarnessSpec, task_id: str, out: Path) -> list[str] | None:
        if spec.verify_command is not None:
            return ["/bin/sh", "-c", spec.verify_command]
        if spec.module is None:
            return None
        return [self.python, "-m", f"{spec.module}.verify", "--task", task_id, "--out", str(out / "episode")]

    # --- groups and the job ---

    async def run_group(self, spec: HarnessSpec, task_id: str, group_size: int | None = None,
                        metadata: dict[str, Any] | None = None, prefix: str = "") -> list[EpisodeResult]:
        """G episodes of one task, in one explicit group ("<prefix><task>::<harness>::<random>"); with the
        harness's `tree_search` and no `group_size` given (evaluation gives 1), its trees of forked episodes
        instead (stepline/rollout/trees.py)."""
        group_id = f"{prefix}{task_id}::{spec.name}::{uuid.uuid4().hex[:12]}"
        metadata = metadata or {}
        metadata = {**metadata, **await self._reference(spec, task_id, metadata.get("split", spec.split))}
        if spec.tree_search is not None and group_size is None:
            return await trees.run_tree_group(self, spec, task_id, spec.tree_search, group_id, metadata,
                                              self.config.seed)
        size = group_size or spec.group_size or self.config.group_size
        experts = spec.expert_per_group if group_size is None and self.purpose == "train" else 0
        episodes = [self.run_episode(spec, task_id, group_id, metadata) for _ in range(size - experts)]
        episodes += [self.run_expert_episode(spec, task_id, group_id, metadata) for _ in range(experts)]
        return list(await asyncio.gather(*episodes))

    async def _reference(self, spec: HarnessSpec, task_id: str, split: str) -> dict[str, str]:
        """{"reference": gold answer} where the harness gives one for the task (IGPO), else {}."""
        if (spec.name, split) not in self._references:
            self._references[spec.name, split] = await asyncio.to_thread(task_references, spec, split)
        answer = self._references[spec.name, split].get(task_id)
        return {} if answer is None else {REFERENCE_KEY: answer}

    def add_result(self, spec: HarnessSpec, result: EpisodeResult) -> None:
        self.stats[spec.name].add(result)
        self.results.append(result)

    async def run(self, num_groups: int | None, stop: asyncio.Event | None = None,
                  metadata: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
        """Draw (harness by weight, then its next task) and run groups until num_groups are done or
        `stop` is set; at most max_concurrency episodes run at once; `metadata` goes into every session's.
        Returns per-harness stats."""
        if self._draw is None:  # kept across calls: a second run() goes on with the next tasks
            self._draw = _TaskDraw(self.config, await asyncio.to_thread(_all_tasks, self.config))
        draw = self._draw
        in_flight: set[asyncio.Task[list[EpisodeResult]]] = set()
        width = max(1, self.config.max_concurrency // self.config.group_size) + 1
        launched = 0
        while (num_groups is None or launched < num_groups) and not (stop and stop.is_set()):
            while len(in_flight) >= width:
                _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            spec, task_id = draw.next()
            in_flight.add(asyncio.create_task(self.run_group(spec, task_id, metadata=metadata)))
            launched += 1
        if in_flight:
            await asyncio.wait(in_flight)
        return self.summary()

    def summary(self) -> dict[str, dict[str, float]]:
        elapsed = time.monotonic() - self._started
        return {name: stats.summary(elapsed) for name, stats in self.stats.items()}


class _TaskDraw:
    """Harness by weight (seeded), then that harness's tasks in a shuffled cycle."""

    def __init__(self, config: RolloutConfig, tasks: dict[str, list[str]]):
        self.rng = random.Random(config.seed)
        self.specs = config.harnesses
        self.tasks = tasks
        self.queues: dict[str, list[str]] = {}

    def next(self) -> tuple[HarnessSpec, str]:
        spec = self.rng.choices(self.specs, weights=[h.weight for h in self.specs])[0]
        queue = self.queues.setdefault(spec.name, [])
        if not queue:
            queue.extend(self.rng.sample(self.tasks[spec.name], len(self.tasks[spec.name])))
        return spec, queue.pop()


def _conversation(out: Path) -> dict[str, Any]:
    """An episode's recorded conversation as the gateway's demonstration endpoint takes it: {"messages", "tools"}."""
    episode = json.loads((out / "episode" / "episode.json").read_text())
    return {"messages": episode["messages"], "tools": episode.get("tools")}


def _from_worker(answer: dict[str, Any], train: bool = False) -> _Played:
    """A worker's answer (stepline/agents/common/serve.py): {"outcome": "ran"|"failed", "reason", "verdict"}."""
    if answer.get("outcome") == "failed":
        return _Played(failure=str(answer.get("reason") or "harness failed"))
    if answer.get("outcome") != "ran":
        return _Played(failure=f"harness worker answered garbage: {str(answer)[:200]}")
    if answer.get("verdict") is None:
        return _Played()  # the driver runs the external verify_command
    try:
        return _Played(verdict=verdict_of(answer["verdict"], train))
    except ValueError as exc:
        return _Played(verdict=Score(0.0, False, f"verifier error: {exc}"))


def _all_tasks(config: RolloutConfig) -> dict[str, list[str]]:
    return {spec.name: training_tasks(spec) for spec in config.harnesses}


def format_stats(stats: Mapping[str, Mapping[str, float]]) -> str:
    """One line per harness: episodes, failed, success, mean reward, episodes/s."""
    rows = [f"{'harness':<12} {'episodes':>8} {'failed':>6} {'success':>8} {'reward':>7} {'ep/s':>6}"]
    for name, s in stats.items():
        rows.append(f"{name:<12} {s['episodes']:>8.0f} {s['failed']:>6.0f} {s['success_rate']:>8.3f} "
                    f"{s['mean_reward']:>7.3f} {s['episodes_per_s']:>6.2f}")
    return "\n".join(rows)


async def run_rollouts(config: RolloutConfig, gateway_url: str, num_groups: int, admin_token: str | None = None,
                       stop: asyncio.Event | None = None) -> tuple[dict[str, dict[str, float]], list[EpisodeResult]]:
    """Convenience: open a gateway client and a work dir, run `num_groups` groups, return stats and results."""
    with tempfile.TemporaryDirectory(prefix="stepline-rollout-", dir=config.work_dir) as work:
        async with GatewayClient(gateway_url, admin_token) as gateway, RolloutDriver(config, gateway, Path(work)) as driver:
            stats = await driver.run(num_groups, stop)
            return stats, driver.results


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL))
        return f.read().decode("utf-8", errors="replace")


def results_json(results: list[EpisodeResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
