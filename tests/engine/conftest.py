"""An engine on the tiny model shared by the read-only tests of this folder, and request helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stepline.engine.testing import running_engine

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with running_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture
def client(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=60) as c:
        yield c
