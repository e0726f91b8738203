"""Test helpers: build EpisodeData from calls without a pool, and sample calls with the HF model.

`episode_from_calls` is a small, independent radix-tree builder (token trie, then chains compressed into
nodes), so the trainer's tests do not depend on the pool's implementation; the integration tests use
the real SQLite pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepline.datapool.records import EpisodeData, Node, Reward, SessionInfo, SessionTree, Step, Trajectory


@dataclass
class FakeCall:
    prompt: list[int]
    output: list[int]
    logprobs: list[float] | None = None
    version: int = 0
    temperature: float = 1.0
    step_reward: float = 0.0


@dataclass
class _Tok:
    token: int
    kind: str
    logprob: float
    call: int
    version: int
    parent: int
    children: dict[int, int] = field(default_factory=dict)
    cut: bool = False  # a node boundary after this token (a prompt or an action ends here)


def episode_from_calls(session_id: str, calls: list[FakeCall], outcome: float | None = 1.0,
                       task_id: str = "t", harness: str = "h") -> EpisodeData:
    toks: list[_Tok] = []
    roots: dict[int, int] = {}
    call_ends: dict[int, tuple[int, int, int]] = {}  # call -> (prompt end tok, first act tok, last act tok)

    def walk(at: int, seq: list[int], kind: str, lps: list[float], ci: int, version: int) -> list[int]:
        path = []
        for t, lp in zip(seq, lps):
            children = toks[at].children if at >= 0 else roots
            if t not in children:
                toks.append(_Tok(t, kind, lp if kind == "act" else 0.0, ci, version if kind == "act" else -1, at))
                children[t] = len(toks) - 1
            at = children[t]
            path.append(at)
        return path

    for ci, call in enumerate(calls):
        lps = call.logprobs if call.logprobs is not None else [-1.0] * len(call.output)
        p = walk(-1, call.prompt, "obs", [0.0] * len(call.prompt), ci, -1)
        a = walk(p[-1], call.output, "act", lps, ci, call.version)
        toks[p[-1]].cut = toks[a[-1]].cut = True
        call_ends[ci] = (p[-1], a[0], a[-1])

    # compress chains into nodes (preorder DFS = topological order)
    nodes: list[Node] = []
    node_of_tok: dict[int, int] = {}
    stack = [(t, -1) for t in reversed(list(roots.values()))]
    while stack:
        start, parent = stack.pop()
        run = [start]
        while (len(toks[run[-1]].children) == 1 and not toks[run[-1]].cut):
            nxt = next(iter(toks[run[-1]].children.values()))
            if toks[nxt].kind != toks[start].kind or toks[nxt].call != toks[start].call:
                break
            run.append(nxt)
        nid = len(nodes)
        first = toks[start]
        nodes.append(Node(id=nid, parent=parent, kind=first.kind,  # type: ignore[arg-type]
                          tokens=np.array([toks[i].token for i in run], dtype=np.int32),
                          logprobs=np.array([toks[i].logprob for i in run], dtype=np.float32),
                          call_index=first.call, weight_version=first.version))
        for i in run:
            node_of_tok[i] = nid
        stack.extend((c, nid) for c in reversed(list(toks[run[-1]].children.values())))

    tree = SessionTree(session_id=session_id, nodes=nodes)
    for ci, (pend, a0, a1) in call_ends.items():
        act = []
        n = node_of_tok[a1]
        while True:
            act.append(n)
            if n == node_of_tok[a0]:
                break
            n = nodes[n].parent
        tree.calls[ci] = (node_of_tok[pend], list(reversed(act)))

    children = {n.parent for n in nodes}
    trajectories = [_trajectory(tree, leaf.id, calls) for leaf in nodes if leaf.id not in children]
    trajectories[-1].is_main = True
    info = SessionInfo(session_id=session_id, task_id=task_id, harness=harness, status="completed")
    rewards = [Reward(session_id, outcome)] if outcome is not None else []
    rewards += [Reward(session_id, c.step_reward, step=i) for i, c in enumerate(calls) if c.step_reward]
    return EpisodeData(info=info, rewards=rewards, tree=tree, trajectories=trajectories)


def _trajectory(tree: SessionTree, leaf: int, calls: list[FakeCall]) -> Trajectory:
    chain = []
    n = leaf
    while n >= 0:
        chain.append(tree.nodes[n])
        n = tree.nodes[n].parent
    chain.reverse()
    node_path, pos = [], 0
    for node in chain:
        node_path.append((node.id, pos, pos + len(node.tokens)))
        pos += len(node.tokens)
    where = {nid: (s, e) for nid, s, e in node_path}
    steps = []
    for ci, (_, act) in sorted(tree.calls.items()):
        if all(a in where for a in act):
            start, end = where[act[0]][0], where[act[-1]][1]
            lps = np.concatenate([tree.nodes[a].logprobs for a in act])
            steps.append(Step(call_index=ci, action_start=start, action_end=end, behaviour_logprobs=lps,
                              weight_version=calls[ci].version, reward=calls[ci].step_reward,
                              temperature=calls[ci].temperature))
    if steps:
        steps[-1].done = True
    kinds = np.concatenate([np.full(len(n.tokens), n.kind == "act", dtype=np.int8) for n in chain])
    return Trajectory(session_id=tree.session_id, leaf=leaf,
                      tokens=np.concatenate([n.tokens for n in chain]).astype(np.int32), loss_mask=kinds,
                      logprobs=np.concatenate([n.logprobs for n in chain]).astype(np.float32),
                      steps=steps, node_path=node_path)


@torch.no_grad()
def sample(model, prompt: list[int], n: int, temperature: float = 1.0, generator=None) -> tuple[list[int], list[float]]:
    """Sample n tokens with the HF model; return ids and log_softmax(logits / T) of each (like the engine)."""
    ids = list(prompt)
    out, lps = [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        t = int(torch.multinomial(logp.exp(), 1, generator=generator))
        out.append(t)
        lps.append(float(logp[t]))
        ids.append(t)
    return out, lps


@torch.no_grad()
def sample_batch(model, prompts: torch.Tensor, n: int, temperature: float = 1.0, generator=None):
    """Sample n tokens for each row of prompts [B, P] (equal lengths, no padding); returns ids [B, n] and
    their logprobs log_softmax(logits / T) [B, n], as the engine records them."""
    ids = prompts.clone()
    out, lps = [], []
    for _ in range(n):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float() / temperature, -1)
        t = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
        out.append(t)
        lps.append(logp.gather(-1, t))
        ids = torch.cat([ids, t], dim=1)
    return torch.cat(out, 1), torch.cat(lps, 1)


def toy_target(model, vocab: int, size: int, seed: int = 0) -> torch.Tensor:
    """A learnable toy target: the `size` tokens whose output embedding points most along a random
    direction (a fresh tiny model samples them at about size/vocab; raising them all is one direction)."""
    g = torch.Generator().manual_seed(seed)
    emb = model.get_output_embeddings().weight[:vocab].detach()
    return (emb @ torch.randn(emb.shape[1], generator=g)).topk(size).indices


def rollout(model, pool, version: int, target: torch.Tensor, *, tasks: int = 4, samples: int = 6, vocab: int = 3000,
            tokens: int = 6, temperature: float = 1.0, seed: int = 0, tag: str = "") -> list[float]:
    """Two-turn sessions sampled in-process, written to the pool as the gateway would (CallRecords, reward,
    end). Reward = fraction of sampled tokens in `target`. Returns the rewards."""
    from stepline.datapool.records import CallRecord, Reward, SessionInfo

    g = torch.Generator().manual_seed(seed * 1000 + version)
    rewards = []
    for task in range(tasks):
        prompt = torch.randint(10, vocab, (1, 8), generator=g).repeat(samples, 1)
        out1, lp1 = sample_batch(model, prompt, tokens, temperature, g)
        prompt2 = torch.cat([prompt, out1, torch.randint(10, vocab, (1, 3), generator=g).repeat(samples, 1)], 1)
        out2, lp2 = sample_batch(model, prompt2, tokens, temperature, g)
        reward = torch.isin(torch.cat([out1, out2], 1), target).float().mean(-1)
        for i in range(samples):
            sid = f"{tag}v{version}-t{task}-{i}"
            pool.create_session(SessionInfo(sid, task_id=f"v{version}-t{task}", harness="toy"))
            pool.add_calls([
                CallRecord(sid, c, p[i].numpy().astype(np.int32), o[i].numpy().astype(np.int32),
                           lp[i].numpy().astype(np.float32), version, sampling={"temperature": temperature})
                for c, (p, o, lp) in enumerate([(prompt, out1, lp1), (prompt2, out2, lp2)])])
            pool.add_reward(Reward(sid, float(reward[i])))
            pool.end_session(sid, "completed")
            rewards.append(float(reward[i]))
    return rewards


class SamplerSync:
    """An in-process 'engine' behind the WeightSync interface: each push loads the new weights into the
    sampler and produces the next round of rollouts into the pool, stamped with the new version."""

    deltas = False  # it reads model.safetensors: every push in full

    def __init__(self, model_dir, pool, target, **rollout_args) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pool, self.target, self.args = pool, target, rollout_args
        self.pushes: list[tuple[str, int]] = []
        self.rewards: list[float] = []

    def push(self, path, version: int) -> None:
        from safetensors.torch import load_file

        self.pushes.append((str(path), version))
        self.model.load_state_dict(load_file(f"{path}/model.safetensors"), strict=False)
        self.start(version)

    def start(self, version: int) -> None:
        self.rewards.append(float(np.mean(rollout(self.model, self.pool, version, self.target, **self.args))))

    def close(self) -> None:
        pass
