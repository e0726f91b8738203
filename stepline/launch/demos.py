"""Expert demonstrations for the SFT warm start.

Each harness's `--expert` mode plays a scripted solver through the same tools and writes the
conversation it would have had with a model (`episode.json`: `messages` and `tools`, in the harness's
own API format). Here those conversations become pool sessions, token for token as the gateway would
have recorded them: the request is parsed by the gateway's own front end (OpenAI chat or Anthropic
messages), prompts come from the gateway's token memory (`TokenState`, so turn N+1 reuses turn N's ids)
and each assistant turn's ids are the template's rendering of it, closed by the end-of-turn token.
The sessions are ended and rewarded by the harness's verifier, so the trainer's SFT mode takes them as
ordinary groups.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Mapping
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from stepline.datapool.base import Pool
from stepline.datapool.records import CallRecord, Reward, SessionInfo
from stepline.gateway.frontends import chat, messages
from stepline.gateway.sessions import TokenState
from stepline.gateway.templating import ChatTemplate
from stepline.rollout.config import HarnessSpec
from stepline.rollout.demos import expert_episodes

__all__ = ["demo_calls", "collect_demos"]

Message = dict[str, Any]


def _chat_call(episode: dict[str, Any]):
    """The episode's conversation as the gateway's front end would see it (OpenAI or Anthropic form)."""
    msgs, tools = episode["messages"], episode.get("tools") or None
    if tools and "input_schema" in tools[0]:  # Anthropic: system is its own field
        system = [m["content"] for m in msgs if m["role"] == "system"]
        body = {"max_tokens": 1, "system": system[0] if system else None, "tools": tools,
                "messages": [m for m in msgs if m["role"] != "system"]}
        return messages.to_call(messages.MessagesRequest.model_validate(body))
    return chat.to_call(chat.ChatRequest.model_validate({"model": "", "messages": msgs, "tools": tools}), max_n=1)


def demo_calls(template: ChatTemplate, episode: dict[str, Any], session_id: str) -> list[CallRecord]:
    """One CallRecord per assistant turn of the episode: the prompt the gateway would have sent and the
    tokens the model would have had to sample to give exactly that answer."""
    call = _chat_call(episode)
    state = TokenState(template)
    records: list[CallRecord] = []
    for i, message in enumerate(call.messages):
        if message["role"] != "assistant":
            continue
        prompt = state.prompt_for(call.messages[:i], call.tools)
        before = template.render(call.messages[:i], call.tools, add_generation_prompt=True)
        after = template.render(call.messages[: i + 1], call.tools, add_generation_prompt=False)
        if not after.startswith(before):
            raise ValueError(f"{session_id}: the template rewrites history before turn {i}; cannot build a demo")
        answer = after[len(before):]
        answer = answer[: answer.index(template.eos_token) + len(template.eos_token)]
        output = np.asarray(template.encode(answer), dtype=np.int32)
        records.append(CallRecord(session_id=session_id, call_index=len(records), prompt_ids=prompt.ids,
                                  output_ids=output, output_logprobs=np.zeros(len(output), dtype=np.float32),
                                  weight_version=0, api=call.api, sampling={"temperature": 1.0}))
        state.remember(prompt, message, output)
    return records


def collect_demos(pool: Pool, model_dir: Path, specs: list[HarnessSpec], per_harness: int,
                  concurrency: int = 2, seed: int = 0, counts: Mapping[str, int] | None = None) -> dict[str, int]:
    """Run `per_harness` expert episodes of each module harness (`counts[name]` where given; a seeded sample
    of its train split) into `pool` as ended, rewarded sessions (one group each). Returns demonstrations
    written per harness."""
    template = ChatTemplate.from_model_dir(model_dir)
    written = {spec.name: 0 for spec in specs}
    with tempfile.TemporaryDirectory(prefix="stepline-demos-") as tmp:
        results = asyncio.run(expert_episodes([s for s in specs if s.module], per_harness, concurrency, Path(tmp), seed,
                                              counts))
    # round-robin over harnesses, so every SFT minibatch mixes them (the pool hands groups out in order)
    by_harness = [[r for r in results if r[0].name == spec.name] for spec in specs]
    interleaved = [row for rows in zip_longest(*by_harness) for row in rows if row is not None]
    for spec, task_id, result in interleaved:
        if result is None:
            continue
        episode, reward = result
        session_id = f"demo-{spec.name}-{task_id}-{uuid.uuid4().hex[:8]}"
        pool.create_session(SessionInfo(session_id=session_id, task_id=task_id, harness=spec.name,
                                        group_id=session_id, created_at=time.time(), purpose="demo"))
        pool.add_calls(demo_calls(template, episode, session_id))
        pool.add_reward(Reward(session_id=session_id, value=reward, created_at=time.time()))
        pool.end_session(session_id, "completed")
        written[spec.name] += 1
    return written
