"""kiln.plan.host: the offloaded step's AdamW pace, measured on this machine's host or assumed for another's."""

from __future__ import annotations

from io import StringIO
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from kiln.config import load_config
from kiln.plan import host, make_plan
from kiln.plan.gpus import GPUS, Gpu, is_here
from kiln.plan.offload import HOST_STEP_BYTES_PER_S
from kiln.plan.report import render

LLAMA3_8B = ["model.init_from=null", "model.size=8b"]


def test_the_probe_measures_a_plausible_pace_and_leaves_the_threads_as_they_were():
    threads = torch.get_num_threads()
    rate = host.measure_adamw(1 << 21, 1)  # small here: the test times the kernel, not the machine
    assert rate is not None and 1e8 < rate < 1e13  # 0.1 GB/s - 10 TB/s
    assert torch.get_num_threads() == threads


def test_a_torch_without_the_fused_cpu_kernel_gives_no_pace(monkeypatch):
    """The probe's fallback: where torch's fused CPU AdamW is missing or refuses the CPU, no pace (the plan then
    assumes the fitted one), and torch's threads as they were."""
    threads = torch.get_num_threads()

    def refused(*args, **kwargs):
        raise NotImplementedError("_fused_adamw_ has no CPU kernel in this build")

    monkeypatch.setattr(torch, "_fused_adamw_", refused)
    assert host.measure_adamw.__wrapped__(1 << 16, 1) is None
    monkeypatch.delattr(torch, "_fused_adamw_")
    assert host.measure_adamw.__wrapped__(1 << 16, 1) is None
    assert torch.get_num_threads() == threads


def _plan(here: bool = True, gpu: str = "h200"):
    """The 24 GB offload preset at 8B on `gpu`; `here`: this machine's card."""
    return make_plan(load_config("cpt-8b-24gb", LLAMA3_8B), 1, GPUS[gpu], here=here)


@pytest.fixture
def measured(monkeypatch):
    """Sets what the probe 'measures'."""
    def at(rate):
        monkeypatch.setattr(host, "measure_adamw", lambda: rate)
    return at


def test_the_offloaded_speed_follows_the_host_pace_it_is_given(measured):
    """AdamW over n parameters in host memory adds 28 n / pace seconds to the GPU's part of the step: a host twice as
    fast (89 GB/s against 40-47 measured on two GPU hosts) is a shorter step, by exactly that."""
    measured(89e9)
    fast = _plan()
    measured(40e9)
    slow = _plan()
    assert fast.host_pace.measured == 89e9 and slow.host_pace.measured == 40e9
    assert fast.host_pace.bytes_per_s == pytest.approx(89e9 * host.STEP_SHARE)
    assert fast.tokens_per_s > 1.3 * slow.tokens_per_s  # the host's AdamW is most of an 8B step
    def step(p):  # seconds: the GPU's part, then the host's
        return p.tokens_per_step / p.tokens_per_s

    n, share = fast.n_params, host.STEP_SHARE
    assert step(slow) - step(fast) == pytest.approx(28 * n / (40e9 * share) - 28 * n / (89e9 * share))
    for p in (fast, slow):
        assert next(o for o in p.options if o.strategy == "single+offload").tokens_per_s == p.tokens_per_s
    # AdamW shorter than the forward pass beside it adds nothing: a faster host still is no faster step
    measured(400e9)
    hidden = _plan()
    measured(800e9)
    assert _plan().tokens_per_s == hidden.tokens_per_s > fast.tokens_per_s
    # the plain layouts beside it do not use the host
    assert [o.tokens_per_s for o in fast.options if o.strategy == "single"] == \
        [o.tokens_per_s for o in slow.options if o.strategy == "single"]


def test_a_plan_for_another_machine_assumes_the_fitted_pace(measured, monkeypatch):
    def no_probe():
        raise AssertionError("measured for a card this machine lacks")

    monkeypatch.setattr(host, "measure_adamw", no_probe)
    plan = _plan(here=False, gpu="rtx4090")
    assert plan.host_pace == host.ASSUMED and plan.host_pace.bytes_per_s == HOST_STEP_BYTES_PER_S
    measured(None)  # here, but torch cannot measure it: assumed too
    assert _plan().host_pace == host.ASSUMED
    lora = make_plan(load_config("cpt-8b-1gpu", LLAMA3_8B), 1, GPUS["h200"], here=True)
    assert lora.host_pace is None  # LoRA plans no offload: nothing measured


def test_the_output_names_the_pace_and_where_it_comes_from(measured):
    def text(plan) -> str:
        out = StringIO()
        render(plan, Console(file=out, width=400))
        return out.getvalue()

    measured(47e9)
    assert "host AdamW at 47 GB/s measured here, x1.50 in the step: 70 GB/s" in text(_plan())
    assert "host AdamW at 67 GB/s assumed" in text(_plan(here=False, gpu="rtx4090"))
    # a plan without the offload names it where its options table plans the offload's speed
    other = text(make_plan(load_config("gpu-1b"), 1, GPUS["h200"], here=True))
    assert "the speed of train.offload=optimizer" in other and "47 GB/s measured here" in other


def test_a_card_is_this_machines_only_when_cuda_reports_it(monkeypatch):
    assert not is_here(GPUS["h200"]) or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=GPUS["h200"].memory))
    assert is_here(GPUS["h200"])  # found here, or named with --gpu h200 on this machine
    assert not is_here(GPUS["rtx4090"])  # --gpu rtx4090: the run will be on another host
    assert not is_here(GPUS["h100"])
    assert not is_here(Gpu("cpu", "CPU", 1 << 30, None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="Some New GPU"))
    assert is_here(Gpu("local", "Some New GPU", 1 << 30, None))


def test_kiln_plan_measures_the_host_of_this_machines_card(monkeypatch):
    from typer.testing import CliRunner

    from kiln.cli.app import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=GPUS["h200"].memory))
    monkeypatch.setattr(host, "measure_adamw", lambda: 60e9)
    args = ["plan", "cpt-8b-24gb", *LLAMA3_8B, "--gpu"]
    for card, said in (("h200", "60 GB/s measured here"), ("rtx4090", "67 GB/s assumed")):
        r = CliRunner().invoke(app, [*args, card], env={"COLUMNS": "400"})
        assert r.exit_code == 0, r.output
        assert said in r.output


def test_the_probes_slice_is_the_offloads():
    from kiln.parallel import offload

    assert host.STEP_SLICE == offload.STEP_SLICE
