"""`kiln train` with train.fp8 on GPUs with float8 tensor cores: the tiny model trains (compiled, selective AC,
real float8 products), a resume gives the losses of the run that went on, model/ holds the fp32 weights under the
names of a bf16 run's, both recipes train, and on two GPUs FSDP gathers the weights in float8 and its sharded
checkpoint resumes (the CPU suite checks the same in emulation: tests/unit/parallel/test_float8.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..integration.conftest import stdlib_corpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a GPU with float8 tensor cores (compute capability 8.9+)")]

STEPS, EVERY = 40, 20
ENV = {**os.environ, "COLUMNS": "400", "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off (scripts/device_setup.sh)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'kiln[fp8]')")
    root = tmp_path_factory.mktemp("fp8")
    (root / "corpus").mkdir()
    corpus = stdlib_corpus(root / "corpus", 300)
    # every linear layer's sizes are multiples of 16 (d 128, kv 64, MLP 384): all fourteen are converted
    return ["model.size=tiny", "model.d_model=128", "model.ffn_hidden=384", "train.seq_len=128",
            "train.batch_size=8", f"train.max_steps={STEPS}", "train.warmup_steps=4", "train.lr=3e-3",
            "train.eval_every=0", "train.eval_batches=2", "train.sample_tokens=0", "train.device=cuda",
            "train.compile=true", "train.activation_checkpointing=selective", f"checkpoint.every={EVERY}",
            "logging.every=1", "logging.console=false", "logging.plots=false", f"data.sources=[{corpus}]",
            "data.val_fraction=0.05", "data.vocab_size=512", f"data.cache_dir={root / 'cache'}"]


def kiln_train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args] + (["--nproc", str(nproc)] if nproc > 1 else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["event"] == "train"}


def weights(run_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    out = {}
    for f in sorted((run_dir / "model").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: (str(st.get_slice(k).get_dtype()), tuple(st.get_slice(k).get_shape())) for k in st.keys()})
    return out


def cut_after(run_dir: Path, step: int) -> None:
    """As a kill after the checkpoint of `step` would leave the run directory."""
    for ck in (run_dir / "checkpoints").iterdir():
        if int(ck.name.split("_")[1]) > step:
            shutil.rmtree(ck)
    shutil.rmtree(run_dir / "model", ignore_errors=True)


@pytest.fixture(scope="module")
def fp8_run(base, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("runs") / "fp8"
    out = kiln_train(*base, "train.fp8.enabled=true", "train.sample_tokens=16", f"train.run_dir={run_dir}")
    return run_dir, out.stdout


def test_fp8_trains_and_saves_the_weights_of_a_bf16_run(base, fp8_run, tmp_path):
    run_dir, stdout = fp8_run
    assert "train.fp8: 14 linear layers in float8, tensorwise scaling" in stdout
    assert "sample again with: kiln generate" in stdout  # the sample after training (the layers plain again)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)) and all(v == v for v in got.values())  # no NaN
    assert sum(got[s] for s in range(STEPS - 4, STEPS + 1)) / 5 < got[1] - 0.7  # 6.24 -> about 5.2 on an H200
    bf16_dir = tmp_path / "bf16"
    kiln_train(*base, f"train.run_dir={bf16_dir}")
    ref = losses(bf16_dir)
    assert got[STEPS] == pytest.approx(ref[STEPS], rel=0.05)  # float8 trains as bf16 does, not the same bits
    assert got[STEPS] != ref[STEPS]
    assert weights(run_dir) == weights(bf16_dir)  # names, dtypes and shapes of model/


def test_fp8_resumes_with_the_losses_of_the_run_that_went_on(base, fp8_run, tmp_path):
    kept, _ = fp8_run
    run_dir = tmp_path / "resumed"
    shutil.copytree(kept, run_dir)
    cut_after(run_dir, EVERY)
    kiln_train(str(run_dir))
    got, want = losses(run_dir), losses(kept)
    assert_resumed(got, want)


def assert_resumed(got: dict[int, float], want: dict[int, float]) -> None:
    """The first step after the checkpoint has the loss of the run that went on (the same weights, optimizer state
    and batch; a forward pass is deterministic); the later ones within 1e-3, as the backward passes' atomic sums
    (embedding, attention) come in any order."""
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert got[EVERY + 1] == pytest.approx(want[EVERY + 1], rel=1e-6)
    resumed = range(EVERY + 1, STEPS + 1)
    assert [got[s] for s in resumed] == pytest.approx([want[s] for s in resumed], rel=1e-3)


def test_rowwise_trains(base, tmp_path):
    run_dir = tmp_path / "rowwise"
    out = kiln_train(*base, "train.fp8.enabled=true", "train.fp8.recipe=rowwise", f"train.max_steps={EVERY}",
                     "train.sample_tokens=16", f"train.run_dir={run_dir}")  # the sample: plain layers again
    assert "train.fp8: 14 linear layers in float8, rowwise scaling" in out.stdout
    assert "sample again with: kiln generate" in out.stdout
    got = losses(run_dir)
    assert got[EVERY] < got[1] - 0.6  # 6.24 -> 5.29 on an H200


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_fsdp_gathers_float8_and_resumes(base, fp8_run, tmp_path):
    run_dir = tmp_path / "fsdp"
    args = [*base, "train.fp8.enabled=true", "train.batch_size=4", "dist.strategy=fsdp", "dist.backend=nccl"]
    out = kiln_train(*args, f"train.run_dir={run_dir}", nproc=2)
    assert "(weights gathered in float8)" in out.stdout
    got, one = losses(run_dir), losses(fp8_run[0])
    # the same global batch as the one-GPU run; each GPU scales its own half of the activations, so the curves part
    # a little (4.85 against 5.17 after 40 steps at lr 3e-3 on two H200s)
    assert got[STEPS] == pytest.approx(one[STEPS], rel=0.1) and got[STEPS] < got[1] - 0.7
    for f in (run_dir / "checkpoints" / f"step_{STEPS:08d}").rglob("*.distcp"):
        assert b"torchao" not in f.read_bytes(), f  # plain fp32 shards: readable without torchao
    resumed_dir = tmp_path / "fsdp_resumed"
    shutil.copytree(run_dir, resumed_dir)
    cut_after(resumed_dir, EVERY)
    kiln_train(str(resumed_dir), nproc=2)
    assert_resumed(losses(resumed_dir), got)
    assert weights(resumed_dir) == weights(fp8_run[0])
