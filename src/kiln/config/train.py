"""`train:` length, batch, schedule, evaluation and device of a run, and its early stopping."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from kiln.config.base import Problem, Section, not_blank
from kiln.config.fp8 import Fp8Config
from kiln.errors import ConfigError


class EarlyStopConfig(Section):
    """Stop training when the validation loss stops improving (needs a validation split and train.eval_every)."""

    patience: int = Field(0, ge=0)
    """Stop after this many evaluations in a row without improvement (0: early stopping off)."""
    min_delta: float = Field(0.0, ge=0)
    """An evaluation improves only when its validation loss is below the best so far by more than this."""
    metric: str = "val_loss"
    """The evaluation metric watched: val_loss, val_bpb, or a benchmark score of eval.tasks (hellaswag/acc_norm;
    with mode: max). Evaluations without it are not counted."""
    _named = field_validator("metric")(classmethod(not_blank))
    mode: Literal["min", "max"] = "min"
    """min: lower is better (losses); max: higher is better (accuracies)."""
    restore_best: bool = True
    """After an early stop, model/ (and the sample) take the weights of the best evaluation, kept in host memory
    (one copy of the weights) or read from its checkpoint; the final checkpoint keeps the last step's state."""


class TrainConfig(Section):
    seq_len: int = Field(256, ge=1)
    """Tokens per training sequence."""
    batch_size: int | Literal["auto"] = 8
    """Sequences per micro-batch on each device; 'auto' tries real training steps before the run and takes the
    largest that fits with recovery.auto_batch_margin to spare (on the CPU: the fewest rows of 1024 tokens that
    the memory allows), needs train.global_batch_tokens, and caches the result per model, sequence, precision,
    device and its memory, and world size."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step (derived from train.global_batch_tokens when that is set)."""
    global_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per optimizer step over all data-parallel ranks, a multiple of train.seq_len; the micro-batch
    may change (auto, or halved after an out-of-memory error) while this stays. null: batch_size x
    grad_accum x ranks x seq_len."""
    max_steps: int = Field(300, ge=1)
    """Optimizer steps to train for."""
    lr: float = Field(2e-3, gt=0, le=1)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = Field(30, ge=0)
    """Linear warmup steps from zero to the peak learning rate."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """For 'wsd': the fraction of steps, at the end, spent decaying to min_lr."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""
    eval_every: int = Field(100, ge=0)
    """Evaluate on the validation split every N steps (0: only at the end)."""
    eval_batches: int = Field(8, ge=1)
    """Validation batches per evaluation."""
    seed: int = Field(1337, ge=0, lt=1 << 63)
    """Seed of weight initialisation, data order and sampling."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    threads: int | None = Field(None, ge=1, le=1024)
    """CPU threads of PyTorch in each process of a run on the CPU (torch.set_num_threads; GPU runs keep
    PyTorch's default). null: for a model under 20M parameters as many as the machine has idle cores when the
    run starts (at least 1): its small matrix products lose to threads that wait for a core another process
    holds (measured: benchmarks/threads.py); else PyTorch's default (one per physical core, or
    OMP_NUM_THREADS)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'bf16': autocast, with fp32 weights and optimizer state and a bf16 residual stream; 'fp32';
    or 'auto' (bf16 on CUDA, fp32 on CPU)."""
    fp8: Fp8Config = Fp8Config()
    """Float8 matrix products in the blocks' linear layers (GPUs with compute capability 8.9+; off by default)."""
    compile: bool = False
    """Compile the model and the loss kernel with torch.compile (fastest on GPU; slow to start on CPU)."""
    compile_scope: Literal["blocks", "model"] = "blocks"
    """With compile: 'blocks' compiles each transformer block (one graph for all, quick to compile);
    'model' the whole forward pass up to the loss (1-2% faster at 124m, longer to compile; under DDP torch
    splits that graph at the gradient buckets, so their reduction overlaps the backward pass; under FSDP it
    is compiled per block, each block being a shard unit)."""
    compile_cache: str | None = "~/.cache/kiln/compile"
    """With compile: the directory torch.compile keeps its compiled graphs and kernels in between runs, so a
    run of the same model and shapes recompiles little (an 8B model's first step: 82 s cold, about 20 s warm).
    Share it between nodes on a shared filesystem (or copy it); null: torch's default, /tmp/torchinductor_$USER,
    lost at a reboot. The environment variable TORCHINDUCTOR_CACHE_DIR, where set, wins."""
    cross_entropy_kernel: Literal["auto", "triton", "torch"] = "torch"
    """The kernel of the chunked cross-entropy's softmax, loss and logits' gradient: 'torch', PyTorch's ops (fused
    by torch.compile with train.compile); 'triton', one Triton kernel that reads each chunk's logits twice and
    writes their gradient over them (CUDA GPUs with triton, which CUDA builds of torch ship); 'auto', triton where
    it can run, else torch. torch is the default: Triton's was 1.02x the whole loss of a 124m step on an H100, and
    an 8B job on 4 H100s with it ran 1.28x slower, its steps growing longer (benchmarks/results/fsdp_8b.md)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in the backward pass to save memory: 'selective' keeps each block's matrix
    product and attention outputs and recomputes its elementwise ops; 'full' recomputes whole blocks
    (3b on an H100 at batch 8: 61 GiB and 54% MFU selective, 46 GiB and 45% MFU full)."""
    offload: Literal["none", "optimizer"] = "none"
    """'optimizer': one GPU trains a model whose fp32 weights and AdamW state do not fit beside it (ZeRO-Offload
    class): the device keeps the weights in the compute dtype (bf16: 2 bytes a parameter), each gradient is added
    to the step's fp32 sum in pinned host memory as soon as the backward pass makes it, and fp32 master weights,
    AdamW moments and those sums stay in host memory (16 bytes a parameter; checked before the run starts), where a
    multi-threaded AdamW steps them and the new weights are copied back. Exact: the same updates as 'none'
    (clipping, accumulation), to the rounding of the compute dtype. One process only, no LoRA, the native model,
    a fixed train.batch_size. 'none': everything on the device."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak dense bf16 TFLOP/s of one device for the MFU metric; null looks the GPU up in a table."""
    run_dir: str | None = None
    """Run directory; null makes runs/<timestamp>."""
    sample_prompt: str = "def "
    """Prompt of the sample printed at the end of training."""
    sample_tokens: int = Field(80, ge=0)
    """Tokens generated for that sample (0: no sample), at most: it ends at the model's first stop token (its EOS,
    and the eos_token_id of model.init_from's generation_config.json) or stop string (that file's stop_strings), as
    `kiln generate` does; sampled with that file's temperature, top_k, top_p and repetition_penalty (do_sample
    false: greedy), else temperature 0.8 and top-k 50."""
    sample_ignore_eos: bool = False
    """Sample all sample_tokens, past the model's stop tokens and stop strings (as `kiln generate --ignore-eos`)."""
    early_stop: EarlyStopConfig = EarlyStopConfig()
    """Early stopping on validation loss: patience (evaluations) and min_delta; off unless patience > 0."""

    @field_validator("batch_size", mode="plain")
    @classmethod
    def _batch_size(cls, v: Any) -> int | str:
        if v == "auto":
            return v
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("Input should be a whole number of sequences, or 'auto'")
        if v < 1:
            raise ValueError("Input should be greater than or equal to 1")
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", v):
            raise ValueError("not a device; use auto, cpu, cuda or cuda:N")
        return v

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        g = self.global_batch_tokens
        if self.batch_size == "auto" and g is None:
            out.append((("batch_size", "global_batch_tokens"), "train.batch_size=auto needs train.global_batch_tokens "
                        "(the tokens of one optimizer step), so the batch the optimizer sees does not depend on "
                        "the device; set it, e.g. train.global_batch_tokens=" f"{8 * self.seq_len * 8}"))
        if g is not None and g % self.seq_len:
            out.append((("global_batch_tokens", "seq_len"), f"train.global_batch_tokens={g} is not a multiple of "
                        f"train.seq_len={self.seq_len}; use {max(1, g // self.seq_len) * self.seq_len}"))
        elif g is not None and self.grad_accum != 1:  # 1, the default, is what a run's config.yaml records
            out.append((("global_batch_tokens", "grad_accum"), "give train.global_batch_tokens or train.grad_accum, "
                        "not both: the accumulation follows from the global batch and the micro-batch"))
        if self.offload != "none" and self.batch_size == "auto":
            out.append((("offload", "batch_size"), f"train.offload={self.offload} needs a fixed train.batch_size "
                        "(batch_size auto measures steps of the plain path); set train.batch_size=1, say"))
        if self.early_stop.patience and not self.eval_every:
            out.append((("early_stop", "eval_every"), f"train.early_stop.patience={self.early_stop.patience} counts "
                        "evaluations during training, and train.eval_every=0 makes none; set train.eval_every (or "
                        "train.early_stop.patience=0)"))
        if self.fp8.enabled and self.precision == "fp32":
            out.append((("fp8.enabled", "precision"), "train.fp8.enabled runs the rest of the model in bf16, and "
                        "train.precision=fp32 asks for fp32; set train.precision=bf16 (or auto)"))
        if self.fp8.enabled and not self.device.startswith(("auto", "cuda")):
            out.append((("fp8.enabled", "device"), f"train.fp8.enabled needs a CUDA GPU with float8 tensor cores "
                        f"(compute capability 8.9 or more: H100, H200, L4, L40S), and train.device={self.device}; "
                        "set train.fp8.enabled=false to train on it in bf16 or fp32"))
        if self.cross_entropy_kernel == "triton" and not self.device.startswith(("auto", "cuda")):
            out.append((("cross_entropy_kernel", "device"), f"train.cross_entropy_kernel=triton runs on CUDA GPUs, "
                        f"and train.device={self.device}; set train.cross_entropy_kernel=auto (or torch)"))
        return out

    def step_rows(self, world: int) -> int:
        """Sequences each of `world` data-parallel ranks trains on per optimizer step (ConfigError if the
        global batch does not split evenly between them)."""
        if self.global_batch_tokens is None:
            return int(self.batch_size) * self.grad_accum
        rows = self.global_batch_tokens // self.seq_len
        if rows % world:
            raise ConfigError(f"train.global_batch_tokens={self.global_batch_tokens} is {rows} sequences, which "
                              f"{world} data-parallel ranks cannot share evenly; make it a multiple of "
                              f"{world * self.seq_len}")
        return rows // world

    def loader_rows(self, world: int) -> int:
        """Sequences in each batch a loader yields: the micro-batch, or with batch_size auto a whole step's."""
        rows = self.step_rows(world)
        if self.batch_size == "auto":
            return rows
        if rows % self.batch_size:
            raise ConfigError(f"train.global_batch_tokens={self.global_batch_tokens} gives {rows} sequences per "
                              f"rank per step, not a multiple of train.batch_size={self.batch_size}; choose a "
                              "batch_size that divides it, or train.batch_size=auto")
        return self.batch_size
