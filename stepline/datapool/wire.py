"""Records <-> msgpack: the encoding shared by the pool service, its client and the export format.

Numpy arrays travel as msgpack ext types holding packed little-endian bytes (int32 ids, float32
logprobs, int8 masks); dataclasses as maps of their fields. `packb`/`unpackb` handle both;
`decode_*` rebuild the typed records (nested ones included).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import msgpack
import numpy as np

from stepline.datapool.records import (
    CallRecord,
    EpisodeData,
    Group,
    Node,
    Reward,
    SessionInfo,
    SessionTree,
    Step,
    Trajectory,
    legacy_purpose,
)

_EXT_DTYPES: dict[int, np.dtype] = {1: np.dtype("<i4"), 2: np.dtype("<f4"), 3: np.dtype("i1"), 4: np.dtype("<i8"), 5: np.dtype("<f8")}
_EXT_CODES = {dt: code for code, dt in _EXT_DTYPES.items()}


def to_wire(obj: Any) -> Any:
    """Plain msgpack-able values: dataclasses become maps, tuples lists, arrays stay arrays."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        dtype = obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype
        code = _EXT_CODES.get(np.dtype(dtype))
        if code is None:
            raise TypeError(f"cannot encode an array of dtype {obj.dtype}")
        return msgpack.ExtType(code, np.ascontiguousarray(obj, dtype=_EXT_DTYPES[code]).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code not in _EXT_DTYPES:
        return msgpack.ExtType(code, data)
    return np.frombuffer(data, dtype=_EXT_DTYPES[code]).copy()


def packb(obj: Any) -> bytes:
    return msgpack.packb(to_wire(obj), default=_default, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def unpacker(stream: Any) -> msgpack.Unpacker:
    """A streaming decoder over a file-like object (the export format)."""
    return msgpack.Unpacker(stream, ext_hook=_ext_hook, raw=False, strict_map_key=False, max_buffer_size=2**31 - 1)


# --- typed decoders (each takes what `to_wire` + `unpackb` produced) ---

def decode_session(d: dict) -> SessionInfo:
    if "purpose" not in d:  # written before SessionInfo.purpose (an older export or client)
        d = {**d, "purpose": legacy_purpose(d.get("metadata") or {})}
    return SessionInfo(**d)


def _pairs(pairs: list) -> list[tuple[int, int]]:
    """Version spans as tuples (msgpack turns them into lists)."""
    return [tuple(p) if isinstance(p, list) else p for p in pairs] if isinstance(pairs, list) else pairs


def decode_call(d: dict) -> CallRecord:
    return CallRecord(**{**d, "version_spans": _pairs(d.get("version_spans", []))})


def decode_reward(d: dict) -> Reward:
    return Reward(**d)


def decode_tree(d: dict) -> SessionTree:
    calls = {int(c): (int(end), list(acts)) for c, (end, acts) in d["calls"].items()}
    return SessionTree(d["session_id"], [Node(**n) for n in d["nodes"]], calls)


def decode_trajectory(d: dict) -> Trajectory:
    steps = [Step(**{**s, "version_spans": _pairs(s.get("version_spans", []))}) for s in d["steps"]]
    d = dict(d, steps=steps, node_path=[tuple(p) for p in d["node_path"]])
    return Trajectory(**d)


def decode_episode(d: dict) -> EpisodeData:
    return EpisodeData(
        decode_session(d["info"]),
        [decode_reward(r) for r in d["rewards"]],
        decode_tree(d["tree"]),
        [decode_trajectory(t) for t in d["trajectories"]],
    )


def decode_group(d: dict) -> Group:
    return Group(d["group_id"], d["group_key"], [decode_episode(e) for e in d["episodes"]], d["min_version"])
