"""train.batch_size auto on the CPU: a micro-batch from the memory budget, the even cut of a step's rows,
the cache that spares a restart the search, and the config that asks for a global batch."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.parallel.mesh import Mesh
from kiln.train import autobatch
from kiln.train.autobatch import CACHE_FILE, choose_micro_batch, cpu_budget, even_cut, row_activation_bytes


def auto_config(tmp_path, *extra):
    return load_config(None, ["model.size=tiny", "model.vocab_size=256", "train.seq_len=64", "train.batch_size=auto",
                              "train.global_batch_tokens=2048", f"data.cache_dir={tmp_path}", *extra])


@pytest.mark.parametrize("rows,fit,micro", [(32, 32, 32), (32, 100, 32), (32, 10, 8), (32, 9, 8), (30, 7, 6),
                                            (100, 48, 34), (5, 1, 1)])
def test_even_cut_uses_the_fewest_even_micro_batches(rows, fit, micro):
    assert even_cut(rows, fit) == micro
    assert -(-rows // micro) == -(-rows // min(fit, rows))  # no more micro-batches than the fit allows


def test_cpu_budget_divides_what_is_left_by_a_sequence_activations(tmp_path, monkeypatch):
    cfg = auto_config(tmp_path)
    n = param_count(cfg.model)
    per_row = row_activation_bytes(cfg)
    free = (16 * n + 3.5 * per_row) / (1 - cfg.recovery.auto_batch_margin)
    monkeypatch.setattr(autobatch, "available_memory", lambda: free)
    assert cpu_budget(cfg, n) == 3
    assert cpu_budget(cfg, n, local_world=2) == 1  # two processes share the host
    logs: list[str] = []
    assert cpu_budget(cfg, n, log=logs.append) == 3 and not logs
    monkeypatch.setattr(autobatch, "available_memory", lambda: 16 * n)  # the state alone takes it all
    assert cpu_budget(cfg, n, log=logs.append) == 1
    assert len(logs) == 1 and "less than the weights, gradients and AdamW state" in logs[0]
    checkpointed = auto_config(tmp_path, "train.activation_checkpointing=full")
    assert row_activation_bytes(checkpointed) < per_row  # one block recomputed at a time (tiny has two)


def test_auto_takes_the_budget_then_the_cache(tmp_path, monkeypatch):
    cfg = auto_config(tmp_path)  # 32 rows a step
    n = param_count(cfg.model)
    per_row = row_activation_bytes(cfg)
    monkeypatch.setattr(autobatch, "available_memory",
                        lambda: (16 * n + 10.5 * per_row) / (1 - cfg.recovery.auto_batch_margin))
    mesh, model = Mesh(device=torch.device("cpu")), Transformer(cfg.model)
    micro, info = choose_micro_batch(cfg, model, mesh, n, print)
    assert (micro, info["fit"], info["how"], info["accumulation"], info["rows_per_step"]) == (8, 10, "memory budget",
                                                                                                4, 32)
    cache = json.loads((tmp_path / CACHE_FILE).read_text())
    [(key, entry)] = cache.items()
    assert entry["fit"] == 10 and entry["setting"]["seq_len"] == 64
    assert entry["setting"]["device"] == f"cpu {autobatch.total_memory() >> 20} MiB"
    monkeypatch.setattr(autobatch, "available_memory", lambda: 1)  # a restart does not look again
    assert choose_micro_batch(cfg, model, mesh, n, print)[1]["how"] == "cached"
    other = auto_config(tmp_path, "train.activation_checkpointing=full")  # another setting: another entry
    assert choose_micro_batch(other, model, mesh, n, print)[1]["how"] == "memory budget"
    off = auto_config(tmp_path, "recovery.auto_batch_cache=false")
    assert choose_micro_batch(off, model, mesh, n, print)[1]["how"] == "memory budget"


def test_global_batch_config():
    with pytest.raises(ConfigError, match="train.batch_size=auto needs train.global_batch_tokens"):
        load_config(None, ["train.batch_size=auto"])
    with pytest.raises(ConfigError, match="not a multiple of train.seq_len=256; use 3840"):
        load_config(None, ["train.global_batch_tokens=4000"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["train.global_batch_tokens=4096", "train.grad_accum=2"])
    t = load_config(None, ["train.batch_size=4", "train.global_batch_tokens=8192"]).train  # 32 rows a step
    assert (t.step_rows(1), t.loader_rows(1), t.step_rows(2), t.loader_rows(2)) == (32, 4, 16, 4)
    with pytest.raises(ConfigError, match="3 data-parallel ranks cannot share"):
        t.step_rows(3)
    odd = load_config(None, ["train.batch_size=5", "train.global_batch_tokens=8192"]).train
    with pytest.raises(ConfigError, match="not a multiple of train.batch_size=5"):
        odd.loader_rows(1)
    plain = load_config(None, ["train.batch_size=4", "train.grad_accum=3"]).train
    assert (plain.step_rows(2), plain.loader_rows(2)) == (12, 4)


def test_on_the_cpu_plenty_of_memory_does_not_make_the_whole_step_one_micro_batch(tmp_path, monkeypatch):
    """A CPU step runs no faster in one huge micro-batch, only larger: with room for every row, auto takes the
    fewest rows that hold CPU_MICRO_TOKENS tokens (16 of 64 tokens), and the rest of the step accumulates."""
    cfg = auto_config(tmp_path)  # 32 rows of 64 tokens a step
    n = param_count(cfg.model)
    monkeypatch.setattr(autobatch, "available_memory", lambda: 64 * 2**30)
    mesh, model = Mesh(device=torch.device("cpu")), Transformer(cfg.model)
    micro, info = choose_micro_batch(cfg, model, mesh, n, print)
    assert autobatch.CPU_MICRO_TOKENS // 64 == 16 and (micro, info["accumulation"]) == (16, 2)
    assert info["how"].startswith("1024 tokens a micro-batch on the CPU; memory allows")
    # the cache is keyed by the machine's memory: another machine (or more RAM) chooses again
    monkeypatch.setattr(autobatch, "total_memory", lambda: 7 * 2**30)
    assert choose_micro_batch(cfg, model, mesh, n, print)[1]["how"] != "cached"
    assert choose_micro_batch(cfg, model, mesh, n, print)[1]["how"] == "cached"
