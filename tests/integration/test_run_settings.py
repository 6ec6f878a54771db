"""Settings a run applies at its start and shows at its end: CPU threads, the sample prompt in the hint to
sample again (shell-quoted, with its trailing space), and hints printed as written."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from .conftest import stdlib_corpus, tiny_cpu_run

pytestmark = pytest.mark.slow

CHILD = r'''
import sys
import torch
from kiln.config import load_config
from kiln.train.events import Callback
from kiln.train.run import run


class Threads(Callback):
    def on_train_start(self, trainer):
        print(f"threads in the loop: {torch.get_num_threads()}")

run(load_config(None, sys.argv[1:]), callbacks=[Threads()])
'''


def test_threads_are_applied_and_the_hint_repeats_the_prompt(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib_corpus(corpus, 60)
    run_dir = tmp_path / "my run"
    prompt = "x = "
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}  # PyTorch would start with 1 thread
    args = tiny_cpu_run(tmp_path / "cache", corpus, 3, 0, "train.eval_batches=1", "train.sample_tokens=4",
                        "train.threads=2", f"train.sample_prompt={prompt}",
                        "logging.console=true", f"train.run_dir={run_dir}", batch_size=4, vocab_size=300)
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "threads in the loop: 2" in r.stdout and "on cpu, 2 thread(s)" in r.stdout
    hint = f"kiln generate {shlex.quote(str(run_dir))} --prompt {shlex.quote(prompt)}"
    assert hint in r.stdout and "--prompt 'x = '" in r.stdout


def test_without_a_sample_the_hint_says_sample_and_the_plot_extra_is_named_as_written(tmp_path, monkeypatch):
    """`sample again with` printed when train.sample_tokens=0 made no sample; rich took '[plot]' in
    "pip install 'kiln[plot]'" for markup and printed "pip install 'kiln'". Both runs train in this process (a new
    interpreter for each cost seconds of imports), on a console as wide as the subprocesses' COLUMNS=400."""
    import io

    from rich.console import Console

    from kiln.config import load_config
    from kiln.train.run import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without the plot extra

    def train(*extra: str) -> str:
        out = io.StringIO()
        run(load_config(None, [*args, *extra]), Console(file=out, width=400))
        return out.getvalue()

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib_corpus(corpus, 60)
    run_dir = tmp_path / "run"
    args = tiny_cpu_run(tmp_path / "cache", corpus, 2, 0, "train.eval_batches=1", "logging.console=true",
                        "logging.plots=true", f"train.run_dir={run_dir}", batch_size=4, vocab_size=300)
    out = train()
    assert "plots.png skipped: matplotlib is not installed (pip install 'kiln[plot]')" in out
    assert f"sample with: kiln generate {shlex.quote(str(run_dir))}" in out and "sample again" not in out
    no_model = train(f"train.run_dir={tmp_path / 'other'}", "checkpoint.save_final=false")
    assert "kiln generate" not in no_model  # no model/ to sample from
