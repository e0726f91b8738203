"""Sessions the gateway serves: ids, per-session API keys, call counters and token memory.

A call is attributed to a session by its URL (`/s/<id>/v1/...`), by its session key (Bearer or
x-api-key) on `/v1/...`, or by an `X-Session-Id` header. A session key acts on its own session only.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from datapool.records import SessionInfo
from gateway.forks import Replay
from gateway.templating import ChatTemplate
from gateway.tito import TextMemory, TokenState

log = logging.getLogger(__name__)


@dataclass
class Session:
    info: SessionInfo
    api_key: str
    tokens: TokenState
    texts: TextMemory  # the Completions API's raw-text prompts
    next_call: int = 0  # call indices are taken when a call's record is made: no gaps for failed calls
    ended: bool = False
    last_active: float = field(default_factory=time.monotonic)  # its latest call (or its creation)
    responses: dict[str, list] = field(default_factory=dict)  # Responses API: response id -> its conversation
    replay: Replay | None = None  # a fork on its way to its branch point (gateway/forks.py)

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

    def new(self, task_id: str, harness: str, group_id: str | None, metadata: dict) -> Session:
        info = SessionInfo(session_id="s-" + uuid.uuid4().hex, task_id=task_id, harness=harness,
                           group_id=group_id, metadata=metadata, created_at=time.time())
        key = "sk-stepline-" + secrets.token_urlsafe(24)
        return Session(info=info, api_key=key, tokens=TokenState(self.template, self.strict_template),
                       texts=TextMemory(self.template))

    def add(self, session: Session) -> None:
        """Make a session visible (after the pool has committed it)."""
        self._by_id[session.info.session_id] = session
        self._by_key[session.api_key] = session

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

    def by_key(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def end(self, session: Session) -> None:
        """Mark ended and free its token memory; the id stays known so later calls get a clear error."""
        session.ended = True
        self._live.pop(session.info.session_id, None)
        self._forget_tokens(session)

    def idle(self, seconds: float) -> list[Session]:
        """Open sessions without a call for more than `seconds` (the reaper ends them as abandoned)."""
        cutoff = time.monotonic() - seconds
        return [s for s in self._by_id.values() if not s.ended and s.last_active < cutoff]

    def open_ids(self) -> list[str]:
        """Ids of this gateway's sessions not ended (live, whatever their age)."""
        return [sid for sid, s in self._by_id.items() if not s.ended]

    def __len__(self) -> int:
        return len(self._by_id)
