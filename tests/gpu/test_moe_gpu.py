"""The mixture of experts on a GPU: torch's grouped GEMM gives the loop's products in bf16; a compiled MoE block
holds the grouped GEMM in its graph (under autocast, with fp32 weights or FSDP2's bf16 ones, with full activation
checkpointing) and fp32 experts fall back to the loop saying why, once; and a compiled MoE block (inductor,
grouped GEMMs inside, no host sync), with selective activation checkpointing too, trains as the eager one does."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from kiln.config import ModelConfig, MoEConfig
from kiln.model import grouped_mm, moe
from kiln.model.llama import Transformer
from kiln.parallel.ac import apply_ac

pytestmark = pytest.mark.gpu


def test_grouped_gemm_is_used_and_matches_the_loop_in_bf16_forward_and_backward():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM serves Hopper and newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.tensor([0, 37, 5, 300, 1, 0, 129, 40], device="cuda")  # empty and odd-sized groups
    offs = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(int(sizes.sum()), 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 384, 256, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    assert moe.kernel_refusal(x, w) is None
    out = moe.grouped_mm(x, w, offs)
    out.float().square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = moe.grouped_mm_loop(x, w, offs)
    want.float().square().sum().backward()
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, x.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw, w.grad, rtol=2e-2, atol=5e-1)
    assert gw[0].abs().sum() == 0 and gw[5].abs().sum() == 0  # experts without tokens get no gradient


def _traced_expert_ops(block: torch.nn.Module, x: torch.Tensor, rope: tuple) -> set[str]:
    """The expert products in the graph torch's compiler traces of `block` (whole, as Kiln compiles it): the
    grouped GEMM's `_grouped_mm`, the loop's `grouped_rows`."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block.compile(fullgraph=True, backend=record)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        block(x, *rope)[0].float().sum().backward()
    names = {str(node.target) for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
             for node in m.graph.nodes}
    return {op for op in ("_grouped_mm", "grouped_rows") if any(op in n for n in names)}


@pytest.mark.parametrize("weights", ["fp32 (one GPU)", "bf16 (FSDP2's gathered weights)"])
def test_a_compiled_moe_block_runs_the_grouped_gemm_under_autocast(weights):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM serves Hopper and newer")
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, qk_norm=True,
                      max_seq_len=256, moe=MoEConfig(n_experts=16, top_k=4, expert_hidden=128))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    if weights.startswith("bf16"):
        model.bfloat16()
    apply_ac(model, "full")  # as benchmarks/moe.py runs it
    block = model.layers[0]
    x = torch.randn(1, 256, 256, device="cuda", dtype=torch.bfloat16)
    rope = model._layer_inputs(None, 256, x.device)[block.attention_kind]  # (cos, sin, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", grouped_mm.ExpertsKernelWarning)
        assert _traced_expert_ops(block, x, rope) == {"_grouped_mm"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_moe_blocks_compiled_under_fsdp_on_two_gpus_trace_the_grouped_gemm_on_every_rank(tmp_path):
    """benchmarks/moe.py's configuration in small (`kiln train` with FSDP2 over NCCL, bf16, compiled blocks, full
    checkpointing): each rank's traced block holds torch's grouped GEMM, not the loop, and no rank warns."""
    cmd = [sys.executable, "-m", "kiln.cli", "train", "model.vocab_size=1024", "model.d_model=256", "model.n_layers=2",
           "model.n_heads=4", "model.n_kv_heads=2", "model.head_size=64", "model.qk_norm=true", "model.max_seq_len=256",
           "model.moe.n_experts=16", "model.moe.top_k=4", "model.moe.expert_hidden=128", "train.seq_len=256",
           "train.batch_size=1", "train.max_steps=3", "train.device=cuda", "train.precision=bf16", "train.compile=true",
           "train.activation_checkpointing=full", "train.eval_every=0", "train.sample_tokens=0",
           "logging.console=false", "logging.plots=false", "checkpoint.save_final=false", "checkpoint.at_end=false",
           "checkpoint.every=0", "dist.strategy=fsdp", "data.vocab_size=1024", f"data.cache_dir={tmp_path / 'cache'}",
           "data.max_bytes=300000", f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_LOGS": "graph_code"}  # each rank prints the graphs it traces
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for rank in (0, 1):
        traced = [line for line in out.splitlines() if line.startswith(f"[rank{rank}]") and "__graph_code" in line]
        assert any("torch._grouped_mm(" in line for line in traced), f"rank {rank} traced no grouped GEMM"
        assert not any("grouped_rows" in line for line in traced), f"rank {rank} traced the loop"
    assert "ExpertsKernelWarning" not in out


def test_fp32_experts_on_a_gpu_keep_to_their_rows_and_say_why_once(monkeypatch):
    monkeypatch.setattr(grouped_mm, "_warned", set())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 32, device="cuda", generator=g)
    w = torch.randn(4, 48, 32, device="cuda", generator=g)
    offs = torch.tensor([10, 10, 40, 64], device="cuda", dtype=torch.int32)
    assert "float32" in moe.kernel_refusal(x, w)
    compiled = torch.compile(moe.grouped_mm, fullgraph=True)
    with pytest.warns(grouped_mm.ExpertsKernelWarning, match="float32"):
        out = compiled(x, w, offs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", grouped_mm.ExpertsKernelWarning)
        again = compiled(x, w, offs)
    want = torch.cat([x[:10] @ w[0].T, x[10:40] @ w[2].T, x[40:] @ w[3].T])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, out)


def test_compiled_moe_blocks_train_as_eager_ones_in_bf16():
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                      max_seq_len=512, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=256))
    x = torch.randint(0, 4096, (4, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    losses = {}
    for compiled in (False, True, "selective AC"):
        torch.manual_seed(0)
        model = Transformer(cfg).cuda().train()
        if compiled == "selective AC":  # the grouped products kept for the backward pass, the rest recomputed
            apply_ac(model, "selective")
        if compiled:
            for block in model.layers:
                block.compile(fullgraph=True)  # the whole block in one graph: no host read of the expert sizes
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[compiled] = run
        assert model.router_aux.take() > 0
    assert losses[True][-1] < losses[True][0]
    for other in (True, "selective AC"):
        for a, b in zip(losses[False], losses[other]):
            assert abs(a - b) < 0.05 * abs(a), losses


class _PinnedRows:
    """Token rows of two packed documents each, pinned as Kiln's loader pins them (seeded by position)."""

    def __init__(self, vocab: int, T: int):
        self.vocab, self.T, self.i = vocab, T, 0

    def __iter__(self):
        return self

    def __next__(self):
        x = torch.randint(0, self.vocab, (2, self.T + 1), generator=torch.Generator().manual_seed(self.i))
        docs = torch.zeros(2, self.T, dtype=torch.int32)
        docs[:, self.T // 3:] = 1
        self.i += 1
        return x[:, :-1].pin_memory(), x[:, 1:].pin_memory(), docs.pin_memory()

    def state_dict(self) -> dict:
        return {"sample": 2 * self.i}


def test_compiled_moe_training_steps_make_no_host_sync_but_the_logging_steps_read(tmp_path, monkeypatch):
    """Kiln's trainer over a compiled MoE model (bf16, grouped GEMMs, full activation checkpointing, packed
    documents, router and z-losses, fused AdamW, clipping), after two warm-up steps, under CUDA's sync debug mode
    set to error: any operation that makes the host wait for the GPU fails the test, apart from the one read of a
    logging step by design (kiln.train.trainer.StepRead: the gradient norm the throughput clock needs and the
    all-reduced loss, router losses and rates), which runs with the mode off."""
    from kiln.config import RunConfig
    from kiln.events import Callback
    from kiln.parallel.compile import apply_compile
    from kiln.train import trainer as trainer_module
    from kiln.train.router_aux import RouterAuxLog

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM serves Hopper and newer")
    cfg = RunConfig.model_validate({
        "model": {"vocab_size": 4096, "d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "qk_norm": True,
                  "max_seq_len": 256, "moe": {"n_experts": 16, "top_k": 4, "expert_hidden": 128,
                                              "z_loss_coef": 0.001}},
        "train": {"seq_len": 256, "batch_size": 2, "max_steps": 8, "warmup_steps": 2, "device": "cuda",
                  "precision": "bf16", "eval_every": 0, "grad_clip": 1.0, "run_dir": str(tmp_path)},
        "logging": {"every": 2}})
    torch.manual_seed(0)
    model = Transformer(cfg.model).cuda()
    apply_ac(model, "full")
    apply_compile(model)
    reads = {"logging": 0}
    plain_read = trainer_module.StepRead.__call__

    def read(self, values=None):  # the logging step's read, by design: the mode off around it
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads["logging"] += 1
            return plain_read(self, values)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(trainer_module.StepRead, "__call__", read)
    logged = []

    class Strict(Callback):
        def on_step_end(self, trainer, metrics):
            if metrics is not None:
                logged.append(metrics)
            if trainer.step == 2:  # compiled and warmed up: from here every sync is an error
                torch.cuda.set_sync_debug_mode("error")

    trainer = trainer_module.Trainer(cfg, model, _PinnedRows(4096, 256), None, torch.device("cuda"),
                                     callbacks=[RouterAuxLog(model.router_aux, model.router_z), Strict()])
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.step == 8 and reads["logging"] == 4
    assert [m["step"] for m in logged] == [2, 4, 6, 8]
    assert all(m["aux_loss"] > 0 and m["router_z_loss"] > 0 for m in logged)
    assert [m["alloc_retries"] for m in logged[1:]] == [0, 0, 0]  # nor did the allocator wait for the device
