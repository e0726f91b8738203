"""The tree forward equals its slow obvious twin, and a fresh policy reproduces the engine's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import FakeCall, episode_from_calls, sample
from transformers import AutoModelForCausalLM

from stepline.trainer.tree_forward import forest_forward, naive_logprobs, pack_forest

torch.set_num_threads(1)


def load(model_dir: Path, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()


def multi_turn(seed: int, turns: int = 4, fork: bool = True) -> list[FakeCall]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(10, 3000, (n,), generator=g).tolist()

    calls, history = [], rand(12)
    for t in range(turns):
        out = rand(5 + t)
        calls.append(FakeCall(prompt=list(history), output=out, temperature=[1.0, 0.7][t % 2]))
        history = history + out + rand(4)
    if fork:  # a retry of turn 1 with a rewritten observation: the tree forks in the middle of a node
        calls.append(FakeCall(prompt=calls[1].prompt[:-2] + rand(3), output=rand(6)))
    return calls


def test_pack_layout_by_hand() -> None:
    # prompt [5 6] -> act [7 8]; then prompt [5 6 7 8 9] -> act [10]; and a retry prompt [5 6 11] -> act [12]
    ep = episode_from_calls("s", [FakeCall([5, 6], [7, 8]), FakeCall([5, 6, 7, 8, 9], [10]), FakeCall([5, 6, 11], [12])])
    f = pack_forest([ep])
    # nodes in order: [5 6] obs, [7 8] act, [9] obs, [10] act, [11] obs, [12] act
    assert f.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert f.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 2, 3]  # depth: the retry branch restarts at 2
    assert f.targets.tolist() == [2, 3, 5, 7]
    assert f.sources.tolist() == [1, 2, 4, 6]  # 7 is predicted at 6, 10 at 9, 12 at 11
    allowed = f.attention_bias(torch.float32)[0, 0] == 0
    assert allowed[6].tolist() == [True, True, False, False, False, False, True, False]  # 11 sees 5 6 11
    assert allowed[5].tolist() == [True] * 6 + [False, False]  # 10 sees its whole path
    assert f.naive_tokens == 4 + 6 + 4  # each step's state + action


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_equals_naive(tiny_model_dir: Path, attn: str) -> None:
    model = load(tiny_model_dir, attn)
    episodes = [episode_from_calls(f"s{i}", multi_turn(i, fork=i == 0)) for i in range(2)]
    forest = pack_forest(episodes)
    assert len(forest.targets) == sum(len(c.output) for i in range(2) for c in multi_turn(i, fork=i == 0))
    with torch.no_grad():
        tree = forest_forward(model, forest).logprobs
        naive = naive_logprobs(model, episodes, forest)
    torch.testing.assert_close(tree, naive, atol=1e-5, rtol=0)
    assert forest.num_tokens < forest.naive_tokens


def test_gradients_equal_naive(tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir)
    episodes = [episode_from_calls("s", multi_turn(3, turns=3))]
    forest = pack_forest(episodes)
    grads = []
    for fn in (lambda: forest_forward(model, forest).logprobs, lambda: naive_logprobs(model, episodes, forest)):
        model.zero_grad()
        fn().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


def test_fresh_policy_reproduces_sampled_logprobs(tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    prompt = [11, 12, 13, 14]
    out0, lp0 = sample(model, prompt, 6, temperature=0.7, generator=g)
    prompt1 = prompt + out0 + [15, 16]
    out1, lp1 = sample(model, prompt1, 5, temperature=1.3, generator=g)
    ep = episode_from_calls("s", [FakeCall(prompt, out0, lp0, temperature=0.7),
                                  FakeCall(prompt1, out1, lp1, temperature=1.3)])
    forest = pack_forest([ep])
    with torch.no_grad():
        out = forest_forward(model, forest)
    torch.testing.assert_close(out.logprobs, forest.behaviour_logprobs, atol=1e-4, rtol=0)
    assert out.entropy is not None and bool((out.entropy > 0).all())


def test_fresh_policy_matches_the_builtin_engine_through_the_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Records sampled by the built-in engine (SGLang /generate subset), stored by the SQLite pool (its own
    # radix tree and steps view), re-scored by one tree forward: logprobs equal the engine's to 1e-4.
    import httpx
    import numpy as np

    from stepline.datapool import open_pool
    from stepline.datapool.records import CallRecord, Reward, SessionInfo
    from stepline.engine.testing import running_engine

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.create_session(SessionInfo("s", task_id="t", harness="h"))
    prompt, records = [11, 12, 13, 14, 15], []
    with running_engine(tiny_model_dir) as url:
        for call, temperature in enumerate([0.7, 1.0, 1.3]):
            sampling = {"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True}
            body = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                       "return_logprob": True}, timeout=60).json()
            logprobs = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
            records.append(CallRecord("s", call, np.array(prompt, np.int32), np.array(body["output_ids"], np.int32),
                                      np.array(logprobs, np.float32), 0, sampling=sampling))
            prompt = prompt + body["output_ids"] + [20 + call, 21 + call]  # the harness adds an observation
    pool.add_calls(records)
    pool.add_reward(Reward("s", 1.0))
    pool.end_session("s")
    episode = pool.get_episode("s")
    pool.close()
    forest = pack_forest([episode])
    assert len(forest.targets) == 18 and forest.temperature.unique().tolist() == pytest.approx([0.7, 1.0, 1.3])
    with torch.no_grad():
        out = forest_forward(load(tiny_model_dir), forest)
    torch.testing.assert_close(out.logprobs, forest.behaviour_logprobs, atol=1e-4, rtol=0)


def test_detached_entropy_changes_nothing_but_the_graph(tiny_model_dir: Path) -> None:
    # the update asks for a detached entropy when its bonus is 0: same values, same logprob gradients, no graph
    model = load(tiny_model_dir)
    forest = pack_forest([episode_from_calls("s", multi_turn(5))])
    outs, grads = [], []
    for entropy_grad in (True, False):
        model.zero_grad()
        out = forest_forward(model, forest, entropy_grad=entropy_grad)
        out.logprobs.sum().backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert outs[0].entropy.requires_grad and not outs[1].entropy.requires_grad
    assert torch.equal(outs[0].entropy.detach(), outs[1].entropy) and torch.equal(grads[0], grads[1])


def sessions_of_a_harness() -> list:
    """Three sessions of one task (the same prompt, two of them sampling the same first answer, then apart) and one
    of another task of the same harness (the same system prompt)."""
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(10, 3000, (n,), generator=g).tolist()

    prompt, same, tool = rand(20), rand(6), rand(5)
    sessions = []
    for i, first in enumerate([same, same, rand(6)]):
        second = prompt + first + tool + rand(2)  # each session's own observation after the shared tool text
        calls = [FakeCall(prompt, first, temperature=0.7), FakeCall(second, rand(4))]
        sessions.append(episode_from_calls(f"s{i}", calls, task_id="t", harness="h"))
    other_task = prompt[:12] + rand(8)  # the harness's system prompt, then another task
    sessions.append(episode_from_calls("s3", [FakeCall(other_task, rand(5))], task_id="u", harness="h"))
    return sessions


def test_sessions_of_a_harness_share_their_prefix() -> None:
    # by hand: prompt [1 2 3] is packed once; a's and b's answer [4 5] too; c's answer [4 6] shares its 4;
    # d, another task of the same harness, shares whatever its tokens have in common with them (here all)
    a = episode_from_calls("a", [FakeCall([1, 2, 3], [4, 5])])
    b = episode_from_calls("b", [FakeCall([1, 2, 3], [4, 5])])
    c = episode_from_calls("c", [FakeCall([1, 2, 3], [4, 6])])
    d = episode_from_calls("d", [FakeCall([1, 2, 3], [4, 5])], task_id="u")
    other = episode_from_calls("e", [FakeCall([1, 2, 3], [4, 5])], harness="x")  # another harness: its own row
    f = pack_forest([a, b, c, d, other])
    assert f.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert f.position_ids.tolist() == [0, 1, 2, 3, 4, 4, 0, 1, 2, 3, 4]
    assert f.offsets == [0, 6, 11]
    assert f.targets.tolist() == [3, 4, 3, 4, 3, 5, 3, 4, 9, 10]  # each session's tokens, scored once each
    assert f.sources.tolist() == [2, 3, 2, 3, 2, 3, 2, 3, 8, 9]
    assert f.episode.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    allowed = f.attention_bias(torch.float32, 0, 6)[0, 0] == 0
    assert allowed[5].tolist() == [True, True, True, True, False, True]  # 6 sees 1 2 3 4, not its sibling 5


def test_shared_harness_forward_and_gradients_equal_naive(tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir)
    episodes = sessions_of_a_harness()
    forest = pack_forest(episodes)
    apart = sum(pack_forest([ep]).num_tokens for ep in episodes)
    # the group's prompt once, the common answer and tool text once more, the other task's system prompt once
    assert forest.num_tokens == apart - 2 * 20 - 6 - 5 - 12
    outputs = []
    for fn in (lambda: forest_forward(model, forest).logprobs, lambda: naive_logprobs(model, episodes, forest)):
        model.zero_grad()
        logprobs = fn()
        logprobs.sum().backward()
        outputs.append((logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], atol=1e-4, rtol=1e-4)


def causal_everywhere(forest) -> bool:
    """Every row's tree mask is plain causal attention (the slow obvious twin of `linear_rows`)."""
    rows = zip(forest.offsets[:-1], forest.offsets[1:])
    return all(torch.equal(forest.attention_bias(torch.float32, a, b)[0, 0] == 0, torch.ones(b - a, b - a).tril() == 1)
               for a, b in rows if b > a)


def linear_forest() -> tuple[list, object]:
    """Two linear sessions (each call extends the last) of two harnesses: two rows, 4 and 2 turns long."""
    episodes = [episode_from_calls(f"s{i}", multi_turn(i, turns=turns, fork=False), harness=f"h{i}")
                for i, turns in enumerate((4, 2))]
    return episodes, pack_forest(episodes)


def test_linear_rows_by_hand() -> None:
    # one session whose calls extend each other: [5 6] obs, [7 8] act, [9] obs, [10] act -> positions 0..5, causal
    chain = episode_from_calls("a", [FakeCall([5, 6], [7, 8]), FakeCall([5, 6, 7, 8, 9], [10])])
    assert pack_forest([chain]).linear_rows
    # a retry forks it: [11] restarts at depth 2, so the row is a tree
    retry = episode_from_calls("b", [FakeCall([5, 6], [7, 8]), FakeCall([5, 6, 7, 8, 9], [10]), FakeCall([5, 6, 11], [12])])
    assert not pack_forest([retry]).linear_rows
    # two linear sessions of one harness share [5 6] and part ways: one row, a tree
    other = episode_from_calls("c", [FakeCall([5, 6], [13])])
    assert not pack_forest([chain, other]).linear_rows
    # the same two in two harnesses: two linear rows of different lengths
    assert pack_forest([chain, episode_from_calls("c", [FakeCall([5, 6], [13])], harness="x")]).linear_rows


def test_linear_rows_is_exactly_a_causal_mask() -> None:
    forests = [pack_forest([episode_from_calls(f"s{i}", multi_turn(i, turns=2 + i % 3, fork=i % 3 == 0),
                                               harness=f"h{i % 2}") for i in range(n)]) for n in range(1, 6)]
    forests += [linear_forest()[1], pack_forest(sessions_of_a_harness())]
    decided = [f.linear_rows for f in forests]
    assert decided == [causal_everywhere(f) for f in forests]
    assert True in decided and False in decided  # both kinds were tried


def attention_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Record (mask given, is_causal) of every SDPA call HF's sdpa attention makes."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_linear_rows_run_sdpa_causal_and_trees_keep_the_mask(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(tiny_model_dir)
    calls = attention_calls(monkeypatch)
    with torch.no_grad():
        forest_forward(model, linear_forest()[1])
        assert calls and set(calls) == {(False, True)}  # no 4-D mask: the fused causal kernel
        calls.clear()
        forest_forward(model, pack_forest(sessions_of_a_harness()))
        assert calls and set(calls) == {(True, False)}  # a tree: the dense tree mask
        calls.clear()
        forest_forward(model, linear_forest()[1], tree_mask=True)
        assert calls and set(calls) == {(True, False)}


@pytest.mark.parametrize(("attn", "checkpointing"), [("sdpa", False), ("sdpa", True), ("eager", False)])
def test_causal_path_equals_tree_mask_and_naive(tiny_model_dir: Path, attn: str, checkpointing: bool) -> None:
    # rows of 4 and 2 turns: the short one is right-padded; its padding must change nothing, NaN included
    model = load(tiny_model_dir, attn)
    if checkpointing:  # as build_policy does; checkpointing recomputes only in training mode
        model.train().activation_checkpointing_enable({"use_reentrant": False})
    episodes, forest = linear_forest()
    (a, b), (_, c) = zip(forest.offsets[:-1], forest.offsets[1:])
    assert forest.linear_rows and b - a > c - b > 0  # two rows, the second shorter
    results = []
    for fn in (lambda: forest_forward(model, forest).logprobs,
               lambda: forest_forward(model, forest, tree_mask=True).logprobs,
               lambda: naive_logprobs(model, episodes, forest)):
        model.zero_grad()
        logprobs = fn()
        logprobs.sum().backward()
        results.append((logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert all(bool(lp.isfinite().all() and grad.isfinite().all()) for lp, grad in results)
    for lp, grad in results[1:]:
        torch.testing.assert_close(results[0][0], lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(results[0][1], grad, atol=1e-5, rtol=1e-4)
