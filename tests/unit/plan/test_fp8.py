"""The plan of a float8 run (train.fp8): faster by the converted products' share of the step, fewer bytes in
FSDP's float8 gathers and in eager autocast's copies, and on a card without float8 a note that it is bf16."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.config.moe import MoEConfig
from kiln.model.registry import flops_per_token
from kiln.plan import make_plan
from kiln.plan.fp8 import FP8_GEMM_SPEEDUP, converted_params, converted_share, speedup
from kiln.plan.gpus import GPUS

EIGHT_B = ["model.size=8b", "train.seq_len=8192", "train.batch_size=1", "train.compile=true",
           "train.activation_checkpointing=selective", "dist.strategy=fsdp", "model.vocab_size=128256"]


def test_speedup_is_the_converted_share_of_the_step_made_faster():
    cfg = load_config("gpu-1b").model.model_copy(update={"vocab_size": 32000})
    share = converted_share(cfg, 2048)
    blocks = cfg.n_layers * converted_params(cfg) * 6
    assert share == pytest.approx(blocks / flops_per_token(cfg, 2048)) and 0.5 < share < 0.9
    assert speedup(cfg, 2048, 0.0) == 1.0
    assert 1.0 < speedup(cfg, 2048, 0.3) < speedup(cfg, 2048, 0.55) < FP8_GEMM_SPEEDUP
    odd = cfg.model_copy(update={"ffn_hidden": 5000})  # 5000 is no multiple of 16: the MLP stays bf16
    assert converted_params(odd) < converted_params(cfg) and speedup(odd, 2048, 0.5) < speedup(cfg, 2048, 0.5)
    moe = cfg.model_copy(update={"moe": MoEConfig(n_experts=8, shared_expert_hidden=1024)})
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = d * (2 * q + 2 * kv)
    assert converted_params(moe) == attention + 3 * d * 1024  # the experts and the router stay bf16


def test_fp8_plans_faster_and_gathers_a_byte_a_weight_under_fsdp():
    bf16 = make_plan(load_config(None, EIGHT_B), 4, GPUS["h100"])
    fp8 = make_plan(load_config(None, [*EIGHT_B, "train.fp8.enabled=true"]), 4, GPUS["h100"])
    x = speedup(fp8.model, 8192, bf16.mfu.mfu)
    assert fp8.tokens_per_s == pytest.approx(bf16.tokens_per_s * x) and x > 1.1
    assert "for float8 (kiln.plan.fp8" in fp8.mfu.basis
    saved = 2 * converted_params(fp8.model)  # two blocks in flight, one byte a weight less each
    assert bf16.memory.compute_weights - fp8.memory.compute_weights == saved
    rowwise = make_plan(load_config(None, [*EIGHT_B, "train.fp8.enabled=true", "train.fp8.recipe=rowwise"]), 4,
                        GPUS["h100"])
    assert rowwise.memory.compute_weights == bf16.memory.compute_weights  # rowwise weights gather in bf16
    import io

    from rich.console import Console

    from kiln.plan.report import render

    out = io.StringIO()
    render(fp8, Console(file=out, width=300))
    assert "bf16 autocast with float8 linear layers (tensorwise)" in out.getvalue()
    assert "for float8 (kiln.plan.fp8" in out.getvalue()


def test_a_card_without_float8_plans_bf16_and_says_so():
    a100 = make_plan(load_config(None, [*EIGHT_B, "train.fp8.enabled=true"]), 4, GPUS["a100"])
    plain = make_plan(load_config(None, EIGHT_B), 4, GPUS["a100"])
    assert a100.tokens_per_s == plain.tokens_per_s and a100.memory == plain.memory
    assert any("has no float8 tensor cores" in n for n in a100.notes)
