"""The Hugging Face Trainer's side of the FSDP2 benchmarks (fsdp_8b.py, moe.py, nemotron_h.py), one process per
GPU under torchrun: a transformers model built from its config on each rank (random init, fp32 master weights),
random token ids, a callback timing every step between device synchronisations, the Trainer in bf16 with fused
AdamW and FSDP2 through accelerate (each decoder layer its own unit, resharded after forward, accelerate's
activation checkpointing per --ac). Rank 0 prints one line, `HF_RESULT {json}` (`parse` reads it back).

    python -m torch.distributed.run --standalone --nproc_per_node=N benchmarks/hf_worker.py SPEC

SPEC is one JSON object (`command` makes the line):
    model, config_class, config
                    the transformers model and config classes by name, the config's keyword arguments
    layer           the decoder layer class accelerate wraps
    tokens          the random ids are drawn from [0, tokens)
    seq, batch, accum, steps, warmup, ac, device, out
                    sequence, micro-batch per GPU, micro-batches a step, steps, steps left out of the median,
                    activation checkpointing (none: off), cuda or cpu (gloo), the Trainer's output folder
    t0              the launcher's time.time() when it started the job (the start-up phase)
    report          extra result fields by name: reduce_dtype (the dtype FSDP2 reduces gradients in, as accelerate
                    set it), experts_implementation (the experts kernel transformers chose for an MoE)

The result: step_s (median after warmup), tokens_per_s_per_gpu, peak_gib (CUDA, from the first step on),
first_loss, last_loss, phases (seconds of start-up, build, wrap, first step, other steps, end), then `report`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root first, not benchmarks/ (whose names would shadow)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json
import os
import statistics
import time
from collections.abc import Iterable

RESULT = "HF_RESULT "
# the HF Trainer's peak learning rate; the Kiln side of each benchmark trains at the same (train.lr), so both
# sides' losses mean the same (an 8B model at Kiln's default 2e-3 rises in its first steps)
LR = 3e-4


def command(spec: dict, nproc: int) -> list[str]:
    """The torchrun line of the worker on `nproc` processes of this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(Path(__file__).resolve()), json.dumps(spec)]


def env() -> dict[str, str]:
    """The worker's environment beside the launcher's: one OpenMP thread a rank unless set, and Kiln's allocator."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **allocator_env()}


def allocator_env() -> dict[str, str]:
    """The CUDA allocator setting Kiln's runs use (`kiln.parallel.allocator`) for a baseline's process, unless the
    environment sets one: both sides of a comparison allocate alike."""
    from kiln.parallel import allocator

    return {} if any(os.environ.get(name) for name in allocator.USER) else {allocator.USER[0]: allocator.SETTING}


def parse(lines: Iterable[str]) -> dict | None:
    """The result rank 0 printed, None where it printed none."""
    line = next((x for x in lines if x.startswith(RESULT)), None)
    return None if line is None else json.loads(line.removeprefix(RESULT))


def build(spec: dict, device):
    """The model of `spec` with random weights (seed 0) on `device`, sdpa attention."""
    import torch
    import transformers

    cfg = getattr(transformers, spec["config_class"])(**spec["config"])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # Built and initialised on this rank's GPU (seconds; on the CPU an 8B model takes minutes): every rank draws
    # the same weights (same seed, same kind of GPU), and accelerate's fully_shard keeps this rank's shard of each
    # and frees the rest.
    with device:
        return getattr(transformers, spec["model"])(cfg)


def experts_implementation(model) -> str | None:
    config = model.config
    return getattr(config, "_experts_implementation_internal", None) or getattr(
        config, "_experts_implementation", None)


def reduce_dtype(model) -> str | None:
    """The dtype FSDP2 reduces gradients in, as accelerate set it (None where it can't be read)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        state = m._get_fsdp_state() if isinstance(m, FSDPModule) else None
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for g in groups:  # the root may hold no parameters of its own (no group)
            if g is not None:
                policy = g.mp_policy
                return str(policy.reduce_dtype or policy.param_dtype or "float32").replace("torch.", "")
    return None


def train(a: dict) -> dict | None:
    """Train as `a` says; the result on rank 0, None on the others."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cuda = a["device"] == "cuda"
    batch, accum = a.get("batch", 1), a.get("accum", 1)
    report = set(a.get("report", ()))
    t_start = time.time()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build(a, device)
    extras = {"experts_implementation": experts_implementation(model)} if "experts_implementation" in report else {}
    if cuda:
        torch.cuda.synchronize()
    t_model = time.time()

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            ids = torch.randint(0, a["tokens"], (a["seq"],), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0, self.first_begin, self.first_end, self.last_end = [], None, None, None, None

        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            if self.first_begin is None:  # the model is sharded (accelerate.prepare) by now: training memory
                self.first_begin = time.time()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            self.last_end = time.time()
            self.first_end = self.first_end or self.last_end

    fsdp_config = {"version": 2, "activation_checkpointing": a["ac"] != "none", "reshard_after_forward": True,
                   "transformer_layer_cls_to_wrap": [a["layer"]]}
    args = TrainingArguments(output_dir=a["out"], per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, max_steps=a["steps"], learning_rate=LR,
                             warmup_steps=0, bf16=cuda, optim="adamw_torch_fused", fsdp=True, fsdp_config=fsdp_config,
                             logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                             use_cpu=not cuda, ddp_backend=None if cuda else "gloo", seed=0)
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    trainer.train()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    step = statistics.median(clock.times[a["warmup"]:] or clock.times)
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    phases = {"start-up (imports)": t_start - a["t0"], "model build + init": t_model - t_start,
              "Trainer + accelerate FSDP2 wrap": clock.first_begin - t_model,
              "first step": clock.first_end - clock.first_begin, "other steps": clock.last_end - clock.first_end,
              "end": time.time() - clock.last_end}
    if "reduce_dtype" in report:
        extras["reduce_dtype"] = reduce_dtype(trainer.model_wrapped)
    return {"step_s": step, "tokens_per_s_per_gpu": a["seq"] * batch * accum / step,  # per GPU and step
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "first_loss": loss[0] if loss else None, "last_loss": loss[-1] if loss else None,
            "phases": phases, **extras}


if __name__ == "__main__":
    out = train(json.loads(sys.argv[1]))
    if out is not None:
        print(RESULT + json.dumps(out), flush=True)
