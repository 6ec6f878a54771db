"""The processes of a training job that run an eval task together agree, before each forward and at its end,
whether every one of them is still in it.

At a training run's evaluations every process runs the same requests (kiln.eval.callback), and on a model
sharded over them (FSDP) every forward is a collective. A task that fails on some processes only (a data file
one node cannot read, a bad example it alone met) left the others in a forward whose gathers no one answered, or
answered by the next training step's: a hang, or weights mixed up. Now a process that fails says so at the
point where the others next check (`check`, before each forward) or end (`all_ok`), one all-reduce of a flag;
all leave the task together and all skip it.

    agreement = Agreement(device)              # device: where the job's collectives run (cuda under NCCL)
    agreement.check()                          # before a forward: FailedElsewhere if another process failed
    agreement.all_ok(error is None)            # at the end (or on an error): False if any process failed
    agreement.from_rank0(scores)               # then rank 0's scores on every process (lm-eval gives them it alone)
"""

from __future__ import annotations

from typing import Any

import torch


class FailedElsewhere(Exception):
    """Another process failed the task: this one leaves it too (its agreement already made)."""


class Agreement:
    """Agreement of every process of the default group on whether a task still runs everywhere."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.device = device
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def all_ok(self, ok: bool) -> bool:
        """True when every process passes True; one collective (nothing on one process)."""
        if self.world == 1:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def check(self) -> None:
        """Before a forward: FailedElsewhere where another process has left the task."""
        if not self.all_ok(True):
            raise FailedElsewhere("the task failed on another process")

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's `value` on every process (a collective): lm-eval hands the results to the process of
        LOCAL_RANK 0 alone, and every process's evaluation must see the same scores (an early stop on one)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def errors(self, error: str | None) -> list[str | None]:
        """Each process's `error` (None where it did not fail), in rank order; a collective, after a failure."""
        if self.world == 1:
            return [error]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, error)
        return out
