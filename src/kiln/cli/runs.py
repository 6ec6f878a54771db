"""`kiln plot`, `kiln runs` and `kiln plan`: a run's curves, the runs of a folder, and a run planned before
it starts."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kiln.cli.app import app, console


@app.command()
def plot(
    runs: list[str] = typer.Argument(..., help="Run directories (or their metrics.jsonl files) to draw together."),
    out: str | None = typer.Option(None, "--out", "-o", help="PNG file to write; an .html page and a .json list "
                                   "of the panels go beside it (default: RUN/plots.png for one run, "
                                   "plots-compare.png here for several)."),
) -> None:
    """Plot training and validation loss, learning rate, gradient norm, tokens/s, MFU, memory and data
    wait against steps and tokens, several runs overlaid.

    Example: kiln plot runs/20261126-101500 runs/20261126-120000 --out compare.png
    """
    from kiln.monitor.plots import write_plots

    if out is None:
        first = Path(runs[0]).expanduser()
        out = str((first if first.is_dir() else first.parent) / "plots.png") if len(runs) == 1 else "plots-compare.png"
    paths = write_plots(runs, out)
    console.print(f"wrote {paths['png']} and {paths['html']}", highlight=False)


@app.command("runs")
def runs_(
    directory: str = typer.Argument("runs", help="Directory holding run directories (default: runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per run) instead of a table."),
) -> None:
    """List the runs under a directory: name, status (running, finished, stopped, failed, killed), steps,
    tokens, best validation loss, last checkpoint and wall time.

    Example: kiln runs runs/
    """
    import json

    from kiln.monitor.runs import list_runs, runs_table

    found = list_runs(directory)
    if as_json:
        print(json.dumps([r.as_dict() for r in found], indent=1))
        return
    if not found:
        console.print(f"no runs in {directory}", highlight=False)
        return
    # a file or a pipe gets the whole table, however wide (rich fits it to 80 columns there, cutting its cells)
    out = console if console.is_terminal else Console(width=1000, soft_wrap=True)  # fits its widest cell
    out.print(runs_table(found, f"runs in {directory}"))
    for r in found:
        if r.note and r.status not in ("running", "finished"):
            console.print(f"{r.name}: {r.status} ({r.note})", highlight=False)


@app.command()
def plan(
    config: str | None = typer.Argument(None, help="YAML config file, preset name or run directory; omit for the "
                                        "quickstart."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.batch_size=16."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Processes (one per GPU) the run would use."),
    gpu: str | None = typer.Option(None, "--gpu", help="The card: h100, h200, a100, a100-40, l40s, rtx4090, "
                                   "rtx4080, rtx3090, a10g, l4 or cpu (default: this machine's GPU; else h100 when "
                                   "train.device asks for CUDA, the CPU otherwise)."),
) -> None:
    """Estimate, before anything runs: parameters, memory per device (weights, gradients, optimizer
    state, activations), the largest micro-batch that fits, tokens/s and the time to
    train.max_steps, and the disk a checkpoint needs. Warns when the run will not fit.

    Example: kiln plan gpu-1b --gpu rtx4090   |   kiln plan gpu-1b model.size=8b --gpus 4 --gpu a100
    """
    from kiln.config import load_config
    from kiln.plan import make_plan
    from kiln.plan.gpus import is_here, local_device
    from kiln.plan.report import render

    overrides = list(overrides or [])
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    if config is not None and (Path(config).expanduser() / "config.yaml").is_file():  # a run directory, as in train
        config = str(Path(config).expanduser() / "config.yaml")
    cfg = load_config(config, overrides)
    device, note = local_device(gpu, cfg.train.device)
    result = make_plan(cfg, gpus, device, here=is_here(device))  # this machine's card: its host measured
    if note:
        result.notes.insert(0, note)
    render(result, console)


# --------------------------------------------------------------------------- launch (kiln.parallel.launch)
