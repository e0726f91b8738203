"""The gateway's settings: one typed model, every field with a default and a one-line doc."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class GatewaySettings(BaseModel):
    """What `create_app` needs besides its components (router, recorder, weight gate, model), and how
    `stepline.gateway.cli.running_gateway` reaches the engines."""

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: a free port)")
    admin_token: str | None = Field(None, description="token for /admin/* and POST /sessions; None: open")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="largest request body accepted, counted after decompression (413 above)"
    )
    offload_bytes: int = Field(
        16 * 1024, ge=0, description="bodies larger than this are parsed, rendered and tokenized on a worker thread "
        "(a request of a few thousand tokens takes a few ms: beyond, it would hold the event loop)"
    )
    tokenize_process_chars: int = Field(
        64 * 1024, ge=0, description="texts of this many characters or more are tokenized in a worker process (the "
        "tokenizer holds the GIL while it builds the ids, and with it the event loop)"
    )
    prepare_workers: int = Field(
        2, ge=0, description="large requests prepared at once (worker threads), and the worker processes that "
        "tokenize long texts (0: one thread, and long texts tokenized in the gateway's own process)"
    )
    max_prompts: int = Field(64, ge=1, description="largest Completions prompt batch accepted")
    max_engine_requests: int = Field(
        256, ge=1, description="largest prompts x n of one call (each is one engine request)"
    )
    max_session_sequences: int = Field(
        64, ge=0, description="engine sequences (choices x prompts) one session may have running at once; its "
        "further ones wait their turn, so one session's burst cannot crowd out the others (0: no limit)",
    )
    session_idle_timeout: float = Field(
        24 * 3600.0, gt=0,
        description="open sessions with no call running and none started or ended for this long end as `abandoned`",
    )
    session_lease: float = Field(
        60.0, gt=0, description="seconds this gateway leases its open sessions in the pool for, renewed every "
        "third of it; a killed gateway's sessions end as `abandoned` once their lease lapses",
    )
    fork_idle_timeout: float = Field(
        300.0, gt=0, description="open forks with no call running and none started or ended for this long end as "
        "`abandoned` (an unfinished fork keeps its group from being claimed)",
    )
    max_forks_per_session: int = Field(64, ge=0, description="forks one session may make (429 beyond)")
    max_forks_per_group: int = Field(
        256, ge=0, description="forks of one group open at once, through this gateway (429 beyond)"
    )
    spill_path: str | None = Field(
        None, description="local file for calls the pool cannot take yet (answers wait until each call is in the "
        "pool or this file); None: no spill file, answers never wait on the pool",
    )
    read_timeout: float = Field(
        30.0, gt=0, description="seconds a client may take to send a request's headers and body (408 after)"
    )
    context_length: int | None = Field(
        None, gt=0, description="prompt + output token limit; None: the model's max_position_embeddings"
    )
    default_max_tokens: int = Field(1024, gt=0, description="max new tokens when a request names none")
    max_n: int = Field(16, ge=1, description="largest `n` (choices per call) accepted")
    max_live_sessions: int = Field(
        50_000, ge=1, description="open sessions keeping token memory; the least recently used beyond are dropped"
    )
    strict_template: bool = Field(
        False,
        description="render every turn with the chat template (forks where the template rewrites history) "
        "instead of keeping the model's own earlier tokens",
    )
    max_wait_paused: float = Field(60.0, ge=0, description="seconds a new call is held during a weight update "
                                   "before 503 + Retry-After")
    update_grace: float = Field(5.0, ge=0, description="seconds in-flight calls may run on into a weight update; "
                                "then the engines end them (finish_reason abort)")
    partial_rollouts: bool = Field(
        True, description="a call a weight update cut short goes on under the new weights (prompt + its tokens so "
        "far, the rest of its max_tokens) and is answered whole, each token recorded with the version that sampled "
        "it; off: it is answered truncated (finish_reason length) with the old weights' tokens"
    )
    retry_after: float = Field(1.0, ge=0, description="Retry-After (s) on 503 answers of the gateway itself")
    public_url: str | None = Field(None, description="base URL handed to harnesses; None: from the request's Host")
    responses_truncated: Literal["incomplete", "completed"] = Field(
        "incomplete", description="Responses API answers cut by max_output_tokens: incomplete (OpenAI's status and "
        "response.incomplete event) or completed (status completed and response.completed, which the OpenAI Agents "
        "SDK accepts; incomplete_details still names max_output_tokens)"
    )
    model_name: str = Field("stepline", description="the model id GET /v1/models lists and answers carry")
    tool_parser: str | None = Field(None, description="tool-call parser (stepline.gateway.parsers.TOOL_PARSERS); None: detected")
    reasoning_parser: str | None = Field(
        None, description="reasoning parser (stepline.gateway.parsers.REASONING_PARSERS); None: detected"
    )
    eot_token: str | None = Field(None, description="end-of-turn token; None: the one the chat template writes")
    inject_tools: bool = Field(
        False, description="for templates that cannot show tools: render them into the system message "
        "(and calls / results as text) in the tool parser's format; off: such requests get 400"
    )
    initial_version: int = Field(0, ge=0, description="weight version the engines serve at start")
    engine_token: str | None = Field(
        None, description="Bearer token sent on every engine call (the built-in engine's --control-token, "
        "SGLang's and vLLM's --api-key); None: none"
    )
    max_connections: int = Field(
        4096, ge=1, description="upstream connections to the engines (aiohttp's default of 100 would cap the "
        "calls in flight)"
    )
