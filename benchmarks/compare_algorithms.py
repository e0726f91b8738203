"""GRPO, GiGPO, Tree-GRPO and SAPO side by side on the main job's RL phase (a comparison, not a timed test).

    .venv/bin/python benchmarks/compare_algorithms.py                          # the main job (SmolLM2-135M)
    .venv/bin/python benchmarks/compare_algorithms.py --model tiny --updates 2 --out runs/compare-tiny

The base model and the SFT warm start are built once (OUT/shared, as `stepline run` builds them); then each
algorithm runs the job's RL phase (engine, gateway, rollouts, trainer; no evaluation) from that same checkpoint,
in its own run directory (OUT/<algorithm>), with the same seed and the same budget: `--updates` updates of the
job's groups per update, each group the same number of episodes (the job's RL time bound does not apply; `--minutes`
sets one for every algorithm). A directory OUT/shared that already holds a run's model-base, sft and model-sft
(a finished `stepline run` of the same job and seed) is reused as it is. Tree-GRPO spends its group on trees: G/2 root
episodes, each forked once at a random step boundary (the fork replays the steps before it, stepline/gateway/forks.py).

Writes OUT/compare.png (training reward per rollout batch: the mean reward of every training episode, kept or
skipped by dynamic sampling, as the main job's progress.png draws it) and OUT/compare.json (those curves and the
trainer's reward_mean per update). `--model tiny` swaps in a tiny random-weight model and a tiny budget, to check
that the comparison runs end to end; its curves say nothing about the algorithms.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import click

from stepline.launch.job import JobConfig, load_job
from stepline.launch.phases import RunDir, build_base_model, trainer_configs, warm_start
from stepline.launch.run import services, train_rl
from stepline.report import batch_rewards

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "gigpo", "tree_grpo", "sapo")
# a tiny random-weight model and the smallest budget that still trains every algorithm (tests/e2e/test_main_job.py)
TINY = {
    "model.kind": "tiny", "model.hidden_size": 32, "model.num_layers": 1,
    "sft.demos_per_harness": 2, "sft.trainer": {"epochs": 2, "groups_per_update": 6, "lr": 3e-3, "tensorboard": False},
    "trainer.groups_per_update": 2, "trainer.minibatches": 1, "trainer.micro_batch_episodes": 4,
    "trainer.train_layers": None, "trainer.dynamic_sampling": False, "rollout.group_size": 4,
    "rollout.max_concurrency": 4, "eval.limit": 1,
}


def variant(name: str, cfg: JobConfig, sapo_coef: float, sapo_tau: float) -> dict[str, Any]:
    """The job overrides that make the RL phase run `name`; everything else stays the job's."""
    if name == "sapo":
        return {"trainer.advantage": "grpo", "trainer.sapo_coef": sapo_coef, "trainer.sapo_tau": sapo_tau}
    if name != "tree_grpo":
        return {"trainer.advantage": name}
    size = cfg.rollout.group_size
    if size % 2:
        raise click.UsageError(f"tree_grpo spends a group of G on G/2 trees of two episodes: G = {size} is odd")
    harnesses = [{**h.model_dump(exclude_none=True), "tree_search": {"trees": size // 2, "branches": 1}}
                 for h in cfg.rollout.harnesses]
    return {"trainer.advantage": "tree_grpo", "rollout.harnesses": harnesses}


def shared_policy(job: Path, overrides: dict[str, Any]) -> Path:
    """The base model and the SFT warm start, built once for every algorithm."""
    cfg = load_job(job, overrides)
    run = RunDir(cfg.run_dir)
    for path in (run.root, run.logs):
        path.mkdir(parents=True, exist_ok=True)
    base = build_base_model(cfg, run)
    sft_cfg, _ = trainer_configs(cfg, run, base)
    return warm_start(cfg, run, base, sft_cfg)


def rl_phase(cfg: JobConfig, policy: Path) -> list[float]:
    """The job's RL phase from `policy`; returns the training reward per rollout batch."""
    run = RunDir(cfg.run_dir)
    for path in (run.root, run.logs):
        path.mkdir(parents=True, exist_ok=True)
    if not (run.rl / "rollouts.json").is_file():
        _, rl_cfg = trainer_configs(cfg, run, policy)
        token = secrets.token_urlsafe(16)
        with services(cfg, run, policy, token) as url:
            train_rl(cfg, run, rl_cfg.model_copy(update={"model_dir": policy, "gateway_url": url, "admin_token": token}))
    return batch_rewards(json.loads((run.rl / "rollouts.json").read_text()))


def update_rewards(run_dir: Path) -> list[float]:
    path = run_dir / "rl" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [row.get("reward_mean", float("nan")) for row in rows]


def plot(curves: dict[str, list[float]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for name, series in curves.items():
        ax.plot(range(1, len(series) + 1), series, marker="o", label=name)
    ax.set(title=title, xlabel="rollout batch (an update takes one or more)", ylabel="mean training reward (all episodes)",
           ylim=(-0.05, 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@click.command()
@click.option("--job", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=ROOT / "examples" / "quickstart.toml", show_default=True, help="the main job's file")
@click.option("--model", type=click.Choice(["job", "tiny"]), default="job", show_default=True,
              help="job: the job's own model; tiny: a tiny random-weight model and budget (a smoke run)")
@click.option("--updates", type=click.IntRange(1), default=None, help="RL updates per algorithm (default: the job's)")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="time bound of each RL phase (default: none, the budget is the updates)")
@click.option("--algorithms", default=",".join(ALGORITHMS), show_default=True, help="comma-separated subset")
@click.option("--sapo-coef", type=float, default=0.1, show_default=True, help="SAPO's weight γ")
@click.option("--sapo-tau", type=float, default=0.9, show_default=True, help="SAPO's ratio threshold τ")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=ROOT.parent / "runs" / "compare",
              show_default=True)
def main(job: Path, model: str, updates: int | None, minutes: float | None, algorithms: str, sapo_coef: float,
         sapo_tau: float, out: Path) -> None:
    names = [a.strip() for a in algorithms.split(",") if a.strip()]
    if unknown := sorted(set(names) - set(ALGORITHMS)):
        raise click.UsageError(f"unknown algorithms {unknown}; choose from {ALGORITHMS}")
    out = out.resolve()
    common: dict[str, Any] = {**(TINY if model == "tiny" else {}), "rl_minutes": minutes}
    if updates is not None:
        common["rl_updates"] = updates
    started = time.monotonic()
    policy = shared_policy(job, {**common, "run_dir": str(out / "shared")})
    base_cfg = load_job(job, common)
    curves, per_update = {}, {}
    for name in names:
        cfg = load_job(job, {**common, "run_dir": str(out / name), **variant(name, base_cfg, sapo_coef, sapo_tau)})
        click.echo(f"{name}: RL phase, {cfg.rl_updates} updates from {policy}")
        curves[name] = rl_phase(cfg, policy)
        per_update[name] = update_rewards(cfg.run_dir)
        click.echo(f"{name}: training reward per batch {[round(r, 3) for r in curves[name]]}")
    label = "tiny random-weight model (hidden 32, 1 layer)" if model == "tiny" else base_cfg.model.kind
    title = f"{label}: {base_cfg.rl_updates} updates, seed {base_cfg.seed}, groups of {base_cfg.rollout.group_size}"
    plot(curves, title, out / "compare.png")
    (out / "compare.json").write_text(json.dumps({
        "model": label, "job": str(job), "seed": base_cfg.seed, "updates": base_cfg.rl_updates,
        "group_size": base_cfg.rollout.group_size, "groups_per_update": base_cfg.trainer.get("groups_per_update"),
        "sapo": {"coef": sapo_coef, "tau": sapo_tau}, "train_reward_per_batch": curves,
        "trainer_reward_mean_per_update": per_update, "seconds": round(time.monotonic() - started, 1),
    }, indent=1))
    click.echo(f"wrote {out / 'compare.png'} and {out / 'compare.json'}")


if __name__ == "__main__":
    main()
