"""Whether bf16 arithmetic pays on a device, for the settings that say "auto".

On a CPU, bf16 can be fast only with native bf16 units (AVX512-BF16 or AMX): without them torch falls back to a
reference GEMM (a 512 x 576 x 1536 linear took 202 ms in bf16 against 34 ms in fp32 on an AVX2 EPYC, 6x slower).
The units are not enough: an Intel Xeon that exposes AVX512-BF16 but not AMX ran that linear in 6.2 ms in bf16
against 3.7 ms in fp32 (2 threads), while an AMD EPYC with AVX512-BF16 runs bf16 about twice as fast as fp32. So
"auto" on a CPU with bf16 units times that linear both ways, once per process, and takes bf16 only where it wins.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Literal

import torch

__all__ = ["bf16_units", "fast_bf16", "resolve_bf16"]

PROBE_SHAPE = (512, 576, 1536)  # tokens x hidden x MLP width: SmolLM2-135M's up projection on a micro-batch
MARGIN = 0.9  # bf16 must take under 90% of fp32's time, so timing noise near a tie keeps fp32


def bf16_units(device: torch.device) -> bool:
    """True where the device has bf16 arithmetic units: a CUDA device that supports bf16, a CPU with AVX512-BF16
    or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_flag("_is_avx512_bf16_supported") or _cpu_flag("_is_amx_tile_supported")
    return False


def fast_bf16(device: torch.device) -> bool:
    """True where bf16 matmuls beat fp32 ones: a CUDA device with bf16 units; a CPU with bf16 units on which
    the probe linear runs faster in bf16 (timed once per process)."""
    if not bf16_units(device):
        return False
    return device.type != "cpu" or _cpu_bf16_wins()


def resolve_bf16(choice: bool | Literal["auto"], device: torch.device) -> bool:
    """A bf16 setting made concrete: True/False as given, "auto" by `fast_bf16`."""
    return fast_bf16(device) if choice == "auto" else bool(choice)


@cache
def _cpu_bf16_wins() -> bool:
    """Best of 5 timings of the probe linear in each dtype, alternating (about 60 ms in all on 2 cores)."""
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    pairs = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in pairs}
    for round_ in range(6):
        for dtype, (a, b) in pairs.items():
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            if round_:  # the first round warms each kernel up
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.bfloat16] < MARGIN * best[torch.float32]


def _cpu_flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # torch's own cpuinfo probes (private, hence the guard)
    return bool(probe()) if callable(probe) else False
