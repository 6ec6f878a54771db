"""`kiln train --nproc 2` end to end on CPU (gloo): FSDP2 over 2 processes logs the losses and validation
losses of one process with the same global batch, consolidates its final weights into one safetensors file
equal to the one process's, and a run resumes on another world size (2 -> 1, 1 -> 2) at the same global
sample with the losses of the run that kept its size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.errors import StateError

from .conftest import kiln_here, losses, stdlib_corpus, tiny_cpu_run

STEPS, EVERY = 12, 6
ENV = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 240)
    return tiny_cpu_run(cache, corpus, STEPS, EVERY)


def kiln_train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """`kiln train ARGS --nproc N`; one process runs in this one (kiln_here): a new interpreter added seconds of
    imports, and the losses are compared within a tolerance, not bit for bit."""
    if nproc == 1:
        done = kiln_here("train", *args)
    else:
        done = subprocess.run([sys.executable, "-m", "kiln.cli", "train", *args, "--nproc", str(nproc)],
                              capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def cut_back(run_dir: Path, to_step: int) -> None:
    """Leave `run_dir` as a kill after the checkpoint of `to_step` would have."""
    for ck in (run_dir / "checkpoints").iterdir():
        if int(ck.name.split("_")[1]) > to_step:
            shutil.rmtree(ck)
    shutil.rmtree(run_dir / "model", ignore_errors=True)


@pytest.fixture(scope="module")
def one_and_two(base, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    one, two = root / "one", root / "two"
    kiln_train(*base, "train.batch_size=4", f"train.run_dir={one}")
    out = kiln_train(*base, "train.batch_size=2", "dist.strategy=fsdp", f"train.run_dir={two}", nproc=2)
    assert "global batch: 4 sequences (128 tokens) per step = 2 per micro-batch x 1 accumulated x 2" in out.stdout
    assert out.stdout.count("run directory:") == 1  # only rank 0 writes the console
    return one, two


@pytest.mark.slow
def test_fsdp_two_processes_train_and_save_like_one(one_and_two):
    from kiln.state.weights import load_model

    one, two = one_and_two
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-4)
    # each process evaluates its rows of the same validation batches: the one process's figures (at step 0,
    # the same weights: to rounding)
    va, vb = losses(one, "eval"), losses(two, "eval")
    assert sorted(va) == sorted(vb) == [0, STEPS]
    assert vb[0] == pytest.approx(va[0], rel=1e-6) and vb[STEPS] == pytest.approx(va[STEPS], rel=1e-4)
    meta = json.loads((two / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["tokens_seen"] == STEPS * 4 * 32
    m1, _ = load_model(one)
    m2, _ = load_model(two)  # one safetensors file gathered from the two processes' shards
    # the sums of the gradients come in another order on two processes, and AdamW turns a difference in a gradient
    # near zero into one of up to its step: 1.3e-5 in a weight seen here, against steps of about 1e-3
    for (k, v1), (_, v2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(v2, v1, rtol=1e-4, atol=5e-5, msg=k)


@pytest.mark.slow
def test_resume_on_another_world_size_matches(one_and_two, base, tmp_path):
    one, two = one_and_two
    expected = losses(one)
    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    shutil.copytree(two, two_to_one)
    shutil.copytree(one, one_to_two)
    for run_dir in (two_to_one, one_to_two):
        cut_back(run_dir, EVERY)
    out = kiln_train(str(two_to_one), "train.batch_size=4", "dist.strategy=auto")  # 2 processes -> 1
    assert "elastic resume: 2 -> 1 process(es)" in out.stdout
    out = kiln_train(str(one_to_two), "train.batch_size=2", "dist.strategy=fsdp", nproc=2)  # 1 -> 2
    assert "elastic resume: 1 -> 2 process(es)" in out.stdout
    for run_dir in (two_to_one, one_to_two):
        got = losses(run_dir)
        assert sorted(got) == list(range(1, STEPS + 1)), run_dir.name
        resumed = range(EVERY + 1, STEPS + 1)
        assert [got[s] for s in resumed] == pytest.approx([expected[s] for s in resumed], rel=1e-4), run_dir.name


@pytest.mark.slow
def test_a_global_batch_in_tokens_resumes_on_another_world_size_with_another_accumulation(one_and_two, base,
                                                                                          tmp_path):
    """train.global_batch_tokens keeps the global batch whatever the number of processes: a 2-process FSDP run
    (1 row x 2 accumulated per rank, each micro-batch reduce-scattered: dist.reduce_every_microbatch) resumes on 1
    (1 row x 4) from its run directory alone, with the losses of the one-process run of the same global batch."""
    one, _ = one_and_two
    run_dir = tmp_path / "tokens"
    out = kiln_train(*base, "train.batch_size=1", "train.global_batch_tokens=128", "dist.strategy=fsdp",
                     f"train.run_dir={run_dir}", nproc=2)
    assert "global batch: 4 sequences (128 tokens) per step = 1 per micro-batch x 2 accumulated x 2" in out.stdout
    cut_back(run_dir, EVERY)
    out = kiln_train(str(run_dir))
    assert "= 1 per micro-batch x 4 accumulated x 1 data-parallel rank(s)" in out.stdout
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{EVERY:08d}'}" in out.stdout
    expected, got = losses(one), losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(EVERY + 1, STEPS + 1)] == pytest.approx(
        [expected[s] for s in range(EVERY + 1, STEPS + 1)], rel=1e-4)


@pytest.mark.slow
def test_a_run_whose_final_model_save_was_cut_short_is_read_from_its_final_checkpoint(one_and_two, tmp_path):
    """An FSDP run's final save interrupted before tokenizer.json (model/ written in the order weights, config,
    tokenizer): `kiln inspect` said 'final model: RUN/model', `kiln export` shipped no tokenizer, `kiln eval`
    and `kiln generate` said the model holds no tokenizer.json. Now inspect and generate say model/ is
    incomplete and what writes it, and export and eval read the final checkpoint (the same weights)."""
    from kiln.evaluate import load_target
    from kiln.state.export import export_from
    from kiln.state.inspect import describe
    from kiln.state.weights import load_model

    _, two = one_and_two
    cut, stopped = tmp_path / "cut", tmp_path / "stopped"
    shutil.copytree(two, cut)
    (cut / "model" / "tokenizer.json").unlink()
    assert f"final model: {cut / 'model'} is incomplete" in describe(cut)
    done = kiln_here("generate", str(cut), "-n", "4")  # refused before it loads a model: in this process
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{cut / 'model'} is incomplete: the run's final model save did not finish. `kiln train {cut}`" in \
        " ".join(done.stderr.split())
    out = export_from(cut, tmp_path / "hf")
    assert (out / "tokenizer.json").read_text() == (two / "model" / "tokenizer.json").read_text()
    target = load_target(cut)
    assert target.kind == "checkpoint" and target.step == STEPS
    reference, _ = load_model(two)
    for k, v in reference.state_dict().items():
        assert torch.equal(target.model.state_dict()[k], v), k
    shutil.copytree(two, stopped)
    cut_back(stopped, EVERY)  # stopped before its end: a sharded checkpoint and no model/
    with pytest.raises(StateError, match=f"{stopped} has no final model \\(model/\\) yet: its newest checkpoint is "
                                         f"step_{EVERY:08d}"):
        load_model(stopped)


