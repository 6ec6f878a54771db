"""A real Trainer on the tiny model, fed by rows that are a pure function of their global sample index, with
the faults the healing code meets: a device that runs out of memory mid-run, and corrupted samples."""

from __future__ import annotations

import json
import math

import torch

from kiln.config import RunConfig
from kiln.events import Callback
from kiln.model.llama import Transformer
from kiln.train.trainer import Trainer

VOCAB, T = 256, 16
BAD_TOKEN = VOCAB - 1  # a corrupted record: one token repeated (good rows never hold it)


class Samples:
    """Batches of `rows` rows; row k is drawn from a generator seeded by k, unless k is in `poison`. Rank `rank`
    of `world` takes the rank-th `rows` of each global batch of rows x world samples, as PackedLoader does."""

    def __init__(self, rows: int, poison=(), rank: int = 0, world: int = 1):
        self.B, self.sample, self.poison, self.rank, self.world = rows, 0, set(poison), rank, world

    def __iter__(self):
        return self

    def __next__(self):
        lo = self.sample + self.rank * self.B
        rows = [torch.full((T + 1,), BAD_TOKEN) if k in self.poison else
                torch.randint(0, BAD_TOKEN, (T + 1,), generator=torch.Generator().manual_seed(k))
                for k in range(lo, lo + self.B)]
        self.sample += self.B * self.world
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:], None

    def state_dict(self) -> dict:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict) -> None:
        self.sample = int(state["sample"])


class Numerics:
    """Forward hooks: the rows of a corrupted record blow up, to NaN in the embedding (`scale` None) or to
    `scale` times the final hidden state, whose logits then give a loss spike, as an overflow on bad data does."""

    def __init__(self, model, scale: float | None = None):
        self.scale, self.bad = scale, None
        model.embed_tokens.register_forward_hook(self.embedded)
        model.norm.register_forward_hook(self.normed)

    def embedded(self, module, args, out):
        self.bad = (args[0] == BAD_TOKEN).all(dim=1)[:, None, None]  # (B, 1, 1)
        if self.scale is not None or not self.bad.any():
            return out
        return torch.where(self.bad, torch.full_like(out[:1], math.nan), out)

    def normed(self, module, args, out):
        if self.scale is None or not self.bad.any():
            return out
        return torch.where(self.bad, out * self.scale, out)


class Notices(Callback):
    def __init__(self):
        self.notices, self.losses = [], {}

    def on_notice(self, trainer, kind, info):
        self.notices.append((kind, info))

    def on_step_end(self, trainer, metrics):
        if metrics:
            self.losses[metrics["step"]] = metrics["loss"]


def config(run_dir, steps: int = 12, recovery: dict | None = None, log_every: int = 1, checkpoint: dict | None = None,
           **train) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": VOCAB},
        "train": {"seq_len": T, "batch_size": 4, "max_steps": steps, "warmup_steps": 2, "device": "cpu",
                  "precision": "fp32", "lr": 3e-3, "eval_every": 0, "run_dir": str(run_dir), **train},
        "logging": {"every": log_every}, "checkpoint": {"async_save": False, "write_threads": 2, **(checkpoint or {})},
        "recovery": recovery or {},
    })


def trainer(cfg: RunConfig, loader, callbacks=(), micro: int | None = None) -> Trainer:
    torch.manual_seed(0)
    return Trainer(cfg, Transformer(cfg.model), loader, None, torch.device("cpu"), list(callbacks), micro_batch=micro)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
