"""One policy update on a batch: advantages, then epochs of minibatch steps with gradient accumulation.

    metrics = update(policy, batch, objective, version)

`Objective` holds plain values (the loop builds it from the config once). Per minibatch the gradient is
accumulated over micro-batches (one tree forward each) with every aggregation divided by the
minibatch's unit count, so 8 micro-batches give the same step as 2 × 4 or 1 × 8. Sessions are never
split across micro-batches. Before the epochs, one no-grad pass reads what the loss compares against:
the trainer's own logprobs (decoupled objective), the frozen reference's (KL) and the critic's values;
with none of them (old_logprobs = "engine", no KL, no critic) there is no such pass. IGPO adds one more no-grad
read, the policy's probability of each session's gold answer after every step's state (information_gain.py). Every forward runs
under `Policy.forward_context()`: bf16 autocast when the config asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from stepline.datapool.records import HINDSIGHT_KEY
from stepline.trainer.algorithms import (
    ADVANTAGES,
    CLIP_RULES,
    POLICY_LOSSES,
    ClipInputs,
    Segments,
    aggregate,
    clipped_value_loss,
    count_units,
    decoupled_weights,
    fresh_mask,
    icepop_weights,
    imitation_bonus,
    kl_penalty,
    mis_weights,
    sapo_kl_term,
    scale_negative,
    value_targets,
)
from stepline.trainer.batch import Batch, TokenView, episode_tokens, token_view
from stepline.trainer.distributed import SINGLE, Ranks
from stepline.trainer.information_gain import REFERENCE_KEY, gold_probabilities
from stepline.trainer.tree_forward import forest_forward

__all__ = ["Objective", "Policy", "update"]

log = logging.getLogger("stepline.trainer")


@dataclass
class Policy:
    """What an update changes or reads: the model, its optional value head and frozen reference."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch LR scheduler
    value_head: nn.Module | None = None
    reference: nn.Module | None = None
    autocast_bf16: bool = False  # forwards under bf16 autocast; weights, gradients and optimizer stay fp32

    def parameters(self) -> list[nn.Parameter]:
        heads = list(self.value_head.parameters()) if self.value_head is not None else []
        return [p for p in self.model.parameters() if p.requires_grad] + heads

    def forward_context(self) -> contextlib.AbstractContextManager:
        """What every forward of an update runs under, the no-grad reads included, so the proximal and the
        training logprobs come from the same arithmetic (the ratio starts at 1). Backward runs outside it,
        as autocast wants: autograd replays each op in the dtype its forward used."""
        if not self.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Objective:
    mode: Literal["rl", "sft"] = "rl"
    advantage: str = "grpo"
    advantage_args: dict[str, Any] = field(default_factory=dict)
    ratio: str = "step"
    policy_loss: str = "ppo"  # a key of POLICY_LOSSES
    policy_loss_args: dict[str, Any] = field(default_factory=dict)  # the loss's own hyper-parameters (δ, ...)
    clip_rule: str = "fixed"  # a key of CLIP_RULES: how ε_low/ε_high are set per token
    clip_rule_args: dict[str, Any] = field(default_factory=dict)
    sapo_coef: float = 0.0  # γ of SAPO's conditional KL term (0: off)
    sapo_tau: float = 1.0  # τ: the term acts on positive-advantage tokens with r < τ
    aggregation: str = "episode-mean"
    token_norm: float | None = None  # C of seq-mean-token-sum-norm
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    old_logprobs: Literal["engine", "recompute"] = "engine"
    tis_cap: float = 2.0
    tis_level: Literal["token", "step"] = "step"
    is_correction: Literal["tis", "icepop", "mis"] = "tis"  # how the stepline/trainer/engine weight is bounded
    is_floor: float = 0.5  # IcePop's lower bound (tis_cap is the upper one)
    imitation_coef: float = 0.0  # self-imitation bonus on episodes with outcome >= imitation_min_outcome
    imitation_min_outcome: float = 1.0
    failure_coef: float = 0.0  # negative reinforcement on episodes with outcome < imitation_min_outcome
    negative_scale: float | dict[str, float] = 1.0  # on negative step advantages; per harness where a dict
    expert_sft_coef: float = 0.0  # > 0: experts' episodes leave their groups and train by cross-entropy × this
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    critic_only: bool = False  # critic warm-up: the policy loss is left out
    epochs: int = 1
    minibatches: int = 1
    micro_batch_episodes: int = 8
    micro_batch_tokens: int | None = None
    max_grad_norm: float = 1.0
    max_staleness: int | None = 4  # None: offline replay, no staleness mask


@dataclass(frozen=True)
class _Targets:
    """Per-step and per-episode values the losses read, computed once per update."""

    advantages: torch.Tensor | None  # [S]
    returns: torch.Tensor | None  # [S] critic targets
    old_values: torch.Tensor | None  # [S] critic values before the update
    outcome: torch.Tensor  # [E]
    episode_group: torch.Tensor  # [E]


@dataclass
class _Aux:
    """No-grad reads for one micro-batch, before any step of this update."""

    prox: torch.Tensor | None = None  # [A] the trainer's logprobs at update start
    ref: torch.Tensor | None = None  # [A] the frozen reference's logprobs
    values: torch.Tensor | None = None  # [A] critic values at each token's source


def update(policy: Policy, batch: Batch, obj: Objective, version: int, ranks: Ranks = SINGLE) -> dict[str, float]:
    """One update on `batch`; with several `ranks`, this rank forwards its share of each minibatch's groups
    (stepline/trainer/distributed.py) and every rank gets the same advantages, gradients and step."""
    start = time.perf_counter()
    plan = [[token_view(batch, micro) for micro in minibatch] for minibatch in _plan(batch, obj, ranks)]
    aux = [[_precompute(policy, view, obj) for view in minibatch] for minibatch in plan]
    gold = _gold_probabilities(policy, batch) if obj.advantage == "igpo" else None
    advantages, returns, old_values = _advantages(batch, plan, aux, obj, gold, ranks,
                                                  critic=policy.value_head is not None)
    targets = _Targets(advantages, returns, old_values, batch.outcome, batch.episode_group)
    stats: dict[str, list[float]] = defaultdict(list)
    if gold is not None:
        stats["gold_prob"].append(float(gold.mean()))
    if not all(t is None or bool(torch.isfinite(t).all()) for t in (advantages, returns, batch.outcome)):
        log.warning("update at version %d skipped: non-finite outcomes or advantages", version)
        stats["non_finite_steps"].append(float(obj.epochs * len(plan)))  # no optimizer step is taken
        return _summary(batch, plan, targets.advantages, stats, obj, version, time.perf_counter() - start, ranks)
    for _ in range(obj.epochs):
        for views, auxes in zip(plan, aux):
            _minibatch_step(policy, views, auxes, targets, obj, version, stats, ranks)
    elapsed = time.perf_counter() - start
    return _summary(batch, plan, targets.advantages, stats, obj, version, elapsed, ranks)


def _gold_probabilities(policy: Policy, batch: Batch) -> torch.Tensor:
    """IGPO: π_θ(a* | s_t) [S] for every step row, under the policy at the start of the update."""
    missing = [ep.info.session_id for ep, ref in zip(batch.episodes, batch.references) if ref is None]
    if missing:
        raise ValueError(f"advantage 'igpo' needs each session's gold answer in metadata[{REFERENCE_KEY!r}]; "
                         f"sessions without one: {missing[:3]}")
    golds = [batch.references[e] for e in batch.step_episode.tolist()]
    with policy.forward_context():
        return gold_probabilities(policy.model, batch.contexts, golds)


def _plan(batch: Batch, obj: Objective, ranks: Ranks = SINGLE) -> list[list[list[int]]]:
    """Episodes -> minibatches (whole groups each) -> this rank's share of the minibatch's groups ->
    micro-batches of at most micro_batch_episodes and micro_batch_tokens (a rank may have none in a minibatch)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for e, g in enumerate(batch.episode_group.tolist()):
        groups[g].append(e)
    parts = [p for p in np.array_split(np.arange(len(groups)), min(obj.minibatches, len(groups))) if len(p)]
    keys = list(groups)
    plan = []
    for part in parts:
        episodes = [e for i in ranks.share(part.tolist()) for e in groups[keys[i]]]
        sizes = [episode_tokens(batch.episodes[e]) for e in episodes]
        plan.append(micro_batches(episodes, sizes, obj.micro_batch_episodes, obj.micro_batch_tokens))
    return plan


def micro_batches(items: list[int], sizes: list[int], max_items: int, max_tokens: int | None) -> list[list[int]]:
    """`items` in order, cut into runs of at most `max_items` whose `sizes` sum to at most `max_tokens`; an item
    larger than `max_tokens` makes a run of its own."""
    runs: list[list[int]] = []
    total = 0
    for item, size in zip(items, sizes):
        if runs and len(runs[-1]) < max_items and (max_tokens is None or total + size <= max_tokens):
            runs[-1].append(item)
            total += size
        else:
            runs.append([item])
            total = size
    return runs


@torch.no_grad()
def _precompute(policy: Policy, view: TokenView, obj: Objective) -> _Aux:
    aux = _Aux()
    if obj.mode == "sft":
        return aux
    if obj.old_logprobs == "recompute" or policy.value_head is not None:
        with policy.forward_context():
            out = forest_forward(policy.model, view.forest, policy.value_head, with_entropy=False)
        aux.prox = out.logprobs if obj.old_logprobs == "recompute" else None
        aux.values = out.values
    if obj.kl_coef > 0 and policy.reference is not None:
        with policy.forward_context():
            aux.ref = forest_forward(policy.reference, view.forest, with_entropy=False).logprobs
    return aux


def _first_tokens(step_ids: torch.Tensor) -> torch.Tensor:
    """Index of the first token of each step present (its state boundary: the value is read there)."""
    _, first = np.unique(step_ids.cpu().numpy(), return_index=True)
    return torch.as_tensor(np.sort(first), device=step_ids.device)


def _advantages(batch: Batch, plan, aux, obj: Objective, gold: torch.Tensor | None = None, ranks: Ranks = SINGLE,
                critic: bool = False):
    """Per-step advantages [S]; for the critic also returns [S] and the values before the update [S]
    (each rank reads the values of its own steps; summed over the ranks, every step has its value)."""
    if obj.mode == "sft":
        return None, None, None
    values = None
    if critic:
        owned = torch.zeros(batch.num_steps)
        for views, auxes in zip(plan, aux):
            for view, a in zip(views, auxes):
                first = _first_tokens(view.step_ids)
                owned[view.step_ids[first]] = a.values[first.to(a.values.device)].float().cpu()
        values = ranks.sum_tensor(owned)[batch.owner_rows()]
    inputs = batch.advantage_inputs(values, gold)
    if obj.expert_sft_coef > 0:  # each expert episode its own group of one: out of the policy's baseline, advantage 0
        inputs = replace(inputs, episode_group=_apart(inputs.episode_group, [ep.info.expert for ep in batch.episodes]))
    advantages = ADVANTAGES[obj.advantage](inputs, **obj.advantage_args)
    if obj.imitation_coef > 0 or obj.failure_coef > 0:
        bonus = imitation_bonus(inputs.outcome, coef=obj.imitation_coef, min_outcome=obj.imitation_min_outcome,
                                failure_coef=obj.failure_coef)
        advantages = advantages + bonus[inputs.step_episode]
    if obj.negative_scale != 1.0:
        scale = torch.tensor([_negative_scale(obj, ep.info.harness) for ep in batch.episodes])
        advantages = scale_negative(advantages, scale[inputs.step_episode])
    if values is None:
        return advantages, None, None
    gae = {k: v for k, v in obj.advantage_args.items() if k in ("gamma", "lam")}
    if obj.advantage == "capo":  # CAPO's critic regresses on the one-step TD target r + γ V(s')
        gae["lam"] = 0.0
    return advantages, value_targets(inputs, **gae), values


def _negative_scale(obj: Objective, harness: str) -> float:
    scale = obj.negative_scale
    return scale if isinstance(scale, float | int) else scale.get(harness, 1.0)


def _apart(group: torch.Tensor, alone: list[bool]) -> torch.Tensor:
    """Group indices [E] with each episode marked `alone` moved to a new group of its own."""
    rows = [i for i, a in enumerate(alone) if a]
    if not rows:
        return group
    out = group.clone()
    out[rows] = int(group.max()) + 1 + torch.arange(len(rows), dtype=group.dtype)
    return out


def _token_mask(view: TokenView, obj: Objective, version: int) -> torch.Tensor:
    if obj.mode == "sft" or obj.max_staleness is None:
        return torch.ones(len(view.step_ids), dtype=torch.bool)
    return fresh_mask(view.forest.weight_version, version, obj.max_staleness)


def _minibatch_step(policy: Policy, views: list[TokenView], auxes: list[_Aux], targets: _Targets, obj: Objective,
                    version: int, stats: dict[str, list[float]], ranks: Ranks = SINGLE) -> None:
    masks = [_token_mask(v, obj, version) for v in views]
    units, value_units = _units(views, masks, obj, ranks)
    policy.optimizer.zero_grad(set_to_none=True)
    for view, aux, mask in zip(views, auxes, masks):
        loss = _micro_loss(policy, view, aux, mask, targets, obj, units, value_units, stats)
        if loss.requires_grad:
            loss.backward()
    ranks.sum_gradients(policy.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), obj.max_grad_norm)
    if not bool(torch.isfinite(grad_norm)):  # a NaN/inf loss or gradient: the weights stay as they are
        log.warning("optimizer step at version %d skipped: gradient norm %s", version, float(grad_norm))
        policy.optimizer.zero_grad(set_to_none=True)
        stats["non_finite_steps"].append(1.0)
        return
    policy.optimizer.step()
    policy.scheduler.step()
    stats["grad_norm"].append(float(grad_norm))
    stats["lr"].append(policy.optimizer.param_groups[0]["lr"])


def _units(views: list[TokenView], masks: list[torch.Tensor], obj: Objective, ranks: Ranks) -> tuple[int, int]:
    """What the minibatch's losses divide by: its aggregation units and its steps with a value, over all ranks
    (the ranks' episodes are disjoint, so their unit counts add up; token-sum divides by 1 on every rank)."""
    if not views:
        units, value_units = 0, 0
    else:
        ids = {k: torch.cat([getattr(v, k) for v in views]) for k in ("step_ids", "traj_ids", "episode_ids")}
        units = count_units(torch.cat(masks), obj.aggregation, **ids)
        value_units = sum(len(_first_tokens(v.step_ids)) for v in views)
    if ranks.world == 1:
        return units, value_units
    total, total_values = ranks.sum([units, value_units])
    return (1 if obj.aggregation == "token-sum" else int(total)), int(total_values)


def _micro_loss(policy: Policy, view: TokenView, aux: _Aux, mask: torch.Tensor, targets: _Targets, obj: Objective,
                units: int, value_units: int, stats: dict[str, list[float]]) -> torch.Tensor:
    with policy.forward_context():
        out = forest_forward(policy.model, view.forest, policy.value_head, with_entropy=True,
                             entropy_grad=obj.mode == "rl" and obj.entropy_coef != 0)
    dev = out.logprobs.device
    mask = mask.to(dev)
    step_ids, traj_ids, episode_ids = view.step_ids.to(dev), view.traj_ids.to(dev), view.episode_ids.to(dev)
    behaviour = view.forest.behaviour_logprobs.to(dev)
    logp = out.logprobs
    if view.forest.expert.any():  # no policy sampled an expert's tokens: its behaviour is the policy now (ratio 1)
        behaviour = torch.where(view.forest.expert.to(dev), logp.detach(), behaviour)
    if obj.mode == "sft":
        per_token = -logp
    else:
        old = aux.prox if aux.prox is not None else behaviour
        adv = targets.advantages.to(dev)[step_ids]
        clip = CLIP_RULES[obj.clip_rule](ClipInputs(
            obj.clip_low, obj.clip_high, old, adv, episode_ids, targets.outcome, targets.episode_group,
            segment_ids={"step": step_ids, "sequence": traj_ids}.get(obj.ratio), mask=mask, behaviour_logp=behaviour),
            **obj.clip_rule_args)
        seg = Segments(obj.ratio, step_ids, traj_ids, mask)
        surrogate = POLICY_LOSSES[obj.policy_loss](logp, old, adv, seg, clip_low=clip.low, clip_high=clip.high,
                                                   dual_clip=obj.dual_clip, **obj.policy_loss_args)
        ratio = surrogate.ratio
        per_token = surrogate.loss
        for side, bound in (("clip_low_eps", clip.low), ("clip_high_eps", clip.high)):
            if isinstance(bound, torch.Tensor):
                _record(stats, side, bound, mask)
        if obj.sapo_coef:
            sapo = sapo_kl_term(logp, old, adv, tau=obj.sapo_tau)
            per_token = per_token - obj.sapo_coef * sapo
            _record(stats, "sapo_active_frac", (sapo != 0).float(), mask)
        if aux.prox is not None:
            weights = _behaviour_weights(aux.prox, behaviour, obj, step_ids, traj_ids, mask)
            per_token = per_token * weights
            _record(stats, "is_weight", weights, mask)
        if aux.ref is not None:
            kl = kl_penalty(logp, aux.ref, obj.kl_estimator)
            per_token = per_token + obj.kl_coef * kl
            _record(stats, "kl_ref", kl, mask)
        if obj.entropy_coef:
            per_token = per_token - obj.entropy_coef * out.entropy
        if obj.expert_sft_coef > 0 and view.forest.expert.any():
            expert = view.forest.expert.to(dev)
            per_token = torch.where(expert, -obj.expert_sft_coef * logp, per_token)
            _record(stats, "expert_nll", -logp.detach(), mask & expert)
        _record(stats, "ratio", ratio.detach(), mask)
        _record(stats, "clip_frac", surrogate.clipped.float(), mask)
        _record(stats, "dual_clip_frac", surrogate.dual_clipped.float(), mask)
        _record(stats, "approx_kl_behaviour", (behaviour - logp).detach(), mask)
    loss = aggregate(per_token, mask, obj.aggregation, step_ids=step_ids, traj_ids=traj_ids,
                     episode_ids=episode_ids, num_units=units, token_norm=obj.token_norm)
    _record(stats, "entropy", out.entropy.detach(), mask)
    _record(stats, "logprob", logp.detach(), mask)
    stats["policy_loss"].append(float(loss.detach()))
    if obj.critic_only:
        loss = loss.detach() * 0
    if out.values is not None and targets.returns is not None:
        first = _first_tokens(step_ids)
        rows = step_ids[first]
        value_loss = clipped_value_loss(out.values[first], targets.old_values.to(dev)[rows],
                                        targets.returns.to(dev)[rows],
                                        clip=obj.value_clip).sum() / max(value_units, 1)
        stats["value_loss"].append(float(value_loss.detach()))
        loss = loss + obj.value_coef * value_loss
    return loss


def _behaviour_weights(prox: torch.Tensor, behaviour: torch.Tensor, obj: Objective, step_ids: torch.Tensor,
                       traj_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """π_prox/μ bounded as configured: truncated (TIS), masked per token (IcePop) or per sequence (MIS)."""
    if obj.is_correction == "icepop":
        return icepop_weights(prox, behaviour, low=obj.is_floor, high=obj.tis_cap)
    if obj.is_correction == "mis":
        return mis_weights(prox, behaviour, cap=obj.tis_cap, segment_ids=traj_ids, mask=mask)
    return decoupled_weights(prox, behaviour, cap=obj.tis_cap, mask=mask,
                             segment_ids=step_ids if obj.tis_level == "step" else None)


def _record(stats: dict[str, list[float]], name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    sel = x.detach()[mask]
    if sel.numel():
        stats[name + "_sum"].append(float(sel.float().sum()))
        stats[name + "_n"].append(float(sel.numel()))
        stats[name + "_min"].append(float(sel.min()))
        stats[name + "_max"].append(float(sel.max()))


def _views(plan: list[list[TokenView]]) -> list[TokenView]:
    return [view for minibatch in plan for view in minibatch]


def _summary(batch: Batch, plan, advantages, stats, obj: Objective, version: int, elapsed: float,
             ranks: Ranks = SINGLE) -> dict[str, float]:
    """The update's metrics: counts and throughput over all ranks; loss, ratio and token statistics from this
    rank's share (`rank_episodes`: the episodes this rank forwarded in the first epoch)."""
    forests = [view.forest for view in _views(plan)]
    local = [sum(len(f.targets) for f in forests), sum(f.num_tokens for f in forests),
             sum(f.naive_tokens for f in forests)]
    targets, packed, naive = ranks.sum(local)
    trained = targets * obj.epochs
    versions = torch.cat([f.weight_version for f in forests]) if forests else torch.zeros(0)
    out: dict[str, float] = {
        "episodes": len(batch.episodes), "groups": len(batch.group_ids), "steps": batch.num_steps,
        "action_tokens": trained / obj.epochs, "tokens_per_s": trained / max(elapsed, 1e-9),
        "forward_tokens_per_s": packed * obj.epochs / max(elapsed, 1e-9),
        "tree_token_saving": 1 - packed / naive if naive else 0.0, "update_seconds": elapsed,
        "anchor_shared": batch.anchor_shared(),
        "rank_episodes": sum(int(torch.unique(view.episode_ids).numel()) for view in _views(plan)),
    }
    if versions.numel():
        out["staleness_mean"] = float(version - versions.float().mean())
        out["staleness_max"] = float(version - versions.min())
    for reason, n in batch.skipped.items():
        out[f"skipped_{reason}"] = n
    by_harness: dict[str, list[float]] = defaultdict(list)  # the policy's episodes (an expert's are counted apart)
    experts = relabelled = 0
    for ep, r in zip(batch.episodes, batch.outcome.tolist()):
        if ep.info.expert:
            experts += 1
            relabelled += ep.info.metadata.get(HINDSIGHT_KEY) is True
        else:
            by_harness[ep.info.harness].append(r)
    own = [r for rewards in by_harness.values() for r in rewards]
    out["reward_mean"] = float(np.mean(own)) if own else math.nan
    out.update({f"reward/{h}": float(np.mean(v)) for h, v in by_harness.items()})
    if experts:
        out["expert_episodes"] = experts
    if relabelled:
        out["hindsight_episodes"] = relabelled  # of the expert episodes: the policy's own, relabelled in hindsight
    if advantages is not None and advantages.numel():
        out.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std(unbiased=False)),
                   adv_min=float(advantages.min()), adv_max=float(advantages.max()))
    for key in [k[:-4] for k in stats if k.endswith("_sum")]:
        out[f"{key}_mean"] = sum(stats[key + "_sum"]) / max(sum(stats[key + "_n"]), 1)
        out[f"{key}_min"], out[f"{key}_max"] = min(stats[key + "_min"]), max(stats[key + "_max"])
    for key in ("policy_loss", "value_loss", "grad_norm", "lr", "gold_prob"):
        if stats.get(key):
            out[key] = float(np.mean(stats[key]))
    if stats.get("non_finite_steps"):
        out["non_finite_steps"] = sum(stats["non_finite_steps"])
    return out
