"""The gateway's tool-call parsers against someone else's tasks: BFCL's possible answers (bfcl-eval's
ground truth, as the bfcl harness's expert plays it) written the way each family's model writes calls,
parsed back by the gateway's parser for that family, whole and streamed in small pieces, and scored by
BFCL's own checker (the AST checker for single-turn tasks, the state-and-response checker for
multi-turn ones). Every call must come back as one BFCL accepts.

Each renderer writes what the family's chat template writes for an assistant turn with tool calls (its
`tool_calls` arguments as a mapping): Qwen3's `tojson` inside `<tool_call>`, Qwen3-Coder's `<parameter=...>`
blocks (strings as they are, mappings and lists as JSON, anything else through Jinja's `string`), GLM-4.5's
`<arg_key>/<arg_value>` pairs, Llama 3.1's `{"name", "parameters"}` after `<|python_tag|>`, Llama 3.2's
Python list, Mistral's `[TOOL_CALLS]` (v3 JSON list and v11 name[ARGS]), DeepSeek V3 / V3.1, Kimi K2 and
gpt-oss (harmony: one message per call).

Needs the bfcl-eval environment (scripts/setup.sh); skips without it. A sample of every category runs in
the suite; every task under `pytest -m slow tests/gateway/test_bfcl_calls.py` (about a minute).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from stepline.agents.bfcl.categories import CATEGORIES, category_of, is_multi_turn
from stepline.agents.bfcl.client import SOCKET_ENV, Bridge, available, start_server
from stepline.gateway.parsers import collect, make_parser
from stepline.gateway.parsers.base import is_text_param

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

Call = dict[str, Any]  # {"name": ..., "arguments": {...}}: one ground-truth call, as the expert plays it


def _jinja_string(value: Any) -> str:
    """Jinja's `string` filter on a JSON value loaded into Python: str() (True, None, 1.5)."""
    return str(value)


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(calls: list[Call]) -> str:
    return "\n".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (c["name"], _tojson(c["arguments"]))
                     for c in calls)


def qwen3_coder(calls: list[Call]) -> str:
    def value(v: Any) -> str:
        return _tojson(v) if isinstance(v, (dict, list)) else _jinja_string(v)

    return "\n".join("<tool_call>\n<function=%s>\n%s</function>\n</tool_call>" % (c["name"], "".join(
        f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in c["arguments"].items())) for c in calls)


def glm45(calls: list[Call]) -> str:
    def value(v: Any) -> str:
        return v if isinstance(v, str) else _tojson(v)

    return "".join("<tool_call>%s\n%s</tool_call>" % (c["name"], "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in c["arguments"].items()))
        for c in calls)


def llama3(calls: list[Call]) -> str:
    return "<|python_tag|>" + "; ".join('{"name": "%s", "parameters": %s}' % (c["name"], _tojson(c["arguments"]))
                                        for c in calls)


def pythonic(calls: list[Call]) -> str:
    return "[" + ", ".join("%s(%s)" % (c["name"], ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items()))
                           for c in calls) + "]"


def mistral_v3(calls: list[Call]) -> str:
    return "[TOOL_CALLS]" + _tojson([{"name": c["name"], "arguments": c["arguments"]} for c in calls])


def mistral_v11(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{_tojson(c['arguments'])}" for c in calls)


def deepseek_v3(calls: list[Call]) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>%s\n```json\n%s\n```<｜tool▁call▁end｜>" % (c["name"], _tojson(c["arguments"]))
        for c in calls) + "<｜tool▁calls▁end｜>"


def deepseek_v31(calls: list[Call]) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(
        "<｜tool▁call▁begin｜>%s<｜tool▁sep｜>%s<｜tool▁call▁end｜>" % (c["name"], _tojson(c["arguments"])) for c in calls
    ) + "<｜tool▁calls▁end｜>"


def kimi_k2(calls: list[Call]) -> str:
    return "<|tool_calls_section_begin|>" + "".join(
        "<|tool_call_begin|>functions.%s:%d<|tool_call_argument_begin|>%s<|tool_call_end|>" % (c["name"], i,
                                                                                                _tojson(c["arguments"]))
        for i, c in enumerate(calls)) + "<|tool_calls_section_end|>"


def harmony(calls: list[Call]) -> str:
    messages = ["<|channel|>commentary to=functions.%s <|constrain|>json<|message|>%s<|call|>" % (c["name"],
                                                                                              _tojson(c["arguments"]))
                for c in calls]
    return "<|start|>assistant".join(messages)


@dataclass(frozen=True)
class Family:
    parser: str  # the gateway's tool parser (its registry name)
    render: Callable[[list[Call]], str]  # how the family's model writes calls
    typed_by_schema: bool = False  # values are text, typed by the tool's schema (XML-style formats)


FAMILIES = {
    "hermes": Family("hermes", hermes),
    "qwen3_coder": Family("qwen3_coder", qwen3_coder, typed_by_schema=True),
    "glm45": Family("glm45", glm45, typed_by_schema=True),
    "llama3": Family("llama3", llama3),
    "pythonic": Family("pythonic", pythonic),
    "mistral-v3": Family("mistral", mistral_v3),
    "mistral-v11": Family("mistral", mistral_v11),
    "deepseekv3": Family("deepseekv3", deepseek_v3),
    "deepseekv31": Family("deepseekv31", deepseek_v31),
    "kimi_k2": Family("kimi_k2", kimi_k2),
    "gpt-oss": Family("gpt-oss", harmony),
}
SAMPLE_EVERY = 25  # the suite's sample: every 25th task of each category (its first always)


@dataclass
class Task:
    id: str
    tools: dict[str, Any]  # name -> parameters schema, as the gateway's parsers take them
    expert: list[list[list[Call]]]  # per user turn, per assistant message, its calls


def parsed(parser: str, text: str, tools: dict[str, Any], piece: int | None) -> list[list[Any]]:
    """[name, arguments JSON] of each call the gateway's parser reads from `text` (fed whole, or in pieces
    of `piece` characters, as a stream arrives)."""
    p = make_parser(parser, "none", True, tools, incremental=piece is not None)
    chunks = [text] if piece is None else [text[i:i + piece] for i in range(0, len(text), piece)]
    events = [e for chunk in chunks for e in p.feed(chunk)] + p.finish()
    return [[c.name, c.arguments] for c in collect(events).tool_calls]


def result_of(task_id: str, steps: list[list[list[list[Any]]]]) -> Any:
    """BFCL's raw result (as the harness's verifier builds it) of parsed calls: single-turn, the one
    message's calls; multi-turn, per user turn its steps' calls then the final text."""
    if not is_multi_turn(task_id):
        return [{name: arguments} for name, arguments in steps[0][0]]
    return [[[{name: arguments} for name, arguments in step] for step in turn] + ["Done."] for turn in steps]


def text_given_other(task: Task) -> bool:
    """The ground truth gives a parameter its schema declares a string something else (BFCL's live data does:
    `is_unisex: True` against enum ["True", "False", "dontcare"]). A format whose values are text typed by
    the schema reads the model's `True` as the string the schema asks for, as vLLM's and SGLang's parsers do,
    and BFCL's checker then wants the boolean: no parse could satisfy both."""
    return any(not isinstance(value, str) and is_text_param(call["name"], key, task.tools)
               for turn in task.expert for step in turn for call in step for key, value in call["arguments"].items())


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bridge]:
    """A connection to a warm bridge server (killed at the end: a pipe bridge takes seconds to exit)."""
    path = tmp_path_factory.mktemp("bfcl-calls") / "bridge.sock"
    server = start_server(path)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(SOCKET_ENV, str(path))
            with Bridge() as b:
                yield b
    finally:
        server.kill()
        server.wait()


def listed(bridge: Bridge, every: int) -> list[Task]:
    """Every `every`-th task of each category the harness lists (those whose ground truth, as the expert plays
    it, BFCL's checker accepts), with its tools' parameter schemas and the expert's calls."""
    tasks = []
    for ids in bridge.ask("tasks", categories=list(CATEGORIES)).values():
        for task_id in ids[::every]:
            tools = {t["function"]["name"]: t["function"].get("parameters") or {}
                     for t in bridge.ask("task", id=task_id)["tools"]}
            tasks.append(Task(task_id, tools, bridge.ask("expert", id=task_id)))
    return tasks


def failures(bridge: Bridge, family: Family, tasks: list[Task]) -> dict[str, str]:
    out = {}
    for task in tasks:
        if family.typed_by_schema and text_given_other(task):
            continue
        for piece in (None, 3):
            steps = [[parsed(family.parser, family.render(calls), task.tools, piece) for calls in turn]
                     for turn in task.expert]
            verdict = bridge.ask("check", id=task.id, result=result_of(task.id, steps))
            if not verdict["valid"]:
                out[f"{task.id} ({'whole' if piece is None else 'streamed'})"] = (
                    f"{verdict['error_type']}: {verdict['error']}; wrote {family.render(task.expert[0][0])[:300]!r}")
                break
    return out


@pytest.fixture(scope="module")
def sample(bridge: Bridge) -> list[Task]:
    return listed(bridge, SAMPLE_EVERY)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sample_of_every_category_round_trips(bridge: Bridge, sample: list[Task], family: str) -> None:
    assert {category_of(t.id) for t in sample} == set(CATEGORIES)
    assert failures(bridge, FAMILIES[family], sample) == {}


@pytest.fixture(scope="module")
def every_task(bridge: Bridge) -> list[Task]:
    return listed(bridge, 1)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_task_round_trips(bridge: Bridge, every_task: list[Task], family: str) -> None:
    assert failures(bridge, FAMILIES[family], every_task) == {}


def test_python_scalars_read_as_qwen3_coders_template_writes_them() -> None:
    """Jinja's `string` filter writes a boolean argument `True`: a boolean parameter gets the boolean, a
    string parameter keeps the text."""
    tools = {"f": {"type": "object", "properties": {"flag": {"type": "boolean"}, "word": {"type": "string"},
                                                    "n": {"type": "integer"}}}}
    text = qwen3_coder([{"name": "f", "arguments": {"flag": True, "word": "True", "n": None}}])
    for piece in (None, 3):
        assert parsed("qwen3_coder", text, tools, piece) == [["f", '{"flag": true, "word": "True", "n": null}']]
