"""Whether bf16 arithmetic pays on a device, for the settings that say "auto".

On a CPU, bf16 is fast only with native bf16 units (AVX512-BF16 or AMX): oneDNN then runs bf16 GEMMs at
about twice the fp32 rate. Without them torch falls back to a reference GEMM: a 512 x 576 x 1536 linear took
202 ms in bf16 against 34 ms in fp32 on an AVX2 EPYC (6x slower), so "auto" means fp32 there.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["fast_bf16", "resolve_bf16"]


def fast_bf16(device: torch.device) -> bool:
    """True where bf16 matmuls beat fp32 ones: a CUDA device that supports bf16, a CPU with bf16 units."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_flag("_is_avx512_bf16_supported") or _cpu_flag("_is_amx_tile_supported")
    return False


def resolve_bf16(choice: bool | Literal["auto"], device: torch.device) -> bool:
    """A bf16 setting made concrete: True/False as given, "auto" by `fast_bf16`."""
    return fast_bf16(device) if choice == "auto" else bool(choice)


def _cpu_flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # torch's own cpuinfo probes (private, hence the guard)
    return bool(probe()) if callable(probe) else False
