"""Each common model family through the gateway, with its real tokenizer and chat template (fetched
and cached by stepline.assets; skipped with the reason where they cannot be): Qwen3, Llama 3 as
packaged (eos_token <|end_of_text|>, turns end with <|eot_id|>), Llama 3.1, Gemma 3, SmolLM2.

- the profile read from the template (tool parser, end-of-turn token, tools support);
- rendering equals transformers' apply_chat_template on a multi-turn tool conversation (for templates
  without tools: on the conversation --inject-tools rewrites it into);
- the family's tool-call text, as real token ids decoded one at a time, parses into tool calls;
- the openai (Chat Completions, Responses) and anthropic SDKs complete a 3-turn tool conversation against an engine answering in the
  family's format, streamed and not; the records hold exactly the engine's ids, and each prompt
  extends the previous prompt + answer (token-exact reuse).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fakes.engine import FakeEngine, Scripted
from gateway_helpers import serve
from tokenizers import Tokenizer

from stepline.gateway.parsers import collect, make_parser
from stepline.gateway.profile import detect
from stepline.gateway.templating import ChatTemplate
from stepline.gateway.tool_prompt import injector


@dataclass(frozen=True)
class Family:
    asset: str  # stepline.assets fetcher
    model_type: str
    tool_parser: str
    eot: str
    tools_supported: bool
    calls: tuple[str, str]  # the model's call text for q="a" and q="b"


FAMILIES = {
    "qwen3": Family("qwen3", "qwen3", "hermes", "<|im_end|>", True,
                    tuple('<tool_call>\n{"name": "get", "arguments": {"q": "%s"}}\n</tool_call>' % q for q in "ab")),
    "llama3": Family("llama3", "llama", "llama3", "<|eot_id|>", False,
                     ('<|python_tag|>{"name": "get", "parameters": {"q": "a"}}', '{"name": "get", "parameters": {"q": "b"}}')),
    "llama3.1": Family("llama3_1", "llama", "llama3", "<|eot_id|>", False,
                       tuple('{"name": "get", "parameters": {"q": "%s"}}' % q for q in "ab")),
    "gemma3": Family("gemma3", "gemma3_text", "pythonic", "<end_of_turn>", False,
                     tuple('[get(q="%s")]' % q for q in "ab")),
    "smollm2": Family("smollm2-tokenizer", "llama", "hermes", "<|im_end|>", True,
                      tuple('<tool_call>\n{"name": "get", "arguments": {"q": "%s"}}\n</tool_call>' % q for q in "ab")),
}
TOOLS = [{"type": "function", "function": {"name": "get", "description": "Look something up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, Path]:
    """A model directory without weights: the family's tokenizer files and template, config.json, and a
    generation_config.json whose eos id is the package's eos_token alone (as packaged)."""
    from stepline import assets

    fam = FAMILIES[request.param]
    try:
        source = (assets.smollm2_tokenizer_dir() if fam.asset == "smollm2-tokenizer"
                  else assets.npm_tokenizer_dir(fam.asset))
    except assets.AssetUnavailable as exc:
        pytest.skip(f"{request.param} tokenizer unavailable ({exc})")
    out = tmp_path_factory.mktemp(request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    if request.param == "smollm2":  # the template the main job serves SmolLM2 with (tools in the system message)
        from stepline.models import TINY_CHAT_TEMPLATE

        (out / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    eos = tok_config["eos_token"]
    eos_id = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(eos if isinstance(eos, str) else eos["content"])
    (out / "config.json").write_text(json.dumps({"model_type": fam.model_type, "max_position_embeddings": 8192,
                                                 "eos_token_id": eos_id}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return fam, out


def conversation(fam: Family) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"q": "a"}'}}
    return [{"role": "system", "content": "You look things up."}, {"role": "user", "content": "What is a?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a is 1"},
            {"role": "assistant", "content": "a is 1."}, {"role": "user", "content": "And b?"}]


def test_profile_from_the_template(family: tuple[Family, Path]) -> None:
    fam, model_dir = family
    profile = detect(ChatTemplate.from_model_dir(model_dir))
    assert (profile.tool_parser, profile.eot_token, profile.tools_supported) == (fam.tool_parser, fam.eot,
                                                                                  fam.tools_supported)
    assert profile.append_only


def test_rendering_equals_transformers(family: tuple[Family, Path]) -> None:
    from transformers import AutoTokenizer

    fam, model_dir = family
    template = ChatTemplate.from_model_dir(model_dir)
    hf = AutoTokenizer.from_pretrained(model_dir)
    messages = conversation(fam)
    if fam.tools_supported:
        ours, tools = template.render(messages, TOOLS, add_generation_prompt=True), TOOLS
        theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    else:  # the conversation --inject-tools renders: plain turns the template can show
        plain = injector(fam.tool_parser)(messages, TOOLS)
        ours = template.with_tool_injection(injector(fam.tool_parser)).render(messages, TOOLS, True)
        theirs = hf.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        assert fam.calls[0].replace("<|python_tag|>", "").split("(")[0][:6] in ours  # the call, in the family's text
    assert ours == theirs
    assert template.encode(ours) == hf(theirs, add_special_tokens=False)["input_ids"]


def test_calls_parse_from_real_ids_one_token_at_a_time(family: tuple[Family, Path]) -> None:
    fam, model_dir = family
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    specs = {"get": TOOLS[0]["function"]["parameters"]}
    for q, text in zip("ab", fam.calls):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        parser, events, shown = make_parser(fam.tool_parser, "none", True, specs), [], ""
        for k in range(1, len(ids) + 1):  # the text an engine streams: decode of the ids so far, minus what was sent
            now = tok.decode(ids[:k], skip_special_tokens=False)
            events += parser.feed(now[len(shown):])
            shown = now
        out = collect(events + parser.finish())
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get", {"q": q})]
        assert out.content == ""


TURNS = 3


def engine_for(fam: Family, tok: Tokenizer) -> tuple[FakeEngine, list[list[int]]]:
    eot = tok.token_to_id(fam.eot)
    texts = [*fam.calls, "The answer is 42."]
    script = [Scripted(tok.encode(t, add_special_tokens=False).ids + [eot], text=t) for t in texts]
    engine = FakeEngine(script, eos_id=eot, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    return engine, [s.output_ids for s in script]


async def drive_chat(client: openai.AsyncOpenAI, stream: bool) -> list[str]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You look things up."},
                                      {"role": "user", "content": "What is it?"}]
    seen = []
    for _ in range(TURNS):
        if stream:
            async with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as s:
                async for _event in s:
                    pass
                message = (await s.get_final_completion()).choices[0].message
        else:
            message = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        calls = message.tool_calls or []
        seen += [json.loads(c.function.arguments)["q"] for c in calls]
        echo: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            echo["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        messages.append(echo)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "result"} for c in calls]
    assert message.content == "The answer is 42."
    return seen


async def drive_responses(client: openai.AsyncOpenAI, stream: bool) -> list[str]:
    tools = [{"type": "function", "name": "get", "description": "Look something up.",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    items: list[Any] = [{"role": "user", "content": "What is it?"}]
    seen = []
    for _ in range(TURNS):
        kwargs = {"model": "m", "input": items, "instructions": "You look things up.", "tools": tools}
        if stream:
            async with client.responses.stream(**kwargs) as s:
                async for _event in s:
                    pass
                response = await s.get_final_response()
        else:
            response = await client.responses.create(**kwargs)
        calls = [o for o in response.output if o.type == "function_call"]
        seen += [json.loads(c.arguments)["q"] for c in calls]
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "result"} for c in calls]
    assert response.output_text == "The answer is 42."
    return seen


async def drive_messages(client: anthropic.AsyncAnthropic, stream: bool) -> list[str]:
    tools = [{"name": "get", "description": "Look something up.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is it?"}]
    seen = []
    for _ in range(TURNS):
        kwargs = {"model": "m", "max_tokens": 200, "system": "You look things up.", "messages": messages, "tools": tools}
        if stream:
            async with client.messages.stream(**kwargs) as s:
                async for _event in s:
                    pass
                message = await s.get_final_message()
        else:
            message = await client.messages.create(**kwargs)
        uses = [b for b in message.content if b.type == "tool_use"]
        seen += [u.input["q"] for u in uses]
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "result"} for u in uses]})
    assert message.stop_reason == "end_turn"
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_sdks_complete_a_three_turn_tool_conversation(family: tuple[Family, Path], api: str, stream: bool,
                                                            tmp_path: Path) -> None:
    fam, model_dir = family
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine, expected = engine_for(fam, tok)
    async with engine as url, serve(model_dir, [url], tmp_path, inject_tools=not fam.tools_supported) as served:
        s = await served.session()
        if api == "messages":
            client: Any = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
            seen = await drive_messages(client, stream)
        else:
            client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
            seen = await (drive_chat if api == "chat" else drive_responses)(client, stream)
        await client.close()
        assert seen == ["a", "b"]
        await served.flush()
        calls = served.calls(s["session_id"])
        assert [output for _, output in calls] == expected  # exactly what the engine sampled
        for (prompt, output), (next_prompt, _) in zip(calls, calls[1:]):
            assert next_prompt[: len(prompt) + len(output)] == prompt + output


async def test_tools_without_template_support_get_400_naming_the_flag(tmp_path: Path) -> None:
    from stepline import assets

    try:
        source = assets.npm_tokenizer_dir("llama3")
    except assets.AssetUnavailable as exc:
        pytest.skip(f"llama3 tokenizer unavailable ({exc})")
    model_dir = tmp_path / "llama3"
    shutil.copytree(source, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|eot_id|>")
    answers = [Scripted(tok.encode(t, add_special_tokens=False).ids + [eot], text=t) for t in ("Hi.", "Fine.")]
    async with FakeEngine(answers, eos_id=eot, decode=lambda ids: tok.decode(ids, skip_special_tokens=False)) as url, \
            serve(model_dir, [url], tmp_path) as served:
        s = await served.session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers=headers) as http:
            messages = [{"role": "user", "content": "Hello"}]
            r = await http.post("/chat/completions", json={"messages": messages, "tools": TOOLS})
            assert r.status_code == 400 and "--inject-tools" in r.json()["error"]["message"]
            # the package as shipped works for multi-turn conversations (end-of-turn from the template)
            for _ in range(2):
                r = await http.post("/chat/completions", json={"messages": messages})
                assert r.status_code == 200, r.text
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "How are you?"}]


def test_injection_turns_tool_results_into_one_user_turn() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"q": "a"}'}}
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"}, {"role": "tool", "tool_call_id": "c1", "content": "r2"},
                {"role": "user", "content": "and?"}]
    out = injector("pythonic")(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # alternating, as Gemma 3 requires
    assert out[2]["content"] == '[get(q="a")]'  # the call in the family's own syntax
    assert out[3]["content"] == "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>\nand?"
    assert '"name": "get"' in out[0]["content"] and "func_name1(" in out[0]["content"]
    assert injector("llama3")(messages[:2], None)[1]["content"] == '{"name": "get", "parameters": {"q": "a"}}'


async def test_tool_results_to_a_template_without_tools_get_400_naming_the_flag(tmp_path: Path) -> None:
    """Gemma 3 as packaged: a tool result breaks its alternating roles; the 400 carries the template's own
    error and names the supported way (--inject-tools)."""
    from stepline import assets

    try:
        source = assets.npm_tokenizer_dir("gemma3")
    except assets.AssetUnavailable as exc:
        pytest.skip(f"gemma3 tokenizer unavailable ({exc})")
    model_dir = tmp_path / "gemma3"
    shutil.copytree(source, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "max_position_embeddings": 8192}))
    async with FakeEngine([], eos_id=1) as url, serve(model_dir, [url], tmp_path) as served:
        s = await served.session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"q": "a"}'}}
        messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r1"}]
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers=headers) as http:
            r = await http.post("/chat/completions", json={"messages": messages})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "alternate" in message and "--inject-tools" in message, message
