"""The check every command runs on a model directory it is given: one line saying what is missing and how to
get it, before anything loads (transformers' own errors on an empty folder are a traceback deep in its loader)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import click

__all__ = ["BUILD_HINT", "model_dir_option", "model_dir_problem"]

BUILD_HINT = ("build one with `stepline make-model DIR --kind smollm2-135m` (or use a finished run's model-sft/ "
              "after `stepline run`)")


def model_dir_problem(path: Path, needs: Sequence[str] = ("config.json",)) -> str | None:
    """What is wrong with `path` as a model directory holding the files `needs`, or None."""
    if not path.exists():
        return f"no Hugging Face model at {path} (the directory does not exist): {BUILD_HINT}"
    if not path.is_dir():
        return f"no Hugging Face model at {path} (not a directory)"
    missing = [name for name in needs if not (path / name).is_file()]
    if missing:
        return f"no Hugging Face model at {path} ({', '.join(missing)} missing): {BUILD_HINT}"
    return None


def model_dir_option(needs: Sequence[str] = ("config.json",)) -> Callable[[click.Context, click.Parameter, Path | None],
                                                                          Path | None]:
    """A click callback refusing a `--model DIR` without the files `needs`, naming the option."""
    def check(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
        problem = None if value is None else model_dir_problem(Path(value), needs)
        if problem:
            raise click.BadParameter(problem, ctx=ctx, param=param)
        return value
    return check
