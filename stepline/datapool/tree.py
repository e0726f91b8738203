"""A session's radix tree of token ids (pure: no I/O).

Each call extends the tree: `RadixTree.insert` walks the deepest existing path that prefixes the
call's prompt, splits a node where the prompt diverges inside it, and adds an observation node (the
prompt tokens past the shared prefix, loss mask 0) and an action node (the sampled tokens with their
logprobs and weight version, loss mask 1). Every token is stored once, as int32 ids / float32 logprobs.

Actions are never merged with an existing node: two samples from the same prompt (a retry) are
siblings even when their tokens coincide, because their logprobs and versions differ. A later prompt
may walk *into* any node, action nodes included (the next turn carries the previous answer).

The insert is deterministic given the order of calls, and it reports where the prompt's shared
prefix came from (`Insert.base_call`, `Insert.base_len`: the prompt starts with the first `base_len`
tokens of call `base_call`'s prompt + output). Storage keeps only that reference and the new tokens;
`replay` rebuilds the same tree from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from stepline.datapool.records import NO_VERSION, CallRecord, Node, SessionTree, prefix_check

ROOT = -1  # id of the (empty) root node


@dataclass(frozen=True)
class Insert:
    """Where a call landed: its prompt = first `base_len` tokens of call `base_call`'s full sequence
    (prompt + output; -1 / 0 when nothing is shared) followed by `new_prompt`."""

    base_call: int
    base_len: int
    new_prompt: np.ndarray  # int32: the prompt tokens this call added (its observation span)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays (vectorised)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixTree:
    """The token tree of one session. Node arrays are never mutated in place (splits make new
    arrays), so `snapshot()` can share them safely."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.nodes: dict[int, Node] = {}
        # parent id -> first token -> child ids (insertion order); several children may share a
        # first token (sibling actions), prompts descend into the longest match, latest on a tie.
        self._children: dict[int, dict[int, list[int]]] = {ROOT: {}}
        self.calls: dict[int, tuple[int, list[int]]] = {}
        self._prompt_ends: dict[int, list[int]] = {}  # node id -> calls whose prompt ends there

    def __len__(self) -> int:
        return len(self.calls)

    @property
    def n_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.nodes.values())

    def sequence(self, call_index: int) -> np.ndarray:
        """The call's full token sequence: prompt followed by output (the path to its last node)."""
        end, acts = self.calls[call_index]
        return self.path_tokens(acts[-1] if acts else end)

    def path_tokens(self, node_id: int) -> np.ndarray:
        """Tokens from the root to the end of `node_id`."""
        parts = []
        while node_id != ROOT:
            parts.append(self.nodes[node_id].tokens)
            node_id = self.nodes[node_id].parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int32)

    def locate(self, prompt: np.ndarray) -> tuple[int, int, int]:
        """Deepest path prefixing `prompt`: (node id, tokens matched inside it, total matched)."""
        return self._descend(ROOT, prompt, 0)

    def _descend(self, node: int, prompt: np.ndarray, k: int) -> tuple[int, int, int]:
        # Walk down from `node` (fully matched, k tokens so far). Where several children share the
        # next token (sibling actions), each is explored and the deepest wins (the latest on a tie).
        while True:
            full = len(self.nodes[node].tokens) if node != ROOT else 0
            candidates = self._children[node].get(int(prompt[k])) if k < len(prompt) else None
            if not candidates:
                return node, full, k
            results = []
            for child in reversed(candidates):
                m = common_prefix_len(self.nodes[child].tokens, prompt[k:])
                if m < len(self.nodes[child].tokens) or len(candidates) == 1:
                    results.append((child, m, k + m))
                else:
                    results.append(self._descend(child, prompt, k + m))
            best = max(results, key=lambda r: r[2])  # first max = latest child
            if len(candidates) > 1 or best[1] < len(self.nodes[best[0]].tokens):
                return best
            node, k = best[0], best[2]

    def insert(
        self,
        call_index: int,
        prompt_ids: np.ndarray,
        output_ids: np.ndarray,
        output_logprobs: np.ndarray,
        weight_version: int,
        version_spans: Sequence[tuple[int, int]] = (),
    ) -> Insert:
        """Add one call. Cost: a vectorised compare along the shared path plus O(new tokens).
        `version_spans`: (first output index, version) pairs (CallRecord.version_spans; empty: one version)."""
        if call_index in self.calls:
            raise ValueError(f"call {call_index} is already in session {self.session_id!r}")
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        node, inside, k = self.locate(prompt)
        if node != ROOT and inside < len(self.nodes[node].tokens):
            self._split(node, inside)
        base = (self.nodes[node].call_index, k) if k > 0 else (-1, 0)
        new_prompt = prompt[k:]
        if len(new_prompt):
            zeros = np.zeros(len(new_prompt), dtype=np.float32)
            node = self._add(node, "obs", new_prompt, zeros, call_index, NO_VERSION)
        self._prompt_ends.setdefault(node, []).append(call_index)
        output = np.asarray(output_ids, dtype=np.int32)
        acts: list[int] = []
        logprobs = np.asarray(output_logprobs, dtype=np.float32)
        spans = list(version_spans) or [(0, weight_version)]
        ends = [s for s, _ in spans[1:]] + [len(output)]
        parent = node
        for (start, version), end in zip(spans, ends):
            if end > start:
                parent = self._add(parent, "act", output[start:end], logprobs[start:end], call_index, int(version))
                acts.append(parent)
        self.calls[call_index] = (node, acts)
        return Insert(base[0], base[1], new_prompt)

    def _add(
        self, parent: int, kind: str, tokens: np.ndarray, logprobs: np.ndarray, call: int, version: int
    ) -> int:
        node_id = len(self.nodes)
        self.nodes[node_id] = Node(node_id, parent, kind, tokens, logprobs, call, version)  # type: ignore[arg-type]
        self._children[parent].setdefault(int(tokens[0]), []).append(node_id)
        self._children[node_id] = {}
        return node_id

    def _split(self, node_id: int, at: int) -> None:
        """Cut a node after `at` tokens: the node keeps the head (its parent's index is unchanged),
        a new node takes the tail and the old children."""
        node = self.nodes[node_id]
        tail_id = len(self.nodes)
        tail = Node(tail_id, node_id, node.kind, node.tokens[at:], node.logprobs[at:], node.call_index,
                    node.weight_version)
        node.tokens, node.logprobs = node.tokens[:at], node.logprobs[:at]
        self.nodes[tail_id] = tail
        self._children[tail_id] = self._children[node_id]
        for child in child_ids(self._children[tail_id]):
            self.nodes[child].parent = tail_id
        self._children[node_id] = {int(tail.tokens[0]): [tail_id]}
        ends = self._prompt_ends.pop(node_id, [])
        if ends:
            self._prompt_ends[tail_id] = ends
            for call in ends:
                self.calls[call] = (tail_id, self.calls[call][1])
        if node.kind == "act":
            acts = self.calls[node.call_index][1]
            acts.insert(acts.index(node_id) + 1, tail_id)

    def snapshot(self) -> SessionTree:
        """The tree as a `SessionTree` record, nodes in topological (depth-first) order."""
        order, stack = [], list(reversed(child_ids(self._children[ROOT])))
        while stack:
            node_id = stack.pop()
            order.append(node_id)
            stack.extend(reversed(child_ids(self._children[node_id])))
        nodes = [
            Node(n.id, n.parent, n.kind, n.tokens, n.logprobs, n.call_index, n.weight_version)
            for n in (self.nodes[i] for i in order)
        ]
        calls = {c: (end, list(acts)) for c, (end, acts) in self.calls.items()}
        return SessionTree(self.session_id, nodes, calls)


def child_ids(index: dict[int, list[int]]) -> list[int]:
    """A node's children in creation order."""
    return sorted(i for ids in index.values() for i in ids)


@dataclass
class StoredCall:
    """A call as storage keeps it: the reference to its shared prefix and its new tokens."""

    call_index: int
    base_call: int
    base_len: int
    new_prompt: np.ndarray  # int32
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32
    weight_version: int
    version_spans: list[tuple[int, int]] = field(default_factory=list)  # CallRecord.version_spans


def replay(session_id: str, calls: list[StoredCall]) -> RadixTree:
    """Rebuild a session's tree from its stored calls, in the order they were inserted."""
    tree = RadixTree(session_id)
    for c in calls:
        prompt = full_prompt(tree, c.base_call, c.base_len, c.new_prompt)
        got = tree.insert(c.call_index, prompt, c.output_ids, c.output_logprobs, c.weight_version, c.version_spans)
        if (got.base_call, got.base_len) != (c.base_call, c.base_len):
            raise ValueError(f"stored call {c.call_index} of {session_id!r} does not replay consistently")
    return tree


def full_prompt(tree: RadixTree, base_call: int, base_len: int, new_prompt: np.ndarray) -> np.ndarray:
    """A stored call's full prompt, given the tree that holds its base call."""
    prefix = tree.sequence(base_call)[:base_len] if base_len else np.zeros(0, np.int32)
    return np.concatenate([prefix, new_prompt]).astype(np.int32, copy=False)


def delta_prompt(tree: RadixTree, record: CallRecord) -> np.ndarray:
    """A delta record's whole prompt: the first `prefix_len` ids of its parent's prompt + output, then its
    own `prompt_ids`. ValueError saying what does not match: a parent the tree lacks (lost, refused, another
    session's), a prefix longer than the parent's ids, or ids that differ at the prefix's end (`prefix_check`)."""
    if record.parent not in tree.calls:
        raise ValueError(f"its parent call {record.parent} is not in the pool (never written, refused, or another "
                         "session's)")
    sequence = tree.sequence(record.parent)
    if record.prefix_len > len(sequence):
        raise ValueError(f"prefix_len {record.prefix_len} is longer than call {record.parent}'s prompt + output "
                         f"({len(sequence)} ids)")
    if prefix_check(sequence[: record.prefix_len]) != record.prefix_check:
        raise ValueError(f"its prefix does not match call {record.parent}'s ids (prefix_check differs)")
    return np.concatenate([sequence[: record.prefix_len], record.prompt_ids]).astype(np.int32, copy=False)
