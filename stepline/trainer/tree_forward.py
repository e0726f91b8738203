"""Tree forward: the log-probabilities of every action token of a session from one forward pass.

A session's calls form a radix tree of tokens (`stepline.datapool.records.SessionTree`). The naive way runs the
model once per step on that step's full sequence, recomputing the shared prefix at every turn
(quadratic in the number of turns). Here the nodes on the trajectories that train are laid out in one
sequence, parents first, and the model gets a *tree attention mask*: each token attends to the tokens
of its ancestor nodes and to the earlier tokens of its own node. Position ids are the depth in the
tree, so every token sees exactly the context and positions it had when the engine sampled it.
The sessions of a harness begin with the same system prompt and tool list, and those of a group (same
task, same harness) with the same whole prompt: a harness's sessions are packed as one trie, so the tokens
they share are forwarded once. Harnesses share one forward pass (a forest) as the rows of a padded batch.

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

from stepline.datapool.records import EpisodeData, Node
from stepline.trainer.algorithms.corrections import logprobs_and_entropy

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
    expert: torch.Tensor  # bool [A]: the token is an expert's (an expert session's), not the policy's sample
    naive_tokens: int  # tokens a per-step forward would process: sum over steps of len(state + action)
    offsets: list[int]  # row i (one harness's tree) is input_ids[offsets[i]:offsets[i + 1]]

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

    @property
    def linear_rows(self) -> bool:
        """True when every row is one linear chain (each node's parent is the node before it): its tree mask is then
        plain causal attention and its position ids run 0..n-1. Positions are depths and every node holds tokens, so
        a row's positions run 0..n-1 exactly when all the nodes before each node are its ancestors: one O(N) test."""
        offsets = torch.tensor(self.offsets, dtype=torch.int64)
        row_start = offsets[:-1].repeat_interleave(offsets.diff())  # [N]
        return torch.equal(self.position_ids, torch.arange(self.num_tokens) - row_start)

    def batch_rows(self, dtype: torch.dtype, causal: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One padded row per harness's tree (attention never crosses harnesses, so no quadratic cost across them):
        input_ids [B, L], position_ids [B, L], bias [B, 1, L, L], and the flat index (row * L + col) of
        each packed token [N]. Padding attends only to itself (no empty softmax rows).

        `causal` (only where `linear_rows`): no bias (None) and position ids 0..L-1 in every row, padding included,
        so the model runs plain causal attention (HF's sdpa path then calls SDPA with is_causal=True, its fused
        kernel; positions that restart would read as packed sequences and bring a mask back). Right padding comes
        after a row's tokens, so they never see it; it sees them, harmlessly, and its outputs are never read."""
        spans = [(a, b) for a, b in zip(self.offsets[:-1], self.offsets[1:]) if b > a]
        width = max(b - a for a, b in spans)
        ids = torch.zeros(len(spans), width, dtype=torch.int64)
        flat = torch.empty(self.num_tokens, dtype=torch.int64)
        for row, (a, b) in enumerate(spans):
            ids[row, : b - a] = self.input_ids[a:b]
            flat[a:b] = row * width + torch.arange(b - a)
        if causal:
            return ids, torch.arange(width).repeat(len(spans), 1), None, flat
        pos = torch.zeros(len(spans), width, dtype=torch.int64)
        bias = torch.full((len(spans), 1, width, width), torch.finfo(dtype).min, dtype=dtype)
        bias.diagonal(dim1=-2, dim2=-1).zero_()
        for row, (a, b) in enumerate(spans):
            pos[row, : b - a] = self.position_ids[a:b]
            bias[row, :, : b - a, : b - a] = self.attention_bias(dtype, a, b)[0]
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


class _Segment:
    """A run of packed tokens in the shared-prefix trie of one harness's sessions. Splitting it at k moves
    tokens[k:] and the children into a new segment; `moved` = (k, that segment) redirects references."""

    __slots__ = ("children", "moved", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.children: dict[int, _Segment] = {}
        self.moved: tuple[int, _Segment] | None = None

    def split(self, k: int) -> None:
        tail = _Segment(self.tokens[k:])
        tail.children = self.children
        if self.moved is not None:  # an earlier split at a later offset now starts inside the tail
            tail.moved = (self.moved[0] - k, self.moved[1])
        self.tokens, self.children, self.moved = self.tokens[:k], {tail.tokens[0]: tail}, (k, tail)


Ref = tuple[_Segment, int]  # (segment, offset): one packed token, before splits are resolved


def _resolve(ref: Ref) -> Ref:
    seg, off = ref
    while seg.moved is not None and off >= seg.moved[0]:
        off, seg = off - seg.moved[0], seg.moved[1]
    return seg, off


def _insert(after: Ref, tokens: np.ndarray) -> list[Ref]:
    """Add `tokens` after the token `after` refers to ((root, -1) for a first node), sharing what is already
    there; returns a reference to each of them."""
    seg, off = _resolve(after)
    fresh: _Segment | None = None  # the segment this insertion created: it grows instead of chaining 1-token ones
    refs: list[Ref] = []
    for token in tokens.tolist():
        if off + 1 < len(seg.tokens):
            if seg.tokens[off + 1] == token:
                off += 1
                refs.append((seg, off))
                continue
            seg.split(off + 1)
        if seg is fresh:
            seg.tokens.append(token)
            off += 1
        elif token in seg.children:
            seg, off = seg.children[token], 0
        else:
            fresh = seg.children[token] = _Segment([token])
            seg, off = fresh, 0
        refs.append((seg, off))
    return refs


def pack_forest(episodes: list[EpisodeData]) -> PackedForest:
    """Lay the training nodes of the episodes out in one sequence (parents before children), the sessions of a
    harness sharing the tokens they have in common: they begin with the same system prompt and tools, a group's
    (same task) with the same whole prompt, so what they share is packed, forwarded and back-propagated once
    instead of once per session. Each harness is one tree (one batch row); its tokens are a trie of its
    sessions' paths, so every packed token has exactly the context and position it had in each session that
    holds it."""
    roots: dict[str, _Segment] = {}
    act: dict[str, list] = {k: [] for k in ("targets", "sources", "temp", "lp", "ver", "ep", "call", "expert")}
    naive = 0
    for e, episode in enumerate(episodes):
        root = roots.setdefault(episode.info.harness, _Segment([]))
        temps = _temperatures(episode)
        expert = episode.info.expert
        last: dict[int, Ref] = {-1: (root, -1)}  # node id -> reference to its last token
        for node in training_nodes(episode):
            if node.kind == "act" and len(node.tokens) and node.parent < 0:
                raise ValueError(f"session {episode.info.session_id}: action node {node.id} has no context")
            refs = _insert(last[node.parent], node.tokens)
            if node.kind == "act" and refs:
                act["targets"].append(refs)
                act["sources"].append([last[node.parent], *refs[:-1]])
                n = len(refs)
                act["temp"].append(np.full(n, temps.get(node.call_index, 1.0), dtype=np.float32))
                act["lp"].append(np.asarray(node.logprobs, dtype=np.float32))
                act["ver"].append(np.full(n, node.weight_version, dtype=np.int64))
                act["ep"].append(np.full(n, e, dtype=np.int64))
                act["call"].append(np.full(n, node.call_index, dtype=np.int64))
                act["expert"].append(np.full(n, expert, dtype=np.bool_))
            last[node.id] = refs[-1] if len(refs) else last[node.parent]
        naive += sum(step.action_end for step in _unique_steps(episode))
    layout = _Layout(list(roots.values()))
    return PackedForest(
        input_ids=torch.tensor(layout.ids, dtype=torch.int64),
        position_ids=torch.tensor(layout.positions, dtype=torch.int64),
        node_of=torch.tensor(layout.node_of, dtype=torch.int64),
        ancestors=_ancestor_matrix(layout.parents),
        targets=layout.positions_of(act["targets"]),
        sources=layout.positions_of(act["sources"]),
        temperature=_cat(act["temp"], torch.float32),
        behaviour_logprobs=_cat(act["lp"], torch.float32),
        weight_version=_cat(act["ver"], torch.int64),
        episode=_cat(act["ep"], torch.int64),
        call_index=_cat(act["call"], torch.int64),
        expert=_cat(act["expert"], torch.bool),
        naive_tokens=naive,
        offsets=layout.offsets,
    )


class _Layout:
    """The tries' segments in preorder (parents first), one row per tree: token ids, depths (position ids),
    each token's segment index, each segment's parent index and where each segment starts."""

    def __init__(self, roots: list[_Segment]) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.node_of: list[int] = []
        self.parents: list[int] = []
        self.start: dict[_Segment, int] = {}
        self.offsets = [0]
        for root in roots:
            for tree in root.children.values():
                stack: list[tuple[_Segment, int, int]] = [(tree, -1, 0)]
                while stack:
                    seg, parent, depth = stack.pop()
                    k = len(self.parents)
                    self.parents.append(parent)
                    self.start[seg] = len(self.ids)
                    self.ids += seg.tokens
                    self.positions += range(depth, depth + len(seg.tokens))
                    self.node_of += [k] * len(seg.tokens)
                    stack += [(child, k, depth + len(seg.tokens)) for child in reversed(seg.children.values())]
                self.offsets.append(len(self.ids))

    def positions_of(self, refs: list[list[Ref]]) -> torch.Tensor:
        flat = [_resolve(ref) for part in refs for ref in part]
        return torch.tensor([self.start[seg] + off for seg, off in flat], dtype=torch.int64)


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
    tree_mask: bool = False,
) -> ForestOutput:
    """One forward pass of a Hugging Face causal LM over the packed forest.

    Only the A source positions go through the LM head, so memory is O(A × vocab), not O(N × vocab); the
    float32 log-softmax and entropy over those logits run in checkpointed chunks of rows
    (`stepline.trainer.algorithms.corrections.logprobs_and_entropy`), one [chunk, vocab] block alive at a time.
    `entropy_grad=False` computes the entropy as a detached statistic: an entropy bonus of 0 needs no
    gradient through it, and its A × vocab graph (exp, product, sum) is the costliest part of the head.

    Where every row is one linear chain (`PackedForest.linear_rows`: a session whose calls extend each other, alone
    in its harness's row) the tree mask is plain causal attention: no 4-D mask goes in, and SDPA runs its fused causal
    kernel instead of scoring all L × L pairs against a dense mask. `tree_mask=True` keeps the dense mask anyway
    (the fast path's twin, for tests and benchmarks).
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if forest.num_tokens == 0:
        empty = torch.zeros(0, device=device)
        return ForestOutput(empty, empty if with_entropy else None, empty if value_head is not None else None)
    ids, pos, bias, flat = forest.batch_rows(dtype, causal=not tree_mask and forest.linear_rows)
    out = model.base_model(input_ids=ids.to(device), position_ids=pos.to(device),
                           attention_mask=None if bias is None else bias.to(device), use_cache=False)
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
