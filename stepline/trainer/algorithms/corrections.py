"""Off-policy corrections and regularisers: truncated importance sampling against the engine's
logprobs, the decoupled behaviour/proximal weight, the staleness bound, KL to a reference, entropy,
and the critic's clipped value loss.

Why: the engine that sampled a token (SGLang/vLLM, older weights, other kernels) is not the policy the
trainer differentiates, so the engine's recorded logprob is the behaviour policy μ and the trainer
corrects for μ ≠ π (docs/architecture.md §2.3).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from stepline.trainer.algorithms._segments import segment_mean

LOG_RATIO_LIMIT = 20.0  # keeps exp() finite; far beyond any cap
K3_LIMIT = 10.0  # verl's low_var_kl clamps k3 to [-10, 10]; outside, the term is constant (no gradient)


@torch.no_grad()
def truncated_is_weights(
    target_logp: Tensor,
    behaviour_logp: Tensor,
    *,
    cap: float = 2.0,
    segment_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Truncated importance sampling weights (TIS; Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"; Espeholt et al. 2018 truncate the same way in IMPALA).

    per token:   w_t = min( exp(log π(t) − log μ(t)), C )
    per segment: w_t = min( exp( mean_{u∈seg(t)} (log π(u) − log μ(u)) ), C )   (segment_ids = step_ids)
    target_logp [N] (e.g. the trainer's logprobs before the update), behaviour_logp [N] (the engine's
    recorded ones) -> weights [N], no gradient; multiply the per-token loss by them. The weights keep the
    inputs' dtype (float64 stays float64); bf16/fp16 inputs are computed and returned in float32.
    """
    log_w = _log_weights(target_logp, behaviour_logp)
    if segment_ids is not None and log_w.numel():
        log_w = segment_mean(log_w, segment_ids, int(segment_ids.max()) + 1, mask)[segment_ids]
    return log_w.exp().clamp(max=cap)


def decoupled_weights(
    prox_logp: Tensor,
    behaviour_logp: Tensor,
    *,
    cap: float = 2.0,
    segment_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Behaviour weight of the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for
    policy optimization"; AReaL, Fu et al. 2025):

    L = −(π_prox/μ) · min( (π_θ/π_prox) A, clip(π_θ/π_prox, 1−ε_low, 1+ε_high) A )
    The clip is centred on the proximal policy π_prox (the trainer's own logprobs at the start of the
    update), not on the stale behaviour policy μ (the engine's); this returns the truncated, detached
    π_prox/μ [N]. The ratio is `RATIOS[level](logp, prox_logp, ...)`.
    """
    return truncated_is_weights(prox_logp, behaviour_logp, cap=cap, segment_ids=segment_ids, mask=mask)


def _log_weights(target_logp: Tensor, behaviour_logp: Tensor) -> Tensor:
    dtype = torch.promote_types(torch.promote_types(target_logp.dtype, behaviour_logp.dtype), torch.float32)
    return (target_logp.to(dtype) - behaviour_logp.to(dtype)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


@torch.no_grad()
def icepop_weights(target_logp: Tensor, behaviour_logp: Tensor, *, low: float = 0.5, high: float = 5.0) -> Tensor:
    """IcePop (Ling Team 2025, Ring-1T, arXiv:2510.18855): double-sided masking of the stepline/trainer/engine mismatch.

    w_t = ρ_t · 1[ low ≤ ρ_t ≤ high ],  ρ_t = π_train(a_t) / π_engine(a_t)
    Where TIS truncates a large ρ to C and keeps the token, IcePop drops the token's gradient entirely when
    the two engines disagree too much in either direction. [N] -> [N], no gradient.
    """
    if not 0 <= low < high:
        raise ValueError(f"icepop needs 0 <= low < high, got low={low}, high={high}")
    rho = _log_weights(target_logp, behaviour_logp).exp()
    return torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))


@torch.no_grad()
def mis_weights(target_logp: Tensor, behaviour_logp: Tensor, *, cap: float = 2.0, segment_ids: Tensor,
                mask: Tensor | None = None) -> Tensor:
    """Sequence-level masked importance sampling / rejection sampling (Seq-MIS; Liu, Li et al. 2025, "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; verl's rollout_rs):

    ρ_seq = Π_{t∈seq, mask_t} π_train(a_t) / π_engine(a_t),   w_t = ρ_seq · 1[ ρ_seq ≤ C ]
    A whole sequence (segment_ids = traj_ids) whose product ratio exceeds C is rejected (weight 0) rather
    than truncated; the rest keep their sequence weight. [N] -> [N], no gradient.
    """
    log_w = _log_weights(target_logp, behaviour_logp)
    if log_w.numel() == 0:
        return log_w
    seg = segment_ids
    sel = torch.ones_like(log_w, dtype=torch.bool) if mask is None else mask.bool()
    total = torch.zeros(int(seg.max()) + 1, dtype=log_w.dtype, device=log_w.device)
    total = total.index_add(0, seg, torch.where(sel, log_w, torch.zeros_like(log_w)))
    rho = total.clamp(max=LOG_RATIO_LIMIT).exp()[seg]
    return torch.where(rho <= cap, rho, torch.zeros_like(rho))


def fresh_mask(versions: Tensor, current_version: int, bound: int) -> Tensor:
    """Hard staleness bound: True where version ≥ current − bound (bound 0 = strictly on-policy).

    versions: long tensor of any shape (per token, step or episode) -> bool tensor of that shape.
    """
    if bound < 0:
        raise ValueError(f"staleness bound must be >= 0, got {bound}")
    return versions >= current_version - bound


# --- KL to a frozen reference (Schulman 2020, "Approximating KL Divergence") --------------------
# Tokens are sampled from the policy; with log r = log π_ref − log π_θ, each k estimates KL(π_θ ‖ π_ref).


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = −log r = log π_θ − log π_ref: unbiased, high variance, can be negative. [N] -> [N]."""
    return logp - ref_logp.detach()


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½ (log r)²: biased, low variance, ≥ 0. [N] -> [N]."""
    return 0.5 * (logp - ref_logp.detach()) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = clamp( (r − 1) − log r, −10, 10 ): unbiased, low variance, ≥ 0 (GRPO's KL term). [N] -> [N].

    Clamped like verl's `low_var_kl`: a token far from the reference (log r > ~2.5, where k3 grows like
    e^{log r}) contributes at most 10 and no gradient, instead of 16.1 at log r = 3 or 3.3e6 at 15.
    """
    log_r = (ref_logp.detach() - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.expm1(log_r) - log_r).clamp(-K3_LIMIT, K3_LIMIT)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate with the named estimator, [N]; gradient flows through logp."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


# --- per-token functions of logits, chunked over the vocabulary-sized rows ---------------------


def _row_stats(logits: Tensor, token_ids: Tensor | None, temperature: Tensor | None, *, entropy: bool,
               entropy_grad: bool) -> tuple[Tensor, ...]:
    """One pass over rows [n, V]: z = logits / T in float32, log p = log_softmax(z); returns log p[token]
    [n] when token_ids are given, then H = −Σ_v p_v log p_v [n] when `entropy` (no graph unless entropy_grad)."""
    z = logits.float()
    if temperature is not None:
        z = z / temperature[:, None]
    logp = torch.log_softmax(z, dim=-1)
    out = [] if token_ids is None else [logp.gather(-1, token_ids[:, None]).squeeze(-1)]
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            out.append(-(logp.exp() * logp).sum(-1))
    return tuple(out)


def _chunked(fn: Callable[..., tuple[Tensor, ...]], logits: Tensor, *rows: Tensor | None,
             chunk_size: int) -> tuple[Tensor, ...]:
    """fn over row chunks of logits [N, V] and of the per-row tensors `rows` (None passes as None), its
    outputs concatenated; under autograd each chunk is recomputed in backward (activation checkpointing),
    so only one chunk's [chunk, V] float32 softmax is alive at a time. N = 0 runs one empty chunk."""
    parts = []
    for start in range(0, max(logits.shape[0], 1), chunk_size):
        args = [None if t is None else t[start : start + chunk_size] for t in (logits, *rows)]
        if torch.is_grad_enabled() and logits.requires_grad:
            parts.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            parts.append(fn(*args))
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def logprobs_and_entropy(logits: Tensor, token_ids: Tensor, *, temperature: Tensor | None = None,
                         entropy: bool = True, entropy_grad: bool = True,
                         chunk_size: int = 1024) -> tuple[Tensor, Tensor | None]:
    """log softmax(z)[token] and the entropy of softmax(z) per row, z = logits / temperature, each row's
    log_softmax computed once: logits [N, V] (any float dtype), token_ids long [N], temperature [N] or None
    (1: no division) -> float32 [N], float32 [N] (None unless `entropy`).

    Grad flows through both; `entropy_grad=False` returns the entropy as a detached statistic (no
    A × V graph for it: an entropy bonus of 0 needs none). Only an entropy graph goes in `chunk_size` chunks
    recomputed in backward: a log-softmax alone keeps one [N, V] output, as large as the logits a checkpoint
    would keep, and each chunk's slice backward would allocate an [N, V] gradient, so it runs in one pass."""
    stats = partial(_row_stats, entropy=entropy, entropy_grad=entropy_grad)
    if entropy and entropy_grad:
        out = _chunked(stats, logits, token_ids, temperature, chunk_size=chunk_size)
    else:
        out = stats(logits, token_ids, temperature)
    return out[0], out[1] if entropy else None


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of each row's softmax: H = −Σ_v p_v log p_v, logits [N, V] -> float32 [N] (grad flows).

    The entropy bonus (Williams & Peng 1991; Mnih et al. 2016) subtracts β·H from the loss."""
    stats = partial(_row_stats, entropy=True, entropy_grad=True)
    return _chunked(stats, logits, None, None, chunk_size=chunk_size)[0]


def token_logprobs_from_logits(logits: Tensor, token_ids: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """log softmax(logits)[token] per row: logits [N, V], token_ids long [N] -> float32 [N] (grad flows)."""
    stats = partial(_row_stats, entropy=False, entropy_grad=False)
    return _chunked(stats, logits, token_ids, None, chunk_size=chunk_size)[0]


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float | None = 0.2) -> Tensor:
    """Critic loss per step (PPO2 baselines; Andrychowicz et al. 2021, "What Matters in On-Policy RL"):

    L = ½ max( (V − G)², (V_old + clip(V − V_old, −ε, ε) − G)² ),  or ½ (V − G)² when clip is None.
    values [S] (grad), old_values [S] (before the update), returns [S] (targets) -> [S].
    """
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped
    old = old_values.detach()
    clipped = (old + (values - old).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped)
