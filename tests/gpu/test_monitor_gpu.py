"""On a CUDA GPU: NVML readings of the training device, and the planner's peak memory of an eager training
step against torch's count."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, OptimConfig
from kiln.model.llama import Transformer
from kiln.model.loss import linear_cross_entropy
from kiln.plan.memory import peak_memory
from kiln.train.optim import build_optimizer

pytestmark = pytest.mark.gpu


def test_nvml_reads_the_training_gpu():
    pytest.importorskip("pynvml")
    from kiln.monitor.resources import gpu_reader

    reader = gpu_reader(torch.device("cuda", 0), print)
    assert reader is not None
    out = reader.read()
    reader.close()
    assert 0 <= out["gpu_util"] <= 100 and 0 < out["gpu_mem_frac"] <= 1
    assert out["gpu_power_w"] > 0 and out["gpu_temp_c"] > 0 and out["gpu_sm_clock_mhz"] > 0
    assert out["gpu_throttle_thermal"] in (0.0, 1.0)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_planned_peak_of_an_eager_bf16_step_is_within_10_percent(ac):
    from kiln.parallel.ac import apply_ac

    cfg = ModelConfig(d_model=1024, n_layers=6, n_heads=16, n_kv_heads=4, ffn_hidden=2816, vocab_size=8192,
                      max_seq_len=1024)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = apply_ac(Transformer(cfg), ac).to(dev)
    opt = build_optimizer(model, OptimConfig(), 1e-4, dev)
    batch = 8
    tokens = torch.randint(0, 8192, (batch, 1024), device=dev)

    phases: dict[str, float] = {}  # GiB at the peak of each part of the step, for the message on a failure

    def step(measure: bool = False):
        def mark(name: str) -> None:
            if measure:
                torch.cuda.synchronize()
                phases[name] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()

        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.hidden(tokens)
            mark("blocks")
            loss = linear_cross_entropy(h, model.lm_head.weight, tokens)
            mark("loss")
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in training
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(measure=True)
    torch.cuda.synchronize()
    measured = max(phases.values()) * 2**30
    plan = peak_memory(cfg, 1024, batch, ac, compiled=False, bf16=True)
    predicted = plan.peak
    planned = {k: round(v / 2**30, 3) for k, v in plan.__dict__.items() if isinstance(v, int)}
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 2**30, measured / 2**30, phases, planned)
