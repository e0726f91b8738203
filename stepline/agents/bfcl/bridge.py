"""BFCL's own code behind a JSON-lines pipe: run by the bfcl-eval environment's interpreter, never imported by Stepline.

    $STEPLINE_BFCL_PYTHON stepline/agents/bfcl/bridge.py             one client on stdin/stdout
    $STEPLINE_BFCL_PYTHON stepline/agents/bfcl/bridge.py --socket S  a forking server on the Unix socket S

bfcl-eval pins numpy==1.26.4 and pulls a dozen provider SDKs, so it lives in an environment of its own
(scripts/setup.sh). This file imports only the standard library and `bfcl_eval`: the wheel's data loaders,
its tool conversion, its multi-turn API classes and executor, its decoders and its checkers decide
everything; nothing here re-implements them. Requests are one JSON object a line, `{"op": ..., ...}`;
each answer is `{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`.

    tasks   {categories}            -> {category: [task id, ...]} in the files' order (those whose expert answer
                                       BFCL's checker accepts: see answerable)
    task    {id}                    -> {id, category, tools (OpenAI chat.completions), turns, ground_truth}
    expert  {id}                    -> the ground truth as tool calls: [[[{name, arguments}] per step] per turn]
    open    {id}                    -> the API classes of a multi-turn task, instantiated from its initial_config
    execute {calls: [{name, arguments}]} -> one result text per call, executed on the opened instances
    check   {id, result}            -> {valid, error_type, error}: BFCL's AST or multi-turn checker's verdict

A connection's state (the opened instances) is its own: the server forks a child per connection from
its warm state (imports and data loaded once), and the instances BFCL keeps in module globals die
with that child.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import inspect
import itertools
import json
import keyword
import os
import signal
import socketserver
import sys
import tempfile
from functools import cache
from typing import Any, Protocol

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
              "live_parallel", "live_parallel_multiple", "multi_turn_base")
# The checkers look a model's registry entry up (the AST checker's "." -> "_" rule for function names):
# an OpenAI function-calling entry, as the harness speaks OpenAI function calling.
CHECKER_MODEL = "gpt-4o-2024-11-20-FC"
_ids = itertools.count()
_PR_SET_PDEATHSIG = 1


class BridgeError(Exception):
    """A request that cannot be answered (unknown task, unknown op, a multi-turn op before open)."""


@cache
def _decoder() -> Any:
    """BFCL's chat.completions function-calling handler, used only for its decoders (it never queries)."""
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # its constructor builds an OpenAI client
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    return OpenAICompletionsHandler(model_name=CHECKER_MODEL, temperature=0, registry_name=CHECKER_MODEL,
                                    is_fc_model=True)


@cache
def _entries(category: str, hint: bool) -> dict[str, dict[str, Any]]:
    """A category's entries by id; `hint` as BFCL's inference loads them (language hints in the function
    docs), without it as its evaluation does."""
    from bfcl_eval.utils import load_dataset_entry

    return {e["id"]: e for e in load_dataset_entry(category, include_prereq=False, include_language_specific_hint=hint)}


@cache
def _answers(category: str) -> dict[str, Any]:
    from bfcl_eval.utils import load_ground_truth_entry

    return {e["id"]: e["ground_truth"] for e in load_ground_truth_entry(category)}


def category_of(task_id: str) -> str:
    from bfcl_eval.utils import extract_test_category_from_id

    category = extract_test_category_from_id(task_id)
    if category not in CATEGORIES or task_id not in _entries(category, True):
        raise BridgeError(f"unknown task {task_id!r}")
    return category


def _tools(entry: dict[str, Any]) -> list[dict[str, Any]]:
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    return convert_to_tool(entry["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)


def op_task(task_id: str) -> dict[str, Any]:
    category = category_of(task_id)
    entry = _entries(category, True)[task_id]
    return {"id": task_id, "category": category, "tools": _tools(entry), "turns": entry["question"],
            "ground_truth": _answers(category)[task_id]}


def _choose(alternatives: Any, required: bool = False) -> tuple[bool, Any]:
    """(give it, value) from a parameter's possible answers: left out where it may be ("" among them) unless
    the function requires it, else the first (a required one's first other than ""). Leaving optional parameters out
    keeps each call of a parallel answer from matching a sibling's possible answer that lists other parameters
    (the checker matches calls to answers without order)."""
    if not isinstance(alternatives, list):
        return True, alternatives
    if not alternatives:
        return False, None
    if "" in alternatives and not required:
        return False, None
    return True, _resolve(next((a for a in alternatives if a != ""), ""))


def _resolve(value: Any) -> Any:
    """Possible answers nest: a dict's values are lists of alternatives, as are those of a list's dicts."""
    if isinstance(value, dict):
        return {k: v for k, (give, v) in ((k, _choose(alts)) for k, alts in value.items()) if give}
    if isinstance(value, list):
        return [_resolve(v) if isinstance(v, dict) else v for v in value]
    return value


def _openai_name(name: str) -> str:
    return name.replace(".", "_")  # convert_to_tool's rule for OpenAI function names


def _single_turn_expert(task_id: str, answer: list[dict[str, Any]]) -> list[list[list[dict[str, Any]]]]:
    functions = {f["name"]: f for f in _entries(category_of(task_id), True)[task_id]["function"]}
    calls = []
    for call in answer:
        (name, params), = call.items()
        required = set(functions.get(name, {}).get("parameters", {}).get("required", []))
        arguments = {k: v for k, (give, v) in ((k, _choose(alts, k in required)) for k, alts in params.items()) if give}
        calls.append({"name": _openai_name(name), "arguments": arguments})
    return [[calls]]


def _multi_turn_expert(task_id: str, answer: list[list[str]]) -> list[list[list[dict[str, Any]]]]:
    """Each ground-truth call string (`sort('report.pdf')`) as keyword arguments of the class method it names."""
    entry = _entries("multi_turn_base", True)[task_id]
    methods = {name: method for cls in _classes(entry) for name, method in inspect.getmembers(cls, inspect.isfunction)}
    turns = []
    for calls in answer:
        steps = []
        for text in calls:
            node = ast.parse(text, mode="eval").body
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), text
            params = [p for p in inspect.signature(methods[node.func.id]).parameters if p != "self"]
            arguments = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
            arguments |= {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            steps.append([{"name": node.func.id, "arguments": arguments}])
        turns.append(steps)
    return turns


def _classes(entry: dict[str, Any]) -> list[type]:
    import importlib

    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    return [getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[c]), c) for c in entry["involved_classes"]]


def answerable(task_id: str) -> bool:
    """Whether BFCL's own checker accepts the answer the expert gives (op_check on op_expert's calls, as the
    harness's verify sends them): a few entries' possible answers contradict their function documents (no value
    for a required parameter, a parameter the function lacks), so no answer to them scores; the harness leaves
    them out. Multi-turn tasks are all in (the expert plays each to 1.0)."""
    return task_id not in _rejected()


def _expert_result(task_id: str) -> list[dict[str, str]]:
    """A single-turn expert answer in the handler's raw format, as verify.raw_result builds it from the episode."""
    (calls,), = op_expert(task_id)
    return [{c["name"]: json.dumps(c["arguments"])} for c in calls]


@cache
def _rejected() -> frozenset[str]:
    """The single-turn tasks whose expert answer BFCL's checker rejects: computed once per bfcl-eval version and
    version of this file (the checker's imports take seconds, the pass itself under a second) and kept in a JSON
    file beside the bfcl-eval environment; computed every time where that cannot be written."""
    from importlib.metadata import version

    with open(__file__, "rb") as source:
        key = {"bfcl_eval": version("bfcl-eval"), "bridge": hashlib.sha256(source.read()).hexdigest()}
    path = os.path.join(sys.prefix, "stepline-bfcl-rejected.json")
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return frozenset(cached["rejected"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    rejected = sorted(t for c in CATEGORIES if not c.startswith("multi_turn") for t in _entries(c, True)
                      if not op_check(t, _expert_result(t))["valid"])
    try:
        with tempfile.NamedTemporaryFile("w", dir=sys.prefix, suffix=".tmp", delete=False) as out:
            json.dump({"key": key, "rejected": rejected}, out)
        os.replace(out.name, path)
    except OSError:
        pass
    return frozenset(rejected)


def op_expert(task_id: str) -> list[list[list[dict[str, Any]]]]:
    category = category_of(task_id)
    answer = _answers(category)[task_id]
    return _multi_turn_expert(task_id, answer) if category.startswith("multi_turn") else _single_turn_expert(task_id, answer)


class Session:
    """One connection: at most one opened multi-turn task, its instances in BFCL's executor globals."""

    def __init__(self) -> None:
        self.entry: dict[str, Any] | None = None
        self.model = f"stepline_{os.getpid()}_{next(_ids)}"  # BFCL keys its instances by model and task id

    def _execute(self, calls: list[str]) -> list[str]:
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

        assert self.entry is not None
        results, _ = execute_multi_turn_func_call(calls, self.entry["initial_config"], self.entry["involved_classes"],
                                                  self.model, self.entry["id"])
        return results

    def open(self, task_id: str) -> None:
        if not category_of(task_id).startswith("multi_turn"):
            raise BridgeError(f"{task_id} is a single-turn task: nothing to execute")
        self.entry = _entries(category_of(task_id), True)[task_id]
        self._execute([])

    def execute(self, calls: list[dict[str, Any]]) -> list[str]:
        """BFCL's decoder turns each call into a Python call string, its executor evals it on the instances.
        A call is checked first (a known function, identifier keywords, a JSON object), since the string is eval'd."""
        if self.entry is None:
            raise BridgeError("execute before open")
        names = {f["name"] for f in self.entry["function"]}
        results = []
        for call in calls:
            problem = call_problem(call, names)
            if problem is not None:
                results.append(f"Error: {problem}")
                continue
            decoded = _decoder().decode_execute([{call["name"]: call["arguments"]}], has_tool_call_tag=False)
            results.extend(self._execute(decoded))
        return results


def call_problem(call: dict[str, Any], names: set[str]) -> str | None:
    """Why a tool call must not reach BFCL's executor (which evals it), or None."""
    name, raw = call.get("name"), call.get("arguments")
    if name not in names:
        return f"unknown function {name!r}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return "arguments are not JSON"
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    bad = [k for k in arguments if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k))]
    return f"invalid argument names {bad!r}" if bad else None


def op_check(task_id: str, result: Any) -> dict[str, Any]:
    """BFCL's evaluation of one entry: the runner's own per-entry functions, on the raw result in the
    handler's format (single-turn: [{name: arguments JSON}]; multi-turn: that or a text, per step, per turn)."""
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.eval_checker import eval_runner

    category = category_of(task_id)
    entry = json.loads(json.dumps(_entries(category, False)[task_id]))  # the runner edits its prompt entry
    answer = _answers(category)[task_id]
    if category.startswith("multi_turn"):
        result = _executable(result, {f["name"] for f in _entries(category, True)[task_id]["function"]})
        verdict = eval_runner._evaluate_single_multi_turn_entry(
            _decoder(), task_id, result, answer, entry, f"stepline_check_{os.getpid()}_{next(_ids)}", category)
    else:
        verdict = eval_runner._evaluate_single_ast_entry(
            _decoder(), task_id, result, answer, entry, CHECKER_MODEL, category, language=Language.PYTHON,
            return_format=ReturnFormat.PYTHON, has_tool_call_tag=False)
    error = verdict.get("error")
    if isinstance(error, dict):  # the multi-turn runner nests the checker's answer
        verdict = {**verdict, "error_type": error.get("error_type"), "error": error.get("error_message")}
    return {"valid": bool(verdict["valid"]), "error_type": verdict.get("error_type"),
            "error": _short(verdict.get("error"))}


def _executable(result: Any, names: set[str]) -> Any:
    """A multi-turn result without the calls the harness refused to execute (the checker evals the rest)."""
    if not isinstance(result, list):
        return result
    return [[[c for c in step if isinstance(c, dict) and len(c) == 1 and call_problem(_named(c), names) is None]
             if isinstance(step, list) else step for step in turn] if isinstance(turn, list) else turn for turn in result]


def _named(call: dict[str, Any]) -> dict[str, Any]:
    (name, arguments), = call.items()
    return {"name": name, "arguments": arguments}


def _short(error: Any) -> str:
    text = "; ".join(map(str, error)) if isinstance(error, list) else str(error or "")
    return text[:500]


def answer(session: Session, request: dict[str, Any]) -> Any:
    op = request.get("op")
    if op == "tasks":
        return {c: [t for t in _entries(c, True) if answerable(t)] for c in request.get("categories") or CATEGORIES
                if c in CATEGORIES}
    if op == "task":
        return op_task(str(request["id"]))
    if op == "expert":
        return op_expert(str(request["id"]))
    if op == "open":
        session.open(str(request["id"]))
        return None
    if op == "execute":
        return session.execute(list(request["calls"]))
    if op == "check":
        return op_check(str(request["id"]), request["result"])
    raise BridgeError(f"unknown op {op!r}")


class Lines(Protocol):
    """A binary stream of request lines in, or of answer lines out (a pipe or a socket's files)."""

    def __iter__(self) -> Any: ...
    def write(self, data: bytes, /) -> Any: ...
    def flush(self) -> Any: ...


def converse(rfile: Lines, wfile: Lines) -> None:
    """Answer request lines until end of input; a failing request is answered, never fatal."""
    session = Session()
    for line in rfile:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, "result": answer(session, json.loads(line))}
        except Exception as exc:  # the process edge: every failure goes back to the client as text
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        wfile.write(json.dumps(reply).encode() + b"\n")
        wfile.flush()


def warm() -> None:
    """What every connection needs, loaded before the server forks: the checkers' imports and all data."""
    from bfcl_eval.eval_checker import eval_runner  # noqa: F401  (imports every handler: seconds)

    _decoder()
    for category in CATEGORIES:
        _entries(category, True), _entries(category, False), _answers(category)
    _rejected()


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        converse(self.rfile, self.wfile)


class _Server(socketserver.ForkingMixIn, socketserver.UnixStreamServer):
    block_on_close = False


def main(argv: list[str]) -> None:
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # BFCL prints; only answers may reach the protocol's stream
    if argv[:1] == ["--socket"]:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the server dies with the worker that started it
        warm()
        with _Server(argv[1], _Handler) as server:
            out.write(b'{"ready": true}\n')
            out.flush()
            server.serve_forever()
    converse(sys.stdin.buffer, out)


if __name__ == "__main__":
    main(sys.argv[1:])
