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
from kiln.events import Callback
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
        # a mean of each half's load-balancing loss, not the whole batch's: close, by how much depends on the rows
        # drawn (1-5% on this corpus as the readers have changed its order), so only closeness is asserted here
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-1)


class _Rows:
    """Token rows drawn from a generator seeded by their position: a loader the Trainer can read."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(self.i))
        self.i += 1
        return x[:, :-1], x[:, 1:], None

    def state_dict(self) -> dict:
        return {"sample": 2 * self.i}


def test_the_router_losses_are_read_with_the_logging_steps_loss_at_no_host_read_of_their_own(tmp_path, monkeypatch):
    """A read of a device value to the host waits for the GPU's queued work: a logging step's end may read the
    gradient norm (the throughput clock) and the all-reduced loss, and nothing else (the router losses come in that
    read), another step nothing. On the CPU the experts' loop reads its row ends, which the GPU's kernel does not."""
    from kiln.config import RunConfig
    from kiln.model.llama import Transformer
    from kiln.train.router_aux import RouterAuxLog
    from kiln.train.trainer import Trainer

    cfg = RunConfig.model_validate({
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 16,
                  "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "z_loss_coef": 0.001}},
        "train": {"seq_len": 16, "batch_size": 2, "max_steps": 4, "warmup_steps": 1, "device": "cpu",
                  "eval_every": 0, "run_dir": str(tmp_path)},
        "optim": {"fused": True}, "logging": {"every": 2}})  # fused AdamW: no read of its step count
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    reads, logged = [], []

    class Count(Callback):
        def on_step_end(self, trainer, metrics):
            logged.append((trainer.step, len(reads), metrics))
            reads.clear()

    def counted(plain):
        def read(t):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.endswith("grouped_mm.py"):  # the CPU's loop over the experts reads their row ends
                reads.append(caller)
            return plain(t)
        return read

    for name in ("item", "tolist"):  # every host read of a tensor the loop makes is one of these
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    trainer = Trainer(cfg, model, _Rows(), None, torch.device("cpu"),
                      callbacks=[RouterAuxLog(model.router_aux, model.router_z), Count()])
    trainer.train()
    assert [(step, n) for step, n, _ in logged] == [(1, 0), (2, 2), (3, 0), (4, 2)]
    for step, _, metrics in logged[1::2]:
        assert 1.0 <= metrics["aux_loss"] <= 4.0 and metrics["router_z_loss"] > 0, step
        assert isinstance(metrics["aux_loss"], float)
    assert model.router_aux.take() is None  # each logging step took the sums since the one before
