"""`kiln eval TARGET --tasks hellaswag,arc_easy`: lm-evaluation-harness scores of any model Kiln reads.

    result = score_target("runs/X", ["hellaswag"], limit=500)   # result["scores"]["hellaswag/acc"]

TARGET is what `kiln eval --data` takes (kiln.evaluate.load_target): a run directory, its model/, a
checkpoint directory, or a Hugging Face model directory, run as Kiln's native model through `KilnLM`;
a Hugging Face directory of another architecture (GPT-2, Gemma, Phi, ...) runs through transformers, as
`model.hf_class=auto` trains it. On CUDA it computes in bf16 (unless the run trained in fp32); on the
CPU in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ConfigError


def score_target(target: str | Path, tasks: Sequence[str], *, include_path: Sequence[str | Path] = (),
                 limit: int | float | None = None, num_fewshot: int | None = None, batch_size: int = 16,
                 device: str = "auto", max_length: int | None = None) -> dict[str, Any]:
    """Scores of TARGET on `tasks`, as a JSON-ready dict (see the module doc)."""
    from kiln.eval.callback import require_lm_eval

    require_lm_eval()
    from kiln.eval.harness import KilnLM
    from kiln.eval.tasks import check_tasks, manager_for, run_tasks
    from kiln.evaluate import _device, load_target
    from kiln.state.stop_tokens import saved_model_stops

    if not tasks:
        raise ConfigError("--tasks: name at least one lm-eval task, e.g. --tasks hellaswag,arc_easy")
    manager = manager_for(tasks, include_path)
    check_tasks(manager, tasks)  # before the model is loaded
    t = load_target(target)  # any architecture kiln train takes: the native model or transformers (auto)
    dev, joined = _device(device), _join_torchrun(device)
    if joined is not None:
        dev = joined
    model = t.model.to(dev).eval()
    if max_length is not None and not 1 <= max_length <= model.cfg.max_seq_len:
        raise ConfigError(f"--max-length {max_length}: give 1 to the model's {model.cfg.max_seq_len} positions")
    bf16 = dev.type == "cuda" and (t.run_cfg is None or t.run_cfg.train.precision != "fp32")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    lm = KilnLM(model, t.tokenizer, batch_size=batch_size, max_length=max_length, autocast=autocast,
                data_parallel=joined is not None, stop_ids=(stops := saved_model_stops(t.path, t.tokenizer)).ids,
                stop_strings=stops.strings)
    try:
        out = run_tasks(lm, tasks, limit=limit, num_fewshot=num_fewshot, manager=manager, stderr=True)
    finally:
        if joined is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    default = t.default_out.with_name(t.default_out.name.replace("eval", "lm_eval", 1)) if t.default_out else None
    return {"target": str(t.path), "kind": t.kind, "step": t.step, "tasks": list(tasks), "limit": limit,
            "processes": lm.world_size, "rank": lm.rank,
            "num_fewshot": num_fewshot, "tokenizer": t.tokenizer.hash, "max_length": lm.max_length,
            "scores": out["scores"], "n_samples": out["n_samples"], "results": out["results"],
            "default_out": str(default) if default is not None else None}


def _join_torchrun(device: str) -> torch.device | None:
    """Under torchrun (kiln eval --nproc N): join the process group (NCCL on GPUs, gloo on the CPU); this
    process's device. None in a process of its own."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    return dev

