"""Advantage estimators: per-step advantages [S] from episode outcomes, dense step rewards and values.

Every registered estimator has the signature `fn(x: AdvantageInputs, **hyper) -> Tensor float [S]`
(no gradient); the trainer broadcasts to tokens with `adv[step_ids]`. Groups are task × harness
(docs/architecture.md §3): baselines never mix harnesses. A group of one sample, or one whose rewards are all
equal, carries no signal and gets advantage 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import compact, segment_count, segment_max, segment_min, segment_sum


@dataclass(frozen=True)
class AdvantageInputs:
    """The tensors every estimator reads. E episodes, S steps (one row per (trajectory, call))."""

    outcome: Tensor  # float [E]: terminal reward of each episode
    episode_group: Tensor  # long [E]: group index (task × harness) of each episode
    step_episode: Tensor  # long [S]: episode of each step
    step_traj: Tensor  # long [S]: trajectory of each step (any ids; a fork is its own trajectory)
    step_position: Tensor  # long [S]: 0..T-1, the step's index within its trajectory
    step_reward: Tensor | None = None  # float [S]: dense per-step reward (None = no dense rewards)
    values: Tensor | None = None  # float [S]: critic V(s_t) at each step's state boundary (GAE only)
    step_state: Tensor | None = None  # long [S]: anchor-state id of each step (equal ids = same observation; GiGPO)
    # float [S]: the policy's probability of the episode's gold answer given the step's state s_t (IGPO)
    gold_prob: Tensor | None = None
    step_call: Tensor | None = None  # long [S]: the call index of each step (forks keep their source's numbering)
    # long [E]: the episode each one was forked from (-1: a root episode), and the call where it branched: it
    # shares its parent's calls before that call (as context) and sampled its own from it (Tree-GRPO)
    episode_parent: Tensor | None = None
    episode_branch: Tensor | None = None


def group_index(keys: Sequence[str]) -> Tensor:
    """Dense group indices long [E] from group keys such as "task::harness" (first seen = 0)."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(k, len(seen)) for k in keys], dtype=torch.long)


# --- episode-level building blocks ------------------------------------------------------------


def group_normalize(outcome: Tensor, group: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage per episode (Shao et al. 2024, DeepSeekMath).

    A_i = (R_i − mean_g R) / (std_g R + eps) with the unbiased std (as TRL/verl), or A_i = R_i − mean_g R
    when `scale_by_std` is False (Dr. GRPO, Liu et al. 2025). outcome [E], group long [E] -> [E].
    Groups of one and groups whose rewards are all equal give exactly 0.
    """
    g, num = compact(group)
    n = segment_count(g, num).to(outcome.dtype)
    centred = outcome - (segment_sum(outcome, g, num) / n)[g]
    if scale_by_std:
        var = segment_sum(centred**2, g, num) / (n - 1).clamp(min=1)
        centred = centred / (var.sqrt()[g] + eps)
    varies = segment_max(outcome, g, num) > segment_min(outcome, g, num)
    return torch.where(varies[g], centred, torch.zeros_like(centred))


def imitation_bonus(outcome: Tensor, *, coef: float, min_outcome: float, failure_coef: float = 0.0) -> Tensor:
    """Self-imitation (SIL, Oh et al. 2018; RAFT, Dong et al. 2023): `coef` for every episode whose outcome
    reached `min_outcome`; and negative reinforcement (NSR, Zhu et al. 2025, "The Surprising Effectiveness of
    Negative Reinforcement in LLM Reasoning"): −`failure_coef` for every other one. outcome [E] -> [E], added
    to each step's advantage on top of the estimator's. A group whose episodes all succeeded, or all failed,
    has estimator advantage 0 everywhere; the bonus still raises the probability of what the policy already
    does right (sharpening a policy whose failures come from sampling its own low-probability tail), and the
    penalty lowers that of what a confident policy gets wrong every time, moving its mass to the alternatives
    it gave less weight (exploring where no sample of the group succeeded).
    """
    return torch.where(outcome >= min_outcome, torch.full_like(outcome, coef), torch.full_like(outcome, -failure_coef))


def scale_negative(advantages: Tensor, scale: Tensor) -> Tensor:
    """Per-step advantages [S] with each negative one multiplied by its step's `scale` [S] (0 to 1).

    Scale 0 is positive-sample reinforcement (PSR in Zhu et al. 2025, "The Surprising Effectiveness of Negative
    Reinforcement in LLM Reasoning"): only steps that did better than their baseline train, so a failed long
    episode pushes none of its tokens down, the right ones it sampled before it failed included.
    """
    return torch.where(advantages < 0, advantages * scale, advantages)


def leave_one_out(outcome: Tensor, group: Tensor) -> Tensor:
    """RLOO advantage per episode (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    A_i = R_i − (Σ_{j∈g} R_j − R_i) / (n_g − 1): the baseline is the mean of the other samples of the
    group, so it is independent of the sample itself. outcome [E], group long [E] -> [E]; n_g = 1 -> 0.
    """
    g, num = compact(group)
    n = segment_count(g, num).to(outcome.dtype)[g]
    others = (segment_sum(outcome, g, num)[g] - outcome) / (n - 1).clamp(min=1)
    return torch.where(n > 1, outcome - others, torch.zeros_like(outcome))


# --- trajectory grid: steps laid out [trajectories, T_max] for backward recursions ---------------


def _grid(x: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(traj row [S], trajectory length per step [S], is-last-step [S]); checks positions are 0..T-1."""
    row, num = compact(x.step_traj)
    length = segment_max(x.step_position.to(torch.float64), row, num).long() + 1
    if not torch.equal(segment_count(row, num).long(), length):
        raise ValueError("step_position must number each trajectory's steps 0..T-1 exactly once")
    return row, length[row], x.step_position == length[row] - 1


def _discounted_suffix_sum(values: Tensor, row: Tensor, pos: Tensor, discount: float) -> Tensor:
    """G_t = v_t + discount · G_{t+1} within each trajectory (G_T = 0). values [S] -> [S].

    Vectorised over trajectories: scatter into a zero-padded [rows, T_max] grid and sweep T_max columns
    right to left; padding is 0 so a trajectory's recursion starts from 0 after its last step.
    """
    rows = int(row.max()) + 1 if row.numel() else 0
    grid = torch.zeros(rows, int(pos.max()) + 1 if pos.numel() else 0, dtype=values.dtype, device=values.device)
    grid[row, pos] = values
    out = torch.zeros_like(grid)
    running = torch.zeros(rows, dtype=values.dtype, device=values.device)
    for t in range(grid.shape[1] - 1, -1, -1):
        running = grid[:, t] + discount * running
        out[:, t] = running
    return out[row, pos]


def _step_rewards(x: AdvantageInputs) -> Tensor:
    return torch.zeros_like(x.step_position, dtype=x.outcome.dtype) if x.step_reward is None else x.step_reward


def _rewards_with_outcome(x: AdvantageInputs, last: Tensor) -> Tensor:
    """r_t [S]: the dense step reward, plus the episode's outcome on the trajectory's last step."""
    outcome = x.outcome[x.step_episode]
    return _step_rewards(x) + torch.where(last, outcome, torch.zeros_like(outcome))


# --- registered estimators: (x, **hyper) -> [S] ------------------------------------------------


@torch.no_grad()
def grpo(x: AdvantageInputs, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024): every step of episode i gets A_i = (R_i − mean_g R) / (std_g R + eps)."""
    return group_normalize(x.outcome, x.episode_group, scale_by_std=scale_by_std, eps=eps)[x.step_episode]


@torch.no_grad()
def rloo(x: AdvantageInputs) -> Tensor:
    """RLOO (Ahmadian et al. 2024): every step of episode i gets R_i − mean of the group's other R_j."""
    return leave_one_out(x.outcome, x.episode_group)[x.step_episode]


@torch.no_grad()
def dr_grpo(x: AdvantageInputs) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"): every step
    of episode i gets A_i = R_i − mean_g R, without GRPO's 1/std (which over-weights groups that are nearly
    all right or all wrong). Its other half is the aggregation: loss_aggregation = "seq-mean-token-sum-norm"
    with a constant token_norm removes the 1/|o_i| length bias."""
    return group_normalize(x.outcome, x.episode_group, scale_by_std=False)[x.step_episode]


@torch.no_grad()
def reinforce_pp(x: AdvantageInputs, *, group_baseline: bool = True, gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """REINFORCE++(-baseline) (Hu 2025, arXiv:2501.03262) with discounted returns of the step rewards:

    G_t = Σ_{k≥t} γ^{k−t} r_k,  r_k = dense step reward + R_i on the last step;
    A_t = (G_t − b_i) / (std_w(G − b) + eps),  b_i = group mean of R (group_baseline) or the batch mean.
    The paper's returns are per token with the reward on the last token; a step's reward arrives at its
    last token, so with γ = 1 (verl's default) G_t is exactly the token-level return of every token of
    step t; with γ < 1 the discount is counted in steps. std_w is the unbiased std over step rows weighted
    1/(rows of the episode), so every episode weighs the same (docs/architecture.md §3); with no step rewards and
    γ = 1 it is the std over episodes. Not re-centred: zero-variance groups without step rewards stay 0.
    """
    row, _, last = _grid(x)
    returns = _discounted_suffix_sum(_rewards_with_outcome(x, last), row, x.step_position, gamma)
    if group_baseline:  # R_i − b_i, exactly 0 in groups whose outcomes are all equal
        outcome_centred = group_normalize(x.outcome, x.episode_group, scale_by_std=False)
    else:
        outcome_centred = x.outcome - x.outcome.mean()
    # G_t − b_i = (G_t − R_i) + (R_i − b_i); the first term is exactly 0 without step rewards at γ = 1
    centred = (returns - x.outcome[x.step_episode]) + outcome_centred[x.step_episode]
    e, episodes = compact(x.step_episode)
    if episodes < 2:
        return torch.zeros_like(centred)
    w = (1.0 / segment_count(e, episodes).to(centred.dtype))[e]  # each episode's rows weigh 1 in all
    mean = (w * centred).sum() / episodes
    std = ((w * (centred - mean) ** 2).sum() / (episodes - 1)).sqrt()
    return centred / (std + eps)


@torch.no_grad()
def step_gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95) -> Tensor:
    """Step-level GAE (Schulman et al. 2016, applied per step as in StepPO; docs/architecture.md §3).

    Per trajectory with steps t = 0..T-1: r_t = dense step reward, plus the outcome on the last step;
    δ_t = r_t + γ V(s_{t+1}) − V(s_t) with V(s_T) = 0 (terminal bootstraps 0);
    A_t = Σ_k (γλ)^k δ_{t+k}. V(s_t) = x.values [S], read at the step's state boundary.
    """
    if x.values is None:
        raise ValueError("gae needs values [S] from the critic")
    row, _, last = _grid(x)
    reward = _step_rewards(x) + torch.where(last, x.outcome[x.step_episode], torch.zeros_like(x.values))
    next_value = _shift_next(x.values, row, x.step_position)  # V(s_{t+1}); 0 after the last step
    delta = reward + gamma * next_value - x.values
    return _discounted_suffix_sum(delta, row, x.step_position, gamma * lam)


def _shift_next(values: Tensor, row: Tensor, pos: Tensor) -> Tensor:
    """Values of step t+1 in the same trajectory, [S]; 0 after the last step (the padding is 0)."""
    if values.numel() == 0:
        return values
    grid = torch.zeros(int(row.max()) + 1, int(pos.max()) + 2, dtype=values.dtype, device=values.device)
    grid[row, pos] = values
    return grid[row, pos + 1]


@torch.no_grad()
def value_targets(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95) -> Tensor:
    """Critic regression targets [S]: the λ-return G^λ_t = A^GAE_t + V(s_t) (Schulman et al. 2016)."""
    if x.values is None:
        raise ValueError("value targets need values [S] from the critic")
    return step_gae(x, gamma=gamma, lam=lam) + x.values


@torch.no_grad()
def dense(x: AdvantageInputs, *, gamma_dense: float = 0.9, scale_by_std: bool = False, eps: float = 1e-6) -> Tensor:
    """Dense step rewards with their own discount next to an undiscounted outcome (asymmetric discount).

    A_t = Σ_{k≥t} γ_d^{k−t} r_k  +  (R_i − mean_g R) [/ (std_g R + eps)]: the dense return of the step's
    remaining trajectory (process rewards, discounted so a step is credited mostly for what follows
    soon after it) plus the GRPO outcome advantage, which every step of the episode shares undiscounted.
    """
    row, _, _ = _grid(x)
    dense_return = _discounted_suffix_sum(_step_rewards(x), row, x.step_position, gamma_dense)
    return dense_return + grpo(x, scale_by_std=scale_by_std, eps=eps)


@torch.no_grad()
def turn_discount(x: AdvantageInputs, *, gamma: float = 0.9, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Turn-level discounting of the outcome: A_t = γ^(T−1−t) · A_i, with A_i the GRPO outcome advantage.

    The discounted return of a terminal reward seen from step t of a T-step trajectory (Sutton & Barto
    §3.3, counted in turns rather than tokens): late turns, nearer the outcome, get more of its credit.
    """
    _, length, _ = _grid(x)
    power = (length - 1 - x.step_position).to(x.outcome.dtype)
    return torch.pow(torch.tensor(gamma, dtype=x.outcome.dtype), power) * grpo(x, scale_by_std=scale_by_std, eps=eps)


@torch.no_grad()
def gigpo(x: AdvantageInputs, *, step_weight: float = 1.0, gamma: float = 0.95, scale_by_std: bool = True,
          eps: float = 1e-6) -> Tensor:
    """GiGPO, group-in-group policy optimisation (Feng et al. 2025, arXiv:2505.10978; "GiGPPO" in the summary of
    Apple's planning-grounding UI agent): an episode-level and a step-level group-relative advantage.

    A_t = A^E_i + ω · A^S_t
    A^E_i: GRPO over the episode outcomes of the group (task × harness).
    A^S_t: GRPO over the step group of t, all steps of the group's episodes whose anchor state (step_state:
    the observation the step acted on) is the same, of their discounted returns
    G_t = Σ_{k≥t} γ^{k−t} r_k (r_k = dense step reward + R_i on the last step). A state visited once gives 0.
    """
    if x.step_state is None:
        raise ValueError("gigpo needs step_state [S], the anchor-state id of each step")
    row, _, last = _grid(x)
    returns = _discounted_suffix_sum(_rewards_with_outcome(x, last), row, x.step_position, gamma)
    group, _ = compact(x.episode_group)
    state, num_states = compact(x.step_state)
    step_group = group[x.step_episode] * num_states + state  # same task × harness and the same anchor state
    step_adv = group_normalize(returns, step_group, scale_by_std=scale_by_std, eps=eps)
    return grpo(x, scale_by_std=scale_by_std, eps=eps) + step_weight * step_adv


@torch.no_grad()
def capo(x: AdvantageInputs, *, gamma: float = 1.0) -> Tensor:
    """CAPO's action-level advantage (action-aligned policy optimisation):
    the critic is read only at action boundaries and each action gets the one-step TD error

    A_t = r_t + γ V(s_{t+1}) − V(s_t),   V(s_T) = 0,  r_t = dense step reward (+ the outcome on the last step),
    shared by every token of the action a_t = (y_{t,1}, …, y_{t,L}). It is step-level GAE with λ = 0; its
    other half, the length-calibrated action ratio, is the `step` ratio (geometric mean over the action).
    """
    return step_gae(x, gamma=gamma, lam=0.0)


@torch.no_grad()
def information_gain(gold_prob: Tensor, x: AdvantageInputs) -> Tensor:
    """IGPO's turn rewards [S] (Wang et al. 2025, arXiv:2510.14967): for every step but the last,

    r_t = π_θ(a* | s_{t+1}) − π_θ(a* | s_t)
    the rise in the policy's probability of the gold answer a* over turn t (s_{t+1} = the next call's prompt:
    the turn's action and what the environment answered); the last step gets 0 here (its reward is the outcome).
    gold_prob [S]: π_θ(a* | s_t) = exp(mean_j log π_θ(a*_j | s_t, a*_<j)), the length-normalised probability.
    """
    row, _, last = _grid(x)
    gain = _shift_next(gold_prob, row, x.step_position) - gold_prob
    return torch.where(last, torch.zeros_like(gain), gain)


@torch.no_grad()
def igpo(x: AdvantageInputs, *, gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """IGPO, information-gain-based policy optimisation (Wang et al. 2025, arXiv:2510.14967):
    dense turn rewards from the policy's own belief in the gold answer, the outcome at the last step.

    r_t = IG_t (+ dense step reward) for t < T−1,  r_{T−1} = R_i (+ dense step reward);  IG_t: `information_gain`
    r̃ = (r − mean_g r) / (std_g r + eps)  over all step rows of the group (task × harness) together;
    A_t = Σ_{k≥t} γ^{k−t} r̃_k   (discounted within the trajectory).
    A group whose rewards are all equal gets 0. Needs x.gold_prob [S] (the trainer computes it with a
    teacher-forced forward of the gold answer after each step's state; see stepline/trainer/information_gain.py).
    """
    if x.gold_prob is None:
        raise ValueError("igpo needs gold_prob [S], the policy's probability of the gold answer at each state")
    row, _, last = _grid(x)
    rewards = _rewards_with_outcome(x, last) + information_gain(x.gold_prob.to(x.outcome.dtype), x)
    normalised = group_normalize(rewards, x.episode_group[x.step_episode], eps=eps)
    return _discounted_suffix_sum(normalised, row, x.step_position, gamma)


def subtree_leaves(step_episode: Tensor, step_call: Tensor, parent: Tensor, branch: Tensor) -> Tensor:
    """bool [S, E]: below[s, l] = episode l's trajectory passes through step s (l is a leaf of s's subtree).

    Episode l contains all its own steps and, up its chain of forks, the steps of each ancestor with a call
    index below the smallest branch point on the way (a fork of a fork at call k, earlier than the fork's own
    branch, shares only the first k calls of their common source)."""
    num = parent.numel()
    big = torch.iinfo(torch.long).max
    limit = torch.zeros(num, num, dtype=torch.long)  # limit[e, l]: l passes through e's calls < limit
    for leaf in range(num):
        limit[leaf, leaf] = big
        node, bound = leaf, big
        for _ in range(num):
            if int(parent[node]) < 0:
                break
            bound = min(bound, int(branch[node]))
            node = int(parent[node])
            limit[node, leaf] = bound
        else:
            raise ValueError("episode_parent has a cycle")
    return step_call[:, None] < limit[step_episode]


def _relative(value: Tensor, outcome: Tensor, segment: Tensor, step_episode: Tensor, scale_by_std: bool,
              eps: float) -> Tensor:
    """(value − mean_k R) [/ (std_k R + eps)] per step row, k = the segment (episodes) of the step's episode;
    0 where the segment's outcomes are all equal (a segment of one included). value [S] -> [S]."""
    g, num = compact(segment)
    n = segment_count(g, num).to(outcome.dtype)
    mean = segment_sum(outcome, g, num) / n
    centred = value - mean[g][step_episode]
    if scale_by_std:
        std = (segment_sum((outcome - mean[g]) ** 2, g, num) / (n - 1).clamp(min=1)).sqrt()
        centred = centred / (std[g][step_episode] + eps)
    varies = segment_max(outcome, g, num) > segment_min(outcome, g, num)
    return torch.where(varies[g][step_episode], centred, torch.zeros_like(centred))


@torch.no_grad()
def tree_grpo(x: AdvantageInputs, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Tree-GRPO (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning", arXiv:2509.21240; seed
    summary 002): episodes branch (forks share their source's steps before the branch point), and each
    step's advantage is group-relative both within its tree and across the group's trees.

    Per leaf l (an episode) of tree T in group G the paper's advantage is
        Â_l = (R_l − mean_T R) / (std_T R + eps)  +  (R_l − mean_G R) / (std_G R + eps)   (intra + inter tree).
    A step shared by several leaves is trained once (docs/architecture.md §2.2), so it takes the mean of Â over
    the leaves of its subtree, which by linearity is the same formula with V_s = mean R of those leaves:
        A_s = (V_s − mean_T R) / (std_T R + eps)  +  (V_s − mean_G R) / (std_G R + eps).
    At a branching node the sibling subtrees differ by their V: the better branch gets the larger advantage
    (the paper's implicit step-level preference). std is unbiased; a tree or group whose rewards are all
    equal adds 0. Without forks every tree is one episode and this is GRPO. Needs x.step_call,
    x.episode_parent and x.episode_branch (the pool's fork links; the trainer fills them in).
    """
    if x.step_call is None or x.episode_parent is None or x.episode_branch is None:
        raise ValueError("tree_grpo needs step_call [S], episode_parent [E] and episode_branch [E]")
    below = subtree_leaves(x.step_episode, x.step_call, x.episode_parent, x.episode_branch)
    outcome = x.outcome
    value = (below.to(outcome.dtype) * outcome).sum(1) / below.sum(1).to(outcome.dtype)
    root = torch.arange(outcome.numel())
    while bool((up := x.episode_parent[root] >= 0).any()):
        root = torch.where(up, x.episode_parent[root], root)
    intra = _relative(value, outcome, root, x.step_episode, scale_by_std, eps)
    inter = _relative(value, outcome, x.episode_group, x.step_episode, scale_by_std, eps)
    return intra + inter


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "gae": step_gae,
    "dense": dense,
    "turn_discount": turn_discount,
    "gigpo": gigpo,
    "capo": capo,
    "igpo": igpo,
    "tree_grpo": tree_grpo,
}
