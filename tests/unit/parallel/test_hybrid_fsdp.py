"""The hybrid model (Nemotron-H's Mamba-2, attention and MLP layers) under FSDP2 with each layer sharded and
checkpointed trains to the losses of one process with the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.parallel.mesh import Mesh

from .test_parallelize import torchrun
from .workers import config, train_losses

HERE = Path(__file__).parent
HYBRID = {"n_layers": 4, "layer_pattern": "M*-M", "mlp": "relu2", "tie_embeddings": False,
          "mamba": {"head_dim": 16, "state": 8, "groups": 2, "chunk": 8}}
CASE = {"batch_size": 2, "grad_accum": 1, "model": HYBRID, "train": {"activation_checkpointing": "full"},
        "dist": {"strategy": "fsdp", "sharding": "full"}}


@pytest.mark.slow
def test_fsdp_with_checkpointed_hybrid_layers_matches_one_process(tmp_path):
    ref_losses, ref_metrics, _ = train_losses(config(4, 1, model=HYBRID), Mesh())
    assert ref_losses[-1] != ref_losses[0]  # random tokens: the weights moved
    out = tmp_path / "out.json"
    done = torchrun([str(HERE / "workers.py"), str(out), json.dumps({"hybrid": CASE})])
    assert done.returncode == 0, done.stderr[-3000:]
    losses, metrics, wrapper = json.loads(out.read_text())["hybrid"]
    assert wrapper == "FSDPTransformer"
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
