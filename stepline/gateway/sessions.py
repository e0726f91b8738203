"""Sessions the gateway serves: ids, per-session API keys, call counters, and their token memory.

A call is attributed to a session by its URL (`/s/<id>/v1/...`), by its session key (Bearer or
x-api-key) on `/v1/...`, or by an `X-Session-Id` header. A session key acts on its own session only.

## Keys

Every route reads the key a request carries with `bearer_key` and compares it with the admin token with
`is_admin_key`: the model routes, the session routes and the admin routes alike, so a missing, empty or
non-Bearer `Authorization` (with no `x-api-key`) is no key everywhere. `admin_allowed` is the rule of the
admin routes and of `POST /sessions`: open when no admin token is configured, else only to that token.

## Token memory: token in, token out

The prompt ids of each call reuse the exact ids of the session's earlier calls (`TokenState`; `TextMemory` for
the Completions API's raw-text prompts).

A harness resends its whole history on every call. Rebuilding that history from text would change the
tokens the model actually produced (retokenization drift, templates that drop earlier reasoning), so
the trainer would train on tokens the policy never sampled. Instead, for each call:

1. Its messages are hashed as a chain: h_0 from the tools, h_i = hash(h_{i-1}, fingerprint(message_i)).
2. An exact retry (h_n seen as an earlier call's messages) reuses that call's prompt ids.
3. Otherwise the longest prefix m_1..m_k whose hash is an earlier call's messages + its answer reuses
   that call's prompt ids + output ids (ending with the end-of-turn token), and only m_{k+1}..m_n are
   rendered (`ChatTemplate.continuation`) and tokenized. The cost follows the new messages.
4. With no reusable prefix the whole conversation is rendered and tokenized.

An assistant message's fingerprint keeps what the harness is expected to echo (text and tool calls,
arguments compared as JSON) and ignores reasoning and ids, so the model's own earlier tokens — its
reasoning included — stay the context even when the harness drops them (the default).

`strict=True` follows the template instead: every call renders the whole conversation, and reuses an
earlier call's ids only where the rendered text begins with that call's prompt and output text. Where
the template rewrites history (Qwen3 drops reasoning of earlier turns), the tokens differ from the
model's own and the session's tree forks there. Its cost follows the context length.

When a call is not append-only (compaction, an edited message, a retry) the ids it shares with an
earlier call are exactly the reused ones plus whatever the template renders identically, so recorded
calls diverge at the first differing token.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from stepline.datapool.records import Purpose, SessionInfo
from stepline.gateway.forks import Replay
from stepline.gateway.templating import ChatTemplate, Message

log = logging.getLogger(__name__)


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of a request's headers: `Authorization: Bearer <key>`, else `x-api-key`; None when empty."""
    auth = headers.get("Authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def is_admin_key(key: str | None, admin_token: str | None) -> bool:
    """The key is the configured admin token (compared in constant time); never when none is configured."""
    return admin_token is not None and key is not None and hmac.compare_digest(key.encode(), admin_token.encode())


def admin_allowed(key: str | None, admin_token: str | None) -> bool:
    """The admin routes and `POST /sessions`: open without an admin token, else only to it."""
    return admin_token is None or is_admin_key(key, admin_token)


LastRequest = tuple[tuple[int, ...], bytes]  # (call indices, the raw request body they were recorded for)


@dataclass
class Session:
    info: SessionInfo
    api_key: str
    tokens: TokenState
    texts: TextMemory  # the Completions API's raw-text prompts
    next_call: int = 0  # call indices are taken when a call's record is made: no gaps for failed calls
    ended: bool = False
    last_active: float = field(default_factory=time.monotonic)  # its latest call's start or end (or its creation)
    calls_in_flight: int = 0  # a session with a call running is never idle, however long the call takes
    responses: dict[str, list] = field(default_factory=dict)  # Responses API: response id -> its conversation
    replay: Replay | None = None  # a fork on its way to its branch point (stepline/gateway/forks.py)
    forks: int = 0  # forks made from this session (bounded: GatewaySettings.max_forks_per_session)
    # the runner's sampling for every call of this session (POST /sessions `sampling`), over the request's own
    sampling: dict[str, Any] = field(default_factory=dict)
    # its latest request body and the calls recorded for it: a turn extending one of them records only the bytes
    # of its body after those they share (one body per session is kept, not one per turn)
    last_request: LastRequest | None = None

    def take_call_index(self) -> int:
        index = self.next_call
        self.next_call += 1
        return index


class SessionStore:
    """In-memory index of the sessions this gateway created (the pool keeps the durable copy).

    At most `max_live` open sessions keep token memory; past that, the least recently used one's is
    dropped (logged): if it calls again, its history is rendered from the template, and its tree forks
    wherever that differs from the model's own tokens."""

    def __init__(self, template: ChatTemplate, strict_template: bool = False, max_live: int = 50_000) -> None:
        self.template = template
        self.strict_template = strict_template
        self.max_live = max_live
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._live: OrderedDict[str, Session] = OrderedDict()  # sessions with token memory, least recent first
        self._open_forks: Counter[str] = Counter()  # group key -> forks of that group not ended

    def new(self, task_id: str, harness: str, group_id: str | None, metadata: dict,
            purpose: Purpose = "train") -> Session:
        info = SessionInfo(session_id="s-" + uuid.uuid4().hex, task_id=task_id, harness=harness,
                           group_id=group_id, metadata=metadata, created_at=time.time(), purpose=purpose)
        key = "sk-stepline-" + secrets.token_urlsafe(24)
        return Session(info=info, api_key=key, tokens=TokenState(self.template, self.strict_template),
                       texts=TextMemory(self.template))

    def add(self, session: Session) -> None:
        """Make a session visible (after the pool has committed it)."""
        self._by_id[session.info.session_id] = session
        self._by_key[session.api_key] = session
        if session.info.fork_of is not None:
            self._open_forks[session.info.group_key] += 1

    def open_forks(self, group_key: str) -> int:
        """Forks of this group (made through this gateway) not ended."""
        return self._open_forks[group_key]

    def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def touch(self, session: Session) -> None:
        """A call of this session: keep its token memory, dropping the least recently used past max_live."""
        session.last_active = time.monotonic()
        self._live[session.info.session_id] = session
        self._live.move_to_end(session.info.session_id)
        while len(self._live) > self.max_live:
            _, idle = self._live.popitem(last=False)
            log.warning("session %s: token memory dropped (more than %d live sessions)", idle.info.session_id,
                        self.max_live)
            self._forget_tokens(idle)

    def _forget_tokens(self, session: Session) -> None:
        session.tokens = TokenState(self.template, self.strict_template)
        session.texts = TextMemory(self.template)
        session.responses.clear()
        session.last_request = None

    def by_key(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def end(self, session: Session) -> None:
        """Mark ended and free its token memory; the id stays known so later calls get a clear error."""
        if not session.ended and session.info.fork_of is not None:
            self._open_forks[session.info.group_key] -= 1
        session.ended = True
        self._live.pop(session.info.session_id, None)
        self._forget_tokens(session)

    def hold(self, session: Session) -> None:
        """A call of this session has started: it is not idle until `release`."""
        session.calls_in_flight += 1

    def release(self, session: Session) -> None:
        """A call of this session has ended (answered or failed): its idle time counts from now."""
        session.calls_in_flight -= 1
        session.last_active = time.monotonic()

    def idle(self, seconds: float, fork_seconds: float | None = None) -> list[Session]:
        """Open sessions with no call running and none started or ended in the last `seconds` (forks: in the
        last `fork_seconds`, when given); the reaper ends them as abandoned."""
        now = time.monotonic()
        cutoff, fork_cutoff = now - seconds, now - (seconds if fork_seconds is None else fork_seconds)
        return [s for s in self._by_id.values() if not s.ended and not s.calls_in_flight
                and s.last_active < (fork_cutoff if s.info.fork_of is not None else cutoff)]

    def open_ids(self) -> list[str]:
        """Ids of this gateway's sessions not ended (live, whatever their age)."""
        return [sid for sid, s in self._by_id.items() if not s.ended]

    def __len__(self) -> int:
        return len(self._by_id)


# --- token memory ---

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class Segments:
    """Token ids as a chain of segments: each turn keeps only its new ids and points to the turn it
    extends, so a session's token memory grows with its tokens, not with turns × context."""

    parent: Segments | None
    tail: np.ndarray  # int32: the ids this segment adds
    length: int  # ids from the root through this segment
    call: int = -1  # the recorded call whose prompt + output these ids begin with (-1: none)
    recorded: int = 0  # how many of these ids are that call's prompt + output (an appended end-of-turn is not)

    def extend(self, ids: np.ndarray) -> Segments:
        return Segments(self, ids, self.length + len(ids))

    def of_call(self, call: int, recorded: int) -> Segments:
        """The same ids, known as the first `recorded` ids of recorded call `call`'s prompt + output."""
        return Segments(self.parent, self.tail, self.length, call, recorded)

    def array(self) -> np.ndarray:
        parts = []
        node: Segments | None = self
        while node is not None:
            parts.append(node.tail)
            node = node.parent
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])


def _root(ids: np.ndarray) -> Segments:
    return Segments(None, ids, len(ids))


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray  # int32 [P]: the prompt the engine receives
    reused: int  # leading ids taken from an earlier call of the session (0: rendered from scratch)
    key: int  # hash of the tools + messages: with the answer's fingerprint, the key of the next turn
    text: str = ""  # the rendered prompt (strict mode only)
    node: Segments | None = None  # the prompt in the session's segment chain (default mode)
    base: Segments | None = None  # the earlier turn it extends; base.call >= 0: recorded, the prompt is its delta


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def fingerprint(message: Message) -> bytes:
    """What of a message decides its tokens, as bytes; assistant reasoning and tool-call ids excluded."""
    role = message.get("role")
    content = message.get("content") or ""
    if role == "assistant":
        text = content.split("</think>")[-1].strip() if isinstance(content, str) else content
        calls = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
                 for c in message.get("tool_calls") or []]
        key: Any = ("assistant", text, calls)
    else:
        key = (role, content, message.get("name"), message.get("tool_call_id"))
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def chain(tools: list[dict] | None, messages: list[Message], known: tuple[list, list[int]] | None = None,
          options: dict[str, Any] | None = None) -> list[int]:
    """h_0..h_n: hashes of the tools (and template options) and each prefix of the messages. `known` =
    (messages, hashes) of an earlier call: the prefix equal to it (compared as dicts, in C) is not
    fingerprinted again."""
    head = hash(orjson.dumps([tools or [], options or {}], option=orjson.OPT_SORT_KEYS))
    hashes, start = [head], 0
    if known is not None and known[1] and known[1][0] == head:
        earlier, earlier_hashes = known
        limit = min(len(earlier), len(messages))
        while start < limit and messages[start] == earlier[start]:
            start += 1
        hashes = earlier_hashes[: start + 1]
    for message in messages[start:]:
        hashes.append(hash((hashes[-1], fingerprint(message))))
    return hashes


class TokenState:
    """One session's token memory: which ids each earlier call's messages (and answers) became."""

    def __init__(self, template: ChatTemplate, strict: bool = False, max_entries: int = 256) -> None:
        self.template = template
        self.strict = strict
        self.max_entries = max_entries
        self._prompts: OrderedDict[int, Segments] = OrderedDict()  # h(messages) -> prompt ids
        self._turns: OrderedDict[int, Segments] = OrderedDict()  # h(messages + answer) -> ids through the answer
        self._texts: OrderedDict[str, np.ndarray] = OrderedDict()  # strict: rendered text -> its ids
        self._last: tuple[list, list[int]] | None = None  # the last call's messages and hash chain

    def prompt_for(self, messages: list[Message], tools: list[dict] | None,
                   options: dict[str, Any] | None = None) -> Prompt:
        """`options`: extra template variables (chat_template_kwargs); part of the key of every turn."""
        if self.strict:
            return self._strict_prompt(messages, tools, options)
        hashes = chain(tools, messages, self._last, options)
        self._last = (list(messages), hashes)  # turn N+1 fingerprints only what follows these
        if (node := self._prompts.get(hashes[-1])) is not None:
            return Prompt(node.array(), node.length, hashes[-1], node=node, base=node)
        for k in range(len(messages), 0, -1):
            if messages[k - 1].get("role") == "assistant" and (base := self._turns.get(hashes[k])) is not None:
                node = base.extend(self.template.encode_ids(self.template.continuation(messages[k:], tools, options)))
                return Prompt(node.array(), base.length, hashes[-1], node=node, base=base)
        text = self.template.render(messages, tools, add_generation_prompt=True, options=options)
        node = _root(self.template.encode_ids(text))
        return Prompt(node.tail, 0, hashes[-1], node=node)

    def remember(self, prompt: Prompt, answer: Message, output_ids: np.ndarray, call: int = -1) -> None:
        """Store a finished call (`call`: its index, -1 where it was not recorded: a fork's replayed answer), so
        that a later prompt reusing its ids is recorded as a delta of it. A turn the model did not close (length,
        stop string) gets the end-of-turn token appended, as the template would write it (an observation token)."""
        output = np.asarray(output_ids, dtype=np.int32)
        tail = output
        if len(tail) == 0 or int(tail[-1]) not in self.template.stop_token_ids:
            tail = np.concatenate([tail, np.asarray([self.template.eos_id], dtype=np.int32)])
        if self.strict or prompt.node is None:
            text = prompt.text + self.template.decode(tail.tolist())
            _put(self._texts, text, np.concatenate([prompt.ids, tail]), self.max_entries)
            return
        node, turn = prompt.node, prompt.node.extend(tail)
        if call >= 0:
            node, turn = node.of_call(call, node.length), turn.of_call(call, node.length + len(output))
        _put(self._prompts, prompt.key, node, self.max_entries)
        _put(self._turns, hash((prompt.key, fingerprint(answer))), turn, self.max_entries)

    def _strict_prompt(self, messages: list[Message], tools: list[dict] | None, options: dict[str, Any] | None) -> Prompt:
        text = self.template.render(messages, tools, add_generation_prompt=True, options=options)
        if (ids := self._texts.get(text)) is not None:
            return Prompt(ids, len(ids), 0, text)
        best, base = "", _EMPTY
        for earlier, earlier_ids in reversed(self._texts.items()):
            if len(earlier) > len(best) and text.startswith(earlier) and earlier.endswith(self.template.eos_token):
                best, base = earlier, earlier_ids
        new = self.template.encode_ids(text[len(best):])
        prompt = Prompt(np.concatenate([base, new]), len(base), 0, text)
        _put(self._texts, text, prompt.ids, self.max_entries)  # an exact retry reuses these ids
        return prompt



class TextMemory:
    """Token memory for raw-text prompts (the Completions API): a prompt that begins with an earlier
    call's prompt text + answer text reuses that call's ids and tokenizes only the rest."""

    def __init__(self, template: ChatTemplate, max_entries: int = 64) -> None:
        self.template = template
        self.max_entries = max_entries
        self._paths: OrderedDict[str, np.ndarray] = OrderedDict()  # prompt + answer text -> ids
        self._exact: OrderedDict[str, np.ndarray] = OrderedDict()  # prompt text -> ids (exact retries only)

    def prompt_for(self, text: str) -> Prompt:
        if (ids := self._exact.get(text)) is not None:
            return Prompt(ids, len(ids), 0, text)
        best, base = "", _EMPTY
        for earlier, ids in reversed(self._paths.items()):
            if len(earlier) > len(best) and text.startswith(earlier):
                best, base = earlier, ids
        new = self.template.encode_ids(text[len(best):]) if text != best else _EMPTY
        return Prompt(np.concatenate([base, new]), len(base), 0, text)

    def remember(self, prompt: Prompt, output_ids: np.ndarray, output_text: str) -> None:
        """Keep prompt + output when the output's ids decode to exactly its text (a stop token the
        text leaves out is dropped first); otherwise keep the prompt alone."""
        ids = output_ids
        if len(ids) and int(ids[-1]) in self.template.stop_token_ids:
            ids = ids[:-1]
        if self.template.decode(ids.tolist()) == output_text:
            _put(self._paths, prompt.text + output_text, np.concatenate([prompt.ids, ids]), self.max_entries)
        _put(self._exact, prompt.text, prompt.ids, self.max_entries)


def _put(table: OrderedDict, key: Any, ids: Any, limit: int) -> None:
    table[key] = ids
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
