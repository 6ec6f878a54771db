"""`kiln sweep CONFIG --space SPACE.yaml --trials N`: hyperparameter search on Ray Tune.

Each trial is an ordinary `kiln train` run of CONFIG with the trial's values as overrides, in its own
run directory OUT/trials/<trial id> (resumable with `kiln train OUT/trials/<id>`, listed by `kiln runs
OUT/trials`). A trial reports to Tune at every evaluation of the run (the space's metric: val_loss, or
a benchmark score with eval.tasks), so ASHA can stop poor trials after `grace` evaluations. Search:
Tune's grid and random variants, or Optuna's TPE through Tune. Ray starts on this machine, or joins
the cluster at `address`. At the end OUT holds results.csv (a row per trial: its values, best and
last metric, steps, status, run directory) and best.yaml (the best trial's whole config).
"""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.events import Callback
from kiln.state.rundir import model_saved
from kiln.sweep.space import Space, override, read_space


def check_space(config: str | None, overrides: Sequence[str], space: Space):
    """The base config with each key set to one of its values (ConfigError for an unknown key or a bad value)."""
    for p in space.params:  # every value of a listed domain, the ends of a range
        for value in (p.values if p.kind in ("choice", "grid") else p.values[:1]):
            load_config(config, [*overrides, override(p.key, value)])
    return load_config(config, [*overrides, *(override(p.key, p.sample_value()) for p in space.params)])


def param_space(space: Space) -> dict[str, Any]:
    from ray import tune

    make = {"choice": lambda v: tune.choice(list(v)), "grid": lambda v: tune.grid_search(list(v)),
            "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v),
            "randint": lambda v: tune.randint(*v)}
    return {p.key: make[p.kind](p.values) for p in space.params}


class ReportToTune(Callback):
    """Reports each evaluation's metrics to Ray Tune (one Tune iteration per evaluation)."""

    def __init__(self, run_dir: Path):
        self.run_dir = str(run_dir)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        from ray import tune

        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        tune.report({**numbers, "run_dir": self.run_dir})


def run_trial(params: dict[str, Any], config: str | None, overrides: Sequence[str], out: str, cwd: str) -> None:
    """A Tune trainable: one `kiln train` run with `params` as overrides, in OUT/trials/<trial id>."""
    from ray import tune
    from rich.console import Console

    from kiln.train.run import run

    # Tune starts each trial in a folder of its own; the config's relative paths are the caller's (a node without
    # the caller's folder keeps Tune's)
    if os.path.isdir(cwd):
        os.chdir(cwd)
    run_dir = Path(out) / "trials" / tune.get_context().get_trial_id()
    cfg = load_config(config, [*overrides, *(override(k, v) for k, v in params.items()), f"train.run_dir={run_dir}"])
    run(cfg, Console(quiet=True), callbacks=[ReportToTune(run_dir)])


def sweep(config: str | None, space_path: str | Path, trials: int, out: str | Path, overrides: Sequence[str] = (),
          *, search: str | None = None, address: str | None = None, cpus_per_trial: float = 1,
          gpus_per_trial: float = 0, concurrent: int | None = None,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the sweep (see the module doc); returns {"rows": [...], "best": row, "results": path,
    "best_config": path}."""
    space = read_space(space_path)
    if search is not None:
        space = read_space_with(space, search)
    if trials < 1:
        raise ConfigError(f"--trials {trials}: give at least 1")
    config = str(Path(config).expanduser().resolve()) if config and Path(config).expanduser().is_file() else config
    base = check_space(config, overrides, space)
    if not base.data.streaming and not any(p.key.startswith("data.") for p in space.params):
        from kiln.data.build import prepare_all

        prepare_all(base.data)  # once, here: a data error shows before any trial, and the trials share the shards
    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        import ray
        from ray import tune
    except ImportError:
        raise ConfigError("kiln sweep needs Ray Tune: pip install 'kiln[sweep]' (or 'ray[tune]')") from None

    evals = base.train.max_steps // base.train.eval_every + 1 if base.train.eval_every else 1
    scheduler, search_alg = scheduler_for(space, evals), search_algorithm(space, base.train.seed)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    started = not ray.is_initialized()
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    trainable = tune.with_parameters(run_trial, config=config, overrides=list(overrides), out=str(out),
                                     cwd=os.getcwd())
    resources = {"cpu": cpus_per_trial, "gpu": gpus_per_trial}
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources), param_space=param_space(space),
        tune_config=tune.TuneConfig(metric=space.metric, mode=space.mode, num_samples=trials, search_alg=search_alg,
                                    scheduler=scheduler, max_concurrent_trials=concurrent),
        run_config=tune.RunConfig(name="tune", storage_path=str(out / "ray"), verbose=0))
    log(f"sweep: {trials} trial(s) x {space.grid_size} grid point(s), {space.search} search on {space.metric} "
        f"({space.mode}){', ASHA' if space.asha else ''}; trials in {out / 'trials'}")
    try:
        grid = tuner.fit()
    finally:
        if started:  # the local Ray this call started (a cluster joined by address stays up)
            ray.shutdown()
    return write_results(grid, space, out)


def scheduler_for(space: Space, evals: int):
    """ASHA over the trials' evaluations (None without `asha`): a trial that reaches its last evaluation is not
    stopped there, so it ends by itself and saves its model."""
    if not space.asha:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="training_iteration", max_t=max(evals, space.asha["grace"]) + 1,
                         grace_period=space.asha["grace"], reduction_factor=space.asha["reduction"])


def search_algorithm(space: Space, seed: int):
    """Optuna's TPE for `search: tpe` (seeded); None for grid and random (Tune's variant generator)."""
    if space.search != "tpe":
        return None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(seed=seed)


def read_space_with(space: Space, search: str) -> Space:
    from dataclasses import replace

    from kiln.sweep.space import SEARCHES

    if search not in SEARCHES:
        raise ConfigError(f"--search {search}: use one of {', '.join(SEARCHES)}")
    return replace(space, search=search)


def write_results(grid, space: Space, out: Path) -> dict[str, Any]:
    """results.csv and best.yaml in OUT, from Tune's ResultGrid."""
    rows = []
    for result in grid:
        history = result.metrics_dataframe
        values = [] if history is None or space.metric not in history else history[space.metric].dropna().tolist()
        metrics = result.metrics or {}
        run_dir = metrics.get("run_dir") or (str(out / "trials" / metrics["trial_id"]) if "trial_id" in metrics else "")
        best = (min(values) if space.mode == "min" else max(values)) if values else None
        rows.append({"trial": metrics.get("trial_id", ""), **{p.key: result.config.get(p.key) for p in space.params},
                     f"best_{space.metric}": best, f"last_{space.metric}": values[-1] if values else None,
                     "evaluations": len(values), "step": metrics.get("step"),
                     "status": _status(result, run_dir), "run_dir": run_dir})
    scored = [r for r in rows if r[f"best_{space.metric}"] is not None]
    if not scored:
        errors = [str(result.error).strip().splitlines()[-1] for result in grid if result.error]
        raise ConfigError(f"no trial reported {space.metric}: name a metric of the runs' evaluations (val_loss, "
                          "val_bpb, or a task score with eval.tasks), and give the runs a validation split; the "
                          f"trials' run directories in {out / 'trials'} say what happened"
                          + (f". The first trial's error: {errors[0]}" if errors else ""))
    best = (min if space.mode == "min" else max)(scored, key=lambda r: r[f"best_{space.metric}"])
    path = out / "results.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    best_config = out / "best.yaml"
    shutil.copyfile(Path(best["run_dir"]) / "config.yaml", best_config)
    return {"rows": rows, "best": best, "results": path, "best_config": best_config}


def _status(result, run_dir: str) -> str:
    if result.error:
        return "error"
    return "finished" if run_dir and model_saved(Path(run_dir) / "model") else "stopped early"
