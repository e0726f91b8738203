"""The harness's side of the bridge (bridge.py): BFCL's code, run by the bfcl-eval environment's interpreter.

`STEPLINE_BFCL_PYTHON` names that interpreter (default: the environment scripts/setup.sh builds,
~/.cache/stepline/bfcl-eval-2026.3.23/bin/python). A `run`/`verify`/`tasks` process starts a bridge of its own
on a pipe; the worker (serve.py) starts one forking bridge server on a Unix socket before its first fork and
names it in `STEPLINE_BFCL_SOCKET`, so an episode's connection costs a fork, not BFCL's seconds of imports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from types import TracebackType
from typing import IO, Any

BRIDGE = Path(__file__).with_name("bridge.py")
DEFAULT_PYTHON = Path.home() / ".cache" / "stepline" / "bfcl-eval-2026.3.23" / "bin" / "python"
SOCKET_ENV = "STEPLINE_BFCL_SOCKET"


class BridgeError(Exception):
    """The bridge is missing, died, or refused a request (its reason is the message)."""


def bfcl_python() -> Path:
    return Path(os.environ.get("STEPLINE_BFCL_PYTHON") or DEFAULT_PYTHON)


def available() -> str | None:
    """None when the bfcl-eval environment is there, else why not (for skips and errors)."""
    python = bfcl_python()
    if not python.is_file():
        return f"no bfcl-eval interpreter at {python} (bash scripts/setup.sh builds it; or set STEPLINE_BFCL_PYTHON)"
    return None


class Bridge:
    """One conversation with the bridge: `ask(op, **fields)` -> the result, or BridgeError."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        if path := os.environ.get(SOCKET_ENV):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
            self.reader: IO[bytes] = self.sock.makefile("rb")
            self.writer: IO[bytes] = self.sock.makefile("wb")
        else:
            if (why := available()) is not None:
                raise BridgeError(why)
            self.proc = subprocess.Popen([str(bfcl_python()), str(BRIDGE)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.reader, self.writer = self.proc.stdout, self.proc.stdin

    def ask(self, op: str, **fields: Any) -> Any:
        try:
            self.writer.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            self.writer.flush()
            line = self.reader.readline()
        except OSError as exc:
            raise BridgeError(f"bridge gone: {exc}") from exc
        if not line:
            raise BridgeError("the bridge exited (see stderr)")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise BridgeError(str(reply.get("error")))
        return reply["result"]

    def close(self) -> None:
        for stream in (self.writer, self.reader):
            stream.close()
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def start_server(path: Path) -> subprocess.Popen[bytes]:
    """A forking bridge server on the socket `path`, warm (imports and data loaded) when this returns."""
    if (why := available()) is not None:
        raise BridgeError(why)
    proc = subprocess.Popen([str(bfcl_python()), str(BRIDGE), "--socket", str(path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if json.loads(proc.stdout.readline() or b"{}").get("ready") is not True:
        raise BridgeError(f"the bridge server did not start (exit {proc.wait()})")
    return proc
