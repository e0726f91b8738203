"""Small builders shared by the pool tests."""

from __future__ import annotations

import numpy as np

from datapool.records import CallRecord, SessionInfo


def session(sid: str = "s1", task: str = "t1", harness: str = "h", group: str | None = None) -> SessionInfo:
    return SessionInfo(sid, task, harness, group)


def call(session_id: str, index: int, prompt, output, version: int = 0, **kw) -> CallRecord:
    return CallRecord(session_id, index, _ids(prompt), _ids(output),
                      np.full(len(output), -0.25 - index, np.float32), version, **kw)


def _ids(xs) -> np.ndarray:
    """int32 ids; int64 where a test needs an id int32 cannot hold."""
    a = np.array(xs, dtype=np.int64)
    return a.astype(np.int32) if a.size == 0 or a.max() < 2**31 else a
