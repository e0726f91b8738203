"""The speed options (stepline/trainer/trainable.py, TrainerConfig): what trains is exactly what the option says, the
engine always gets the full plain model, autocast keeps fp32 weights, and checkpoints resume each of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_update import policy_for, toy_groups
from transformers import AutoModelForCausalLM

from stepline.trainer.batch import build_batch
from stepline.trainer.checkpoint import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint
from stepline.trainer.loop import build_policy, objective
from stepline.trainer.update import update
from stepline.trainer.weight_sync import save_weights

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4 layers, so that 'the top 2' leaves two frozen below them."""
    from stepline.models import ModelShape, build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny4", kind="tiny", seed=0, shape=ModelShape(num_layers=4))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def optimized(policy) -> set[int]:
    return {id(p) for group in policy.optimizer.param_groups for p in group["params"]}


def test_train_layers_moves_only_the_top_layers(four_layer_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(four_layer_dir, tmp_path, train_layers=2)
    before = snapshot(policy.model)
    update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    top = {n for n in before if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm."))}
    assert changed == top  # everything else (embedding = tied LM head, layers 0 and 1) bit-identical
    assert optimized(policy) == {id(p) for n, p in policy.model.named_parameters() if n in top}


def test_lora_push_is_base_plus_merged_delta(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, lora_rank=4, lora_alpha=16.0, lora_targets=["q_proj", "down_proj"])
    update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
    base = load_file(tiny_model_dir / "model.safetensors")
    params = dict(policy.model.named_parameters())
    assert optimized(policy) == {id(p) for n, p in params.items() if ".lora_" in n}
    saved = load_file(save_weights(policy.model, tmp_path / "weights", 1, tiny_model_dir) / "model.safetensors")
    assert set(saved) == set(base)  # plain HF names, nothing of peft's
    adapted = 0
    for key, w0 in base.items():
        prefix = key.removesuffix(".weight")
        if f"{prefix}.lora_A.default.weight" not in params:
            assert torch.equal(saved[key], w0), key  # untouched by LoRA and frozen
            continue
        a, b = params[f"{prefix}.lora_A.default.weight"], params[f"{prefix}.lora_B.default.weight"]
        assert torch.equal(params[f"{prefix}.base_layer.weight"], w0)  # the base weight never trains
        torch.testing.assert_close(saved[key], w0 + 16.0 / 4 * b.detach() @ a.detach(), atol=1e-6, rtol=0)
        adapted += not torch.equal(saved[key], w0)
    assert adapted == 2 * 2  # q_proj and down_proj of both layers moved
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "v000001").eval()
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, policy.model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)


def test_autocast_loss_is_close_and_weights_stay_fp32(tiny_model_dir: Path, tmp_path: Path) -> None:
    losses = {}
    for autocast in (False, True):
        cfg, policy = policy_for(tiny_model_dir, tmp_path, mode="sft", autocast_bf16=autocast)
        batch = build_batch(toy_groups(1))
        losses[autocast] = update(policy, batch, objective(cfg, 0, False), version=0)["policy_loss"]
        assert all(p.dtype == torch.float32 for p in policy.model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in policy.optimizer.state.values())
    # bf16 keeps 8 bits of mantissa: a loss of ~8 nats moves by a few hundredths, never by nothing
    assert 0 < abs(losses[True] - losses[False]) < 0.02 * losses[False], losses


@pytest.mark.parametrize("options", [
    {"train_layers": 2},
    {"lora_rank": 4, "train_layers": 1, "autocast_bf16": True},
])
def test_checkpoint_resumes_each_option(four_layer_dir: Path, tmp_path: Path, options: dict) -> None:
    # a resumed policy takes the next step exactly as the one that never stopped
    cfg, a = policy_for(four_layer_dir, tmp_path, critic=True, advantage="gae", **options)
    batch = build_batch(toy_groups())
    update(a, batch, objective(cfg, 0, False), version=0)
    save_checkpoint(tmp_path / "ckpt", TrainerState(update=1, version=1), a.model, a.optimizer, a.scheduler, a.value_head)
    b = build_policy(cfg)
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), b.model, b.optimizer, b.scheduler, b.value_head)
    for p in (a, b):
        update(p, batch, objective(cfg, 1, False), version=1)
    after_a, after_b = snapshot(a.model), snapshot(b.model)
    assert after_a.keys() == after_b.keys()
    for name in after_a:
        assert torch.equal(after_a[name], after_b[name]), name
    assert len(optimized(b)) == len([p for p in b.parameters()])  # still only what trains (and the value head)
