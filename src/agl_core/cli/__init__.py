"""``agl``: the command line, one click group whose commands load only when they run.

    agl worker --server URL --agent pkg.module:fn     lease tasks and run an agent on each (agl-core)
    agl traces list | show ROLLOUT                    rollouts of a store, and one as a tree (agl-core)
    agl export --format jsonl|parquet|hf OUT          transitions for SFT or offline RL elsewhere (agl-core)
    agl doctor                                        plugins, frameworks, provider, gateway (agl-core)
    agl serve | demo | train | apo show               the trainer's commands (agl-trainer)

``agl --help`` lists the commands from the table below without importing any of
them, so it never pays for agl-trainer, torch or a framework; a command's module
is imported when that command is asked for. The trainer's commands live in
agl-trainer: without it they say which distribution to install and exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any, NamedTuple

import click

__all__ = ["COMMANDS", "cli", "main"]


class _Entry(NamedTuple):
    target: str  # "module:attribute" of the click command
    dist: str  # the distribution that ships the module
    about: str  # the one-line help shown by `agl --help`


COMMANDS: dict[str, _Entry] = {
    "apo": _Entry("agl_trainer.apo_view:apo", "agl-trainer",
                  "Show a prompt optimisation run: candidates, critiques, scores, the winner."),
    "demo": _Entry("agl_trainer.cli:demo", "agl-trainer", "Train a LangChain agent with RL on this CPU, in minutes."),
    "doctor": _Entry("agl_core.cli.doctor:doctor", "agl-core",
                     "Plugins, framework versions, tracer provider, gateway and what would be captured."),
    "export": _Entry("agl_core.cli.export:export", "agl-core",
                     "Write a store's transitions as JSONL, Parquet or a Hugging Face dataset."),
    "serve": _Entry("agl_trainer.cli:serve", "agl-trainer",
                    "The trainer server: task queue, rollouts, gateway and dashboard."),
    "traces": _Entry("agl_core.cli.traces:traces", "agl-core", "List a store's rollouts, or show one as a tree."),
    "train": _Entry("agl_trainer.train_cli:train", "agl-trainer", "Train from a config file: agl train config.yaml."),
    "worker": _Entry("agl_core.cli.worker:worker", "agl-core",
                     "Lease tasks from an agl server and run an agent on each."),
}


def _unavailable(name: str, message: str) -> click.Command:
    """A stand-in for a command that cannot load here: it takes any arguments, says why, and exits 2."""

    def run(args: tuple[str, ...]) -> None:
        click.echo(f"agl {name}: {message}", err=True)
        sys.exit(2)

    return click.Command(name, callback=run, add_help_option=False, help=message,
                         params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


def load_command(name: str) -> click.Command:
    """Import the command ``name`` from its module; a stand-in when its distribution is missing."""
    entry = COMMANDS[name]
    module_name, _, attr = entry.target.partition(":")
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:  # the command's own package
            return _unavailable(name, f"needs {entry.dist} (pip install {entry.dist})")
        return _unavailable(name, f"cannot load {module_name}: {exc} (pip install {entry.dist} installs what it "
                                  "needs)")
    command = getattr(module, attr)
    if not isinstance(command, click.Command):
        raise TypeError(f"{entry.target} is a {type(command).__name__}, not a click command")
    return command


class LazyGroup(click.Group):
    """A group that imports a command only when it is invoked (or its own help is asked for)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return load_command(cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        from agl_core.errors import AglError

        try:
            return super().invoke(ctx)
        except AglError as exc:  # agl's own errors say what is wrong: one line, never a traceback
            raise click.ClickException(str(exc)) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # from the table, not from the commands: listing them must not import them
        rows = [(name, entry.about) for name, entry in sorted(COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _version() -> str:
    from agl_core import __version__

    return __version__


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "-V", "--version", prog_name="agl")
def cli() -> None:
    """agl: train any agent with reinforcement learning, unchanged.

    Run `agl COMMAND --help` for a command's options.
    """


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``agl`` with ``argv`` (default: the process's arguments); return the exit status."""
    try:
        cli.main(args=None if argv is None else list(argv), prog_name="agl", standalone_mode=True)
    except SystemExit as exc:
        code: Any = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
