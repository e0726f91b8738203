"""The model's own chat template and tokenizer, loaded from its model directory.

The template is compiled the way Hugging Face `apply_chat_template` compiles it (sandboxed Jinja with
`trim_blocks`, `lstrip_blocks`, `tojson`, `raise_exception`), without importing transformers, so the
gateway renders exactly the text the model was trained on. Tokenization uses the `tokenizers` library
directly (fast, no Python loop).

`ChatTemplate.continuation` renders only the messages a harness appended after an assistant turn: it
renders them behind a fixed two-message stand-in history whose assistant turn carries a sentinel, and
keeps the text after that turn's end-of-turn marker. The stand-in makes the cost follow the new
messages, not the conversation's length.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

Message = dict[str, Any]

_SENTINEL = "\u2063STEPLINE-SENTINEL\u2063"
_STAND_IN: list[Message] = [
    {"role": "user", "content": "\u2063"},
    {"role": "assistant", "content": _SENTINEL},
]


class TemplateError(ValueError):
    """The chat template refused the conversation (e.g. `raise_exception` in the template)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Hugging Face's override: Jinja's own tojson escapes HTML characters, which the model never saw
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """Render conversations with the model's template and turn text into token ids and back."""

    def __init__(self, source: str, tokenizer: Tokenizer, eos_token: str, stop_token_ids: list[int],
                 context_length: int, model_type: str = "") -> None:
        self.template = compile_template(source)
        self.tokenizer = tokenizer
        self.eos_token = eos_token  # the end-of-turn marker the template writes after each assistant turn
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"end-of-turn token {eos_token!r} is not in the tokenizer")
        self.eos_id: int = eos_id
        self.stop_token_ids = sorted({eos_id, *stop_token_ids})
        self.context_length = context_length
        self.model_type = model_type

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> ChatTemplate:
        model_dir = Path(model_dir)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        source = tok_config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise ValueError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        eos = tok_config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        stop_ids = _as_list(gen_config.get("eos_token_id")) + _as_list(config.get("eos_token_id"))
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        if not isinstance(eos, str):
            eos = tokenizer.id_to_token(stop_ids[0])
        context = int(config.get("max_position_embeddings") or tok_config.get("model_max_length") or 4096)
        return cls(source, tokenizer, eos, stop_ids, context, str(config.get("model_type", "")))

    def render(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool,
               options: dict[str, Any] | None = None) -> str:
        """`options`: extra template variables (a request's chat_template_kwargs, e.g. enable_thinking)."""
        try:
            return self.template.render(
                **(options or {}), messages=messages, tools=tools or None,
                add_generation_prompt=add_generation_prompt, bos_token="", eos_token=self.eos_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template rejected the conversation: {exc}") from exc
        except (TypeError, AttributeError, KeyError, IndexError, jinja2.exceptions.UndefinedError) as exc:
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from exc

    def continuation(self, messages: list[Message], tools: list[dict] | None, options: dict[str, Any] | None = None) -> str:
        """Text of `messages` (appended after a finished assistant turn) plus the generation prompt."""
        text = self.render(_STAND_IN + messages, tools, add_generation_prompt=True, options=options)
        at = text.find(_SENTINEL)
        end = text.find(self.eos_token, at) if at >= 0 else -1
        if end < 0:
            raise TemplateError("the chat template does not close assistant turns with its end-of-turn token")
        return text[end + len(self.eos_token):]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@lru_cache(maxsize=4)
def _cached(path: str, mtime: float) -> ChatTemplate:
    return ChatTemplate.from_model_dir(path)


def load_template(model_dir: Path | str) -> ChatTemplate:
    """`ChatTemplate.from_model_dir`, shared by the apps of one process (parsing tokenizer.json takes
    about a second for a 150k vocabulary). Read-only after loading, so sharing is safe."""
    path = Path(model_dir).resolve()
    return _cached(str(path), (path / "tokenizer.json").stat().st_mtime)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
