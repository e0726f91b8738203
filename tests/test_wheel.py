"""The built wheel installs one import package, `stepline`, and lives beside the OpenAI Agents SDK (`agents`).

The wheel is built from this checkout's tracked files (`pip wheel --no-build-isolation`, the project's own setuptools). The
side-by-side test installs it into a fresh virtual environment next to `openai-agents` from PyPI, in either
order, and uninstalls either one; Stepline's own dependencies come from this environment's site-packages
through a .pth line (the heavy ones, torch included, are not installed twice). Slow: it needs PyPI for
openai-agents and its dependencies; .ci/run runs it after the suite:

    .venv/bin/python -m pytest -q -m slow tests/test_wheel.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the tracked files, built in a copy (a build/ folder left in the checkout could add stale files)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    for name in tracked:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("stepline-*.whl")
    return built


def test_the_wheel_installs_only_the_stepline_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"stepline"}
    assert "stepline/agents/ui/tasks.py" in names and "stepline/dashboard/static/index.html" in names


SDK_FILES = ("agents", "openai_agents")


def fresh_venv(path: Path) -> Path:
    """A new environment that sees this one's packages after its own (a .pth line to a folder of links), so only
    what is installed into it is new; returns its python. The links leave out this environment's own Agents SDK
    (the dev extra installs it), so the SDK the test installs and uninstalls is the only one there."""
    venv.create(path, with_pip=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    outer = path / "outer"
    outer.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(SDK_FILES) and not entry.name.endswith(".pth"):
            (outer / entry.name).symlink_to(entry)
    (Path(site) / "outer.pth").write_text(f"{outer}\n")
    return python


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True,
                   capture_output=True, text=True, timeout=600)


def works(python: Path, tmp: Path) -> dict[str, bool]:
    """Whether `from agents import Agent` works, and whether a Stepline harness answers its tasks command."""
    sdk = subprocess.run([str(python), "-c", "from agents import Agent; Agent(name='probe')"], cwd=tmp,
                         capture_output=True, text=True)
    harness = subprocess.run([str(python), "-m", "stepline.agents.ui.tasks", "--split", "test"], cwd=tmp,
                             capture_output=True, text=True)
    return {"agents": sdk.returncode == 0, "stepline": harness.returncode == 0 and '"ui-' in harness.stdout}


@pytest.mark.slow
@pytest.mark.parametrize("first", ["stepline", "openai-agents"])
def test_stepline_and_the_agents_sdk_side_by_side(wheel: Path, tmp_path: Path, first: str) -> None:
    python = fresh_venv(tmp_path / "env")
    ours = [str(wheel), "--no-deps"]
    order = [ours, ["openai-agents"]] if first == "stepline" else [["openai-agents"], ours]
    for args in order:
        pip(python, "install", *args)
    assert works(python, tmp_path) == {"agents": True, "stepline": True}
    pip(python, "uninstall", "-y", "stepline")
    assert works(python, tmp_path) == {"agents": True, "stepline": False}
    pip(python, "install", *ours)
    pip(python, "uninstall", "-y", "openai-agents")
    assert works(python, tmp_path) == {"agents": False, "stepline": True}
