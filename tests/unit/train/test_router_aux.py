"""kiln.train.router_aux on the native model: a Mixtral run from init_from trains Kiln's own mixture of experts
and logs its load-balancing loss as aux_loss at every logging step; under FSDP on two processes (experts sharded
with their blocks) it trains to the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.train.run import run

transformers = pytest.importorskip("transformers")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MIXTRAL = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
               router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=1)


def _setup(tmp_path: Path) -> list[str]:
    """A Mixtral directory with a tokenizer, a corpus, and the run's overrides."""
    from kiln.data.prepare.tokenizer import train_bpe

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.3)  # a router that chooses
    model.save_pretrained(tmp_path / "mixtral")
    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py")]
    train_bpe(texts, 320).save(tmp_path / "mixtral" / "tokenizer.json")
    (tmp_path / "c").mkdir()
    for name in ("argparse.py", "textwrap.py"):
        (tmp_path / "c" / name).write_text((STDLIB / name).read_text())
    return [f"model.init_from={tmp_path / 'mixtral'}", f"data.sources=[{tmp_path / 'c'}]",
            f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=32", "train.batch_size=2", "train.max_steps=3",
            "train.eval_every=0", "train.device=cpu", "train.precision=fp32", "train.sample_tokens=0",
            "logging.every=1", "logging.console=false", "logging.plots=false"]


def _train(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "train"]


def test_a_native_moe_run_logs_aux_loss_at_every_logging_step(tmp_path):
    overrides = _setup(tmp_path)
    run(load_config(None, [*overrides, f"train.run_dir={tmp_path / 'run'}", "model.moe.z_loss_coef=0.001"]))
    train = _train(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(1.0 < r["aux_loss"] < 4.0 for r in train)  # top 2 of 4 experts: 2 when balanced, 4 at worst
    assert all(r["router_z_loss"] > 0 for r in train)
    # beside init_from a run chooses the router losses' weights, not the experts
    from kiln.config import ModelConfig, MoEConfig
    from kiln.errors import ConfigError
    from kiln.model.hf_import import resolve_init_from

    path = str(tmp_path / "mixtral")
    assert resolve_init_from(ModelConfig(init_from=path, moe=MoEConfig(aux_loss_coef=0.5))).moe.aux_loss_coef == 0.5
    with pytest.raises(ConfigError, match="also sets model.moe="):
        resolve_init_from(ModelConfig(init_from=path, moe=MoEConfig(n_experts=8, z_loss_coef=0.1)))


@pytest.mark.slow  # two processes start
def test_fsdp_over_two_processes_trains_the_moe_to_the_one_process_losses(tmp_path):
    overrides = _setup(tmp_path)
    run(load_config(None, [*overrides, f"train.run_dir={tmp_path / 'one'}"]))
    cmd = [sys.executable, "-m", "kiln.cli", "train", *overrides, "train.batch_size=1", "dist.strategy=fsdp",
           f"train.run_dir={tmp_path / 'two'}", "--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    one, two = _train(tmp_path / "one"), _train(tmp_path / "two")
    # each process's load-balancing loss is over its own tokens (as under transformers with DDP): the logged
    # means differ a little from the one process's over all of them, and so do the later steps' weights
    ce = [[r["loss"] - 0.02 * r["aux_loss"] for r in rows] for rows in (one, two)]
    assert ce[0][0] == pytest.approx(ce[1][0], rel=1e-5)  # the same weights, the same data: the same cross-entropy
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=3e-2)
