"""bf16 "auto": bf16 only where the device has bf16 units and bf16 matmuls beat fp32 there, fp32 elsewhere
(trainer and the job's engine)."""

import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import stepline.trainer.precision as precision
from stepline.launch.job import ServicesSection
from stepline.launch.wiring import engine_spec
from stepline.trainer.config import TrainerConfig
from stepline.trainer.precision import bf16_units, fast_bf16, resolve_bf16

CPUS = {"bf16-faster": (True, True), "bf16-slower": (True, False), "avx2-only": (False, False)}


@pytest.fixture(params=list(CPUS))
def cpu_bf16(request, monkeypatch) -> bool:
    """A CPU with or without bf16 units, on which the probe finds bf16 faster or not; returns what auto picks."""
    units, wins = CPUS[request.param]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: units, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(precision, "_cpu_bf16_wins", lambda: wins)
    return units and wins


def test_auto_follows_the_cpu_and_explicit_choices_stand(cpu_bf16):
    cpu = torch.device("cpu")
    assert fast_bf16(cpu) is cpu_bf16
    assert resolve_bf16("auto", cpu) is cpu_bf16
    assert resolve_bf16(True, cpu) is True and resolve_bf16(False, cpu) is False


def test_job_engine_dtype_auto_becomes_a_concrete_dtype(cpu_bf16):
    argv = engine_spec(ServicesSection(engine_dtype="auto"), Path("model"), 9).to_argv()
    assert argv[argv.index("--dtype") + 1] == ("bfloat16" if cpu_bf16 else "float32")


@pytest.mark.parametrize("slower", [torch.bfloat16, torch.float32])
def test_the_probe_takes_bf16_only_where_its_linear_runs_faster(monkeypatch, slower):
    # The probe times F.linear in both dtypes; here a stand-in takes 20 ms in the `slower` dtype and 1 ms in the
    # other (no arithmetic, so the machine's load cannot reorder them).
    def linear(a, b):
        time.sleep(0.02 if a.dtype == slower else 0.001)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    precision._cpu_bf16_wins.cache_clear()
    try:
        assert precision._cpu_bf16_wins() is (slower == torch.float32)
    finally:
        precision._cpu_bf16_wins.cache_clear()
    assert bf16_units(torch.device("meta")) is False


def test_trainer_config_takes_auto_and_refuses_other_words(tiny_model_dir):
    assert TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="auto").autocast_bf16 == "auto"
    with pytest.raises(ValidationError, match="autocast_bf16"):
        TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="sometimes")
    with pytest.raises(ValidationError, match="needs dtype"):
        TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="auto", dtype="bfloat16")
