"""Out-of-memory recovery: a step that runs out of device memory runs again in smaller micro-batches.

The samples of a step are fixed before it runs (`Trainer._step_batch`); the trainer cuts them into
micro-batches of `trainer.micro` rows and weights each loss by its share of the rows, so the gradient
is that of the mean loss over the step's rows whatever the cut. When a forward or backward pass
raises `torch.OutOfMemoryError`, `OomRetry.run` drops the step's gradients and cached blocks, halves
the micro-batch (the accumulation doubles) and runs the step again on the same rows in the same
order: the global batch, the samples and the loss curve go on as if nothing happened. The optimizer
has not stepped yet, so nothing else needs undoing.

An offloaded run (train.offload) whose vocabulary matrices' gradient sums were on the device when the error came
sums them in host memory from then on and runs the step again at the same micro-batch (`OptimizerOffload.relieved`).

After `recovery.oom_retries` such errors in one step (or at a micro-batch of one row, or in a run of
several processes, whose other ranks wait in collectives and cannot retry with it), the loader goes
back to the step's start and the run stops with a `ResourceError` carrying the numbers; `emergency`
on it asks `kiln.state.preempt.train_guarded` for an emergency checkpoint of the (consistent) state.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

from kiln.errors import ResourceError

T = TypeVar("T")
GIB = 2**30


def free_step_memory(trainer) -> None:
    """Drop the failed attempt's gradients (FSDP's unreduced ones too: the retry would add them to its own) and
    return the allocator's cached blocks to the device."""
    from kiln.parallel.parallelize import drop_unreduced_grads

    drop_unreduced_grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()


def memory_text(device: torch.device) -> str:
    """'peak X of Y GiB' on CUDA ('' elsewhere)."""
    if device.type != "cuda":
        return ""
    total = torch.cuda.get_device_properties(device).total_memory
    return f"; peak {torch.cuda.max_memory_allocated(device) / GIB:.1f} of {total / GIB:.1f} GiB allocated"


class OomRetry:
    """Runs a step's forward and backward passes, halving `trainer.micro` after each out-of-memory error."""

    def __init__(self, retries: int):
        self.retries = retries

    def run(self, trainer, work: Callable[[], T]) -> T:
        tried: list[int] = []
        while True:
            try:
                return work()
            except torch.OutOfMemoryError as e:
                tried.append(trainer.micro)
                reason = str(e).splitlines()[0] if str(e) else "out of memory"
            # here, outside the except block, the failed attempt's frames (and their activations) are gone
            free_step_memory(trainer)
            offload = getattr(trainer, "offload", None)
            if offload is not None and offload.relieved:  # it moved sums it had on the device to the host
                offload.relieved = False
                trainer.notice("oom", step=trainer.step + 1, micro_batch=trainer.micro, from_micro_batch=trainer.micro,
                               accumulation=-(-trainer.rows // trainer.micro), global_batch=trainer.rows *
                               trainer.mesh.world, error=reason,
                               message=f"out of memory in step {trainer.step + 1} with the vocabulary matrices' "
                                       "gradient sums on the device (train.offload): they are summed in host memory "
                                       "from now on, and the step runs again as it was")
                tried.pop()
                continue
            if len(tried) > self.retries or trainer.micro == 1 or trainer.mesh.distributed:
                raise self._give_up(trainer, tried, reason)
            trainer.micro = max(1, trainer.micro // 2)
            accum = -(-trainer.rows // trainer.micro)
            trainer.notice("oom", step=trainer.step + 1, micro_batch=trainer.micro, from_micro_batch=tried[-1],
                           accumulation=accum, global_batch=trainer.rows * trainer.mesh.world, error=reason,
                           message=f"out of memory in step {trainer.step + 1} at a micro-batch of {tried[-1]}: "
                                   f"retrying it as {accum} micro-batches of {trainer.micro} (the global batch "
                                   f"stays {trainer.rows * trainer.mesh.world} sequences)")

    def _give_up(self, trainer, tried: list[int], reason: str) -> ResourceError:
        """Put the loader back to the step's start (the state is then that of the last step) and say why."""
        trainer.train_loader.load_state_dict(trainer.step_start)
        trainer.consistent = True
        T, step = trainer.cfg.train.seq_len, trainer.step + 1
        why = ("this run has several processes, whose others cannot retry with it" if trainer.mesh.distributed
               else "a micro-batch of 1 sequence does not fit" if trainer.micro == 1
               else f"recovery.oom_retries={self.retries} retries are spent")
        trainer.notice("oom_stop", step=step, tried=tried, error=reason)
        err = ResourceError(
            f"out of device memory in step {step} on {trainer.device} ({reason}{memory_text(trainer.device)}), "
            f"{len(tried)} time(s), with micro-batches of {', '.join(map(str, tried))} sequences of {T} tokens; "
            f"{why}. The global batch is {trainer.rows * trainer.mesh.world} sequences. Lower train.batch_size "
            f"(now {trainer.cfg.train.batch_size}), set train.activation_checkpointing=selective or full, or use "
            "more devices; the state after the last complete step is saved as an emergency checkpoint "
            "(with checkpoint.on_signal on), and `kiln train RUN_DIR` resumes from it")
        err.emergency = True
        return err
