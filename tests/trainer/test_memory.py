"""keep_freed_memory reaches glibc's mallopt (the CPU trainer's page-fault fix, trainer/memory.py)."""

from __future__ import annotations

import platform

import pytest

from trainer.memory import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_mallopt_accepts_the_thresholds() -> None:
    assert keep_freed_memory() is True
