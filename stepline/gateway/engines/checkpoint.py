"""Checking a checkpoint folder before an engine loads it: every tensor's name, shape and dtype, read
from the safetensors headers (no tensor data is read), against the model the engine serves (the same
names and shapes; the same dtype, one float type standing in for another).

    signature(folder) -> {name: (dtype, shape)}      raises CheckpointInvalid
    check_checkpoint(folder, expected) -> None       raises CheckpointInvalid naming the first differences

An engine that half-loads a broken checkpoint in place (vLLM's `reload_weights` does) is left serving
a mix of weights or dies; checking first keeps the old weights serving and gives the caller a clear
error. A truncated or corrupt file fails here too: the safetensors header must cover the whole file.
"""

from __future__ import annotations

from pathlib import Path

from stepline.gateway.engines.base import EngineRejected

Signature = dict[str, tuple[str, tuple[int, ...]]]

__all__ = ["CheckpointInvalid", "Signature", "check_checkpoint", "signature"]


class CheckpointInvalid(EngineRejected):
    """The checkpoint cannot be served by this engine (answered 400; the old weights keep serving)."""


def signature(folder: Path | str) -> Signature:
    """{tensor name: (dtype, shape)} over every *.safetensors file in `folder`."""
    from safetensors import SafetensorError, safe_open

    root = Path(folder)
    if not root.is_dir():
        raise CheckpointInvalid(f"checkpoint {root} is not a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointInvalid(f"checkpoint {root} has no *.safetensors file")
    out: Signature = {}
    for file in files:
        try:
            with safe_open(str(file), framework="np") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    out[name] = (str(tensor.get_dtype()), tuple(int(d) for d in tensor.get_shape()))
        except (SafetensorError, OSError) as exc:
            raise CheckpointInvalid(f"checkpoint file {file} is unreadable: {exc}") from exc
    return out


def _fits(found: tuple[str, tuple[int, ...]], expected: tuple[str, tuple[int, ...]]) -> bool:
    """Same shape, and the same dtype, except that one float type may replace another (a trainer in
    bf16 pushes bf16 tensors to an engine started on fp32 ones; the engine casts on load)."""
    (dtype, shape), (want_dtype, want_shape) = found, expected
    floats = _is_float(dtype) and _is_float(want_dtype)
    return shape == want_shape and (dtype == want_dtype or floats)


def _is_float(dtype: str) -> bool:
    return dtype.startswith("F") or dtype == "BF16"  # F16 F32 F64 F8_E4M3 ... BF16 (not BOOL)


def check_checkpoint(folder: Path | str, expected: Signature, subset: bool = False) -> None:
    """Raise CheckpointInvalid unless `folder` holds exactly the tensors of `expected` (`subset`: some of them,
    as a delta folder does, stepline.weightdelta)."""
    found = signature(folder)
    problems = [] if subset else [f"missing {name}" for name in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {name}" for name in sorted(found.keys() - expected.keys())]
    for name in sorted(expected.keys() & found.keys()):
        if not _fits(found[name], expected[name]):
            (want_dtype, want_shape), (dtype, shape) = expected[name], found[name]
            problems.append(f"{name}: {dtype} {list(shape)} where the served model has {want_dtype} {list(want_shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointInvalid(f"checkpoint {folder} does not fit the served model: {shown}")
