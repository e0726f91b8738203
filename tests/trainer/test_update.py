"""The update: gradient accumulation is exact, groups are flattened as documented, bad groups are skipped,
and each optional term (critic, KL, entropy, decoupled objective, SFT) does what it says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import FakeCall, episode_from_calls

from stepline.datapool.records import EpisodeData, Group
from stepline.trainer.batch import build_batch, token_view
from stepline.trainer.config import TrainerConfig
from stepline.trainer.loop import build_policy, objective
from stepline.trainer.update import Objective, micro_batches, update

torch.set_num_threads(1)


def toy_groups(n_groups: int = 2, per_group: int = 4, seed: int = 0, outcome: float | None = None) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(n_groups):
        prompt = torch.randint(10, 3000, (8,), generator=g).tolist()
        eps = []
        for i in range(per_group):
            out = torch.randint(10, 3000, (5,), generator=g).tolist()
            out2 = torch.randint(10, 3000, (4,), generator=g).tolist()
            calls = [FakeCall(prompt, out, [-8.0] * 5), FakeCall(prompt + out + [7, 8], out2, [-8.0] * 4)]
            eps.append(episode_from_calls(f"g{k}s{i}", calls, outcome=float(i % 2 + k) if outcome is None else outcome,
                                            task_id=f"t{k}"))
        groups.append(Group(f"g{k}", f"t{k}::h", eps, 0))
    return groups


def policy_for(model_dir: Path, tmp_path: Path, **kw):
    kw = {"lr": 1e-3, **kw}
    cfg = TrainerConfig(model_dir=model_dir, output_dir=tmp_path, progress=False, tensorboard=False, **kw)
    return cfg, build_policy(cfg)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_micro_batches_accumulate_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    # one optimizer step over 8 sessions: 8 micro-batches of 1 == 2 of 4 == 1 of 8. Plain SGD with
    # lr 1 makes the step equal to the (clipped) accumulated gradient; Adam's first step, ±lr·sign(g), would
    # turn float noise in near-zero gradients into full-size differences.
    # A token bound cuts the same way (8 tokens: every session alone), and gradient checkpointing recomputes the
    # activations without changing the gradient.
    steps = []
    for fields in ({"micro_batch_episodes": 1}, {"micro_batch_episodes": 4}, {"micro_batch_episodes": 8},
                   {"micro_batch_episodes": 8, "micro_batch_tokens": 8},
                   {"micro_batch_episodes": 4, "gradient_checkpointing": True}):
        cfg, policy = policy_for(tiny_model_dir, tmp_path, **fields)
        before = flat(policy.model)
        policy.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda _: 1.0)
        update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
        steps.append(flat(policy.model) - before)
    assert steps[0].abs().max() > 1e-4  # the step did move the weights
    for other in steps[1:]:
        torch.testing.assert_close(steps[0], other, atol=1e-6, rtol=0)


def test_micro_batches_respect_both_bounds() -> None:
    items, sizes = [10, 11, 12, 13, 14], [3, 3, 9, 2, 2]
    assert micro_batches(items, sizes, 8, None) == [[10, 11, 12, 13, 14]]
    assert micro_batches(items, sizes, 2, None) == [[10, 11], [12, 13], [14]]
    assert micro_batches(items, sizes, 8, 6) == [[10, 11], [12], [13, 14]]  # 9 > 6 goes alone
    assert micro_batches(items, sizes, 1, 100) == [[10], [11], [12], [13], [14]]


def test_minibatches_and_epochs_count_optimizer_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, groups_per_update=2, minibatches=2, epochs=3)
    update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
    assert policy.scheduler.last_epoch == 6  # 2 minibatches (one group each) × 3 epochs


def test_batch_rows_by_hand() -> None:
    # call 0 then call 1 continuing it, and a retry of call 1 (call 2): two trajectories share call 0
    ep = episode_from_calls("s", [FakeCall([1, 2], [3, 4]), FakeCall([1, 2, 3, 4, 5], [6]),
                                  FakeCall([1, 2, 3, 4, 9], [10, 11])])
    batch = build_batch([Group("g", "t::h", [ep], 0)])
    # rows (trajectory, call): main trajectory first (the last leaf): (0, call 0), (0, call 2), then (1, 0), (1, 1)
    assert batch.step_traj.tolist() == [0, 0, 1, 1]
    assert batch.step_call.tolist() == [0, 2, 0, 1]
    assert batch.step_position.tolist() == [0, 1, 0, 1]
    assert batch.owner_rows().tolist() == [0, 1, 0, 3]  # call 0's tokens belong to the main trajectory's row
    view = token_view(batch, [0])
    # packed: [1 2] obs, [3 4] act (call 0), [5] obs, [6] act (call 1), [9] obs, [10 11] act (call 2)
    assert view.step_ids.tolist() == [0, 0, 3, 1, 1]  # each sampled token once
    assert view.traj_ids.tolist() == [0, 0, 1, 0, 0]


def test_non_finite_groups_are_skipped_and_counted() -> None:
    good, nan_lp, inf_reward, flat_reward = toy_groups(4)
    nan_lp.episodes[0].tree.nodes[1].logprobs[0] = np.nan
    inf_reward.episodes[2].rewards[0].value = math.inf
    for ep in flat_reward.episodes:
        ep.rewards[0].value = 1.0
    huge = toy_groups(5)[4]
    huge.episodes[1].rewards[0].value, huge.episodes[1].rewards[0].weight = 1e300, 1e10  # a stored product of inf
    batch = build_batch([good, nan_lp, inf_reward, flat_reward, huge],
                        keep_group=lambda g: "no_variance" if g is flat_reward else None)
    assert batch.skipped == {"non_finite": 3, "no_variance": 1}
    assert [ep.info.session_id for ep in batch.episodes] == [f"g0s{i}" for i in range(4)]
    assert batch.group_ids == ["g0", "g1", "g2", "g3", "g4"]  # all of them are consumed


def test_a_non_finite_gradient_leaves_the_weights_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path)
    before = flat(policy.model).clone()
    batch = build_batch(toy_groups())
    with torch.no_grad():  # a poisoned activation: every loss and gradient of the update becomes NaN
        policy.model.get_input_embeddings().weight[:, 0] = math.nan
    poisoned = flat(policy.model).clone()
    m = update(policy, batch, objective(cfg, 0, False), version=0)
    assert m["non_finite_steps"] == 1 and "grad_norm" not in m
    assert torch.equal(flat(policy.model).nan_to_num(), poisoned.nan_to_num())  # no optimizer step was taken
    assert not torch.equal(before.nan_to_num(), poisoned.nan_to_num())


def test_weights_holding_nan_are_never_saved(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.trainer.weight_sync import save_weights, saved_weights

    _, policy = policy_for(tiny_model_dir, tmp_path)
    save_weights(policy.model, tmp_path / "w", 1, tiny_model_dir)
    with torch.no_grad():
        policy.model.get_input_embeddings().weight[0, 0] = math.inf
    with pytest.raises(ValueError, match="NaN/inf"):
        save_weights(policy.model, tmp_path / "w", 2, tiny_model_dir)
    assert [p.name for p in saved_weights(tmp_path / "w")] == ["v000001"]


def test_first_update_terms_on_a_fresh_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    # critic + GAE, KL to the reference, entropy bonus, decoupled objective with truncated IS. Seeded: the value
    # head's random init decides the GAE advantages, and with all of them > 0 no ratio of epoch 2 falls below 1
    torch.manual_seed(0)
    cfg, policy = policy_for(tiny_model_dir, tmp_path, critic=True, advantage="gae", kl_coef=0.1, entropy_coef=0.01,
                             old_logprobs="recompute", epochs=2)
    m = update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
    # epoch 1 runs before any step: policy == reference == proximal, so its KL is 0 and its ratios 1;
    # epoch 2 sees the moved policy
    assert m["kl_ref_min"] == pytest.approx(0, abs=1e-6) and m["kl_ref_max"] > 1e-4
    assert m["ratio_min"] < 1 < m["ratio_max"]
    assert m["value_loss"] > 0 and math.isfinite(m["policy_loss"]) and m["entropy_mean"] > 0
    cfg1, fresh = policy_for(tiny_model_dir, tmp_path, critic=True, advantage="gae", kl_coef=0.1,
                             old_logprobs="recompute", epochs=1)
    m1 = update(fresh, build_batch(toy_groups()), objective(cfg1, 0, False), version=0)
    assert m1["kl_ref_max"] == pytest.approx(0, abs=1e-6)
    assert m1["ratio_min"] == pytest.approx(1, abs=1e-6) and m1["ratio_max"] == pytest.approx(1, abs=1e-6)


def test_critic_warmup_leaves_the_policy_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, critic=True, advantage="gae", critic_warmup_updates=1)
    before = flat(policy.model)
    head_before = torch.cat([p.detach().flatten().clone() for p in policy.value_head.parameters()])
    update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=0)
    assert torch.equal(flat(policy.model), before)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in policy.value_head.parameters()]), head_before)
    assert not objective(cfg, 1, False).critic_only


def test_stale_tokens_are_masked(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, max_staleness=0)
    before = flat(policy.model)
    m = update(policy, build_batch(toy_groups()), objective(cfg, 0, False), version=3)  # data is version 0
    assert "ratio_mean" not in m and m["staleness_max"] == 3  # no token passed the bound
    assert torch.equal(flat(policy.model), before)


def test_sft_raises_the_likelihood_of_chosen_episodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, mode="sft", lr=1e-2)
    batch = build_batch(toy_groups(1), keep_episode=lambda ep: ep.outcome >= 1.0)
    assert len(batch.episodes) == 2  # outcomes 0, 1, 0, 1
    logprob = [update(policy, batch, objective(cfg, i, False), version=0)["logprob_mean"] for i in range(5)]
    assert logprob[-1] > logprob[0] + 0.5, logprob


@pytest.mark.parametrize("ratio", ["token", "step", "sequence"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "step-mean", "episode-mean"])
def test_every_ratio_and_aggregation_runs(tiny_model_dir: Path, tmp_path: Path, ratio: str, aggregation: str) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, ratio=ratio, loss_aggregation=aggregation, dual_clip=3.0)
    m = update(policy, build_batch(toy_groups(1)), objective(cfg, 0, False), version=0)
    assert math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0


def test_objective_defaults_match_the_config() -> None:
    # the update's plain values have the same defaults as the job file's
    fields = TrainerConfig.model_fields
    for name, value in Objective().__dict__.items():
        key = {"aggregation": "loss_aggregation"}.get(name, name)
        if key in fields and not name.endswith("_args"):
            assert fields[key].default == value, name


def test_eval_and_flat_groups_are_filtered(tiny_model_dir: Path) -> None:
    from stepline.trainer.loop import group_filter

    varied, flat_group, evaluation = toy_groups(3)
    for ep in flat_group.episodes:
        ep.rewards[0].value = 0.5
    evaluation.episodes[0].info.purpose = "eval"
    keep = group_filter(TrainerConfig(model_dir=tiny_model_dir))
    assert [keep(g) for g in (varied, flat_group, evaluation)] == [None, "no_variance", "eval"]
    sft = group_filter(TrainerConfig(model_dir=tiny_model_dir, mode="sft"))
    assert [sft(g) for g in (varied, flat_group, evaluation)] == [None, None, "eval"]


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo", "gmpo"])
@pytest.mark.parametrize("is_correction", ["tis", "icepop", "mis"])
def test_every_policy_loss_and_is_correction_runs(tiny_model_dir: Path, tmp_path: Path, policy_loss: str,
                                                   is_correction: str) -> None:
    # with SAPO's term on: after the first epoch's step some positive-advantage tokens have r < τ = 1
    cfg, policy = policy_for(tiny_model_dir, tmp_path, policy_loss=policy_loss, is_correction=is_correction,
                             old_logprobs="recompute", tis_cap=5.0, sapo_coef=0.1, epochs=2,
                             loss_aggregation="seq-mean-token-sum-norm", loss_token_norm=9)
    m = update(policy, build_batch(toy_groups(1)), objective(cfg, 0, False), version=0)
    assert math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0
    assert 0 < m["sapo_active_frac_mean"] < 1
    assert 0 <= m["is_weight_min"] <= m["is_weight_max"] <= 5.0


def test_anchor_states_come_from_the_observation_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    # toy episodes: step 0 observes its group's prompt, step 1 observes [7, 8] (added after the action)
    batch = build_batch(toy_groups(2))
    first = batch.step_state[batch.step_position == 0].view(2, 4)  # rows: groups; one id per group's prompt
    assert (first == first[:, :1]).all() and first[0, 0] != first[1, 0]
    second = batch.step_state[batch.step_position == 1]
    assert (second == second[0]).all() and second[0] not in first
    assert batch.anchor_shared() == 1.0  # every second step saw [7, 8], as did its group's other episodes
    batch.step_state[(batch.step_position == 1).nonzero().flatten()[:2]] = torch.tensor([100, 101])
    assert batch.anchor_shared() == 6 / 8  # two second steps of group 0 now saw screens no other episode saw
    batch.step_state[batch.step_position == 1] = second
    cfg, policy = policy_for(tiny_model_dir, tmp_path, advantage="gigpo", advantage_args={"gamma": 0.9})
    m = update(policy, batch, objective(cfg, 0, False), version=0)
    assert math.isfinite(m["policy_loss"]) and m["adv_max"] > 0


@pytest.mark.parametrize("fields", [
    {"ratio": "turn"},
    {"ratio": "prefix", "clip_rule": "gapo", "clip_rule_args": {"clip_max": 0.5}},
    {"ratio": "step", "clip_rule": "ripo", "clip_rule_args": {"delta": 0.05}},
    {"ratio": "prefix", "clip_rule": "kl"},
    {"ratio": "token", "policy_loss": "cispo", "clip_rule": "stale", "old_logprobs": "recompute"},
    {"ratio": "token", "policy_loss": "dppo", "policy_loss_args": {"delta": 0.05}},
    {"ratio": "token", "policy_loss": "drpo"},
    {"ratio": "token", "policy_loss": "cppo", "policy_loss_args": {"min_weight": 0.5}},
])
def test_every_trust_region_runs(tiny_model_dir: Path, tmp_path: Path, fields: dict) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, epochs=2, **fields)
    m = update(policy, build_batch(toy_groups(1)), objective(cfg, 0, False), version=0)
    assert math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0
    if fields.get("clip_rule") in ("gapo", "ripo", "stale"):  # per-token bounds were used and logged
        assert m["clip_high_eps_min"] >= 0 and math.isfinite(m["clip_high_eps_max"])


def test_capo_trains_the_critic_on_td_targets(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg, policy = policy_for(tiny_model_dir, tmp_path, advantage="capo", critic=True)
    m = update(policy, build_batch(toy_groups(1)), objective(cfg, 0, False), version=0)
    assert math.isfinite(m["value_loss"]) and m["value_loss"] > 0 and math.isfinite(m["adv_max"])


def test_igpo_reads_the_gold_answer_from_session_metadata(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.trainer.information_gain import reference_ids

    groups = toy_groups(1)
    for ep in groups[0].episodes:
        ep.info.metadata["reference"] = "Paris"
    cfg, policy = policy_for(tiny_model_dir, tmp_path, advantage="igpo", reference_template="<answer>{reference}")
    batch = build_batch(groups, reference_ids=reference_ids(tiny_model_dir, cfg.reference_template))
    assert all(ref is not None and len(ref) > 1 for ref in batch.references)
    m = update(policy, batch, objective(cfg, 0, False), version=0)
    assert 0 < m["gold_prob"] < 1 and math.isfinite(m["policy_loss"]) and m["adv_max"] > 0
    groups[0].episodes[1].info.metadata.pop("reference")
    batch = build_batch(groups, reference_ids=reference_ids(tiny_model_dir))
    with pytest.raises(ValueError, match="g0s1"):
        update(policy, batch, objective(cfg, 0, False), version=0)


@pytest.mark.parametrize("count_abandoned", [True, False])
def test_count_abandoned_decides_whether_an_abandoned_episode_trains(tiny_model_dir: Path, count_abandoned: bool) -> None:
    from stepline.trainer.loop import episode_filter

    (group,) = toy_groups(1)  # 4 episodes, each with a terminal reward
    group.episodes[1].info.status = "abandoned"  # ended by the gateway's idle reaper
    cfg = TrainerConfig(model_dir=tiny_model_dir, count_abandoned=count_abandoned)
    batch = build_batch([group], keep_episode=episode_filter(cfg))
    assert batch.outcome.numel() == (4 if count_abandoned else 3)  # left out of the baseline too


def as_fork(ep: EpisodeData, source: str, call: int, shift: int) -> EpisodeData:
    """The episode as a fork of `source` at `call` whose own calls are numbered from `shift` (as the gateway
    numbers a fork's calls after its replayed ones)."""
    ep.info.metadata["fork_of"] = {"session": source, "call": call}
    ep.tree.calls = {c + shift: v for c, v in ep.tree.calls.items()}
    for node in ep.tree.nodes:
        node.call_index += shift
    for traj in ep.trajectories:
        for step in traj.steps:
            step.call_index += shift
    return ep


def test_fork_links_reach_tree_grpo(tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = toy_groups(2)
    eps = groups[0].episodes
    as_fork(eps[1], "g0s0", 1, shift=1)  # calls 1, 2: branched where asked
    as_fork(eps[2], "g0s1", 2, shift=1)  # a fork of the fork whose own calls start at 1: branched at 1
    as_fork(eps[3], "elsewhere", 1, shift=1)  # its source is not in the batch: a root
    as_fork(groups[1].episodes[0], "g0s0", 1, shift=1)  # another group's session is no parent
    batch = build_batch(groups)
    assert batch.episode_parent.tolist() == [-1, 0, 1, -1, -1, -1, -1, -1]
    assert batch.episode_branch.tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert batch.step_call[batch.step_episode == 1].tolist() == [1, 2]
    cfg, policy = policy_for(tiny_model_dir, tmp_path, advantage="tree_grpo")
    m = update(policy, batch, objective(cfg, 0, False), version=0)
    assert math.isfinite(m["policy_loss"]) and m["adv_max"] > 0


def test_self_imitation_trains_groups_that_all_succeeded(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.trainer.loop import group_filter

    (solved,) = toy_groups(1)
    for ep in solved.episodes:
        ep.rewards[0].value = 1.0
    assert group_filter(TrainerConfig(model_dir=tiny_model_dir))(solved) == "no_variance"
    cfg, policy = policy_for(tiny_model_dir, tmp_path, imitation_coef=0.5, lr=1e-2)
    assert group_filter(cfg)(solved) is None
    failed = toy_groups(1)[0]
    for ep in failed.episodes:
        ep.rewards[0].value = 0.0
    assert group_filter(cfg)(failed) == "no_variance"  # nothing to imitate
    batch = build_batch([solved])
    logprob = [update(policy, batch, objective(cfg, i, False), version=0)["logprob_mean"] for i in range(4)]
    assert logprob[-1] > logprob[0] + 0.2, logprob  # the solved episodes' own tokens became more likely


def test_negative_reinforcement_trains_groups_that_all_failed(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.trainer.loop import group_filter

    (failed,) = toy_groups(1)
    for ep in failed.episodes:
        ep.rewards[0].value = 0.25  # partial credit, the same for all: no variance, none reached the bar of 1
    cfg, policy = policy_for(tiny_model_dir, tmp_path, failure_coef=0.5, lr=1e-2)
    assert group_filter(TrainerConfig(model_dir=tiny_model_dir))(failed) == "no_variance"
    assert group_filter(cfg)(failed) is None
    solved = toy_groups(1)[0]
    for ep in solved.episodes:
        ep.rewards[0].value = 1.0
    assert group_filter(cfg)(solved) == "no_variance"  # nothing failed, and self-imitation is off
    batch = build_batch([failed])
    metrics = [update(policy, batch, objective(cfg, i, False), version=0) for i in range(4)]
    assert metrics[0]["adv_max"] == metrics[0]["adv_min"] == -0.5
    logprob = [m["logprob_mean"] for m in metrics]
    assert logprob[-1] < logprob[0] - 0.2, logprob  # the failed episodes' own tokens became less likely


def test_negative_scale_applies_to_the_harness_it_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    (group,) = toy_groups(1)  # outcomes 0, 1, 0, 1 of harness "h": GRPO advantages ±0.87
    extremes = {}
    for scale in (1.0, {"h": 0.0}, {"other": 0.0}, 0.25):
        cfg, policy = policy_for(tiny_model_dir, tmp_path, negative_scale=scale)
        metrics = update(policy, build_batch([group]), objective(cfg, 0, False), version=0)
        extremes[str(scale)] = (round(metrics["adv_min"], 3), round(metrics["adv_max"], 3))
    assert extremes["1.0"] == extremes["{'other': 0.0}"] == (-0.866, 0.866)
    assert extremes["{'h': 0.0}"] == (0.0, 0.866)  # positive-sample reinforcement on the named harness
    assert extremes["0.25"] == (-0.217, 0.866)


def own_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_an_experts_tokens_train_as_the_policys_own_samples(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Off-policy guidance: no policy sampled an expert session's tokens (recorded logprobs 0), so the trainer takes
    its own logprobs for them: the step is exactly the one of the same episode sampled by the policy itself
    (recorded logprobs = the policy's), and not the one the recorded zeros would give."""
    steps = []
    for variant in ("expert", "on-policy", "zeros as recorded"):
        cfg, policy = policy_for(tiny_model_dir, tmp_path)
        policy.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda _: 1.0)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(10, 3000, (8,), generator=g).tolist()
        episodes = []
        for i in range(4):  # episode 0 succeeds: the expert's in the first variant
            out = torch.randint(10, 3000, (5,), generator=g).tolist()
            own = variant == "on-policy" or (variant == "expert" and i > 0)
            lps = own_logprobs(policy.model, prompt, out) if own else [0.0] * 5
            episodes.append(episode_from_calls(f"s{i}", [FakeCall(prompt, out, lps)], outcome=float(i == 0)))
        if variant == "expert":  # an expert's: a relabelled episode of the policy's own is counted as one too
            episodes[0].info.metadata.update(expert=True, hindsight=True)
        before = flat(policy.model)
        m = update(policy, build_batch([Group("g", "t::h", episodes, 0)]), objective(cfg, 0, False), version=0)
        steps.append(flat(policy.model) - before)
        if variant == "expert":  # the training reward is the policy's own; the expert's episode is counted apart
            assert (m["expert_episodes"], m["hindsight_episodes"], m["reward_mean"]) == (1, 1, 0.0)
        if variant != "zeros as recorded":
            assert m["ratio_min"] == pytest.approx(1, abs=1e-5) and m["ratio_max"] == pytest.approx(1, abs=1e-5)
    torch.testing.assert_close(steps[0], steps[1], atol=1e-6, rtol=0)
    assert (steps[0] - steps[2]).abs().max() > 1e-4


def test_an_expert_under_sft_anchor_trains_by_cross_entropy_outside_the_groups_baseline(tiny_model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """expert_sft_coef = c: a group of an expert (reward 1) and three policy episodes (1, 0, 0) takes, in one plain
    SGD step over its 4 episodes, (c × the SFT step on the expert alone + 3 × the RL step on the three policy episodes
    alone) / 4: the expert's tokens get c × their cross-entropy, and the policy's advantages are those of its own
    three (GRPO: +1.155, -0.577, -0.577), not lowered by the expert's success."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(10, 3000, (8,), generator=g).tolist()
    outs = [torch.randint(10, 3000, (5,), generator=g).tolist() for _ in range(4)]
    c = 0.5

    def step(indices: list[int], **kw) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, policy = policy_for(tiny_model_dir, tmp_path, max_grad_norm=1e6, **kw)
        policy.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda _: 1.0)
        episodes = []
        for i in indices:  # episode 0 is the expert's
            lps = [0.0] * 5 if i == 0 else own_logprobs(policy.model, prompt, outs[i])
            episodes.append(episode_from_calls(f"s{i}", [FakeCall(prompt, outs[i], lps)], outcome=float(i <= 1)))
            episodes[-1].info.metadata["expert"] = i == 0
        before = flat(policy.model)
        m = update(policy, build_batch([Group("g", "t::h", episodes, 0)]),
                   objective(cfg, 0, False), version=0)
        return flat(policy.model) - before, m

    anchored, m = step([0, 1, 2, 3], expert_sft_coef=c)
    sft, _ = step([0], mode="sft")
    rl, rl_metrics = step([1, 2, 3])
    torch.testing.assert_close(anchored, (c * sft + 3 * rl) / 4, atol=1e-6, rtol=1e-4)
    assert rl_metrics["adv_max"] == pytest.approx(2 / 3 / math.sqrt(1 / 3), abs=1e-4)
    assert m["adv_max"] == pytest.approx(rl_metrics["adv_max"], abs=1e-4) and m["expert_nll_max"] > 0


def test_the_entropy_term_raises_or_lowers_the_entropy_by_its_sign(tiny_model_dir: Path, tmp_path: Path) -> None:
    # groups whose episodes all score alike: the advantages are 0, so the entropy term alone moves the policy;
    # a bonus (> 0) spreads the sampled distribution, entropy minimisation (< 0) sharpens it towards its mode
    groups = toy_groups(outcome=1.0)
    entropies = {}
    for coef in (0.5, -0.5):
        cfg, policy = policy_for(tiny_model_dir, tmp_path, entropy_coef=coef, dynamic_sampling=False, lr=3e-3)
        metrics = [update(policy, build_batch(groups), objective(cfg, 0, False), version=0) for _ in range(4)]
        assert all(m["adv_min"] == m["adv_max"] == 0 for m in metrics)
        entropies[coef] = [m["entropy_mean"] for m in metrics]
    assert entropies[0.5][0] == pytest.approx(entropies[-0.5][0])  # the same policy before the first step
    assert entropies[0.5][-1] > entropies[0.5][0] and entropies[-0.5][-1] < entropies[-0.5][0]
