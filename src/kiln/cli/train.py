"""`kiln train` and `kiln sweep`: a run, or a search over runs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import typer

from kiln.cli.app import app, console, env_number, err_console, job_rank, state
from kiln.errors import ConfigError, KilnError


@app.command(context_settings={"allow_extra_args": False})
def train(
    config: str | None = typer.Argument(None, help="YAML config file, preset name (see configs/), or a run "
                                                     "directory to resume; omit for the built-in quickstart."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.lr=3e-4."),
    resume: str = typer.Option("auto", "--resume", help="auto: continue from the newest good checkpoint of "
                               "train.run_dir if it has one; never: start fresh (in a new directory if that one "
                               "has checkpoints); force: continue even though the config or data changed."),
    help_config: bool = typer.Option(False, "--help-config", help="List every config key with its doc and exit."),
    nproc: int = typer.Option(1, "--nproc", help="Start torchrun with this many processes on this machine (one "
                              "per GPU); see dist.* in --help-config for DDP / FSDP."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="With --nproc: torchrun restarts the job this many "
                                     "times after a process dies; each start resumes from the newest checkpoint."),
) -> None:
    """Train a model, or resume one.

    With no arguments, trains a small model on this Python's standard library source on the CPU
    in a few minutes and prints a sample.

    Example: kiln train gpu-124m train.max_steps=2000 model.n_layers=8

    Resume: `kiln train RUN_DIR` continues the run in RUN_DIR from its newest checkpoint whose
    hashes verify (damaged ones are skipped, with a message), with the config in RUN_DIR/config.yaml.
    `kiln train CONFIG train.run_dir=RUN_DIR` does the same with CONFIG, which must match the saved
    config; add `--resume force` to accept deliberate changes (e.g. train.max_steps=4000 train.lr=1e-4).
    A run stopped by SIGTERM or Ctrl-C writes a checkpoint first and exits 128 + the signal's number (143, 130:
    not finished, so a scheduler restarts it); Ctrl-C twice aborts at once.
    """
    from kiln.config import derive, describe_fields, load_config

    if help_config:
        print(describe_fields())
        return
    overrides = list(overrides or [])
    if config is not None and "=" in config:  # only overrides were given
        overrides.insert(0, config)
        config = None
    if resume not in ("auto", "never", "force"):
        raise ConfigError(f"--resume {resume!r}: use auto, never or force")
    try:
        if config is not None and Path(config).expanduser().is_dir():  # a run directory: resume it
            run_dir = Path(config).expanduser()
            if not (run_dir / "config.yaml").is_file():
                from kiln.state.rundir import started_by

                command = started_by(run_dir)
                if command:  # a start killed before it wrote config.yaml (kiln.train.run writes it at once now)
                    raise ConfigError(f"{run_dir} has no config.yaml: the run started there with `{command}` was "
                                      "stopped before it wrote one, so there is nothing to resume. Run that command "
                                      "again")
                raise ConfigError(f"{run_dir} is a directory without config.yaml, so not a run directory; give a "
                                  "config file, or the directory of an earlier `kiln train`")
            from kiln.state.rundir import run_config

            cfg = run_config(run_dir, overrides, strict=True)
            if not any(o.strip().startswith("train.run_dir=") for o in overrides):
                cfg = derive(cfg, {"train.run_dir": str(run_dir)})
        else:
            cfg = load_config(config, overrides)
        if cfg.train.run_dir:
            from kiln.state.rundir import check_config_is_a_runs

            check_config_is_a_runs(Path(cfg.train.run_dir).expanduser())
    except KilnError:
        if job_rank() is not None and env_number("LOCAL_RANK", 0) > 0:
            # kiln.parallel: every process of a node reads the same config and fails alike: its first one says so
            from kiln.parallel.launch.torchrun import wait_for_first_rank
            from kiln.start_signals import started

            started()  # torchrun's SIGTERM ends this wait, as it should, without a word
            wait_for_first_rank()
            raise typer.Exit(2) from None
        raise
    from kiln.start_signals import started

    if nproc != 1 or max_restarts:  # kiln.parallel: torchrun runs this same command in nproc processes
        from kiln.parallel.launch.local import relaunch

        started()  # signals are the launcher's from here on: it passes them to torchrun
        # the config was checked here first: an error in it is shown once, not by every process of every restart
        raise typer.Exit(relaunch(nproc, max_restarts=max_restarts, cfg=cfg))
    from kiln.parallel.launch.torchrun import STOPPED
    from kiln.state import after_save
    from kiln.state.preempt import Interrupted, stopped_by
    from kiln.train.run import run

    started()  # torch is loaded: signals are the run's from here on (kiln.train.run)
    try:
        run(cfg, console, resume=resume)
    except Interrupted as e:  # SIGINT/SIGTERM outside the training loop: what happened and what to do
        if state["debug"]:
            raise
        err_console.print(str(e), highlight=False)
        raise typer.Exit(0 if after_save.is_saved() else e.exit_code) from None
    signame = stopped_by()  # stopped in the loop, its checkpoint written: not finished, 128 + the signal's number
    if signame and not os.environ.get(STOPPED):  # under `kiln train --nproc`, the launcher's exit code says it
        raise typer.Exit(128 + signal.Signals[signame].value)


@app.command()
def sweep(
    config: str | None = typer.Argument(None, help="YAML config file or preset name each trial trains with."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides for every trial."),
    space: str = typer.Option(..., "--space", help="YAML search space: params (config keys and their domains), "
                              "search (grid, random, tpe), metric, mode, asha."),
    trials: int = typer.Option(4, "--trials", min=1, help="Trials to sample (with grid params: times the grid)."),
    out: str = typer.Option("sweeps/sweep", "--out", "-o", help="Directory of the sweep: trials/, results.csv, "
                            "best.yaml."),
    search: str | None = typer.Option(None, "--search", help="grid, random or tpe (default: the space's)."),
    address: str | None = typer.Option(None, "--address", help="An existing Ray cluster (auto, or ray://HOST:10001); "
                                       "default: Ray on this machine."),
    cpus: float = typer.Option(1, "--cpus-per-trial", min=0, help="CPUs each trial takes."),
    gpus: float = typer.Option(0, "--gpus-per-trial", min=0, help="GPUs each trial takes (0.5: two share one)."),
    concurrent: int | None = typer.Option(None, "--concurrent", min=1, help="At most this many trials at once."),
) -> None:
    """Hyperparameter search on Ray Tune: each trial is a `kiln train` run in OUT/trials/<id>; ASHA stops
    poor trials early; the results table and the best config are written to OUT.

    Example: kiln sweep my.yaml --space space.yaml --trials 8 --gpus-per-trial 1
    """
    from rich.table import Table

    from kiln.sweep.tune import sweep as run_sweep

    result = run_sweep(config, space, trials, out, list(overrides or []), search=search, address=address,
                       cpus_per_trial=cpus, gpus_per_trial=gpus, concurrent=concurrent,
                       log=lambda m: console.print(m, highlight=False))
    rows = result["rows"]
    table = Table(title=f"kiln sweep {out}", title_justify="left")
    for name in rows[0]:
        if name != "run_dir":
            table.add_column(name, justify="left" if name in ("trial", "status") else "right")
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in r.items() if k != "run_dir"])
    console.print(table)
    console.print(f"best: trial {result['best']['trial']} ({result['best']['run_dir']}); its config: "
                  f"{result['best_config']}; every trial: {result['results']}", highlight=False)
