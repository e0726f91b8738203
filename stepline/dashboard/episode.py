"""One session as the episode view draws it: its radix tree of steps, decoded, with which leaves train.

Built from the pool's own `EpisodeData` and `stepline.datapool.steps` (the leaf rules `stepline pool show` uses),
so ids, logprobs and versions are the pool's, token for token. Decoding uses the policy's
`tokenizer.json` (the `tokenizers` library: no model, no torch); without one, tokens show as ids.

Each token's text is its own decode, except where a character spans several byte-level tokens: the
whole character goes on the first of them and the rest show "" (hover still names each id), so a
node's texts joined equal its decoded text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepline.datapool.records import EpisodeData, LeafRule, Node
from stepline.datapool.steps import children_map, main_leaf, select_leaves, superseded_leaves

__all__ = ["Decoder", "episode_view", "load_decoder"]

Decoder = Callable[[list[int]], str]
MAX_MERGE = 4  # tokens a single character may span (UTF-8 is at most 4 bytes)
REPLACEMENT = "\ufffd"


def load_decoder(model_dir: Path | None) -> Decoder | None:
    """A decoder from `model_dir/tokenizer.json`, keeping special tokens (the chat template's markers
    are what the model saw); None when there is no tokenizer."""
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def token_texts(ids: list[int], decode: Decoder) -> list[str]:
    """The text of each token (see the module docstring for characters spread over several tokens)."""
    out: list[str] = []
    while len(out) < len(ids):
        text, n = _piece(ids, len(out), decode)
        out.extend([text] + [""] * (n - 1))
    return out


def _piece(ids: list[int], i: int, decode: Decoder) -> tuple[str, int]:
    """The text starting at token i and how many tokens it takes (1 unless a character is cut)."""
    text = decode(ids[i:i + 1])
    if text.endswith(REPLACEMENT):
        for n in range(2, min(MAX_MERGE, len(ids) - i) + 1):
            merged = decode(ids[i:i + n])
            # completed: no cut character at the end, and one fewer replacement than the token alone
            # (a byte that no later token completes is not merged with what follows)
            if not merged.endswith(REPLACEMENT) and merged.count(REPLACEMENT) < text.count(REPLACEMENT):
                return merged, n
    return text, 1


def _leaf_tag(node_id: int, main: int | None, trains: set[int], dead: set[int]) -> str:
    if node_id == main:
        return "main"
    return "dead" if node_id in dead else "trains" if node_id in trains else "leaf"


def _node(node: Node, decode: Decoder | None, step_rewards: dict[int, float]) -> dict[str, Any]:
    ids = node.tokens.tolist()
    out: dict[str, Any] = {"id": node.id, "parent": node.parent, "kind": node.kind, "call": node.call_index,
                           "n_tokens": len(ids), "ids": ids, "text": decode(ids) if decode else None}
    if node.kind == "act":
        out.update(version=node.weight_version, logprobs=[float(x) for x in node.logprobs.tolist()],
                   pieces=token_texts(ids, decode) if decode else None,
                   step_reward=step_rewards.get(node.call_index))
    return out


def episode_view(ep: EpisodeData, leaf_rule: LeafRule, decode: Decoder | None) -> dict[str, Any]:
    """The episode as JSON: header, rewards, and nodes in depth-first order with their children and,
    for leaves, whether they train under `leaf_rule` (main / trains / dead: a superseded retry / leaf)."""
    info, tree = ep.info, ep.tree
    kids = children_map(tree)
    trains, dead, main = set(select_leaves(tree, leaf_rule)), superseded_leaves(tree), main_leaf(tree)
    step_rewards: dict[int, float] = {}
    for r in ep.rewards:
        if r.step is not None:
            step_rewards[r.step] = step_rewards.get(r.step, 0.0) + r.value * r.weight
    nodes = []
    for node in tree.nodes:
        row = _node(node, decode, step_rewards)
        row["children"] = kids[node.id]
        if not kids[node.id]:
            row["leaf"] = _leaf_tag(node.id, main, trains, dead)
            row["trains"] = node.id in trains
        nodes.append(row)
    return {
        "session": {"session_id": info.session_id, "task_id": info.task_id, "harness": info.harness,
                    "group_key": info.group_key, "status": info.status, "metadata": info.metadata,
                    "created_at": info.created_at, "ended_at": info.ended_at},
        "outcome": ep.outcome if any(r.step is None for r in ep.rewards) else None,
        "rewards": [{"name": r.name, "value": r.value, "weight": r.weight, "step": r.step} for r in ep.rewards],
        "leaf_rule": leaf_rule, "decoded": decode is not None, "roots": kids[-1], "nodes": nodes,
        "calls": len(tree.calls), "tokens": sum(len(n.tokens) for n in tree.nodes),
    }
