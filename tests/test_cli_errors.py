"""Every command's bad input is one clear error, never a traceback.

Each case gives a command a job file or options with a wrong field, a wrong type, a model directory that is not
there (or holds no model), or a path that does not exist, and checks that it exits non-zero with an `Error:` line
naming what is wrong. In-process through click's CliRunner (nothing starts: every case fails before a service
would), so the matrix stays fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stepline.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "examples" / "quickstart.toml")

# name -> (files to write under tmp_path, argv with {tmp} for tmp_path, text the error line must hold)
CASES: dict[str, tuple[dict[str, str], list[str], str]] = {
    "run-wrong-field": ({"job.toml": "rl_update = 3\n"}, ["run", "{tmp}/job.toml"], "rl_update"),
    "run-wrong-type": ({"job.toml": 'rl_updates = "x"\n'}, ["run", "{tmp}/job.toml"], "rl_updates"),
    "run-bad-toml": ({"job.toml": "x = [\n"}, ["run", "{tmp}/job.toml"], "cannot read job file"),
    "run-no-such-file": ({}, ["run", "{tmp}/missing.toml"], "does not exist"),
    "run-missing-model-dir": ({"job.toml": '[model]\ndir = "{tmp}/nowhere"\n'}, ["run", "{tmp}/job.toml"],
                              "{tmp}/nowhere (the directory does not exist)"),
    "run-bad-override": ({}, ["run", QUICKSTART, "--set", "rl_updates=x"], "rl_updates"),
    "train-job-for-run": ({}, ["train", QUICKSTART], "trainer.model_dir: not set"),
    "train-missing-model-dir": ({"job.toml": '[trainer]\nmodel_dir = "nowhere"\n'}, ["train", "{tmp}/job.toml"],
                                "trainer.model_dir"),
    "train-empty-model-dir": ({"job.toml": '[trainer]\nmodel_dir = "empty"\n', "empty/.keep": ""},
                              ["train", "{tmp}/job.toml"], "config.json missing"),
    "train-wrong-type": ({"job.toml": '[trainer]\nlr = "fast"\n'}, ["train", "{tmp}/job.toml"], "trainer.lr"),
    "replay-no-such-pool": ({"job.toml": "[trainer]\n"}, ["replay", "{tmp}/job.toml", "--pool", "{tmp}/p.db"],
                            "--pool"),
    "replay-wrong-field": ({"job.toml": "[trainer]\nlrr = 1\n", "p.db": ""},
                           ["replay", "{tmp}/job.toml", "--pool", "{tmp}/p.db"], "trainer.lrr"),
    "eval-no-gateway": ({}, ["eval", QUICKSTART], "--gateway"),
    "eval-unreachable-gateway": ({}, ["eval", QUICKSTART, "--gateway", "http://127.0.0.1:1"],
                                 "--gateway http://127.0.0.1:1"),
    "eval-wrong-type": ({}, ["eval", QUICKSTART, "--limit", "x"], "--limit"),
    "up-missing-model-dir": ({}, ["up", "--model", "{tmp}/nowhere"], "does not exist"),
    "up-empty-model-dir": ({"empty/.keep": ""}, ["up", "--model", "{tmp}/empty"], "config.json missing"),
    "up-wrong-port": ({"config.json": "{}"}, ["up", "--model", "{tmp}", "--port", "99999"], "--port"),
    "gateway-engine-not-a-url": ({}, ["gateway", "--engine", "localhost:30000", "--model", "{tmp}",
                                      "--pool", "sqlite:///x.db"], "'localhost:30000' is not an http"),
    "gateway-model-without-tokenizer": ({}, ["gateway", "--engine", "http://127.0.0.1:1", "--model", "{tmp}",
                                             "--pool", "sqlite:///x.db"], "tokenizer.json missing"),
    "engine-empty-model-dir": ({}, ["engine", "--model", "{tmp}"], "config.json missing"),
    "engine-wrong-type": ({"config.json": "{}"}, ["engine", "--model", "{tmp}", "--port", "many"], "--port"),
    "pool-unknown-url": ({}, ["pool", "show", "--db", "bogus://x", "s1"], "cannot open pool 'bogus://x'"),
    "pool-missing-database": ({}, ["pool", "export", "sqlite:///{tmp}/no/such.db", "{tmp}/out.bin"],
                              "cannot open SQLite pool"),
    "dashboard-missing-run-dir": ({}, ["dashboard", "{tmp}/nowhere"], "does not exist"),
    "dashboard-unknown-pool": ({}, ["dashboard", "--pool", "bogus://x"], "--pool"),
    "dashboard-wrong-range": ({}, ["dashboard", "{tmp}", "--poll", "0"], "--poll"),
    "make-model-unknown-kind": ({}, ["make-model", "{tmp}/m", "--kind", "gpt-5"], "smollm2-135m"),
    "make-model-path-under-a-file": ({"file": ""}, ["make-model", "{tmp}/file/m"], "Not a directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_error(case: str, tmp_path: Path) -> None:
    files, argv, expected = CASES[case]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.replace("{tmp}", str(tmp_path)))
    result = CliRunner().invoke(main, [arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, (result.exception, result.output)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert expected.replace("{tmp}", str(tmp_path)) in result.output, result.output


def test_every_command_has_a_case() -> None:
    from stepline.cli import COMMANDS

    assert {name.split("-")[0] for name in CASES} >= {command.split("-")[0] for command in COMMANDS}


def test_a_bug_still_shows_its_traceback() -> None:
    """Only errors the user's input causes become one line; anything else keeps its traceback."""
    from stepline.cli import user_error

    assert user_error(KeyError("x")) is None and user_error(FileNotFoundError(2, "No such file", "a/b")) == \
        "a/b: No such file"


def test_the_make_model_help_names_every_kind() -> None:
    from stepline.models import MODEL_KINDS

    listing = CliRunner().invoke(main, ["--help"]).output
    line = " ".join(listing.split("make-model", 1)[1].split("pool", 1)[0].split())
    assert all(kind in line for kind in MODEL_KINDS), line
