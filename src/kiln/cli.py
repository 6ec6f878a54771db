"""The `kiln` command."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from kiln import __version__
from kiln.errors import KilnError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Kiln: raw text to a trained causal language model.")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"kiln {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    _state["debug"] = debug


@app.command(context_settings={"allow_extra_args": False})
def train(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name (see configs/); "
                                                     "omit for the built-in quickstart."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.lr=3e-4."),
    help_config: bool = typer.Option(False, "--help-config", help="List every config key with its doc and exit."),
) -> None:
    """Train a model.

    With no arguments, trains a small model on this Python's standard library source on the CPU
    in a few minutes and prints a sample.

    Example: kiln train gpu-124m train.max_steps=2000 model.n_layers=8
    """
    from kiln.config import describe_fields, load_config
    from kiln.train.run import run

    if help_config:
        print(describe_fields())
        return
    overrides = list(overrides or [])
    if config is not None and "=" in config:  # only overrides were given
        overrides.insert(0, config)
        config = None
    run(load_config(config, overrides), console)


@app.command()
def generate(
    run_dir: str = typer.Argument(..., help="Run directory of a finished `kiln train` (or its model/ folder)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue."),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens", "-n", help="Tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="Sampling temperature; 0 is greedy."),
    top_k: int = typer.Option(50, "--top-k", help="Sample among the k most likely tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible samples."),
) -> None:
    """Sample text from a trained model.

    Example: kiln generate runs/20261126-101500 --prompt "def main(" -n 64 --seed 0
    """
    import torch

    from kiln.errors import ConfigError
    from kiln.model.generate import generate as sample
    from kiln.state.weights import load_model

    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    model, tok = load_model(run_dir, "cuda" if torch.cuda.is_available() else "cpu")
    if tok is None:
        raise ConfigError(f"{run_dir} holds no tokenizer.json; cannot encode the prompt")
    ids = tok.encode(prompt) if prompt else [tok.eos_id]
    out = sample(model, ids, max_new_tokens, temperature, top_k or None, seed)
    print(prompt + tok.decode(out))


def main() -> None:
    try:
        app()
    except KilnError as e:
        if _state["debug"]:
            raise
        err_console.print(Text.assemble(("error: ", "bold red"), str(e)), highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
