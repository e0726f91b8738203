"""The CPU trainer's process settings: glibc keeps freed memory (stepline/trainer/memory.py), OpenMP waits passively
(stepline/trainer/__init__.py)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from stepline.trainer.memory import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_mallopt_accepts_the_thresholds() -> None:
    assert keep_freed_memory() is True


def test_importing_the_trainer_makes_openmp_wait_passively() -> None:
    # stepline/trainer/__init__.py must run before torch loads libgomp; a subprocess starts without the variable
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import stepline.trainer, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "False"]
