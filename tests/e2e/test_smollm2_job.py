"""The main job shortened on the real policy, SmolLM2-135M-Instruct (slow: 3 minutes on 2 cores with AMX, more without).

    .venv/bin/python -m pytest -m slow tests/e2e/test_smollm2_job.py -q

Runs examples/quickstart.toml with few demonstrations, one RL update and two test tasks per harness,
then checks what the fast tiny-model e2e test cannot: that the SFT policy writes well-formed tool calls
for every harness, and that after the update the engine served the pushed weights — the logprobs it
recorded for the evaluation after RL are those of the pushed checkpoint (recomputed with transformers),
not those of the SFT model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.datapool import open_pool
from stepline.gateway.parsers import parse_text
from stepline.launch.job import load_job
from stepline.launch.run import run_job
from stepline.weightdelta import materialize

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the job takes minutes, not the suite default 300 s
ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"search": {"search", "answer"}, "terminal": {"bash"}, "ui": {"tap", "type", "scroll", "back", "ask_user"}}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, smollm2_model_dir: Path) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("smollm2-run")
    cfg = load_job(ROOT / "examples" / "quickstart.toml", {
        "run_dir": str(run_dir), "rl_updates": 1, "model.dir": str(smollm2_model_dir),
        "sft.demos_per_harness": 8, "sft.demos": {}, "trainer.groups_per_update": 3, "trainer.minibatches": 1, "trainer.dynamic_sampling": False,
        "rollout.group_size": 2, "rollout.harnesses.2.group_size": 2, "eval.limit": 2,
        "services.engine_dtype": "float32",  # the quickstart's "auto" serves bf16 on bf16 CPUs: the exact check needs fp32
        "trainer.failure_coef": 0.5,  # every episode moves the weights, even when all six fail (they did, seed 0)
    })
    return run_dir, run_job(cfg)


def _eval_actions(pool, version: int) -> list[tuple[str, list[int], list[int], list[float]]]:
    """(harness, prompt ids, output ids, recorded logprobs) of the evaluation calls sampled by `version`."""
    out = []
    for info in pool.list_sessions():
        if info.purpose != "eval":
            continue
        episode = pool.get_episode(info.session_id)
        for traj in episode.trajectories:
            for step in traj.steps:
                if step.weight_version == version:
                    out.append((info.harness, traj.tokens[:step.action_start].tolist(),
                                traj.tokens[step.action_start:step.action_end].tolist(),
                                step.behaviour_logprobs.tolist()))
    return out


def _logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_sft_policy_writes_tool_calls(finished_run: tuple[Path, dict]) -> None:
    run_dir, _ = finished_run
    tok = AutoTokenizer.from_pretrained(run_dir / "model-sft")
    pool = open_pool(f"sqlite:///{run_dir / 'pool.db'}", read_only=True)
    try:
        first_turns: dict[str, list[bool]] = {}
        for harness, _prompt, output, _lp in _eval_actions(pool, 0):
            text = tok.decode(output, skip_special_tokens=True)
            calls = parse_text(text, tools=dict.fromkeys(TOOLS[harness], {})).tool_calls
            first_turns.setdefault(harness, []).append(bool(calls))
    finally:
        pool.close()
    assert set(first_turns) == set(TOOLS)
    for harness, parsed in first_turns.items():  # the SFT policy writes each harness's tool calls...
        assert any(parsed), (harness, parsed)
    every = [ok for parsed in first_turns.values() for ok in parsed]  # ...and mostly well-formed (UI alone, on
    assert sum(every) >= len(every) / 2, first_turns                    # 2-3 first turns, is a coin flip after 8 demos)


def test_rl_update_changes_what_the_engine_serves(finished_run: tuple[Path, dict]) -> None:
    run_dir, summary = finished_run
    assert summary["rl_updates"] == 1 and summary["weight_version"] == 1
    folder = materialize(run_dir / "rl" / "weights" / "v000001", run_dir / "v000001-full")  # a delta: made whole
    pushed = AutoModelForCausalLM.from_pretrained(folder).eval()
    sft = AutoModelForCausalLM.from_pretrained(run_dir / "model-sft").eval()
    pool = open_pool(f"sqlite:///{run_dir / 'pool.db'}", read_only=True)
    try:
        served = _eval_actions(pool, 1)[:6]
    finally:
        pool.close()
    assert served
    gap_pushed, gap_sft = 0.0, 0.0
    for _harness, prompt, output, recorded in served:
        rec = torch.tensor(recorded)
        gap_pushed = max(gap_pushed, float((_logprobs(pushed, prompt, output) - rec).abs().max()))
        gap_sft = max(gap_sft, float((_logprobs(sft, prompt, output) - rec).abs().max()))
    # recorded = the pushed weights' logprobs (float32 engine), and measurably not the SFT model's
    assert gap_pushed < 2e-3, gap_pushed
    assert gap_sft > 10 * gap_pushed, (gap_sft, gap_pushed)
