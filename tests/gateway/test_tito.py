"""Token-exact rendering on the real Qwen3 template: which ids each turn's prompt reuses, and where
calls that are not append-only diverge (exactly at the first differing token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stepline.gateway.sessions import TextMemory, TokenState
from stepline.gateway.templating import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "get", "description": "fetch",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'
CALL = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"q": "x"}'}}


@pytest.fixture(scope="module")
def template(qwen3_model_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_model_dir(qwen3_model_dir)


def answer(template: ChatTemplate, text: str) -> np.ndarray:
    """What the engine samples for `text`: its ids and the end-of-turn token."""
    return np.asarray(template.encode(text) + [template.eos_id], dtype=np.int32)


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_render_matches_transformers(template: ChatTemplate, qwen3_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_model_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "r"}, {"role": "user", "content": "ünïcode & <b>"}]
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert template.render(messages, TOOLS, add_generation_prompt=True) == expected
    assert template.encode(expected) == hf(expected, add_special_tokens=False)["input_ids"]


def test_append_only_turn_reuses_ids_and_tokenizes_only_the_new_messages(template: ChatTemplate) -> None:
    state = TokenState(template)
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    p1 = state.prompt_for(history, None)
    assert p1.reused == 0
    assert p1.ids.tolist() == template.encode(template.render(history, None, add_generation_prompt=True))
    out1 = answer(template, "Hello")
    state.remember(p1, {"role": "assistant", "content": "Hello"}, out1)
    history += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]
    p2 = state.prompt_for(history, None)
    assert p2.reused == len(p1.ids) + len(out1)
    tail = template.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert p2.ids.tolist() == p1.ids.tolist() + out1.tolist() + tail
    # here the template writes the earlier turn exactly as the model did, so this is also the full rendering
    assert p2.ids.tolist() == template.encode(template.render(history, None, add_generation_prompt=True))


def test_default_keeps_the_models_reasoning_strict_forks_at_it(template: ChatTemplate) -> None:
    history = [{"role": "user", "content": "hi"}]
    model_text = "<think>\nlet me see\n</think>\n\nHello"
    follow = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]  # reasoning dropped
    default, strict = TokenState(template), TokenState(template, strict=True)
    for state in (default, strict):
        p1 = state.prompt_for(history, None)
        out1 = answer(template, model_text)
        state.remember(p1, {"role": "assistant", "content": "Hello", "reasoning_content": "let me see"}, out1)
    path = p1.ids.tolist() + out1.tolist()
    kept = default.prompt_for(history + follow, None).ids.tolist()
    assert kept[: len(path)] == path  # the model's own <think> tokens stay the context
    rewritten = strict.prompt_for(history + follow, None).ids.tolist()
    # Qwen3's template renders the earlier turn without its reasoning: the strict prompt leaves the
    # model's tokens at its first output token (<think>) and follows the template from there
    assert first_difference(rewritten, path) == len(p1.ids)
    assert path[len(p1.ids)] == template.tokenizer.token_to_id("<think>")
    assert rewritten == template.encode(template.render(history + follow, None, add_generation_prompt=True))


def test_strict_keeps_the_models_ids_where_the_template_reproduces_them(template: ChatTemplate) -> None:
    state = TokenState(template, strict=True)
    history = [{"role": "user", "content": "hi"}]
    p1 = state.prompt_for(history, TOOLS)
    out1 = answer(template, "<think>\nR\n</think>\n\n" + CALL_TEXT)
    state.remember(p1, {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "R"}, out1)
    echoed = history + [{"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "R"},
                        {"role": "tool", "content": "42"}]
    p2 = state.prompt_for(echoed, TOOLS)
    assert p2.reused == len(p1.ids) + len(out1)
    assert p2.ids.tolist()[: p2.reused] == p1.ids.tolist() + out1.tolist()


def test_retry_reuses_the_prompt_exactly(template: ChatTemplate) -> None:
    state = TokenState(template)
    history = [{"role": "user", "content": "hi"}]
    p1 = state.prompt_for(history, TOOLS)
    state.remember(p1, {"role": "assistant", "content": "x"}, answer(template, "x"))
    again = state.prompt_for(history, TOOLS)
    assert again.ids.tolist() == p1.ids.tolist() and again.reused == len(p1.ids)


def _tool_conversation(template: ChatTemplate, state: TokenState, first_result: str) -> tuple[list, list[np.ndarray]]:
    """user → call → result → call → result, the model's answers scripted; returns messages and prompts."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "find it"}]
    prompts = []
    for result in (first_result, "beta"):
        prompt = state.prompt_for(messages, TOOLS)
        prompts.append(prompt)
        state.remember(prompt, {"role": "assistant", "content": "", "tool_calls": [CALL]}, answer(template, CALL_TEXT))
        messages += [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": result}]
    return messages, prompts


def test_edited_tool_result_diverges_at_its_first_token(template: ChatTemplate) -> None:
    state = TokenState(template)
    messages, prompts = _tool_conversation(template, state, "alpha")
    original = state.prompt_for(messages, TOOLS).ids.tolist()
    edited_messages = [dict(m) for m in messages]
    edited_messages[3]["content"] = "omega"  # the harness rewrites the first tool result
    edited = state.prompt_for(edited_messages, TOOLS).ids.tolist()
    first_turn = prompts[0].ids.tolist() + answer(template, CALL_TEXT).tolist()
    opening = template.encode("\n<|im_start|>user\n<tool_response>\n")
    assert first_difference(original, edited) == len(first_turn) + len(opening)
    assert edited[: len(first_turn)] == first_turn  # still the model's own first turn


def test_compaction_diverges_after_the_shared_system_prompt(template: ChatTemplate) -> None:
    state = TokenState(template)
    messages, _ = _tool_conversation(template, state, "alpha")
    before = state.prompt_for(messages, None).ids.tolist()
    compacted = [{"role": "system", "content": "S"}, {"role": "user", "content": "summary: found nothing"}]
    after = state.prompt_for(compacted, None).ids.tolist()
    shared = template.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n")
    assert first_difference(before, after) == len(shared)


def test_turn_cut_by_length_is_closed_with_the_end_of_turn_token(template: ChatTemplate) -> None:
    state = TokenState(template)
    p1 = state.prompt_for([{"role": "user", "content": "hi"}], None)
    cut = np.asarray(template.encode("Hel"), dtype=np.int32)  # max_tokens reached, no <|im_end|>
    state.remember(p1, {"role": "assistant", "content": "Hel"}, cut)
    p2 = state.prompt_for([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"},
                           {"role": "user", "content": "go on"}], None)
    assert p2.ids.tolist()[: len(p1.ids) + len(cut) + 1] == p1.ids.tolist() + cut.tolist() + [template.eos_id]


def test_tool_call_arguments_match_as_json(template: ChatTemplate) -> None:
    """A harness that re-serialises the arguments (other spacing, key order) still extends the turn."""
    state = TokenState(template)
    history = [{"role": "user", "content": "hi"}]
    p1 = state.prompt_for(history, TOOLS)
    call = {"id": "a", "type": "function", "function": {"name": "get", "arguments": '{"q": "x", "n": 1}'}}
    state.remember(p1, {"role": "assistant", "content": "", "tool_calls": [call]}, answer(template, CALL_TEXT))
    echoed = {"id": "other", "type": "function", "function": {"name": "get", "arguments": '{"n":1,"q":"x"}'}}
    p2 = state.prompt_for(history + [{"role": "assistant", "content": None, "tool_calls": [echoed]},
                                     {"role": "tool", "content": "r"}], TOOLS)
    assert p2.reused == len(p1.ids) + len(answer(template, CALL_TEXT))


def test_text_memory_reuses_prompt_and_answer_ids(template: ChatTemplate) -> None:
    memory = TextMemory(template)
    p1 = memory.prompt_for("Once upon a time")
    out = np.asarray(template.encode(" there was") + [template.eos_id], dtype=np.int32)
    memory.remember(p1, out, " there was")
    p2 = memory.prompt_for("Once upon a time there was a cat")
    assert p2.ids.tolist() == p1.ids.tolist() + out[:-1].tolist() + template.encode(" a cat")


def test_template_options_reach_the_template_and_key_the_turns(template: ChatTemplate) -> None:
    state = TokenState(template)
    off = {"enable_thinking": False}
    history = [{"role": "user", "content": "hi"}]
    p1 = state.prompt_for(history, None, off)
    assert template.decode(p1.ids.tolist()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out1 = answer(template, "Hello")
    state.remember(p1, {"role": "assistant", "content": "Hello"}, out1)
    history += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]
    p2 = state.prompt_for(history, None, off)
    assert p2.ids.tolist()[: len(p1.ids) + len(out1)] == p1.ids.tolist() + out1.tolist()
    assert template.decode(p2.ids.tolist()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert state.prompt_for(history, None).reused == 0  # other options: another conversation
