"""bf16 "auto": bf16 only where the device has bf16 units, fp32 elsewhere (trainer and the job's engine)."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stepline.launch.job import ServicesSection
from stepline.launch.wiring import engine_spec
from stepline.trainer.config import TrainerConfig
from stepline.trainer.precision import fast_bf16, resolve_bf16


@pytest.fixture(params=[True, False], ids=["bf16-units", "avx2-only"])
def cpu_bf16(request, monkeypatch) -> bool:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: request.param, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    return request.param


def test_auto_follows_the_cpu_and_explicit_choices_stand(cpu_bf16):
    cpu = torch.device("cpu")
    assert fast_bf16(cpu) is cpu_bf16
    assert resolve_bf16("auto", cpu) is cpu_bf16
    assert resolve_bf16(True, cpu) is True and resolve_bf16(False, cpu) is False


def test_job_engine_dtype_auto_becomes_a_concrete_dtype(cpu_bf16):
    argv = engine_spec(ServicesSection(engine_dtype="auto"), Path("model"), 9).to_argv()
    assert argv[argv.index("--dtype") + 1] == ("bfloat16" if cpu_bf16 else "float32")


def test_trainer_config_takes_auto_and_refuses_other_words(tiny_model_dir):
    assert TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="auto").autocast_bf16 == "auto"
    with pytest.raises(ValidationError, match="autocast_bf16"):
        TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="sometimes")
    with pytest.raises(ValidationError, match="needs dtype"):
        TrainerConfig(model_dir=tiny_model_dir, autocast_bf16="auto", dtype="bfloat16")
