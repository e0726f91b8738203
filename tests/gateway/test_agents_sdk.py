"""The unmodified OpenAI Agents SDK (`openai-agents`) on the Responses API, against an answer cut by
max_output_tokens: with OpenAI's behaviour (the default) the SDK raises ModelBehaviorError on the
`incomplete` status / `response.incomplete` event; with `responses_truncated = "completed"` the run
finishes with the cut text, `incomplete_details` still names the cause, and the pool records the call's
finish_reason `length` either way."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from agents.exceptions import ModelBehaviorError
from fakes.engine import FakeEngine
from gateway_helpers import END, Served, scripted, serve, tokenizer

CUT = "The answer is four hundred and"  # what the model wrote before its token budget ran out


def agent(s: dict) -> Agent:
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
    return Agent(name="solver", instructions="Answer briefly.",
                 model=OpenAIResponsesModel(model="m", openai_client=client),
                 model_settings=ModelSettings(max_tokens=7))


async def play(s: dict, stream: bool) -> str:
    """The agent's final output; streamed, the raw `response.completed` event also says why it stopped (the
    SDK's ModelResponse keeps no status: a harness sees the cause only in the raw events, and in the pool)."""
    config = RunConfig(tracing_disabled=True)  # no export to api.openai.com
    if not stream:
        return str((await Runner.run(agent(s), "What is 20 x 21?", run_config=config)).final_output)
    streamed = Runner.run_streamed(agent(s), "What is 20 x 21?", run_config=config)
    ends = [e.data.response async for e in streamed.stream_events()
            if e.type == "raw_response_event" and e.data.type == "response.completed"]
    assert [r.incomplete_details.reason if r.incomplete_details else None for r in ends] == ["max_output_tokens"]
    return str(streamed.final_output)


async def truncated_call(served: Served, session_id: str) -> str:
    await served.flush()
    [record] = served.pool.get_calls(session_id)
    return record.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["incomplete", "completed"])
async def test_an_answer_cut_by_max_output_tokens(mode: str, stream: bool, qwen3_model_dir: Path,
                                                  tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    engine = FakeEngine([scripted(tok, CUT, close=False)], eos_id=tok.token_to_id(END),
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, responses_truncated=mode) as served:
        s = await served.session()
        if mode == "incomplete":  # OpenAI's answer: the SDK turns the episode into an error
            with pytest.raises(ModelBehaviorError, match="incomplete.*max_output_tokens"):
                await play(s, stream)
        else:
            assert await play(s, stream) == CUT
        assert await truncated_call(served, s["session_id"]) == "length"
