"""Bad job files fail before anything starts, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stepline.trainer.config import TrainerConfig


def test_defaults_load(tiny_model_dir: Path) -> None:
    cfg = TrainerConfig(model_dir=tiny_model_dir)
    assert cfg.advantage == "grpo" and cfg.ratio == "step" and cfg.loss_aggregation == "episode-mean"
    assert all(f.description for f in TrainerConfig.model_fields.values())  # every field documented


@pytest.mark.parametrize("fields,where,says", [
    ({"advantage": "ppo-magic"}, "advantage", "unknown name 'ppo-magic'"),
    ({"ratio": "per-char"}, "ratio", "unknown name"),
    ({"loss_aggregation": "sum"}, "loss_aggregation", "unknown name"),
    ({"kl_estimator": "k4"}, "kl_estimator", "unknown name"),
    ({"max_staleness": -1}, "max_staleness", ">= 0"),
    ({"groups_per_update": 6, "minibatches": 4}, "", "divisible by minibatches"),
    ({"advantage": "gae"}, "", "needs a critic"),
    ({"advantage_args": {"gama": 0.9}}, "", "['gama'] not accepted"),
    ({"lr": 0}, "lr", "greater than 0"),
    ({"clip_hi": 0.3}, "clip_hi", "Extra inputs"),
    ({"schedule": "cosine"}, "", "set max_updates"),
    ({"push_every": 3, "max_staleness": 1}, "", "push_every (3) must be <= max_staleness + 1"),
    ({"train_layers": 3}, "train_layers", "exceeds the model's 2 layers"),
    ({"train_layers": 0}, "train_layers", "greater than or equal to 1"),
    ({"lora_rank": 0}, "lora_rank", "greater than or equal to 1"),
    ({"lora_rank": 8, "lora_targets": ["q_proj", "c_attn"]}, "lora_targets", "['c_attn'] are not linear layers"),
    ({"lora_rank": 8, "lora_targets": []}, "lora_targets", "empty"),
    ({"lora_alpha": 16}, "", "lora_alpha set but lora_rank is not"),
    ({"lora_targets": ["q_proj"]}, "", "lora_targets set but lora_rank is not"),
    ({"autocast_bf16": True, "dtype": "bfloat16"}, "", "autocast_bf16 keeps fp32 master weights"),
    ({"loss_aggregation": "seq-mean-token-sum-norm"}, "", "loss_token_norm is the constant C"),
    ({"loss_token_norm": 512}, "", "loss_token_norm is the constant C"),
    ({"loss_token_norm": 0}, "loss_token_norm", "greater than 0"),
    ({"policy_loss": "trpo"}, "policy_loss", "unknown name 'trpo'"),
    ({"policy_loss": "cispo", "dual_clip": 3.0}, "", "dual_clip applies to policy_loss 'ppo' only"),
    ({"sapo_tau": 0.5}, "", "sapo_tau set but sapo_coef is 0"),
    ({"sapo_coef": 0.1, "sapo_tau": 1.5}, "sapo_tau", "less than or equal to 1"),
    ({"sapo_coef": -1}, "sapo_coef", "greater than or equal to 0"),
    ({"is_correction": "icepop"}, "", "only with old_logprobs"),
    ({"is_correction": "imp", "old_logprobs": "recompute"}, "is_correction", "Input should be"),
    ({"is_floor": 0.2, "old_logprobs": "recompute"}, "", "is_floor is IcePop's lower bound"),
    ({"is_correction": "icepop", "old_logprobs": "recompute", "is_floor": 3.0}, "", "must be below tis_cap"),
    ({"advantage": "dr_grpo", "advantage_args": {"scale_by_std": True}}, "", "['scale_by_std'] not accepted"),
    ({"advantage": "capo"}, "", "'capo' needs a critic"),
    ({"advantage": "igpo", "advantage_args": {"lam": 0.9}}, "", "advantage_args: ['lam'] not accepted"),
    ({"reference_template": "<answer>{reference}</answer>"}, "", "reference_template is for advantage 'igpo'"),
    ({"advantage": "igpo", "reference_template": "<answer>"}, "", "must contain {reference}"),
    ({"ratio": "prefixes"}, "ratio", "unknown name"),
    ({"policy_loss": "dppo", "ratio": "token", "policy_loss_args": {"delt": 0.1}}, "",
     "policy_loss_args: ['delt'] not accepted by policy_loss 'dppo'"),
    ({"policy_loss_args": {"delta": 0.1}}, "", "not accepted by policy_loss 'ppo'"),
    ({"policy_loss": "drpo"}, "", "set ratio = \"token\" (not 'step')"),
    ({"policy_loss": "cppo", "ratio": "token", "policy_loss_args": {"min_weight": 1.5}}, "",
     "policy_loss_args.min_weight must be in (0, 1]"),
    ({"policy_loss": "drpo", "ratio": "token", "policy_loss_args": {"delta": 0}}, "",
     "policy_loss_args.delta must be > 0"),
    ({"clip_rule": "adaptive"}, "clip_rule", "unknown name 'adaptive'"),
    ({"clip_rule": "ripo", "clip_rule_args": {"radius": 0.02}}, "", "clip_rule_args: ['radius'] not accepted"),
    ({"clip_rule": "gapo", "clip_rule_args": {"clip_max": 0.1}}, "", "clip_max (0.1) must be >= clip_low"),
    ({"clip_rule": "gapo", "policy_loss": "gmpo"}, "", "sets the ratio clip of ppo or cispo"),
    ({"clip_rule": "stale"}, "", "set old_logprobs = \"recompute\""),
    ({"clip_rule": "ripo", "clip_rule_args": {"delta": "big"}}, "", "clip_rule_args.delta must be a number"),
])
def test_bad_fields_are_named(tiny_model_dir: Path, fields: dict, where: str, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainerConfig(model_dir=tiny_model_dir, **fields)
    err = info.value.errors()[0]
    assert ".".join(map(str, err["loc"])) == where and says in err["msg"], err


def test_missing_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as info:
        TrainerConfig(model_dir=tmp_path / "nope")
    assert info.value.errors()[0]["loc"] == ("model_dir",)
