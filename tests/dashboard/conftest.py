"""A run-like directory built here: the tiny model's tokenizer, trainer metrics, evaluations, rollouts.json
and a pool.db whose sessions are written through the pool API (linear, forked with a retry, failed,
open, evaluation)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, Purpose, Reward, SessionInfo


@dataclass
class RunFixture:
    root: Path
    tokenizer_dir: Path
    sessions: dict[str, dict]  # session id -> what was written: harness, reward, status, split


class Writer:
    """Writes sessions whose tokens are real text under the tiny tokenizer."""

    def __init__(self, pool, tokenizer) -> None:
        self.pool, self.tok = pool, tokenizer

    def ids(self, text: str) -> np.ndarray:
        return np.array(self.tok.encode(text, add_special_tokens=False).ids, np.int32)

    def call(self, sid: str, index: int, prompt: np.ndarray, text: str, version: int) -> tuple[CallRecord, np.ndarray]:
        out = self.ids(text)
        logprobs = -np.linspace(0.05, 3.0, len(out)).astype(np.float32) - 0.01 * index
        return CallRecord(sid, index, prompt, out, logprobs, version), np.concatenate([prompt, out])


def write_linear(w: Writer, sid: str, harness: str, task: str, turns: int, version: int, metadata=None,
                 group: str | None = None, purpose: Purpose = "train") -> None:
    w.pool.create_session(SessionInfo(sid, task, harness, group_id=group, metadata=metadata or {}, purpose=purpose))
    prompt, records = w.ids(f"system: solve {task}\nuser: go"), []
    for t in range(turns):
        record, seq = w.call(sid, t, prompt, f"step {t}: I think the answer is {t * 7} é", version + t)
        records.append(record)
        prompt = np.concatenate([seq, w.ids(f"\ntool: result {t}\n")])
    w.pool.add_calls(records)


def write_forked(w: Writer, sid: str, task: str = "t-fork", group: str | None = None) -> None:
    """call 0; calls 1 and 2 share call 0's sequence but add different observations (a fork);
    call 3 retries call 2's prompt, so call 2's leaf is superseded (dead)."""
    w.pool.create_session(SessionInfo(sid, task, "search", group_id=group))
    r0, seq0 = w.call(sid, 0, w.ids("system: fork task\nuser: find it"), "search for it", 1)
    r1, _ = w.call(sid, 1, np.concatenate([seq0, w.ids("\ntool: page A")]), "answer A", 1)
    p2 = np.concatenate([seq0, w.ids("\ntool: page B, rewritten")])
    r2, _ = w.call(sid, 2, p2, "answer B", 2)
    r3, _ = w.call(sid, 3, p2, "answer B again", 2)
    w.pool.add_calls([r0, r1, r2, r3])
    w.pool.add_reward(Reward(sid, 0.5, step=0, name="progress"))


def build_pool(path: Path, tokenizer) -> dict[str, dict]:
    pool = open_pool(f"sqlite:///{path}")
    w, written = Writer(pool, tokenizer), {}
    try:
        for i in range(6):
            sid, harness, reward = f"s-lin-{i}", ("search", "ui")[i % 2], float(i % 3 == 0)
            write_linear(w, sid, harness, f"t{i}", turns=2 + i % 2, version=i)
            pool.add_reward(Reward(sid, reward))
            pool.end_session(sid)
            written[sid] = {"harness": harness, "reward": reward, "status": "completed", "split": "train"}
        write_forked(w, "s-fork")
        pool.add_reward(Reward("s-fork", 1.0))
        pool.end_session("s-fork")
        written["s-fork"] = {"harness": "search", "reward": 1.0, "status": "completed", "split": "train"}
        write_linear(w, "s-failed", "ui", "t-bad", turns=1, version=3)
        pool.end_session("s-failed", "failed")
        written["s-failed"] = {"harness": "ui", "reward": None, "status": "failed", "split": "train"}
        write_linear(w, "s-open", "search", "t-open", turns=1, version=4)
        written["s-open"] = {"harness": "search", "reward": None, "status": "open", "split": "train"}
        write_linear(w, "eval::s-0", "search", "t-test", turns=1, version=6, metadata={"split": "test"},
                     purpose="eval")
        pool.add_reward(Reward("eval::s-0", 1.0))
        pool.end_session("eval::s-0")
        written["eval::s-0"] = {"harness": "search", "reward": 1.0, "status": "completed", "split": "eval"}
    finally:
        pool.close()
    return written


def _eval(rates: dict[str, tuple[float, int]], version: int) -> str:
    return json.dumps({"split": "test", "weight_version": version, "harnesses": {
        h: {"episodes": n, "failed": 0, "success_rate": r, "mean_reward": r} for h, (r, n) in rates.items()}})


def write_run_files(root: Path, tokenizer_dir: Path) -> None:
    (root / "eval").mkdir(parents=True)
    (root / "rl").mkdir()
    (root / "model-sft").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, root / "model-sft" / name)
    (root / "job.json").write_text(json.dumps({"model": {"dir": None}, "trainer": {"leaf_rule": "drop_superseded"}}))
    (root / "phases.json").write_text(json.dumps({"model": 0.5, "sft": 12.0}))
    (root / "eval" / "before.json").write_text(_eval({"search": (0.25, 8), "ui": (0.5, 8)}, 0))
    (root / "eval" / "after-3.json").write_text(_eval({"search": (0.5, 8), "ui": (0.75, 8)}, 3))
    later = time.time() + 3600  # every session ends before update 1 was logged: all fall in window 1
    metrics = [{"update": u, "time": later + u, "policy_loss": 0.1 * u, "approx_kl_behaviour_mean": 0.01 * u,
                "entropy_mean": 2.0 - 0.1 * u, "clip_frac_mean": 0.05, "staleness_mean": 0.5, "staleness_max": 1.0,
                "tokens_per_s": 100.0 * u, "reward/search": 0.25 * u, "reward/ui": 0.5} for u in (1, 2, 3)]
    (root / "rl" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"update": 4, "ti')
    rollouts = [{"session_id": "s-failed", "harness": "ui", "task_id": "t-bad", "status": "failed", "reward": None,
                 "success": False, "reason": "harness timed out after 30s", "batch": 1},
                {"session_id": "s-lin-0", "harness": "search", "task_id": "t0", "status": "completed", "reward": 1.0,
                 "success": True, "reason": "found the page", "batch": 1}]
    (root / "rl" / "rollouts.json").write_text(json.dumps(rollouts))


@pytest.fixture(scope="session")
def run_fixture(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> RunFixture:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("dashboard") / "run"
    write_run_files(root, tiny_model_dir)
    sessions = build_pool(root / "pool.db", Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))
    return RunFixture(root, tiny_model_dir, sessions)


def build_group_pool(path: Path, tokenizer) -> None:
    """Groups as the rollout driver makes them (an explicit group id per task × harness draw):
    g-var: rewards 1, 0, 0.5 (s-var-1 two turns, s-var-2 forked); g-same: rewards 1, 1; g-open: one
    ended and rewarded, one still open; g-big is task t-big's default key (no group id) with one session."""
    pool = open_pool(f"sqlite:///{path}")
    w = Writer(pool, tokenizer)
    try:
        write_linear(w, "s-var-0", "search", "t-g", turns=1, version=0, group="g-var")
        write_linear(w, "s-var-1", "search", "t-g", turns=2, version=0, group="g-var")
        write_forked(w, "s-var-2", task="t-g", group="g-var")
        write_linear(w, "s-same-0", "ui", "t-s", turns=1, version=1, group="g-same")
        write_linear(w, "s-same-1", "ui", "t-s", turns=1, version=1, group="g-same")
        write_linear(w, "s-open-0", "ui", "t-o", turns=1, version=1, group="g-open")
        write_linear(w, "s-open-1", "ui", "t-o", turns=1, version=1, group="g-open")
        write_linear(w, "s-big-0", "terminal", "t-big", turns=1, version=2)
        for sid, reward in (("s-var-0", 1.0), ("s-var-1", 0.0), ("s-same-0", 1.0), ("s-same-1", 1.0),
                            ("s-open-0", 0.0), ("s-big-0", 1.0)):
            pool.add_reward(Reward(sid, reward))
            pool.end_session(sid)
        pool.add_reward(Reward("s-var-2", 0.5))  # its dense step reward (0.5 at step 0) came with write_forked
        pool.end_session("s-var-2")
    finally:
        pool.close()


@pytest.fixture(scope="session")
def group_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A run directory whose job trains with GRPO and dynamic sampling, and whose pool holds `build_group_pool`."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("dashboard-groups") / "run"
    write_run_files(root, tiny_model_dir)
    (root / "job.json").write_text(json.dumps({"trainer": {"advantage": "grpo", "dynamic_sampling": True,
                                                           "leaf_rule": "drop_superseded"}}))
    build_group_pool(root / "pool.db", Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))
    return root


@pytest.fixture(scope="session")
def session_writer(tiny_model_dir: Path):
    """write(path, n, pause_s): n linear sessions (groups of two, one or two turns) written one by one into a new
    SQLite pool at path — created, called, rewarded and ended — as a job writes them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))

    def write(path: Path, n: int, pause_s: float = 0.0) -> None:
        pool = open_pool(f"sqlite:///{path}")
        w = Writer(pool, tokenizer)
        try:
            for i in range(n):
                sid = f"s-live-{i}"
                write_linear(w, sid, "search", f"t-live-{i // 2}", turns=1 + i % 2, version=i // 4,
                             group=f"g-live-{i // 2}")
                pool.add_reward(Reward(sid, float(i % 3 == 0)))
                pool.end_session(sid)
                time.sleep(pause_s)
        finally:
            pool.close()

    return write
