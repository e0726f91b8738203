"""`stepline engine --model DIR --port N`: serve a model directory with the built-in CPU engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from stepline.engine.options import EngineOptions
from stepline.modeldir import model_dir_option

__all__ = ["engine_command"]


def _default(name: str) -> Any:
    return EngineOptions.model_fields[name].default


def _help(name: str) -> str:
    text = EngineOptions.model_fields[name].description or ""
    return text[:1].upper() + text[1:] + "."


@click.command("engine")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path), callback=model_dir_option(),
              help="HF model directory (e.g. from `stepline make-model`).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-running-requests", "max_running", default=_default("max_running"), show_default=True,
              type=click.IntRange(min=1), help=_help("max_running"))
@click.option("--context-length", default=None, type=click.IntRange(min=1), help=_help("context_length"))
@click.option("--incremental-streaming-output", "incremental_streaming", is_flag=True,
              help=_help("incremental_streaming"))
@click.option("--weight-version", default=_default("weight_version"), show_default=True,
              help=_help("weight_version"))
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch intra-op threads.")
@click.option("--prefix-cache-mb", default=_default("prefix_cache_mb"), show_default=True,
              type=click.FloatRange(min=0), help=_help("prefix_cache_mb"))
@click.option("--dtype", default=_default("dtype"), show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help=_help("dtype"))
@click.option("--control-token", default=lambda: os.environ.get("STEPLINE_ENGINE_TOKEN"),
              help=_help("control_token") + " [env STEPLINE_ENGINE_TOKEN]")
@click.option("--read-timeout", default=_default("read_timeout"), show_default=True, type=click.FloatRange(min=0.1),
              help=_help("read_timeout"))
def engine_command(model_dir: Path, host: str, port: int, threads: int | None, **options: Any) -> None:
    """Serve MODEL with SGLang's /generate API subset on CPU (HF transformers, continuous batching)."""
    import torch
    import uvicorn

    from stepline.engine.limits import HeaderTimeoutH11
    from stepline.engine.server import create_app

    engine = EngineOptions(**options)  # every other option is a field of the same name
    if threads:
        torch.set_num_threads(threads)
    app = create_app(model_dir, engine)
    click.echo(f"stepline engine: serving {model_dir} on http://{host}:{port}", err=True)
    if engine.control_token is None:
        click.echo("stepline engine: no --control-token: pause, abort and weight updates are open to anyone", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning",
                http=HeaderTimeoutH11.with_timeout(engine.read_timeout))
