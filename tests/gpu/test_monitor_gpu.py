"""On a CUDA GPU: NVML readings of the training device, and the planner's peak memory of an eager training
step against torch's count."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, OptimConfig
from kiln.model.llama import Transformer
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

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(tokens, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in training
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = peak_memory(cfg, 1024, batch, ac, compiled=False, bf16=True).peak
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 2**30, measured / 2**30)
