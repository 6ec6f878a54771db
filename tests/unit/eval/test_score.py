"""`kiln eval TARGET --tasks`: on an exported model, the adapter's scores, written as JSON; clear errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.errors import ConfigError
from kiln.eval.harness import KilnLM
from kiln.eval.score import score_target
from kiln.eval.tasks import check_tasks, kept_rng, run_tasks, task_manager


def test_kiln_eval_tasks_on_an_export(tiny, manager, tmp_path):
    model, tok, export, tasks = tiny
    out = tmp_path / "scores.json"
    result = CliRunner().invoke(app, ["eval", str(export), "--tasks", "tiny_mc,tiny_gen", "--include-path", str(tasks),
                                      "--limit", "6", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "tiny_mc" in result.output and "acc_norm" in result.output
    written = json.loads(out.read_text())
    assert written["kind"] == "hf" and written["n_samples"] == {"tiny_mc": 6, "tiny_gen": 6}
    expect = run_tasks(KilnLM(model, tok), ["tiny_mc", "tiny_gen"], manager=manager, limit=6)["scores"]
    assert {k: v for k, v in written["scores"].items() if not k.endswith("_stderr")} == expect
    assert "tiny_mc/acc_stderr" in written["scores"]


def test_unknown_tasks_and_missing_arguments_are_clear_errors(tiny):
    _, _, export, tasks = tiny
    with pytest.raises(ConfigError, match=r"no task 'tiny_mcq' \(did you mean tiny_mc"):
        check_tasks(task_manager([tasks], include_defaults=False), ["tiny_mcq"])
    with pytest.raises(ConfigError, match="does not exist"):
        score_target(export, ["tiny_mc"], include_path=[tasks / "nowhere"])
    result = CliRunner().invoke(app, ["eval", str(export)])
    assert isinstance(result.exception, ConfigError) and "--data" in str(result.exception)


def draws(seed: int | None) -> tuple:
    """A draw of each generator, after seeding them all with `seed` (None: as they are)."""
    if seed is not None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
    return float(torch.rand(1)), random.random(), float(np.random.rand())


def test_the_callers_random_state_is_kept():
    draws(3)
    expect = draws(None)
    draws(3)
    with kept_rng():
        draws(1234)  # as lm-eval seeds them
    assert draws(None) == expect


@pytest.mark.slow
def test_two_processes_share_the_requests_and_score_as_one(tiny, manager, tmp_path):
    """kiln eval --tasks --nproc 2 (torchrun, gloo): lm-eval gives each process its share, the scores are one's."""
    import subprocess
    import sys

    model, tok, export, tasks = tiny
    out = tmp_path / "two.json"
    subprocess.run([sys.executable, "-m", "kiln.cli", "eval", str(export), "--tasks", "tiny_mc,tiny_ppl",
                    "--include-path", str(tasks), "--device", "cpu", "--nproc", "2", "--out", str(out)],
                   check=True, capture_output=True)
    two = json.loads(out.read_text())
    one = run_tasks(KilnLM(model, tok), ["tiny_mc", "tiny_ppl"], manager=manager)["scores"]
    assert two["processes"] == 2
    assert {k: v for k, v in two["scores"].items() if not k.endswith("_stderr")} == pytest.approx(one, rel=1e-6)
