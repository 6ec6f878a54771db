"""The `kiln` command's shared parts: the typer app, the consoles, the global options, and this process's
place in a job of several."""

from __future__ import annotations

import os

import typer
from rich.console import Console

from kiln import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Kiln: raw text to a trained causal language model.")
# soft_wrap: lines are never broken by rich (it wraps at 80 columns when the output is not a terminal), so a
# path or file:line in a message stays whole and can be copied
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
state = {"debug": False}  # --debug: errors show their traceback


def _version(value: bool) -> None:
    if value:
        print(f"kiln {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    state["debug"] = debug
    if ctx.invoked_subcommand != "train":  # it loads torch first: it gives the signals back as it starts training
        from kiln.start_signals import started

        started()


def env_number(name: str, default: int) -> int:
    """An integer environment variable of torchrun's; one that is not a number reads as `default` here (where
    an error is being shown: kiln.parallel.mesh says what is wrong with it when the run starts)."""
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def job_rank() -> int | None:
    """This process's rank in a job of several (torchrun's RANK), None in a one-process run."""
    if env_number("WORLD_SIZE", 1) <= 1:
        return None
    return env_number("RANK", 0)
