"""Episode-level GRPO against step-level methods on the UI harness alone, from one SFT policy (a study, not a test).

    .venv/bin/python benchmarks/ui_study.py --out ../runs/ui-study --updates 10 --seeds 0,1,2

The main job's SFT warm start (examples/quickstart.toml, all three harnesses, seed 0) is built once in OUT/shared and
evaluated once on every UI test task (OUT/shared/eval/before.json). Then every (seed, method) runs the main job's
RL phase on the UI harness alone from that policy, with the same budget (`--updates` updates of the job's groups;
no time bound, so what else runs on the machine changes the wall time, not the budget), and is evaluated on all UI
test tasks after it. Methods: grpo (the quickstart's recipe), gigpo (step groups over identical screens), tree_grpo
(a group of G spent on G/2 trees of a root episode and one fork at a random step boundary). Each run is an ordinary
`stepline run` directory (OUT/<method>-s<seed>: summary.json, rl/metrics.jsonl, progress.png); OUT/study.json
collects test success per run and pooled per method with 95% Wilson intervals. A finished run is not run again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click

from stepline.launch.job import JobConfig, load_job
from stepline.launch.phases import RunDir, build_base_model, evaluate_once, trainer_configs, warm_start
from stepline.launch.run import run_job, services
from stepline.report import eval_paths
from stepline.report import wilson as report_wilson

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("grpo", "gigpo", "tree_grpo")


def ui_only(cfg: JobConfig, method: str) -> dict[str, Any]:
    """Overrides: the UI harness alone (weight 1), the method's advantage (and Tree-GRPO's forked groups)."""
    ui = next(h for h in cfg.rollout.harnesses if h.name == "ui")
    spec = {**ui.model_dump(exclude_none=True), "weight": 1.0}
    if method == "tree_grpo":
        spec["tree_search"] = {"trees": cfg.rollout.group_size // 2, "branches": 1}
    return {"rollout.harnesses": [spec], "trainer.advantage": method, "sft.demos": {}}


def shared_policy(job: Path, out: Path) -> tuple[Path, Path]:
    """The quickstart's base model and SFT warm start (seed 0), built once; returns (base, sft)."""
    cfg = load_job(job, {"run_dir": str(out)})
    run = RunDir(cfg.run_dir)
    for path in (run.root, run.logs, run.root / "eval"):
        path.mkdir(parents=True, exist_ok=True)
    base = build_base_model(cfg, run)
    sft_cfg, _ = trainer_configs(cfg, run, base)
    return base, warm_start(cfg, run, base, sft_cfg)


def wilson(k: int, n: int) -> list[float]:
    """The 95% Wilson interval, rounded for the study's JSON."""
    return [round(x, 3) for x in report_wilson(k, n)]


def ui_counts(report: dict[str, Any]) -> tuple[int, int]:
    episodes = [e for e in report["episodes"] if e.get("harness") == "ui"]
    return sum(bool(e.get("success")) for e in episodes), len(episodes)


@click.command()
@click.option("--job", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=ROOT / "examples" / "quickstart.toml", show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=ROOT.parent / "runs" / "ui-study",
              show_default=True)
@click.option("--updates", type=click.IntRange(1), default=10, show_default=True, help="RL updates of every run")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--methods", default=",".join(METHODS), show_default=True)
def main(job: Path, out: Path, updates: int, seeds: str, methods: str) -> None:
    out = out.resolve()
    names = [m for m in methods.split(",") if m]
    if unknown := sorted(set(names) - set(METHODS)):
        raise click.UsageError(f"unknown methods {unknown}; choose from {METHODS}")
    shared = out / "shared"
    base, sft = shared_policy(job, shared)
    common = {"rl_updates": updates, "job_minutes": None, "rl_minutes": None, "eval.limit": None}
    before = RunDir(shared).eval_file("before")
    if not before.is_file():
        cfg = load_job(job, {**common, "run_dir": str(shared), **ui_only(load_job(job), "grpo")})
        with services(cfg, RunDir(shared), sft, token := "study-token") as url:
            evaluate_once(cfg, RunDir(shared), url, token, "before")
    rows = []
    for seed in [int(s) for s in seeds.split(",") if s]:
        for method in names:
            root = out / f"{method}-s{seed}"
            cfg = load_job(job, {**common, "run_dir": str(root), "seed": seed, **ui_only(load_job(job), method)})
            run = RunDir(root)
            (root / "eval").mkdir(parents=True, exist_ok=True)
            for link, target in ((run.base_model, base), (run.sft_model, sft)):
                if not link.exists():
                    link.symlink_to(target)
            if not run.eval_file("before").is_file():
                shutil.copy(before, run.eval_file("before"))
            if not (root / "summary.json").is_file():
                click.echo(f"{method} seed {seed}: {updates} updates of UI RL from {sft}")
                run_job(cfg)
            summary = json.loads((root / "summary.json").read_text())
            after = eval_paths(root)[-1]
            k, n = ui_counts(json.loads(after.read_text()))
            rows.append({"method": method, "seed": seed, "success": k, "tasks": n, "rate": round(k / n, 3),
                         "ci95": wilson(k, n), "rl_updates": summary["rl_updates"],
                         "rl_episodes": summary["rl_episodes"], "phases_s": summary["phases_s"]})
            click.echo(f"{method} seed {seed}: UI test {k}/{n} = {k / n:.3f} {wilson(k, n)}")
    k0, n0 = ui_counts(json.loads(before.read_text()))
    pooled = {}
    for method in names:
        mine = [r for r in rows if r["method"] == method]
        k, n = sum(r["success"] for r in mine), sum(r["tasks"] for r in mine)
        pooled[method] = {"success": k, "tasks": n, "rate": round(k / n, 3) if n else None, "ci95": wilson(k, n)}
    result = {"updates": updates, "sft": {"success": k0, "tasks": n0, "rate": round(k0 / n0, 3), "ci95": wilson(k0, n0)},
              "runs": rows, "pooled": pooled}
    (out / "study.json").write_text(json.dumps(result, indent=1))
    click.echo(json.dumps({"sft": result["sft"], "pooled": pooled}, indent=1))


if __name__ == "__main__":
    main()
