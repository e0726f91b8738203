"""`stepline engine --model DIR --port N`: serve a model directory with the built-in CPU engine."""

from __future__ import annotations

import os
from pathlib import Path

import click

from stepline.modeldir import model_dir_option

__all__ = ["engine_command"]


@click.command("engine")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path), callback=model_dir_option(),
              help="HF model directory (e.g. from `stepline make-model`).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-running-requests", default=64, show_default=True, type=click.IntRange(min=1),
              help="Sequences decoded together in one batch; the rest wait.")
@click.option("--context-length", default=None, type=click.IntRange(min=1),
              help="Prompt + new tokens limit (default: the model's max_position_embeddings).")
@click.option("--incremental-streaming-output", is_flag=True,
              help="Stream only the new text/ids/logprobs in each chunk (SGLang's flag); default cumulative.")
@click.option("--weight-version", default="0", show_default=True, help="Initial weight_version.")
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch intra-op threads.")
@click.option("--prefix-cache-mb", default=1024.0, show_default=True, type=click.FloatRange(min=0),
              help="Memory for K/V of finished sequences, reused by prompts that extend them (0: off).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="Weights and K/V dtype; bfloat16 is faster on CPUs with bf16 units, its logprobs less exact.")
@click.option("--control-token", default=lambda: os.environ.get("STEPLINE_ENGINE_TOKEN"),
              help="Token the control endpoints (pause, abort, weight updates) require [env STEPLINE_ENGINE_TOKEN]; "
                   "none: open to anyone who can reach the port.")
@click.option("--read-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a client may take to send a request's headers, and then its body.")
def engine_command(model_dir: Path, host: str, port: int, max_running_requests: int, context_length: int | None,
                   incremental_streaming_output: bool, weight_version: str, threads: int | None,
                   prefix_cache_mb: float, dtype: str, control_token: str | None, read_timeout: float) -> None:
    """Serve MODEL with SGLang's /generate API subset on CPU (HF transformers, continuous batching)."""
    import torch
    import uvicorn

    from stepline.engine.limits import HeaderTimeoutH11
    from stepline.engine.server import create_app

    if threads:
        torch.set_num_threads(threads)
    app = create_app(model_dir, incremental_streaming=incremental_streaming_output,
                     max_running=max_running_requests, context_length=context_length, weight_version=weight_version,
                     prefix_cache_mb=prefix_cache_mb, dtype=dtype, control_token=control_token,
                     read_timeout=read_timeout)
    click.echo(f"stepline engine: serving {model_dir} on http://{host}:{port}", err=True)
    if control_token is None:
        click.echo("stepline engine: no --control-token: pause, abort and weight updates are open to anyone", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", http=HeaderTimeoutH11.with_timeout(read_timeout))
