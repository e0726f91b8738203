"""The records every Stepline component exchanges.

The gateway produces `CallRecord`s; the pool stores them as a radix tree of tokens per session
(`SessionTree`) and serves `Trajectory`s (the steps view) and `Group`s to the trainer. These types
are the contract between the components: change a field here and every side changes with it.

Token arrays are numpy arrays (int32 ids, float32 logprobs) in memory and packed little-endian bytes
on the wire and on disk.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

SessionStatus = Literal["open", "completed", "failed", "aborted", "abandoned"]
# What a session is for: "train" (RL episodes, the default), "eval" (`stepline eval`: never trained on),
# "demo" (expert demonstrations for SFT). docs/architecture.md §3.
Purpose = Literal["train", "eval", "demo"]
PURPOSES: tuple[Purpose, ...] = get_args(Purpose)
NodeKind = Literal["obs", "act"]
LeafRule = Literal["all", "drop_superseded", "main"]

NO_VERSION = -1  # weight version of observation tokens (not sampled by any policy)
REFERENCE_KEY = "reference"  # the session-metadata key of the task's gold answer (IGPO's information gain)
EXPERT_KEY = "expert"  # the session-metadata flag of an expert's episode in a training group (no policy sampled it)
HINDSIGHT_KEY = "hindsight"  # the session-metadata flag of a failed episode recorded again under what it did achieve
FORK_KEY = "fork_of"  # the session-metadata key of a fork's link, {"session": id, "call": k} (set by the gateway)
END_REASON_KEY = "end_reason"  # the session-metadata key saying why the pool abandoned a session (set by the pool)


@dataclass(frozen=True)
class ForkPoint:
    """Where a forked session branched off: it shares `session`'s calls 0..call-1 (their exact token ids, as
    context) and samples its own from call `call` on (docs/architecture.md §3, Tree-GRPO)."""

    session_id: str
    call: int


@dataclass
class SessionInfo:
    """One episode of one harness on one task."""

    session_id: str
    task_id: str
    harness: str
    group_id: str | None = None  # explicit group; default group is f"{task_id}::{harness}"
    metadata: dict[str, Any] = field(default_factory=dict)
    status: SessionStatus = "open"
    created_at: float = 0.0  # unix seconds
    ended_at: float | None = None
    purpose: Purpose = "train"

    @property
    def group_key(self) -> str:
        return self.group_id if self.group_id is not None else f"{self.task_id}::{self.harness}"

    @property
    def expert(self) -> bool:
        """An expert's episode in a training group (`metadata["expert"]`): no policy sampled its calls."""
        return self.metadata.get(EXPERT_KEY) is True

    @property
    def fork_of(self) -> ForkPoint | None:
        """The session and call this one was forked from (`metadata["fork_of"]`), None for a root episode."""
        link = self.metadata.get(FORK_KEY)
        return None if link is None else ForkPoint(link["session"], int(link["call"]))


def legacy_purpose(metadata: dict[str, Any]) -> Purpose:
    """The purpose of a session recorded before `SessionInfo.purpose` (pool schema 1, older exports): the
    evaluator marked its sessions `{"eval": true}` and the demonstrations `{"demo": true}`."""
    return "eval" if metadata.get("eval") else "demo" if metadata.get("demo") else "train"


@dataclass
class CallRecord:
    """One model call as the gateway saw it: exactly which tokens went in and came out."""

    session_id: str
    call_index: int  # 0, 1, 2… in dispatch order within the session (assigned by the gateway)
    prompt_ids: np.ndarray  # int32 [P]: the full prompt the engine received
    output_ids: np.ndarray  # int32 [O]: the tokens the engine sampled, in order
    output_logprobs: np.ndarray  # float32 [O]: the engine's logprob of each sampled token
    weight_version: int  # policy version stamped at dispatch
    finish_reason: str = "stop"  # stop | length | abort
    api: str = "chat.completions"  # chat.completions | completions | responses | messages
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_new_tokens…
    timings: dict[str, float] = field(default_factory=dict)  # received, dispatched, first_token, done
    request: bytes | None = None  # zstd-compressed orjson of the API request body
    response: bytes | None = None  # zstd-compressed orjson of the API answer
    # (first output index, version) of each run of tokens one version sampled, in order: a call the weight gate
    # cut for an update and resumed under the new weights has several (docs/architecture.md, "Weight updates").
    # Empty (the default, and every call never cut): all its output tokens at `weight_version`.
    version_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """`version_spans`, or the one span of a call sampled by one version."""
        return [(int(s), int(v)) for s, v in self.version_spans] or [(0, self.weight_version)]

    # The delta form (what the gateway sends for a turn that extends an earlier call; docs/architecture.md,
    # "Recording a turn as a delta"): parent >= 0 means the prompt is the first `prefix_len` ids of call
    # `parent`'s prompt + output (same session) followed by `prompt_ids`, and `prefix_check` is
    # `prefix_check(prompt[:prefix_len])`; request_prefix > 0 means the request body is the first
    # `request_prefix` bytes of the parent's body followed by what `request` holds (zstd, its size in the frame).
    # -1 / 0: `prompt_ids` and `request` are whole (what the pool hands back).
    parent: int = -1
    prefix_len: int = 0
    prefix_check: int = 0
    request_prefix: int = 0

    @property
    def is_delta(self) -> bool:
        return self.parent >= 0


PREFIX_CHECK_IDS = 64  # the ids at the end of a delta's prefix that `prefix_check` covers


def prefix_check(prefix: np.ndarray) -> int:
    """crc32 of the last `PREFIX_CHECK_IDS` ids of a delta's prefix (packed int32): the pool compares it with
    its own copy of the parent's ids, so a delta against the wrong parent is refused, at a cost that does not
    grow with the context."""
    return zlib.crc32(np.ascontiguousarray(prefix[-PREFIX_CHECK_IDS:], dtype="<i4").tobytes())


@dataclass
class Reward:
    """A reward for a session: terminal (step None) or for one call (step = call_index)."""

    session_id: str
    value: float
    step: int | None = None
    name: str = "outcome"  # named component; several components add up with their weights
    weight: float = 1.0
    created_at: float = 0.0


@dataclass
class Node:
    """A node of a session's radix tree: a run of tokens that share one parent and one kind."""

    id: int
    parent: int  # -1 for a child of the (empty) root
    kind: NodeKind  # "obs": added by the harness (loss mask 0); "act": sampled (loss mask 1)
    tokens: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]; zeros on observation nodes
    call_index: int  # the call that added these tokens
    weight_version: int = NO_VERSION  # version that sampled them (act nodes only)


@dataclass
class SessionTree:
    """All tokens of a session, each stored once. `nodes` are in topological order (parents first)."""

    session_id: str
    nodes: list[Node]
    # call_index -> (node id where the call's prompt ends, node ids of its action, in order)
    calls: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass
class Step:
    """One transition of a trajectory. Positions index `Trajectory.tokens`.

    State s_t = tokens[:action_start] (the call's prompt); action a_t = tokens[action_start:action_end].
    """

    call_index: int
    action_start: int
    action_end: int
    behaviour_logprobs: np.ndarray  # float32 [action_end - action_start], as recorded from the engine
    weight_version: int  # the oldest version among its action tokens (what the staleness bound compares)
    reward: float = 0.0  # dense per-step reward (weighted sum of components); 0 if none posted
    done: bool = False  # True on the trajectory's last step
    finish_reason: str = "stop"
    # sampling temperature of the call (its `sampling["temperature"]`, 1.0 if absent): the engine's
    # logprobs are log_softmax(logits / T), so the trainer divides its logits by the same T
    temperature: float = 1.0
    # (first index within the action, version) of each run of tokens one version sampled: one entry, unless the
    # call was resumed across a weight update (CallRecord.version_spans)
    version_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Trajectory:
    """A root-to-leaf path of a session's tree, with its steps (the steps view)."""

    session_id: str
    leaf: int  # node id of the leaf
    tokens: np.ndarray  # int32 [T]: root → leaf
    loss_mask: np.ndarray  # int8 [T]: 1 on action tokens
    logprobs: np.ndarray  # float32 [T]: behaviour logprobs on action tokens, 0 elsewhere
    steps: list[Step]
    node_path: list[tuple[int, int, int]]  # (node id, start, end) in `tokens`: the position in the tree
    is_main: bool = False  # the main trajectory of the session (see the leaf rules)


@dataclass
class EpisodeData:
    """What the trainer needs of one session: info, rewards, its tree and the trajectories that train."""

    info: SessionInfo
    rewards: list[Reward]
    tree: SessionTree
    trajectories: list[Trajectory]

    @property
    def outcome(self) -> float:
        """Terminal reward: weighted sum of the terminal components (0 if none)."""
        return float(sum(r.value * r.weight for r in self.rewards if r.step is None))


@dataclass
class Group:
    """Sessions of the same task × harness (or explicit group id), handed to one trainer."""

    group_id: str  # unique id of this handed-out group (the same task × harness recurs in later batches)
    group_key: str  # task::harness or the explicit group id of its sessions
    episodes: list[EpisodeData]
    min_version: int  # oldest weight version among its action tokens
