"""A real Trainer on the tiny model, fed by a loader whose batches are a pure function of its position."""

from __future__ import annotations

import pytest
import torch

from kiln.config import RunConfig
from kiln.model.llama import Transformer
from kiln.state.checkpointer import Checkpointer
from kiln.train.trainer import Trainer

VOCAB, B, T = 256, 2, 16


class PositionalBatches:
    """Token batches drawn from a generator seeded by (seed, position): resumable like PackedLoader."""

    def __init__(self, seed: int = 0):
        self.seed, self.i = seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.i)
        self.i += 1
        x = torch.randint(0, VOCAB, (B, T + 1), generator=g)
        return x[:, :-1], x[:, 1:], None

    def state_dict(self) -> dict:
        return {"sample": self.i * B, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["sample"] // B


def make_trainer(run_dir, **overrides) -> Trainer:
    cfg = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": VOCAB},
        "train": {"seq_len": T, "batch_size": B, "max_steps": 50, "warmup_steps": 3, "device": "cpu",
                  "run_dir": str(run_dir)},
        "checkpoint": {"async_save": False, "write_threads": 2, **overrides},
    })
    torch.manual_seed(0)
    return Trainer(cfg, Transformer(cfg.model), PositionalBatches(), PositionalBatches(1), torch.device("cpu"))


def run_steps(trainer: Trainer, n: int) -> list[float]:
    """n optimizer steps as the loop does them; the loss of each."""
    losses = []
    for _ in range(n):
        loss, _ = trainer.train_step()
        trainer.step += 1
        trainer.tokens_seen += trainer.tokens_per_step
        losses.append(loss.item())
    return losses


@pytest.fixture
def trainer_factory(tmp_path):
    return lambda **kw: make_trainer(tmp_path / "run", **kw)


PRINTS = {"config": "c0", "dataset": "d0", "tokenizer": "t0", "train_tokens": 1}  # fingerprints of test runs


def saved_checkpoints(trainer_factory, n: int):
    """A trainer and the paths of its checkpoints after each of its first n steps."""
    t = trainer_factory()
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)
    paths = []
    for _ in range(n):
        run_steps(t, 1)
        paths.append(ck.save(t))
    ck.close()
    return t, paths
