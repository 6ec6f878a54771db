"""`dist:` how a run of several processes spreads over its devices (kiln.parallel)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.config.base import Problem, Section


class DistConfig(Section):
    """How a run started under torchrun (several processes) spreads over its devices."""

    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """'ddp': every process holds the whole model, gradients are all-reduced (bucketed, overlapped with
    the backward pass); 'fsdp': parameters, gradients and optimizer state are sharded (FSDP2); 'auto'
    (one process trains as always; several pick ddp when the model, its gradients and AdamW state fit
    one device with room for activations, else fsdp; the choice is logged)."""
    sharding: Literal["full", "grad_op", "hybrid"] = "full"
    """With fsdp: 'full' (ZeRO-3) gathers each block's parameters for its forward and backward and frees
    them after; 'grad_op' (ZeRO-2) keeps them gathered from forward to backward (more memory, one
    all-gather less); 'hybrid' (HSDP) shards inside each group of dist.replicas and replicates across."""
    replicas: int | None = None
    """With sharding 'hybrid': the number of replica groups (null: one per node); the processes of a group
    shard the model between them, the groups all-reduce gradients."""
    expert_parallel: int = Field(1, ge=1)
    """Expert parallelism for a native mixture of experts (model.moe) under fsdp: each of the processes keeps
    n_experts / expert_parallel whole experts of every layer, and each layer sends its tokens to the processes
    holding their experts and back (two all-to-alls each way, one small exchange of counts and a host read per layer
    and pass), instead of FSDP gathering and reducing every expert's weights every step. 1: off. Must equal the
    number of processes and divide model.moe.n_experts; not with sharding 'hybrid', cpu_offload or LoRA. The rest
    of the model is sharded by FSDP as without it; checkpoints (which resume with or without it) and the export are
    the same. docs/distributed.md says what it does and when it is faster."""
    cpu_offload: bool = False
    """With fsdp: keep parameters, gradients and optimizer state in CPU memory and run the optimizer step
    on the CPU (FSDP2's CPUOffloadPolicy): fits a model too large for the GPUs, at a cost in speed."""
    reduce_fp32: bool = True
    """With bf16 precision under fsdp: reduce gradients in fp32 (exact sums); false reduces in bf16
    (half the traffic). Parameters are gathered in bf16 for compute; the master weights stay fp32."""
    reduce_every_microbatch: bool = True
    """With fsdp and gradient accumulation: reduce-scatter each micro-batch's gradients as its backward pass makes
    them and add them to each process's fp32 shard, so no process keeps a whole unsharded gradient between
    micro-batches (hybrid sharding defers the all-reduce between replicas to a step's last micro-batch); false
    reduces once a step, after the last micro-batch, keeping every parameter's unsharded gradient (in the reduce
    dtype: 4 bytes a parameter on every process, 30 GiB at 8B) in between: less communication where memory allows.
    No effect under ddp (which all-reduces once a step) or in one process."""
    bucket_mb: float = Field(25.0, gt=0)
    """With ddp: gradients are all-reduced in buckets of about this many MB, each as soon as the backward pass
    has made all of its gradients (smaller: the first starts sooner; larger: fewer, faster collectives)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: 'auto' is nccl on GPUs and gloo on CPUs."""
    timeout_s: int = 600
    """Seconds a collective may wait for the other processes before the run stops with an error."""
    watchdog_s: int = 0
    """Stop every process when one has made no progress for this many seconds (stuck in I/O or a
    collective), naming it and printing the stacks of its threads (0: off)."""

    @model_validator(mode="after")
    def _check_dist(self) -> DistConfig:
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"dist.replicas must be at least 1, got {self.replicas}")
        if self.timeout_s < 1 or self.watchdog_s < 0:
            raise ValueError("dist.timeout_s must be positive and dist.watchdog_s 0 or more")
        if self.cpu_offload and self.strategy == "ddp":
            raise ValueError("dist.cpu_offload needs dist.strategy=fsdp (or auto); DDP keeps the model on the GPU")
        return self

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.replicas is not None and self.sharding != "hybrid":
            out.append((("replicas",), f"dist.replicas={self.replicas} applies to dist.sharding=hybrid only (it is "
                                       f"{self.sharding}); remove dist.replicas or set dist.sharding=hybrid"))
        if self.expert_parallel > 1:  # the rest, against the model and the processes: kiln.parallel.experts.check
            for key, refused, why in (("strategy", self.strategy == "ddp", "needs dist.strategy=fsdp (or auto)"),
                                      ("sharding", self.sharding == "hybrid", "does not support dist.sharding=hybrid"),
                                      ("cpu_offload", self.cpu_offload, "does not support dist.cpu_offload")):
                if refused:
                    out.append((("expert_parallel", key), f"dist.expert_parallel={self.expert_parallel} {why}: "
                                                          "change one of the two"))
        return out
