"""The memory model against real tensors: a tiny model's parameters, gradients and AdamW state byte for byte,
the activations its forward pass saves (counted with saved-tensor hooks), and the peaks measured on an H100."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from kiln.config import ModelConfig, OptimConfig
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.parallel.ac import apply_ac
from kiln.plan.memory import (
    Layout,
    Lora,
    act_per_layer_token,
    checkpoint_bytes,
    layer_params,
    loss_head_bytes,
    peak_memory,
    state_bytes,
)
from kiln.train.optim import build_optimizer

TINY = dict(d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=512)


def test_weights_gradients_and_adamw_state_match_a_real_model_exactly():
    cfg = ModelConfig(n_layers=2, **TINY)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimConfig(), 1e-3, torch.device("cpu"))
    tokens = torch.randint(0, 512, (2, 16))
    model(tokens, tokens).backward()
    opt.step()
    params = {id(p): p for p in model.parameters()}.values()  # tied embeddings once
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moments = sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    n = param_count(cfg)
    assert (weights, grads, moments) == state_bytes(n, Layout())
    assert checkpoint_bytes(n) - (1 << 20) == weights + moments  # a checkpoint holds weights and moments
    assert layer_params(cfg) == sum(p.numel() for p in model.layers[0].parameters())


def test_sharding_divides_the_state_and_offload_moves_it_to_the_host():
    n = 1_000_003
    assert state_bytes(n, Layout("fsdp", 4)) == (-(-4 * n // 4), -(-4 * n // 4), -(-8 * n // 4))
    cfg = ModelConfig(size="1b", vocab_size=32000)
    off = peak_memory(cfg, 2048, 1, "full", layout=Layout("fsdp", 4, offload=True))
    assert (off.weights, off.grads, off.optimizer) == (0, 0, 0)
    assert off.host == -(-16 * param_count(cfg) // 4)
    full = peak_memory(cfg, 2048, 1, "full", layout=Layout("fsdp", 4))
    grad_op = peak_memory(cfg, 2048, 1, "full", layout=Layout("fsdp", 4, "grad_op"))
    assert grad_op.compute_weights > full.compute_weights  # ZeRO-2 keeps the gathered weights to the backward


def _saved_bytes(cfg: ModelConfig, tokens: torch.Tensor, bf16: bool, ac: str) -> int:
    """Bytes of the distinct tensors the forward pass saves for the backward (parameters and buffers left out)."""
    torch.manual_seed(0)
    model = apply_ac(Transformer(cfg), ac)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = s.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model.hidden(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_eager_activations_per_layer_match_what_autograd_saves(bf16, ac):
    tokens = torch.randint(0, 512, (2, 64))
    one, two = (ModelConfig(n_layers=n, **TINY) for n in (1, 2))
    per_layer = _saved_bytes(two, tokens, bf16, ac) - _saved_bytes(one, tokens, bf16, ac)
    # autocast keeps a bf16 copy of each matrix it casts (the norms' weights stay fp32)
    copies = 2 * (layer_params(one) - 2 * one.d_model) if bf16 and ac == "none" else 0
    e = 2 if bf16 else 4
    assert per_layer == tokens.numel() * act_per_layer_token(one, ac, compiled=False, e=e) + copies


# peak GiB (torch.cuda.max_memory_allocated) measured on an H100, sequence 2048, vocab 32000, bf16, compiled:
# benchmarks/results/throughput.md
H100 = [("124m", 16, "none", 11.7), ("350m", 16, "none", 30.3), ("350m", 32, "none", 54.9), ("1b", 8, "none", 35.7),
        ("3b", 8, "selective", 60.8), ("3b", 8, "full", 45.5)]


@pytest.mark.parametrize("size,batch,ac,measured", H100)
def test_compiled_model_reproduces_the_peaks_measured_on_an_h100(size, batch, ac, measured):
    cfg = ModelConfig(size=size, vocab_size=32000, max_seq_len=2048)
    predicted = peak_memory(cfg, 2048, batch, ac).peak / 2**30
    assert predicted == pytest.approx(measured, rel=0.03)


def test_checkpointing_trades_memory_in_order_and_batch_grows_it():
    cfg = ModelConfig(size="3b", vocab_size=32000)
    peaks = [peak_memory(cfg, 2048, 8, ac).peak for ac in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    assert peak_memory(cfg, 2048, 16, "selective").peak > peaks[1]
    # 3b without AC at batch 8 did not fit the H100 (throughput.md); with selective AC it did
    assert peaks[0] * 1.05 + 2**30 > 81559 * 2**20 > peaks[1] * 1.05 + 2**30


class _HeapPeak:
    """The most bytes glibc's allocator had handed out (mallinfo2: arena and mmapped chunks in use), read after
    every aten op of the block: the peak of a step on the CPU, at op granularity."""

    def __init__(self):
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = Info
        except (OSError, AttributeError):
            pytest.skip("needs glibc's mallinfo2 (Linux)")
        self.libc, self.peak = libc, 0

    def used(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.peak = max(outer.peak, outer.used())
                return out

        self.start, self.mode = self.used(), Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _bf16_step_peak(model, tokens) -> int:
    """Bytes at the peak of an eager bf16-autocast training step (forward, backward, AdamW) of `model` on the CPU:
    the allocator's peak above its start, plus the weights and moments that exist between steps."""
    opt = build_optimizer(model, OptimConfig(), 1e-4, torch.device("cpu"))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the moments exist from here on
    state = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim())
    with _HeapPeak() as heap:
        step()
    return heap.peak - heap.start + state


@pytest.mark.parametrize("ac", ["none", "full"])
def test_eager_bf16_plan_reproduces_the_peak_of_a_step_on_the_cpu(ac):
    """The whole eager step (blocks, the chunked loss, backward, AdamW), weights and moments included, against
    the bytes the CPU allocator held at its peak: the terms and their timing, not only the saved activations."""
    cfg = ModelConfig(n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, ffn_hidden=320, vocab_size=2048,
                      max_seq_len=128)
    torch.manual_seed(0)
    model = apply_ac(Transformer(cfg), ac)
    measured = _bf16_step_peak(model, torch.randint(0, 2048, (4, 128)))
    planned = peak_memory(cfg, 128, 4, ac, compiled=False, bf16=True)
    assert planned.peak == pytest.approx(measured, rel=0.05), (planned, measured)
    assert planned.loss > 0.3 * planned.peak  # the chunked loss is the largest part here: its timing counts


@pytest.mark.parametrize("ac", ["none", "full"])
def test_eager_lora_plan_reproduces_the_peak_of_a_step_on_the_cpu(ac):
    """A LoRA step (bf16 base, lm_head frozen with it): the chunked loss makes no gradient for the head
    (kiln.model.loss), so the plan counts none. Counting the head's fp32 sum and a compute copy a bf16 base does
    not need (6 bytes a vocabulary entry and model dimension, as for full training) planned 7% over this peak."""
    from kiln.config import LoraConfig
    from kiln.model.lora import apply_lora

    cfg = ModelConfig(n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, ffn_hidden=320, vocab_size=8192,
                      max_seq_len=128)
    torch.manual_seed(0)
    model = apply_ac(apply_lora(Transformer(cfg), LoraConfig(rank=8, targets=["all"])), ac)
    measured = _bf16_step_peak(model, torch.randint(0, cfg.vocab_size, (4, 128)))
    planned = peak_memory(cfg, 128, 4, ac, compiled=False, bf16=True, lora=Lora(8, ("all",), 2))
    assert planned.peak == pytest.approx(measured, rel=0.03), (planned, measured)


def test_the_loss_counts_the_output_projections_gradient_only_where_it_trains():
    cfg = ModelConfig(size="8b", vocab_size=128256)
    vd = 128256 * 4096
    assert loss_head_bytes(cfg, 2) == 6 * vd  # full training: the fp32 sum and the bf16 copy of the fp32 weight
    assert loss_head_bytes(cfg, 2, Lora(16, ("all",), 2)) == 0  # bf16 base under bf16: frozen, already bf16
    assert loss_head_bytes(cfg, 2, Lora(16, ("all",), 2, nf4=True)) == 0  # QLoRA: lm_head stays bf16
    assert loss_head_bytes(cfg, 2, Lora(16, ("all",), 4)) == 2 * vd  # fp32 base: its bf16 copy for the products
    full = peak_memory(cfg, 2048, 1, "full")
    lora = peak_memory(cfg, 2048, 1, "full", lora=Lora(16, ("all",), 2))
    assert full.loss - lora.loss == 6 * vd  # 2.9 GiB at Llama-3-8B's vocabulary
    # the start of the backward pass holds no head gradient either: at 32K tokens it is LoRA's peak
    big = peak_memory(cfg, 2048, 16, "full", lora=Lora(16, ("all",), 2))
    assert big.phase == "recompute" and big.peak < peak_memory(cfg, 2048, 16, "full").peak - 12 * vd


# peak GiB (torch.cuda.max_memory_allocated, rank 0) of the Llama-3-8B shape under FSDP2 full sharding on H200s,
# sequence 8192, bf16 compute with fp32 masters and fp32 reduction, compile, document masks (flex attention):
# benchmarks/results/fsdp_8b.md; (GPUs, micro-batch, micro-batches a step, AC, measured)
FSDP_8B = [(2, 1, 1, "full", 64.8), (2, 1, 1, "selective", 73.5), (4, 1, 1, "selective", 51.1),
           (4, 1, 1, "none", 64.1), (4, 4, 4, "full", 71.2)]


@pytest.mark.parametrize("gpus,batch,accum,ac,measured", FSDP_8B)
def test_fsdp_8b_peaks_measured_on_h200s_are_predicted(gpus, batch, accum, ac, measured):
    """The last row is the cpt-8b-4gpu preset, measured when Kiln reduced FSDP's gradients once a step
    (dist.reduce_every_microbatch=false now): 41.1 GiB was planned before the unsharded gradients FSDP2 keeps
    between micro-batches were counted. Reducing every micro-batch (the default now) keeps the sharded ones
    instead, 4 N / 4: 22.4 GiB less at 8B over 4 GPUs, to be measured."""
    cfg = ModelConfig(size="8b", vocab_size=128256, max_seq_len=8192)
    mem = peak_memory(cfg, 8192, batch, ac, layout=Layout("fsdp", gpus), accumulate=accum > 1,
                      every_microbatch=False)
    assert mem.peak / 2**30 == pytest.approx(measured, rel=0.05)
    every = peak_memory(cfg, 8192, batch, ac, layout=Layout("fsdp", gpus), accumulate=accum > 1)
    assert every.accumulated == 0
    assert mem.peak - every.peak == (mem.accumulated - mem.grads if accum > 1 else 0)


@pytest.mark.parametrize("reduce_fp32,every", [(False, False), (True, True)])
def test_fsdp_keeps_the_unsharded_gradients_between_micro_batches_as_planned(reduce_fp32, every):
    """Kiln's FSDP2 model (bf16 compute, rank 0 of 2 with a fake process group standing in for the other), its
    gradient sync off as the trainer turns it off for every micro-batch but a step's last (dist.reduce_every_
    microbatch=false): the CPU heap grows by `accumulation_bytes` (each parameter's gradient whole, in the reduce
    dtype) and stays there over a second such micro-batch; the last micro-batch reduce-scatters it into the sharded
    gradients, 4 N / 2. Reducing every micro-batch (`every`), each adds to those sharded fp32 gradients: 4 N / 2
    from the first, no more with the next, and `accumulation_bytes` is 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kiln.config import RunConfig
    from kiln.parallel.materialize import materialize
    from kiln.parallel.mesh import Mesh
    from kiln.parallel.parallelize import grad_sync, parallelize
    from kiln.plan.memory import accumulation_bytes

    heap = _HeapPeak()
    rc = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": 512, "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_hidden": 384, "max_seq_len": 32},
        "train": {"device": "cpu", "precision": "bf16", "seq_len": 16},
        "dist": {"strategy": "fsdp", "reduce_fp32": reduce_fp32, "reduce_every_microbatch": every}})
    n = param_count(rc.model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        grid = init_device_mesh("cpu", (2,), mesh_dim_names=(f"accumulation_{reduce_fp32}_{every}",))
        with torch.device("meta"):
            model = Transformer(rc.model)
        mesh = Mesh(0, 0, 2, 2, torch.device("cpu"), "fake", grid)
        model = parallelize(model, rc, mesh, n, lambda s: None, strategy="fsdp")
        materialize(model, mesh)
        for p in model.parameters():
            torch.nn.init.normal_(p.to_local(), std=0.02)
        tokens = torch.randint(0, 512, (2, 16))

        def micro_batch(sync: bool) -> int:
            with grad_sync(model, sync=sync, every_microbatch=every):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(tokens, tokens)
                loss.backward()
            del loss
            gc.collect()
            return heap.used()

        micro_batch(True)  # what the first step leaves allocated (rope tables, autocast's and FSDP's buffers)
        model.zero_grad(set_to_none=True)
        gc.collect()
        start = heap.used()
        kept = [micro_batch(False) - start, micro_batch(False) - start]
        reduced = micro_batch(True) - start
    finally:
        dist.destroy_process_group()
    planned = accumulation_bytes(n, Layout("fsdp", 2), bf16=True, reduce_fp32=reduce_fp32, every_microbatch=every)
    assert reduced == pytest.approx(4 * n / 2, rel=0.05)
    if every:
        assert planned == 0
        assert kept[0] == pytest.approx(4 * n / 2, rel=0.05) and kept[1] == pytest.approx(4 * n / 2, rel=0.05)
        return
    assert planned == (4 if reduce_fp32 else 2) * n
    assert kept[0] == pytest.approx(planned, rel=0.03) and kept[1] == pytest.approx(planned, rel=0.03)
