"""Run lm-evaluation-harness tasks on a `KilnLM` and read back their scores as flat metrics.

    scores = run_tasks(lm, ["hellaswag", "arc_easy"], limit=200)   # {"hellaswag/acc": 0.31, ...}

Task names are lm-eval's (its built-in tasks, whose data sets come from the Hugging Face Hub or its
local cache), or those of task YAML files in `include_path` directories: a task over local JSONL
files runs offline (`dataset_path: json`, `dataset_kwargs: {data_files: {test: FILE}}`). lm-eval
seeds Python's, NumPy's and torch's generators; the ones of the calling process are restored after,
so a training run that evaluates goes on drawing the numbers it would have drawn.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import ConfigError, DataError


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) random states as they were, after the block."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@contextlib.contextmanager
def _no_machine_report() -> Iterator[None]:
    """lm-eval adds a report of the machine to its results (torch's collect_env: seconds of subprocesses at
    every call, which a run evaluating every few minutes would pay each time) and the git commit of the current
    directory (git's complaint on stderr outside a repository); Kiln keeps none of it."""
    from unittest import mock

    import lm_eval.evaluator as ev

    with contextlib.ExitStack() as stack:
        for name, value in (("add_env_info", lambda results: None), ("get_git_commit_hash", lambda: None)):
            if hasattr(ev, name):
                stack.enter_context(mock.patch.object(ev, name, value))
        yield


def task_manager(include_path: Sequence[str | Path] = (), include_defaults: bool = True):
    """lm-eval's TaskManager over its built-in tasks (unless not `include_defaults`) and `include_path`."""
    from lm_eval.tasks import TaskManager

    paths = [str(Path(p).expanduser()) for p in include_path]
    for p in paths:
        if not Path(p).exists():
            raise ConfigError(f"eval.include_path: {p} does not exist; give directories of task YAML files")
    return TaskManager(include_path=paths or None, include_defaults=include_defaults)


def manager_for(tasks: Sequence[str], include_path: Sequence[str | Path] = ()):
    """A TaskManager that knows `tasks`: over `include_path` alone when it holds them all (lm-eval takes
    seconds to index its thousands of built-in tasks), else with the built-in tasks too."""
    if include_path:
        own = task_manager(include_path, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    return task_manager(include_path)


def check_tasks(manager, tasks: Sequence[str]) -> None:
    """ConfigError naming each task lm-eval does not know, with the nearest names it does."""
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        hints = []
        for t in missing:
            near = difflib.get_close_matches(t, known, n=3)
            hints.append(f"'{t}'" + (f" (did you mean {', '.join(near)}?)" if near else ""))
        raise ConfigError(f"lm-eval knows no task {', '.join(hints)}; list its tasks with `lm-eval ls tasks`, or give "
                          "the directory of your task YAML files as an include path")


def scores_of(results: dict[str, Any]) -> dict[str, float]:
    """{"task/metric": value} of lm-eval's results: 'acc,none' is acc, another filter's 'acc,strict' is
    acc_strict; standard errors keep their names; values that are no numbers (N/A) are left out."""
    out: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                if key == "alias" or "," not in key or isinstance(value, bool):
                    continue
                metric, _, filt = key.partition(",")
                if not isinstance(value, int | float) or not math.isfinite(float(value)):
                    continue
                name = metric if filt in ("none", "") else f"{metric}_{filt}"
                out[f"{task}/{name}"] = float(value)
    return out


def run_tasks(lm, tasks: Sequence[str], *, include_path: Sequence[str | Path] = (), limit: int | float | None = None,
              num_fewshot: int | None = None, include_defaults: bool = True, manager=None,
              stderr: bool = False) -> dict[str, Any]:
    """Evaluate `lm` on `tasks` (at most `limit` examples each); returns {"scores": {task/metric: value},
    "results": lm-eval's per-task results, "n_samples": examples per task}."""
    import lm_eval

    if not tasks:
        raise ConfigError("give at least one lm-eval task (--tasks hellaswag,arc_easy or eval.tasks: [...])")
    manager = manager or task_manager(include_path, include_defaults)
    check_tasks(manager, tasks)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        with kept_rng(), _no_machine_report():
            res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=False,
                                          bootstrap_iters=100 if stderr else 0)
    except ConnectionError as e:  # `datasets`' words for a Hub it cannot reach (no network, HF_HUB_OFFLINE=1)
        raise DataError(f"lm-eval could not load the data of {', '.join(tasks)}: {e}. Run it once where the Hugging "
                        "Face Hub is reachable (the datasets are then cached), or give tasks over local files in a "
                        "directory of task YAMLs (--include-path, eval.include_path)") from None
    if res is None:  # a rank other than 0 under lm-eval's own distribution
        return {"scores": {}, "results": {}, "n_samples": {}}
    scores = scores_of(res)
    if not stderr:
        scores = {k: v for k, v in scores.items() if "_stderr" not in k}
    n = {t: v.get("effective", v.get("original")) for t, v in (res.get("n-samples") or {}).items()}
    return {"scores": scores, "results": res.get("results", {}), "n_samples": n}
