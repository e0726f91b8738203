"""Tree forward: the log-probabilities of every action token of a session from one forward pass.

A session's calls form a radix tree of tokens (`datapool.records.SessionTree`). The naive way runs the
model once per step on that step's full sequence, recomputing the shared prefix at every turn
(quadratic in the number of turns). Here the nodes on the trajectories that train are laid out in one
sequence, parents first, and the model gets a *tree attention mask*: each token attends to the tokens
of its ancestor nodes and to the earlier tokens of its own node. Position ids are the depth in the
tree, so every token sees exactly the context and positions it had when the engine sampled it.
Several sessions share one forward pass (a forest) as the rows of a padded batch.

    forest = pack_forest(episodes)                     # PackedForest, plain tensors
    out = forest_forward(model, forest)                # ForestOutput: logprobs [A], entropy [A], values [A]
    naive_logprobs(model, episodes)                    # the slow obvious twin (tests, benchmarks)

The logprob of an action token is read from the logits at its *source*: the previous token in its own
node, or the last token of the parent node for a node's first token. Logits are divided by the call's
sampling temperature before log_softmax, as the engine does (`Step.temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from datapool.records import EpisodeData, Node
from trainer.algorithms.corrections import logprobs_and_entropy

__all__ = ["ForestOutput", "PackedForest", "forest_forward", "naive_logprobs", "pack_forest", "training_nodes"]


@dataclass
class PackedForest:
    """Several session trees laid out as one sequence of N tokens with A action tokens to score."""

    input_ids: torch.Tensor  # int64 [N]
    position_ids: torch.Tensor  # int64 [N]: depth of each token in its tree
    node_of: torch.Tensor  # int64 [N]: index of each token's node in the pack (0..K-1)
    ancestors: torch.Tensor  # bool [K, K]: ancestors[a, b] = node b is node a or one of a's ancestors
    targets: torch.Tensor  # int64 [A]: packed position of each action token
    sources: torch.Tensor  # int64 [A]: packed position whose logits predict that token
    temperature: torch.Tensor  # float32 [A]: the sampling temperature of the token's call
    behaviour_logprobs: torch.Tensor  # float32 [A]: the engine's recorded logprobs
    weight_version: torch.Tensor  # int64 [A]: the policy version that sampled the token
    episode: torch.Tensor  # int64 [A]: index of the token's episode in the list given to pack_forest
    call_index: torch.Tensor  # int64 [A]: the call (step) that sampled the token
    naive_tokens: int  # tokens a per-step forward would process: sum over steps of len(state + action)
    offsets: list[int]  # episode i's tokens are input_ids[offsets[i]:offsets[i + 1]] (one batch row each)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def attention_bias(self, dtype: torch.dtype, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Additive mask [1, 1, n, n] over tokens start:end: 0 where query i may attend key j, the dtype's
        minimum elsewhere. Works with HF's eager and sdpa attention (a 4-D mask is passed through as is).
        Ancestor nodes come earlier in the pack, so `j <= i` only restricts attention inside a node."""
        node = self.node_of[start:end]
        allowed = self.ancestors[node[:, None], node[None, :]]
        allowed &= torch.ones(len(node), len(node), dtype=torch.bool).tril()
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias[None, None]

    def batch_rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One padded row per episode (attention never crosses sessions, so no quadratic cost across them):
        input_ids [B, L], position_ids [B, L], bias [B, 1, L, L], and the flat index (row * L + col) of
        each packed token [N]. Padding attends only to itself (no empty softmax rows)."""
        spans = [(a, b) for a, b in zip(self.offsets[:-1], self.offsets[1:]) if b > a]
        width = max(b - a for a, b in spans)
        ids = torch.zeros(len(spans), width, dtype=torch.int64)
        pos = torch.zeros(len(spans), width, dtype=torch.int64)
        bias = torch.full((len(spans), 1, width, width), torch.finfo(dtype).min, dtype=dtype)
        bias.diagonal(dim1=-2, dim2=-1).zero_()
        flat = torch.empty(self.num_tokens, dtype=torch.int64)
        for row, (a, b) in enumerate(spans):
            ids[row, : b - a] = self.input_ids[a:b]
            pos[row, : b - a] = self.position_ids[a:b]
            bias[row, :, : b - a, : b - a] = self.attention_bias(dtype, a, b)[0]
            flat[a:b] = row * width + torch.arange(b - a)
        return ids, pos, bias, flat


@dataclass
class ForestOutput:
    logprobs: torch.Tensor  # float32 [A]: log_softmax(logits / T) at each action token
    entropy: torch.Tensor | None  # float32 [A]: entropy of the tempered distribution at each action token
    values: torch.Tensor | None  # float32 [A]: value-head output at each token's source (the state before it)


def training_nodes(episode: EpisodeData) -> list[Node]:
    """The nodes on the episode's training trajectories, in the tree's (topological) order."""
    wanted = {node_id for traj in episode.trajectories for node_id, _, _ in traj.node_path}
    return [node for node in episode.tree.nodes if node.id in wanted]


def _temperatures(episode: EpisodeData) -> dict[int, float]:
    return {step.call_index: step.temperature for traj in episode.trajectories for step in traj.steps}


def pack_forest(episodes: list[EpisodeData]) -> PackedForest:
    """Lay the training nodes of each episode's tree out in one sequence (parents before children)."""
    ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    node_of: list[np.ndarray] = []
    parents: list[int] = []  # pack index of each node's parent, -1 for a root child
    act: dict[str, list] = {k: [] for k in ("targets", "sources", "temp", "lp", "ver", "ep", "call")}
    cursor = 0
    naive = 0
    offsets = [0]
    for e, episode in enumerate(episodes):
        temps = _temperatures(episode)
        slot: dict[int, int] = {}  # node id -> pack index
        last: dict[int, int] = {}  # node id -> packed position of its last token
        depth_end: dict[int, int] = {}  # node id -> depth just after its last token
        for node in training_nodes(episode):
            k = len(parents)
            slot[node.id] = k
            parents.append(slot[node.parent] if node.parent >= 0 else -1)
            n = len(node.tokens)
            start_depth = depth_end[node.parent] if node.parent >= 0 else 0
            ids.append(np.asarray(node.tokens, dtype=np.int64))
            positions.append(np.arange(start_depth, start_depth + n, dtype=np.int64))
            node_of.append(np.full(n, k, dtype=np.int64))
            if node.kind == "act" and n:
                first_source = last[node.parent] if node.parent >= 0 else -1
                if first_source < 0:
                    raise ValueError(f"session {episode.info.session_id}: action node {node.id} has no context")
                sources = np.concatenate([[first_source], np.arange(cursor, cursor + n - 1)])
                act["targets"].append(np.arange(cursor, cursor + n))
                act["sources"].append(sources)
                act["temp"].append(np.full(n, temps.get(node.call_index, 1.0), dtype=np.float32))
                act["lp"].append(np.asarray(node.logprobs, dtype=np.float32))
                act["ver"].append(np.full(n, node.weight_version, dtype=np.int64))
                act["ep"].append(np.full(n, e, dtype=np.int64))
                act["call"].append(np.full(n, node.call_index, dtype=np.int64))
            last[node.id] = cursor + n - 1 if n else last.get(node.parent, -1)
            depth_end[node.id] = start_depth + n
            cursor += n
        naive += sum(step.action_end for step in _unique_steps(episode))
        offsets.append(cursor)
    return PackedForest(
        input_ids=_cat(ids, torch.int64),
        position_ids=_cat(positions, torch.int64),
        node_of=_cat(node_of, torch.int64),
        ancestors=_ancestor_matrix(parents),
        targets=_cat(act["targets"], torch.int64),
        sources=_cat(act["sources"], torch.int64),
        temperature=_cat(act["temp"], torch.float32),
        behaviour_logprobs=_cat(act["lp"], torch.float32),
        weight_version=_cat(act["ver"], torch.int64),
        episode=_cat(act["ep"], torch.int64),
        call_index=_cat(act["call"], torch.int64),
        naive_tokens=naive,
        offsets=offsets,
    )


def _unique_steps(episode: EpisodeData) -> list:
    """Each step (call) once, even when several trajectories carry it."""
    seen: dict[int, object] = {}
    for traj in episode.trajectories:
        for step in traj.steps:
            seen.setdefault(step.call_index, step)
    return list(seen.values())


def _cat(parts: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=dtype)
    return torch.from_numpy(np.concatenate(parts)).to(dtype)


def _ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """bool [K, K]: row a marks node a and all its ancestors (parents come first, so one pass suffices)."""
    k = len(parents)
    anc = torch.eye(k, dtype=torch.bool)
    for a, parent in enumerate(parents):
        if parent >= 0:
            anc[a] |= anc[parent]
    return anc


def forest_forward(
    model: nn.Module,
    forest: PackedForest,
    value_head: nn.Module | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> ForestOutput:
    """One forward pass of a Hugging Face causal LM over the packed forest.

    Only the A source positions go through the LM head, so memory is O(A × vocab), not O(N × vocab); the
    float32 log-softmax and entropy over those logits run in checkpointed chunks of rows
    (`trainer.algorithms.corrections.logprobs_and_entropy`), one [chunk, vocab] block alive at a time.
    `entropy_grad=False` computes the entropy as a detached statistic: an entropy bonus of 0 needs no
    gradient through it, and its A × vocab graph (exp, product, sum) is the costliest part of the head.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if forest.num_tokens == 0:
        empty = torch.zeros(0, device=device)
        return ForestOutput(empty, empty if with_entropy else None, empty if value_head is not None else None)
    ids, pos, bias, flat = forest.batch_rows(dtype)
    out = model.base_model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=bias.to(device),
                           use_cache=False)
    hidden = out.last_hidden_state.flatten(0, 1)[flat[forest.sources].to(device)]  # [A, H]
    return _score(model, hidden, forest.input_ids[forest.targets].to(device), forest.temperature.to(device),
                  value_head, with_entropy, entropy_grad)


def _score(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
           value_head: nn.Module | None, with_entropy: bool, entropy_grad: bool = True) -> ForestOutput:
    logits = model.get_output_embeddings()(hidden)  # [A, V] in the model's dtype; float32 a chunk of rows at a time
    tempered = None if bool((temperature == 1).all()) else temperature  # x / 1 is x exactly: skip the division
    logprobs, entropy = logprobs_and_entropy(logits, targets, temperature=tempered, entropy=with_entropy,
                                             entropy_grad=entropy_grad)
    values = value_head(hidden).float().squeeze(-1) if value_head is not None else None
    return ForestOutput(logprobs=logprobs, entropy=entropy, values=values)


def naive_logprobs(model: nn.Module, episodes: list[EpisodeData], forest: PackedForest) -> torch.Tensor:
    """The slow obvious twin: one causal forward of each step's full sequence (state + action).

    Returns float32 [A] in the forest's order (so it compares with `forest_forward(...).logprobs`), and is
    differentiable, so the benchmark can time a training step with it.
    """
    device = next(model.parameters()).device
    out = torch.zeros(len(forest.targets), device=device)
    done: set[tuple[int, int]] = set()
    for e, episode in enumerate(episodes):
        for traj in episode.trajectories:
            for step in traj.steps:
                if (e, step.call_index) in done:
                    continue
                done.add((e, step.call_index))
                seq = torch.as_tensor(traj.tokens[: step.action_end], dtype=torch.int64, device=device)[None]
                hidden = model.base_model(input_ids=seq, use_cache=False).last_hidden_state[0]
                src = hidden[step.action_start - 1 : step.action_end - 1]
                temp = torch.full((len(src),), step.temperature, device=device)
                logprobs = _score(model, src, seq[0, step.action_start:], temp, None, False).logprobs
                where = ((forest.episode == e) & (forest.call_index == step.call_index)).nonzero().squeeze(-1)
                out = out.index_put((where.to(device),), logprobs)
    return out
