"""Shared test setup: GPU-marked tests skip cleanly without CUDA; caches stay inside tmp dirs; the
process-wide loss kernel that `apply_compile` swaps, and the signal handlers a test's `kiln` main or guard
installs, are put back after each test."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/unit/parallel/test_ac_compile.py runs pytest on this conftest


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """One local Ray for the tests that run Ray jobs (`kiln sweep`, `kiln launch ray`): each joins it as a cluster
    already up, as a user's call does, and leaves it up; its start and stop (several seconds) are paid once."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:  # its daemons and workers keep the tests' home, as _isolated_home does
        mp.setenv("HOME", str(tmp_path_factory.getbasetemp() / "home"))
        ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep ~/.cache/kiln of the machine out of tests (the default cache_dir expands ~)."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.getbasetemp() / "home"))


@pytest.fixture(autouse=True)
def _restore_loss_kernel():
    """`kiln.parallel.compile.apply_compile` swaps a compiled kernel into `ChunkKernel` for the whole process;
    without this, every later test's loss would run (and compile) that kernel."""
    from kiln.model.loss import ChunkKernel

    saved = ChunkKernel.__dict__["fn"]  # the descriptor itself (a staticmethod), not what it gives
    yield
    ChunkKernel.fn = saved


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A test that runs `kiln`'s main in-process installs kiln.state.after_save's handler for the rest of the
    process, and one whose guard fails may leave its own: a later test's handler would then chain to them (a
    recursion, or a signal the test sends itself ending pytest)."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture
def repeating_model():
    """A function: token id -> a tiny eval-mode Transformer (vocabulary 320) whose most likely next token is always
    that one (the layers add nothing to the embedding and the output layer sees only that token's row)."""
    from kiln.config import ModelConfig
    from kiln.model.llama import Transformer

    def make(token: int) -> Transformer:
        model = Transformer(ModelConfig(size="tiny", vocab_size=320, tie_embeddings=False)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0 if name == "embed_tokens.weight" else 0.0)
            model.norm.weight.fill_(1.0)
            model.lm_head.weight[token] = 1.0
        return model

    return make


def kiln_here(*args: str) -> subprocess.CompletedProcess:
    """`kiln ARGS` through the CLI's entry point (`kiln.cli.main`: errors turned into messages and exit codes) in
    this process, where a process of its own adds nothing to what a test checks (a finished run, a refusal,
    sampling, a run whose losses are compared with no other process's): a new interpreter cost seconds of imports
    and nothing more. The torch thread count the command sets is put back."""
    from kiln.cli import main

    out, err, threads, code = io.StringIO(), io.StringIO(), torch.get_num_threads(), 0
    try:
        with redirect_stdout(out), redirect_stderr(err), mock.patch.object(sys, "argv", ["kiln", *args]):
            try:
                main()
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["kiln", *args], code, out.getvalue(), err.getvalue())
