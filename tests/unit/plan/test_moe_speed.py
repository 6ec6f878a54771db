"""A mixture of experts' planned speed (kiln.plan.moe_speed) against Kiln's measured MoE runs: moe.md's
Qwen3-30B-A3B layers under FSDP (and expert parallelism) and families.md's 124m Mixtral, Qwen2-MoE and Qwen3-MoE,
each planned from a full config as `kiln plan` reads it."""

from __future__ import annotations

import pytest

from kiln.config import ModelConfig, RunConfig
from kiln.plan import make_plan
from kiln.plan.gpus import GPUS
from kiln.plan.moe_speed import factor

from .test_experts import SEQ, qwen3_moe


def moe_run(layers: int, ways: int = 1) -> RunConfig:
    """benchmarks/moe.py's Kiln run: batch 1 of 4096 per GPU, full AC, bf16, compiled, FSDP."""
    return RunConfig.model_validate({
        "model": qwen3_moe(layers).model_dump(exclude_unset=True),
        "train": dict(seq_len=SEQ, batch_size=1, grad_accum=1, precision="bf16", compile=True,
                      activation_checkpointing="full", device="cuda"),
        "dist": dict(strategy="fsdp", sharding="full", expert_parallel=ways)})


# (layers, GPUs, card, expert_parallel): tokens/s per GPU measured (benchmarks/results/moe.md)
MOE_MD = {(8, 2, "h200", 1): 11_359, (20, 4, "h100", 1): 6_758, (8, 2, "h200", 2): 9_650}


@pytest.mark.parametrize("run", list(MOE_MD), ids=lambda r: f"{r[0]}l-{r[1]}x{r[2]}-ep{r[3]}")
def test_the_moe_md_runs_are_planned_within_a_quarter_of_their_measured_speed(run):
    """Before the MoE factor the 8-layer run was planned at 67K tokens/s a GPU (the dense MFU of 5.6B parameters)."""
    layers, gpus, card, ways = run
    plan = make_plan(moe_run(layers, ways), gpus, GPUS[card])
    assert plan.layout.experts == ways
    assert plan.tokens_per_s / gpus == pytest.approx(MOE_MD[run], rel=0.25)
    assert "mixture of experts: x0.19 at 256 routed rows per expert" in plan.mfu.basis


# benchmarks/families.py's MoE layouts on the 124m attention (d 768, 12 layers, expert widths from its MLP of 2048):
# tokens/s on one H200, batch 16 x 1024, no AC, compiled, bf16 (benchmarks/results/families.md)
FAMILIES = {
    "mixtral": (dict(n_experts=8, top_k=2, expert_hidden=2048), {}, 313_588),
    "qwen2_moe": (dict(n_experts=16, top_k=4, expert_hidden=512, shared_expert_hidden=2048),
                  dict(attention_bias="qkv"), 267_698),
    "qwen3_moe": (dict(n_experts=32, top_k=8, expert_hidden=256), dict(qk_norm=True), 319_774),
}


def test_the_124m_families_are_planned_within_a_quarter_of_their_measured_speed():
    for kind, (moe, fields, measured) in FAMILIES.items():
        cfg = RunConfig.model_validate({
            "model": dict(size="124m", vocab_size=32000, max_seq_len=1024, tie_embeddings=False, moe=moe, **fields),
            "train": dict(seq_len=1024, batch_size=16, grad_accum=1, precision="bf16", compile=True,
                          activation_checkpointing="none", device="cuda")})
        assert ModelConfig(size="124m").mlp_hidden == 2048
        plan = make_plan(cfg, 1, GPUS["h200"])
        assert plan.tokens_per_s == pytest.approx(measured, rel=0.25), kind
        assert "x0.62 at 4,096 routed rows per expert" in plan.mfu.basis


def test_the_factor_between_and_beyond_the_measured_rows():
    """The mean of the points measured at each r (0.72, 0.61 and 0.52 at 4096; 0.17 and 0.21 at 256), linear in
    log r between them, the nearest end beyond them (and the plan says it extrapolated)."""
    high = (0.72 + 0.61 + 0.52) / 3
    assert factor(256) == (pytest.approx(0.19), False)
    assert factor(4096) == (pytest.approx(high), False)
    assert factor(1024) == (pytest.approx((0.19 + high) / 2), False)  # halfway in log r
    assert factor(64) == (pytest.approx(0.19), True) and factor(65536) == (pytest.approx(high), True)
    plan = make_plan(moe_run(2).model_copy(update={"train": moe_run(2).train.model_copy(update={"seq_len": 512})}),
                     2, GPUS["h100"])
    assert "32 routed rows per expert a micro-batch" in plan.mfu.basis and "extrapolated" in plan.mfu.basis
