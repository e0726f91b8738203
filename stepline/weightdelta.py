"""Weight deltas: push only the tensors that changed, and prove that the engine then serves the trainer's state.

    table = digests(state)                         # {name: digest}; tied tensors once (first name)
    checksum(table)                                # the full state's checksum, from the table alone
    write_delta(out, tensors, checksum(table), anchor, anchor_version)
    delta = read_manifest(folder)                  # None for an ordinary (full) checkpoint folder
    folder_digests(folder)                         # the table of a full checkpoint folder, from its files
    materialize(folder, out)                       # a full checkpoint folder of the weights a delta stands for

A delta folder holds `delta.safetensors` (the changed tensors under plain Hugging Face names, in the trainer's
dtype) and `delta.json` {"format", "checksum", "anchor", "anchor_version", "tensors"}.

Digests. A tensor's digest is BLAKE2b-128 over its name, dtype, shape and raw bytes; the state's checksum is
BLAKE2b over the sorted (name, digest) pairs. A side that keeps the table rehashes only the tensors that
changed (the trainer: its trainable ones; the engine: the delta's), never the whole model.

What makes a delta safe. Each delta is taken against the *anchor*, the full state the engines were last given
whole (the model folder they start on, or the trainer's last full push), and holds every tensor that differed
from the anchor at any push since. So an engine serving the anchor or any earlier delta of it reaches exactly
the trainer's state by loading the newest delta, and an engine restarted on the anchor catches up in one load.
The engine does not take this on trust: it digests the delta's tensors itself, folds them into its own table
and loads only if the result equals `checksum`; otherwise it refuses and keeps its weights (it lacks the
base: it missed a full push, or started on other weights), and the trainer pushes the full state instead.

torch and safetensors are imported inside the functions: the gateway reads manifests without loading torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DELTA_FILE", "MANIFEST", "Delta", "checksum", "digest", "digests", "folder_digests", "materialize",
           "read_manifest", "unique_tensors", "write_delta"]

FORMAT = "stepline-delta/1"
MANIFEST = "delta.json"
DELTA_FILE = "delta.safetensors"


@dataclass(frozen=True)
class Delta:
    """A delta folder's manifest."""

    folder: Path
    checksum: str  # the full state's checksum once the delta is loaded
    anchor: str  # the full checkpoint folder the delta is taken against (an engine lacking the base loads it first)
    anchor_version: int  # the weight version that folder was pushed as (0: the model the engines start on)
    tensors: tuple[str, ...]  # names in delta.safetensors


def digest(name: str, tensor: torch.Tensor) -> bytes:
    """BLAKE2b-128 of name, dtype, shape and bytes (hashlib releases the GIL on large buffers)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|".encode())
    h.update(flat.view(torch.uint8).numpy().data)  # the bytes, not a copy
    return h.digest()


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each storage once, under its first name: a tied LM head is the embedding, and
    save_pretrained writes it once (model.embed_tokens.weight, not lm_head.weight)."""
    seen: set[tuple[int, object]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def digests(state: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: digest(name, t) for name, t in unique_tensors(state).items()}


def checksum(table: Mapping[str, bytes]) -> str:
    """The state's checksum from its digest table (hex)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(table):
        h.update(name.encode() + b"\0" + table[name])
    return h.hexdigest()


def folder_digests(folder: Path | str) -> dict[str, bytes]:
    """The digest table of the tensors in the *.safetensors files of a checkpoint folder."""
    from safetensors import safe_open

    table: dict[str, bytes] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                table[name] = digest(name, f.get_tensor(name))
    return table


def write_delta(out: Path, tensors: Mapping[str, torch.Tensor], state_checksum: str, anchor: Path | str,
                anchor_version: int) -> Path:
    """Write a delta folder at `out` (under a temporary name, then renamed: an engine never sees half of one)."""
    import shutil

    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / DELTA_FILE))
    manifest = {"format": FORMAT, "checksum": state_checksum, "anchor": str(anchor), "anchor_version": anchor_version,
                "tensors": sorted(tensors)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_manifest(folder: Path | str) -> Delta | None:
    """The manifest of a delta folder; None when `folder` is an ordinary checkpoint. ValueError when it is damaged."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown delta format {data.get('format')!r} (expected {FORMAT!r})")
        return Delta(Path(folder), str(data["checksum"]), str(data["anchor"]), int(data["anchor_version"]),
                     tuple(str(n) for n in data["tensors"]))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"delta manifest {path} is damaged: {exc}") from exc


def materialize(folder: Path | str, out: Path | str) -> Path:
    """A full checkpoint folder at `out` of the weights the delta in `folder` stands for (its anchor's files, the
    delta's tensors written over), checked against the delta's checksum; `folder` itself when it is no delta."""
    import shutil

    from safetensors.torch import load_file, save_file

    delta = read_manifest(folder)
    if delta is None:
        return Path(folder)
    anchor, out = Path(delta.anchor), Path(out)
    shutil.copytree(anchor, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for file in sorted(anchor.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tensors.update(load_file(str(Path(folder) / DELTA_FILE)))
    if checksum({name: digest(name, t) for name, t in tensors.items()}) != delta.checksum:
        raise ValueError(f"{folder} over its anchor {anchor} does not give the state it was pushed as")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
