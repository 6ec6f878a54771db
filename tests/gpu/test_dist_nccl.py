"""`kiln train --nproc 2` on two GPUs through NCCL: DDP, FSDP `full` and FSDP `grad_op` log the losses and the
first gradient norm of one GPU with the same global batch, and the FSDP run's sharded checkpoint resumes on
one GPU at the same global sample with the losses of the run that kept its size (the CPU suite checks the
same over gloo: tests/integration/test_dist_train.py).

Every run starts from the same weights, a random Llama saved by transformers (model.init_from): a random
init would differ, since FSDP on GPUs draws its shards there (kiln.parallel.materialize), and one GPU and DDP
draw on the host."""

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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

STEPS, EVERY = 12, 6
ENV = {**os.environ, "COLUMNS": "400", "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off (scripts/device_setup.sh)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    import transformers

    from kiln.data.prepare.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("data")
    (root / "corpus").mkdir()
    corpus = stdlib_corpus(root / "corpus", 200)
    text = "".join(p.read_text() for p in sorted(corpus.glob("*.txt")))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    train_bpe([text[:200_000]], 512).save(root / "model" / "tokenizer.json")
    # fp32 without compile: the runs differ only in the order of their sums
    return [f"model.init_from={root / 'model'}", "train.seq_len=64", f"train.max_steps={STEPS}",
            "train.warmup_steps=2", "train.lr=3e-3", "train.eval_every=0", "train.sample_tokens=0",
            "train.device=cuda", "train.precision=fp32", "train.compile=false", f"checkpoint.every={EVERY}",
            "logging.every=1", "logging.console=false", "logging.plots=false", f"data.sources=[{root / 'corpus'}]",
            "data.val_fraction=0.1", f"data.cache_dir={root / 'cache'}"]


def kiln_train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args] + (["--nproc", str(nproc)] if nproc > 1 else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def records(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r["event"] == "train"}


@pytest.fixture(scope="module")
def one(base, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "one"
    kiln_train(*base, "train.batch_size=4", f"train.run_dir={run_dir}")
    return run_dir


@pytest.fixture(scope="module")
def two_fsdp(base, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "fsdp"
    kiln_train(*base, "train.batch_size=2", "dist.strategy=fsdp", "dist.backend=nccl", f"train.run_dir={run_dir}",
               nproc=2)
    return run_dir


@pytest.mark.parametrize("strategy", [["dist.strategy=ddp"], None, ["dist.strategy=fsdp", "dist.sharding=grad_op"]],
                         ids=["ddp", "fsdp-full", "fsdp-grad_op"])
def test_two_gpus_train_like_one_with_the_same_global_batch(base, one, two_fsdp, strategy, tmp_path):
    if strategy is None:
        run_dir = two_fsdp
    else:
        run_dir = tmp_path / "run"
        out = kiln_train(*base, "train.batch_size=2", *strategy, "dist.backend=nccl", f"train.run_dir={run_dir}",
                         nproc=2)
        assert "per step = 2 per micro-batch x 1 accumulated x 2 data-parallel rank(s)" in out.stdout
    a, b = records(one), records(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [b[s]["loss"] for s in a] == pytest.approx([a[s]["loss"] for s in a], rel=1e-4)
    # without the gradients reduced across the GPUs, each would step on its half of the batch
    assert b[1]["grad_norm"] == pytest.approx(a[1]["grad_norm"], rel=1e-4)
    assert b[STEPS]["tokens"] == a[STEPS]["tokens"] == STEPS * 4 * 64
    assert b[STEPS]["tokens_per_s"] == pytest.approx(2 * b[STEPS]["tokens_per_s_per_device"])


def test_a_two_gpu_fsdp_checkpoint_resumes_on_one_gpu_at_the_same_sample(base, one, two_fsdp, tmp_path):
    run_dir = tmp_path / "two_to_one"
    shutil.copytree(two_fsdp, run_dir)
    for ck in (run_dir / "checkpoints").iterdir():  # as a kill after the checkpoint of step EVERY would leave it
        if int(ck.name.split("_")[1]) > EVERY:
            shutil.rmtree(ck)
    shutil.rmtree(run_dir / "model", ignore_errors=True)
    out = kiln_train(str(run_dir), "train.batch_size=4", "dist.strategy=auto")
    assert "elastic resume: 2 -> 1 process(es)" in out.stdout
    got, kept = records(run_dir), records(two_fsdp)  # the run that kept its size
    resumed = range(EVERY + 1, STEPS + 1)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in resumed] == pytest.approx([kept[s]["loss"] for s in resumed], rel=1e-4)
