"""Settings a run applies at its start and shows at its end: CPU threads, and the sample prompt in the
hint to sample again (shell-quoted, with its trailing space)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from .conftest import stdlib_corpus

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
    r = subprocess.run([sys.executable, "-c", CHILD, "model.size=tiny", "train.seq_len=32", "train.batch_size=4",
                        "train.max_steps=3", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=4",
                        "train.device=cpu", "train.threads=2", f"train.sample_prompt={prompt}",
                        "checkpoint.save_final=false", "checkpoint.every=0", f"data.sources=[{corpus}]",
                        "data.val_fraction=0.1", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                        f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "threads in the loop: 2" in r.stdout and "on cpu, 2 thread(s)" in r.stdout
    hint = f"kiln generate {shlex.quote(str(run_dir))} --prompt {shlex.quote(prompt)}"
    assert hint in r.stdout and "--prompt 'x = '" in r.stdout
