"""Step-level RL algorithms as pure functions of tensors, with registries (name -> function).

Shapes: N flattened action tokens (segment ids `step_ids`, `traj_ids`, `episode_ids`, long [N]),
S steps, E episodes. The table of methods and their sources is in docs/reference.md ("Trainer algorithms").
"""

from trainer.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    group_index,
    group_normalize,
    leave_one_out,
    value_targets,
)
from trainer.algorithms.corrections import (
    KL_ESTIMATORS,
    clipped_value_loss,
    decoupled_weights,
    entropy_from_logits,
    fresh_mask,
    icepop_weights,
    kl_penalty,
    mis_weights,
    token_logprobs_from_logits,
    truncated_is_weights,
)
from trainer.algorithms.losses import (
    AGGREGATIONS,
    Surrogate,
    aggregate,
    clipped_surrogate,
    count_units,
    masked_mean,
    surrogate_stats,
)
from trainer.algorithms.objectives import POLICY_LOSSES, cispo_loss, gmpo_loss, ppo_loss, sapo_kl_term
from trainer.algorithms.ratios import RATIOS, segment_ratio, sequence_ratio, step_ratio, token_ratio
from trainer.algorithms.sampling import dynamic_sampling_mask, has_reward_variance, overlong_penalty

__all__ = [
    "ADVANTAGES",
    "AdvantageInputs",
    "group_index",
    "group_normalize",
    "leave_one_out",
    "value_targets",
    "KL_ESTIMATORS",
    "clipped_value_loss",
    "decoupled_weights",
    "entropy_from_logits",
    "fresh_mask",
    "icepop_weights",
    "kl_penalty",
    "mis_weights",
    "token_logprobs_from_logits",
    "truncated_is_weights",
    "AGGREGATIONS",
    "Surrogate",
    "aggregate",
    "clipped_surrogate",
    "count_units",
    "masked_mean",
    "surrogate_stats",
    "POLICY_LOSSES",
    "cispo_loss",
    "gmpo_loss",
    "ppo_loss",
    "sapo_kl_term",
    "RATIOS",
    "segment_ratio",
    "sequence_ratio",
    "step_ratio",
    "token_ratio",
    "dynamic_sampling_mask",
    "has_reward_variance",
    "overlong_penalty",
]
