"""`stepline pool show`: a session's tree, readable (rich)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Group as RichGroup
from rich.text import Text
from rich.tree import Tree

from stepline.datapool.records import EpisodeData, Node, SessionInfo
from stepline.datapool.steps import children_map, main_leaf, select_leaves, superseded_leaves

Decode = Callable[[list[int]], str]
PREVIEW = 60  # characters (or ids) of each node shown


def render_episode(ep: EpisodeData, decode: Decode | None = None, forks: Sequence[SessionInfo] = ()) -> RichGroup:
    """Header (session, status, rewards, the session it was forked from) and the tree: per node its kind,
    call, version, tokens, and for leaves whether they train (main / trains / dead: superseded retry); the
    sessions forked from this one (`forks`) hang below the node of the call they branched at."""
    info, tree = ep.info, ep.tree
    head = Text.assemble(
        (f"session {info.session_id}", "bold"), f"  task {info.task_id}  harness {info.harness}  group {info.group_key}"
        f"  status {info.status}\n", f"calls {len(tree.calls)}  nodes {len(tree.nodes)}  unique tokens "
        f"{sum(len(n.tokens) for n in tree.nodes)}  outcome {ep.outcome:g}")
    for r in ep.rewards:
        head.append(f"\n  reward {r.name}={r.value:g} ×{r.weight:g}" + ("" if r.step is None else f" (step {r.step})"))
    if (link := info.fork_of) is not None:
        head.append(f"\n  fork of {link.session_id} at call {link.call} (its calls before {link.call} are context here)")
    at: dict[int, list[SessionInfo]] = {}  # node where the branch call's prompt ends (ROOT: not in this tree)
    for fork in forks:
        if fork.fork_of is not None:
            at.setdefault(tree.calls.get(fork.fork_of.call, (-1, []))[0], []).append(fork)
    kids = children_map(tree)
    trains = set(select_leaves(tree, "drop_superseded"))
    dead, main = superseded_leaves(tree), main_leaf(tree)
    by_id = {n.id: n for n in tree.nodes}
    root = Tree(Text("root", "dim"))
    stack = [(root, child) for child in reversed(kids[-1])]
    while stack:
        parent, node_id = stack.pop()
        label = _label(by_id[node_id], decode)
        if not kids[node_id]:
            tag = "main" if node_id == main else "dead (superseded)" if node_id in dead else \
                "trains" if node_id in trains else "leaf"
            label.append(f"  ◀ {tag}", "bold green" if tag in ("main", "trains") else "bold red")
        branch = parent.add(label)
        for fork in at.pop(node_id, []):
            branch.add(_fork_label(fork))
        stack.extend((branch, child) for child in reversed(kids[node_id]))
    for fork in at.pop(-1, []):
        root.add(_fork_label(fork))
    return RichGroup(head, root)


def _fork_label(fork: SessionInfo) -> Text:
    call = fork.fork_of.call if fork.fork_of else 0
    return Text(f"⑂ fork {fork.session_id} ({fork.status}) samples call {call} anew from here", "bold magenta")


def _label(node: Node, decode: Decode | None) -> Text:
    ids = node.tokens.tolist()
    body = decode(ids) if decode else " ".join(map(str, ids))
    body = body if len(body) <= PREVIEW else body[:PREVIEW] + "…"
    if node.kind == "act":
        meta = f"act #{node.id} call {node.call_index} v{node.weight_version} · {len(ids)} tok" \
               f" · mean logprob {float(node.logprobs.mean()):.3f}"
        return Text.assemble((meta, "cyan"), "  ", (repr(body), "white"))
    return Text.assemble((f"obs #{node.id} call {node.call_index} · {len(ids)} tok", "yellow"), "  ",
                         (repr(body), "dim"))
