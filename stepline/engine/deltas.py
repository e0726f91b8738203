"""Loading a delta folder (stepline.weightdelta) into the served model in place.

    tensors, table = prepare_delta(delta, model, table_or_None, model_path)   # any thread; DeltaRefused
    apply_delta(model, tensors)                                               # the scheduler thread

`prepare_delta` reads the delta's tensors, checks each one against the served model (name, shape), digests
them itself and folds them into the engine's digest table of what it serves (computed from the folder it last
loaded in full, once, where it has none yet). Only when the resulting checksum equals the delta's may it be
applied: the engine would otherwise serve a mix of two states (it lacks the delta's base). Nothing is
touched before that, so a refused delta leaves the old weights serving. Digests are over the tensors as
shipped (the trainer's dtype), so an engine serving bfloat16 checks the same table as one in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stepline.weightdelta import DELTA_FILE, Delta, checksum, digest, folder_digests

__all__ = ["DeltaRefused", "apply_delta", "prepare_delta"]


class DeltaRefused(ValueError):
    """The delta cannot be loaded here (HTTP 400; the old weights keep serving)."""


def prepare_delta(delta: Delta, model: nn.Module, table: dict[str, bytes] | None,
                  model_path: str) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """The delta's tensors and the digest table the engine will serve once they are applied."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(delta.folder / DELTA_FILE))
    except (SafetensorError, OSError) as exc:
        raise DeltaRefused(f"delta {delta.folder} is unreadable: {exc}") from exc
    if sorted(tensors) != sorted(delta.tensors):
        raise DeltaRefused(f"delta {delta.folder}: its file and its manifest name different tensors")
    served = model.state_dict()
    unfit = [f"{n} {tuple(t.shape)}" for n, t in tensors.items() if n not in served or served[n].shape != t.shape]
    if unfit:
        raise DeltaRefused(f"delta {delta.folder} holds tensors the served model does not have: {unfit[:3]}")
    new = dict(table) if table is not None else folder_digests(Path(model_path))
    new.update({name: digest(name, t) for name, t in tensors.items()})
    if checksum(new) != delta.checksum:
        raise DeltaRefused(f"delta {delta.folder} would not give the trainer's state (checksum {checksum(new)}, "
                           f"expected {delta.checksum}): this engine lacks its base {delta.anchor} "
                           f"(version {delta.anchor_version}); push the full weights")
    return tensors, new


@torch.no_grad()
def apply_delta(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each tensor into the served parameter (cast to its dtype); a tied LM head follows its embedding,
    which is the same storage."""
    served = model.state_dict()
    for name, tensor in tensors.items():
        served[name].copy_(tensor)
