"""The model's own chat template and tokenizer, loaded from its model directory.

The template is compiled the way Hugging Face `apply_chat_template` compiles it (sandboxed Jinja with
`trim_blocks`, `lstrip_blocks`, `tojson`, `raise_exception`), without importing transformers, so the
gateway renders exactly the text the model was trained on. Tokenization uses the `tokenizers` library
directly (fast, no Python loop); `encode_ids` hands a long text to the tokenizer processes where the app
has them (`with_pool`, stepline.gateway.tokenizing), so tokenizing it never holds the event loop.

`ChatTemplate.continuation` renders only the messages a harness appended after an assistant turn: it
renders them behind a fixed two-message stand-in history whose assistant turn carries a sentinel, and
keeps the text after that turn's end-of-turn marker. The stand-in makes the cost follow the new
messages, not the conversation's length.

The end-of-turn marker is read from the template itself (the special token it writes right after an
assistant turn), not from `eos_token` alone: Llama 3's package names the base model's
`<|end_of_text|>` there while its template closes turns with `<|eot_id|>`. Every id that ends an
answer (that marker, `eos_token`, `generation_config.json` / `config.json` eos ids) is a stop id.

`with_tool_injection` gives a copy that renders tools into the system message, assistant tool calls
as the family's call text and tool results as user turns, for templates that cannot show tools
(`stepline.gateway.tool_prompt`); an explicit opt-in of the operator.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from stepline.gateway.tokenizing import TokenizerPool, encode_here

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


@dataclass(frozen=True)
class Markers:
    """The special tokens a template writes and the engine stops at."""

    eos_token: str  # the end-of-turn marker the template writes after each assistant turn
    stop_token_ids: list[int]  # the model's own stop ids (the end-of-turn id is added to them)
    bos_token: str = ""  # the template's `bos_token` (Llama, Gemma write it; rendered, not added)
    template_eos: str | None = None  # the template's `eos_token`; None: eos_token


class ChatTemplate:
    """Render conversations with the model's template and turn text into token ids and back."""

    def __init__(self, source: str, tokenizer: Tokenizer, markers: Markers, context_length: int,
                 model_type: str = "") -> None:
        self.source = source
        self.template = compile_template(source)
        self.tokenizer = tokenizer
        self.eos_token = markers.eos_token
        eos_id = tokenizer.token_to_id(markers.eos_token)
        if eos_id is None:
            raise ValueError(f"end-of-turn token {markers.eos_token!r} is not in the tokenizer")
        self.eos_id: int = eos_id
        self.stop_token_ids = sorted({eos_id, *markers.stop_token_ids})
        self.context_length = context_length
        self.model_type = model_type
        self.bos_token = markers.bos_token
        self.template_eos = markers.eos_token if markers.template_eos is None else markers.template_eos
        self.inject: Callable[[list[Message], list[dict] | None], list[Message]] | None = None
        self.tokenizer_path: str | None = None  # tokenizer.json (what the tokenizer processes load)
        self.pool: TokenizerPool | None = None  # where long texts are tokenized (None: here)

    def with_tool_injection(self, inject: Callable[[list[Message], list[dict] | None], list[Message]]) -> ChatTemplate:
        """A copy whose renders pass the messages through `inject(messages, tools)` (and no tools)."""
        twin = copy.copy(self)
        twin.inject = inject
        return twin

    def with_pool(self, pool: TokenizerPool | None) -> ChatTemplate:
        """A copy whose `encode_ids` hands long texts to `pool`."""
        twin = copy.copy(self)
        twin.pool = pool
        return twin

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, eot_token: str | None = None) -> ChatTemplate:
        """`eot_token`: the end-of-turn token (None: read from the template, else `eos_token`)."""
        model_dir = Path(model_dir)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        source = tok_config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise ValueError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        eos, bos = _token(tok_config.get("eos_token")), _token(tok_config.get("bos_token")) or ""
        stop_ids = _as_list(gen_config.get("eos_token_id")) + _as_list(config.get("eos_token_id"))
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        if eos is None:
            eos = tokenizer.id_to_token(stop_ids[0])
        if (eos_id := tokenizer.token_to_id(eos)) is not None:
            stop_ids.append(eos_id)
        context = int(config.get("max_position_embeddings") or tok_config.get("model_max_length") or 4096)
        model_type = str(config.get("model_type") or config.get("text_config", {}).get("model_type", ""))
        probe = cls(source, tokenizer, Markers(eos, stop_ids, bos, eos), context, model_type)
        eot = eot_token or end_of_turn(probe) or eos
        template = cls(source, tokenizer, Markers(eot, stop_ids, bos, eos), context, model_type)
        template.tokenizer_path = str(model_dir / "tokenizer.json")
        return template

    def render(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool,
               options: dict[str, Any] | None = None) -> str:
        """`options`: extra template variables (a request's chat_template_kwargs, e.g. enable_thinking)."""
        if self.inject is not None:
            messages, tools = self.inject(messages, tools), None
        try:
            return self.template.render(
                **(options or {}), messages=messages, tools=tools or None,
                add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.template_eos,
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

    def encode_ids(self, text: str) -> np.ndarray:
        """int32 ids of `text`: a long one in a tokenizer process where this template has them (`with_pool`),
        else here (a long one with the GIL released while it is tokenized)."""
        if self.pool is not None and self.pool.wants(text):
            return self.pool.encode(text)
        return encode_here(self.tokenizer, text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@lru_cache(maxsize=4)
def _cached(path: str, mtime: float, eot_token: str | None) -> ChatTemplate:
    return ChatTemplate.from_model_dir(path, eot_token)


def load_template(model_dir: Path | str, eot_token: str | None = None) -> ChatTemplate:
    """`ChatTemplate.from_model_dir`, shared by the apps of one process (parsing tokenizer.json takes
    about a second for a 150k vocabulary). Read-only after loading, so sharing is safe."""
    path = Path(model_dir).resolve()
    return _cached(str(path), (path / "tokenizer.json").stat().st_mtime, eot_token)


def end_of_turn(template: ChatTemplate) -> str | None:
    """The special token the template writes right after an assistant turn's text (longest match), or
    None when the probe cannot render or no special token follows."""
    try:
        text = template.render(_STAND_IN, None, add_generation_prompt=False)
    except TemplateError:
        return None
    at = text.find(_SENTINEL)
    after = text[at + len(_SENTINEL):] if at >= 0 else ""
    specials = [t.content for t in template.tokenizer.get_added_tokens_decoder().values() if t.special]
    found = [s for s in specials if s and after.startswith(s)]
    return max(found, key=len) if found else None


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
