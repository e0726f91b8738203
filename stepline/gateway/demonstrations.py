"""Demonstrations as the gateway would have recorded them: a whole conversation in, one CallRecord per turn out.

    records_from_conversation(template, conversation, session_id, weight_version) -> list[CallRecord]

A scripted expert (a harness's `--expert` mode) writes the conversation it would have had with a model:
`{"messages": [...], "tools": [...]}` in the OpenAI chat form, or with Anthropic tools (`input_schema`) in the
Messages form. Each assistant turn becomes the call the gateway would have recorded for it: the request is
read by the gateway's own front end (chat or messages), the prompt comes from the session's token memory (so
turn N+1 reuses turn N's ids, as a served session does), and the output ids are the template's rendering of
the answer, closed by the end-of-turn token. Their logprobs are 0: no policy sampled them. The SFT warm start records them
at version 0; an expert episode in an RL group (`POST /sessions/<id>/demonstration`) at the version serving
then, and the trainer takes the policy's own logprobs for them (ratio 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stepline.datapool.records import CallRecord
from stepline.gateway.frontends import chat, messages
from stepline.gateway.frontends.prompting import ChatCall
from stepline.gateway.sessions import TokenState
from stepline.gateway.templating import ChatTemplate

__all__ = ["records_from_conversation"]


def records_from_conversation(template: ChatTemplate, conversation: dict[str, Any],
                              session_id: str, weight_version: int = 0) -> list[CallRecord]:
    """One CallRecord per assistant turn of `conversation`: the prompt the gateway would have sent and the
    tokens the model would have had to sample to give exactly that answer. ValueError when the template
    rewrites the history before a turn (no exact record of it exists)."""
    call = _chat_call(conversation)
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
                                  weight_version=weight_version, api=call.api, sampling={"temperature": 1.0}))
        state.remember(prompt, message, output)
    return records


def _chat_call(conversation: dict[str, Any]) -> ChatCall:
    """The conversation as the gateway's front end would see it (OpenAI or Anthropic form)."""
    msgs, tools = conversation["messages"], conversation.get("tools") or None
    if tools and "input_schema" in tools[0]:  # Anthropic: system is its own field
        system = [m["content"] for m in msgs if m["role"] == "system"]
        body = {"max_tokens": 1, "system": system[0] if system else None, "tools": tools,
                "messages": [m for m in msgs if m["role"] != "system"]}
        return messages.to_call(messages.MessagesRequest.model_validate(body))
    return chat.to_call(chat.ChatRequest.model_validate({"model": "", "messages": msgs, "tools": tools}), max_n=1)
