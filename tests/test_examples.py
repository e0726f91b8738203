"""Every example job file loads and validates: a broken example is a broken README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stepline.launch.job import JobError, load_job

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.toml"))


def test_the_examples_are_found() -> None:
    assert [p.name for p in EXAMPLES] == ["bfcl.toml", "own_agent.toml", "quickstart.toml", "ray-cluster.toml", "ui.toml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_job_validates(path: Path) -> None:
    cfg = load_job(path)
    assert cfg.rollout.harnesses
    assert cfg.run_dir.is_absolute()


def test_the_cluster_example_is_the_guides_job() -> None:
    """deploy/README.md's cluster job is this file, as the guide shows it."""
    root = Path(__file__).resolve().parents[1]
    cfg = load_job(root / "examples" / "ray-cluster.toml")
    assert (cfg.cluster.engines, cfg.cluster.gateways, cfg.cluster.rollout_workers) == (4, 2, 4)
    assert cfg.cluster.engine_command and "{port}" in cfg.cluster.engine_command and cfg.cluster.engine.num_gpus == 1
    guide = (root / "deploy" / "README.md").read_text()
    shown = guide.split("# examples/ray-cluster.toml: stepline run examples/ray-cluster.toml --ray --ray-address auto\n", 1)[1]
    assert shown.split("```", 1)[0] in (root / "examples" / "ray-cluster.toml").read_text()


def test_the_own_agent_example_is_the_readmes() -> None:
    """The README's own-agent snippet is the job file's harness, as written; the job trains a pretrained policy."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    shown = readme.split("```toml\n[[rollout.harnesses]]\nname = \"adder\"", 1)[1].split("```", 1)[0]
    assert '[[rollout.harnesses]]\nname = "adder"' + shown in (root / "examples" / "own_agent.toml").read_text()
    assert load_job(root / "examples" / "own_agent.toml").model.kind == "smollm2-135m"


def test_the_readme_is_a_guide() -> None:
    """A user's guide on a screen or two: the measurements live in docs/results.md."""
    root = Path(__file__).resolve().parents[1]
    assert len((root / "README.md").read_text().splitlines()) <= 300


def test_a_bad_field_is_named(tmp_path: Path) -> None:
    job = tmp_path / "bad.toml"
    job.write_text('rl_updates = -1\n[rollout]\ngroup_size = 0\n')
    with pytest.raises(JobError) as err:
        load_job(job)
    assert "rl_updates" in str(err.value) and "rollout.group_size" in str(err.value)


def test_an_unknown_field_is_refused(tmp_path: Path) -> None:
    job = tmp_path / "typo.toml"
    job.write_text('rl_update = 3\n')
    with pytest.raises(JobError, match="rl_update"):
        load_job(job)


def test_settings_per_harness_name_known_harnesses(tmp_path: Path) -> None:
    job = tmp_path / "demos.toml"
    ui = '[rollout]\n[[rollout.harnesses]]\nname = "ui"\nmodule = "stepline.agents.ui"\n'
    for table, line, error in [
            ("sft", 'demos = {uii = 32}', "sft.demos: no harness named 'uii'"),
            ("sft", 'demos = {ui = -1}', "sft.demos.ui"),
            ("sft", 'demo_tasks_matching = {uii = "a"}', "sft.demo_tasks_matching: no harness named 'uii'"),
            ("sft", 'demo_tasks_matching = {ui = "("}', "sft.demo_tasks_matching.ui: not a regular expression"),
            ("sft", 'demo_kinds = {uii = {toggle = 2}}', "sft.demo_kinds: no harness named 'uii'"),
            ("sft", 'demo_kinds = {ui = {toggle = 0}}', "sft.demo_kinds.ui.toggle"),
            ("trainer", 'negative_scale = {uii = 0.0}', "trainer.negative_scale: no harness named 'uii'"),
            ("trainer", 'negative_scale = {ui = 1.5}', "less than or equal to 1")]:
        job.write_text(f"[{table}]\n{line}\n{ui}")
        with pytest.raises(JobError, match=re.escape(error)):
            load_job(job)


def test_the_trainer_waits_for_the_smallest_group_of_the_mix(tmp_path: Path) -> None:
    from stepline.launch.phases import smallest_group

    job = tmp_path / "mix.toml"
    job.write_text('[rollout]\ngroup_size = 4\n[[rollout.harnesses]]\nname = "ui"\nmodule = "stepline.agents.ui"\ngroup_size = 8\n'
                   '[[rollout.harnesses]]\nname = "search"\nmodule = "stepline.agents.search"\n')
    assert smallest_group(load_job(job).rollout) == 4
    job.write_text('[rollout]\ngroup_size = 4\n[[rollout.harnesses]]\nname = "ui"\nmodule = "stepline.agents.ui"\ngroup_size = 8\n')
    assert smallest_group(load_job(job).rollout) == 8


def test_an_override_reaches_into_an_array_of_tables() -> None:
    path = EXAMPLES[[p.name for p in EXAMPLES].index("quickstart.toml")]
    names = [h.name for h in load_job(path).rollout.harnesses]
    cfg = load_job(path, {"rollout.harnesses.1.max_turns": 2})
    assert [h.max_turns for h in cfg.rollout.harnesses][1] == 2 and [h.name for h in cfg.rollout.harnesses] == names
    with pytest.raises(JobError, match="not an index"):
        load_job(path, {"rollout.harnesses.9.max_turns": 2})
    with pytest.raises(JobError, match="not a table"):
        load_job(path, {"seed.x": 1})


def test_the_cluster_example_needs_ray_to_start_its_engines(tmp_path: Path) -> None:
    """Its SGLang servers come from cluster.engine_command, which only `--ray` starts: a local run says so."""
    from stepline.launch.phases import RunDir
    from stepline.launch.run import services

    cfg = load_job(Path(__file__).resolve().parents[1] / "examples" / "ray-cluster.toml")
    run = RunDir(tmp_path)
    run.logs.mkdir()
    with pytest.raises(JobError, match="without --ray the job needs services.engine_url"):
        with services(cfg, run, tmp_path, "token"):
            pass


@pytest.mark.parametrize(("answer", "reward", "success"), [("7", 1.0, True), ("3 + 4 = 7", 0.5, False),
                                                           ("3 + 4 = 8", 0.0, False), ("", 0.0, False)])
def test_the_own_agent_verifier_gives_partial_credit(tmp_path: Path, answer: str, reward: float, success: bool) -> None:
    """The example's verifier: 1 for the sum alone, 0.5 for the sum inside a sentence (signal for a group of a
    policy that answers in sentences), 0 otherwise."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "answer.txt").write_text(answer)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "STEPLINE_TASK_ID": "add-3-4", "STEPLINE_OUT_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(root / "examples" / "own_agent" / "verify.py")], env=env,
                         capture_output=True, text=True, check=True).stdout
    verdict = json.loads(out)
    assert (verdict["reward"], verdict["success"]) == (reward, success)


def test_the_bfcl_harness_mixes_with_the_quickstarts_three(tmp_path: Path) -> None:
    """examples/bfcl.toml's harness table added to the quickstart's is a valid four-harness job."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    table = (examples / "bfcl.toml").read_text().split("\n[[rollout.harnesses]]", 1)[1].split("\n[eval]", 1)[0]
    text = (examples / "quickstart.toml").read_text().replace("\n[eval]", f"\n[[rollout.harnesses]]{table}\n[eval]", 1)
    (tmp_path / "mix.toml").write_text(text)
    names = [h.name for h in load_job(tmp_path / "mix.toml").rollout.harnesses]
    assert names == ["search", "terminal", "ui", "bfcl"]
