"""The spill file: calls the gateway acknowledged while the pool could not take them, kept on local disk.

The recorder appends a call here (and fsyncs) when a pool write fails, or at shutdown instead of dropping
its queue; the answer to the harness waits for that fsync or for the pool's commit, whichever comes
first. The file is truncated once every spilled call is in the pool, and read back at the next start.
Replaying is exactly-once in effect: the pool ignores a call it already holds (same session and call
index, same digest), so a crash between the pool's commit and the truncation re-sends harmlessly.

Format: frames of `<u32 length><u32 crc32>` + msgpack (stepline.datapool.wire) of one `CallRecord`. A torn last
frame (a crash mid-append, before its fsync, so never acknowledged) is cut off when the file is opened.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from pathlib import Path

from stepline.datapool import wire
from stepline.datapool.records import CallRecord

__all__ = ["Spill", "SpillInUse", "default_state_dir"]

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<II")


class SpillInUse(RuntimeError):
    """Another process (a second gateway) holds the spill file."""


def default_state_dir() -> Path:
    """Where a gateway keeps its spill file when none is named: $STEPLINE_STATE_DIR, else
    $XDG_STATE_HOME/stepline, else ~/.local/state/stepline."""
    if os.environ.get("STEPLINE_STATE_DIR"):
        return Path(os.environ["STEPLINE_STATE_DIR"])
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "stepline"


class Spill:
    """An append-only file of call records (one writer: the recorder's worker thread), locked against a
    second gateway for as long as it is open (two writers would interleave and truncate each other's calls)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._file = self.path.open("a+b")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise SpillInUse(f"the spill file {self.path} is in use by another gateway: give this one its own "
                             "(--spill FILE or --state-dir DIR)") from None
        if created:  # the directory entry must survive a crash too
            _fsync_dir(self.path.parent)
        self._loaded, good = _read_frames(self.path.read_bytes())
        if good < self.size():
            log.warning("spill file %s: cut a torn last record (%d bytes)", self.path, self.size() - good)
            self._file.truncate(good)
            os.fsync(self._file.fileno())

    def load(self) -> list[CallRecord]:
        """The calls an earlier run spilled and did not see committed (once; the file keeps them)."""
        records, self._loaded = self._loaded, []
        return records

    def append(self, records: list[CallRecord]) -> None:
        """Write the records and fsync: when this returns they survive a crash of the process or machine."""
        frames = []
        for record in records:
            data = wire.packb(record)
            frames.append(_HEADER.pack(len(data), zlib.crc32(data)) + data)
        self._file.write(b"".join(frames))
        self._file.flush()
        os.fsync(self._file.fileno())

    def clear(self) -> None:
        """Forget everything spilled (every spilled call is in the pool)."""
        self._file.truncate(0)
        os.fsync(self._file.fileno())

    def size(self) -> int:
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self._file.close()


def _read_frames(data: bytes) -> tuple[list[CallRecord], int]:
    """The records of whole, intact frames, and the byte offset where they end."""
    records, offset = [], 0
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        body = data[offset + _HEADER.size: offset + _HEADER.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        records.append(wire.decode_call(wire.unpackb(body)))
        offset += _HEADER.size + length
    return records, offset


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
