"""Checkpoints of CUDA state: pinned staging (allocated in the background), async save, exact restore."""

from __future__ import annotations

import pytest
import torch

from kiln.config import RunConfig
from kiln.model.llama import Transformer
from kiln.state.checkpointer import Checkpointer
from kiln.train.trainer import Trainer


class Batches:
    def __init__(self):
        self.i = 0

    def __next__(self):
        g = torch.Generator().manual_seed(self.i)
        self.i += 1
        x = torch.randint(0, 256, (2, 33), generator=g)
        return x[:, :-1], x[:, 1:], None

    def state_dict(self):
        return {"sample": self.i * 2}

    def load_state_dict(self, s):
        self.i = s["sample"] // 2


def make(run_dir) -> Trainer:
    cfg = RunConfig.model_validate({"model": {"size": "tiny", "vocab_size": 256},
                                    "train": {"seq_len": 32, "batch_size": 2, "device": "cuda",
                                              "run_dir": str(run_dir)},
                                    "checkpoint": {"async_save": True}})
    torch.manual_seed(0)
    return Trainer(cfg, Transformer(cfg.model).cuda(), Batches(), Batches(), torch.device("cuda"))


def leaves(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from leaves(v)


def steps(t: Trainer, n: int) -> None:
    for _ in range(n):
        t.train_step()
        t.step += 1


@pytest.mark.gpu
def test_async_cuda_checkpoint_restores_exactly(tmp_path):
    t = make(tmp_path / "run")
    steps(t, 1)
    logs: list[str] = []
    ck = Checkpointer(tmp_path / "run", t.cfg, {}, logs.append)
    ck.warm_up(t)  # pinned buffers, allocated in the background
    steps(t, 1)
    saved_model = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    saved_moments = [s["exp_avg"].clone() for s in t.optimizer.state.values()]
    cuda_rng = torch.cuda.get_rng_state()
    path = ck.save(t)
    steps(t, 2)  # the weights change while the background write runs
    ck.wait()
    staged = list(leaves(ck.staged))
    assert len(staged) > 10 and all(x.is_pinned() for x in staged)  # every buffer, the small ones side by side too
    assert not any("pin" in m for m in logs), logs

    fresh = make(tmp_path / "run")
    Checkpointer(tmp_path / "run", fresh.cfg, {}, print).load(fresh, path)
    for k, v in fresh.model.state_dict().items():
        assert v.is_cuda and torch.equal(v, saved_model[k]), k
    for s, m in zip(fresh.optimizer.state.values(), saved_moments):
        assert torch.equal(s["exp_avg"], m)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng) and fresh.step == 2
    ck.close()
