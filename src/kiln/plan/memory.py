"""Peak memory of one training process, from the model's shape and the run's settings (no torch).

Where the bytes go, per process, for AdamW with fp32 master weights:

    weights 4 N, gradients 4 N, AdamW moments 8 N     divided by the shard count under FSDP; on the
                                                      CPU instead with dist.cpu_offload
    compute copies of the weights                     bf16 casts autocast saves for the backward pass
                                                      (no AC), or FSDP's gathered blocks
    activations   tokens x (layers x per-layer + rest) what the backward pass needs, by AC mode
    loss buffers                                      one chunk of logits and its gradient, the output
                                                      projection's gradient (kiln.model.loss; none for
                                                      LoRA's frozen lm_head)

The peak is the largest of three moments: the end of the forward pass (every activation alive, no
gradient yet: optimizer.zero_grad sets them to None), with activation checkpointing the start of the
backward pass (every checkpointed activation still alive beside the first block recomputed: the peak at
large micro-batches), and the end of the backward pass (every gradient alive, the activations gone).

With gradient accumulation (several micro-batches a step) the gradients of the first micro-batch stay
through the forward and backward passes of the others, so both earlier moments hold them too. One process
and DDP accumulate into the gradients counted above (4 N, or 4 N / shards). So does FSDP2 with
dist.reduce_every_microbatch (the default): each micro-batch's gradients are reduce-scattered into the sharded
fp32 ones, 4 N / shards, for one reduce-scatter per micro-batch rather than per step. With it off, Kiln turns
FSDP2's gradient sync off for every micro-batch but the last (kiln.parallel.parallelize.grad_sync), and FSDP2
then keeps each parameter's *unsharded* gradient, in the reduce dtype (fp32 with dist.reduce_fp32, the
default), until the last micro-batch reduce-scatters it: 4 N bytes on every process whatever the shard count,
30 GiB at 8B (`accumulation_bytes`).

Activation bytes per layer and token, e = bytes of an activation element (2 under bf16, 4 in fp32),
d = d_model, q = n_heads x head_dim, kv = n_kv_heads x head_dim, h = the MLP's hidden width, H = heads:

    compiled (torch.compile keeps what the backward pass needs and recomputes elementwise ops):
      none       e (4d + 2q + 2kv + 3h) + 4H    block input, both norm outputs, the residual after
                                                attention; q, k, v and the attention output; the
                                                MLP's gate, up and their product; the softmax
                                                log-sum-exp in fp32
      selective  e (2d + 2q + 2kv + 2h) + 4H    the outputs of the matrix products and attention
      full       e d                            each block's input (one block is recomputed at a time)
    eager (measured exactly on the CPU with saved-tensor hooks: tests/unit/plan/test_memory.py):
      none       2 (4d + 2ed) + 8 + e (2q + 2kv + 4h) + 4H   each RMSNorm keeps its input in fp32
      selective  e (3d + 2q + 2kv + 2h) + 4H
      full       e d

The compiled coefficients were fitted to peak memory measured on an H100 (benchmarks/results/
throughput.md: 124m, 350m at two batch sizes, 1b; 3b with selective and full AC, all without accumulation)
and reproduce those six numbers within 3%. Real `kiln train` runs of the 1b and 3b presets (accumulation 4,
benchmarks/results/plan.md) peaked higher by the gradients kept between micro-batches, 4 N (4.1 GiB at 1b, at
micro-batch 8 and 12 alike; 3b within 4% with it); the 8B FSDP runs (fsdp_8b.md: 2 and 4 GPUs, sequence 8192, batch 1
with selective, full or no AC; batch 4 x accumulation 4 with full AC, 71.2 GiB) are predicted within 3%.
A gateless MLP (relu2) keeps one h less in each mode.

Expert parallelism (dist.expert_parallel, `Layout.experts`) changes the compute copies, the activations and the end
of the backward pass of a mixture of experts: each term is in kiln.plan.experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config import ModelConfig
from kiln.model.registry import param_count
from kiln.plan import experts as ep

LOGIT_CHUNK = 2**28  # kiln.model.loss.CHUNK_ELEMENTS: logits of one chunk of rows


@dataclass(frozen=True)
class Layout:
    """How the state of a run is laid over its processes."""

    strategy: str = "single"  # single, ddp or fsdp
    shard: int = 1  # processes one copy of the state is split over (FSDP), else 1
    sharding: str = "full"  # FSDP: full, grad_op or hybrid
    offload: bool = False  # FSDP: parameters, gradients and optimizer state in CPU memory
    experts: int = 1  # FSDP: dist.expert_parallel, processes the routed experts are spread over (kiln.plan.experts)


@dataclass(frozen=True)
class Lora:
    """Low-rank adapters (the lora: section): a frozen base in `base_bytes` per weight, adapters of `rank` on
    the `targets` (q, k, v, o, gate, up, down) trained in fp32 with AdamW."""

    rank: int
    targets: tuple[str, ...]
    base_bytes: int = 2
    nf4: bool = False  # QLoRA: the blocks' linear layers in NF4 (kiln.model.quant), the rest in base_bytes


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # kiln.model.quant.BYTES_PER_WEIGHT: 4-bit codes and their scales


def block_linear_params(m: ModelConfig) -> int:
    """Weights of the blocks' linear layers (q, k, v, o, gate, up, down): what NF4 quantizes."""
    d, q, kv, h = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_hidden
    return m.n_layers * (2 * d * q + 2 * d * kv + (3 if m.mlp == "swiglu" else 2) * d * h)


def base_bytes(m: ModelConfig, n: int, lora: Lora) -> int:
    """Bytes of the frozen base: every weight in lora.base_bytes, or (QLoRA) the block linears in NF4."""
    if not lora.nf4:
        return lora.base_bytes * n
    q = block_linear_params(m)
    return int(NF4_BYTES * q) + lora.base_bytes * (n - q)


def lora_params(m: ModelConfig, lora: Lora) -> int:
    """Trainable parameters of the adapters: rank x (in + out) for each target layer of every block."""
    d, q, kv, h = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_hidden
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "up": (d, h), "down": (h, d)}
    if m.mlp != "relu2":  # gated: swiglu, geglu
        shapes["gate"] = (d, h)
    names = shapes if "all" in lora.targets else [t for t in lora.targets if t in shapes]
    if m.fused_projections:  # one adapter on qkv_proj for any of q, k, v; one on gate_up_proj for gate, up
        shapes.update(qkv=(d, q + 2 * kv), gate_up=(d, 2 * h))
        names = list(dict.fromkeys({"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}.get(t, t)
                                   for t in names))
    return m.n_layers * sum(lora.rank * sum(shapes[t]) for t in names)


@dataclass(frozen=True)
class Memory:
    """Bytes on one device at the peak of a step, by what holds them."""

    weights: int
    grads: int
    optimizer: int
    compute_weights: int  # bf16 copies or gathered FSDP units, at the end of the forward pass
    activations: int
    loss: int  # loss buffers and the last norm, at the end of the forward pass
    backward: int  # what exists only at the end of the backward pass besides gradients
    peak: int
    phase: str  # "forward" or "backward": when the peak comes
    host: int  # bytes of CPU memory per process for offloaded state (0 without offload)
    accumulated: int = 0  # FSDP, reducing once a step: unsharded gradients kept between micro-batches


def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer block."""
    no_layers = m.model_copy(update={"n_layers": 0})
    return (param_count(m) - param_count(no_layers)) // m.n_layers


def act_per_layer_token(m: ModelConfig, ac: str, compiled: bool, e: int, experts: int = 1) -> int:
    """Activation bytes one block keeps per token for the backward pass (see the module doc). Expert parallelism
    (`experts` > 1) keeps none of the routed experts' hidden activations (kiln.plan.experts)."""
    d, q, kv, h, H = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp_hidden, m.n_heads
    gated = m.mlp != "relu2"  # swiglu, geglu
    if ac == "full":
        return e * d
    if m.moe is not None:  # a token's experts' hidden widths, and its rows sorted to them and weighted back
        h = (m.moe.top_k * m.moe.expert_hidden if experts == 1 else 0) + (m.moe.shared_expert_hidden or 0)
        d += m.moe.top_k * d
    if ac == "selective":
        return e * ((2 if compiled else 3) * d + 2 * q + 2 * kv + (2 if gated else 1) * h) + 4 * H
    if compiled:
        return e * (4 * d + 2 * q + 2 * kv + (3 if gated else 2) * h) + 4 * H
    return 2 * (4 * d + 2 * e * d) + 8 + e * (2 * q + 2 * kv + (4 if gated else 2) * h) + 4 * H


def loss_rest_per_token(m: ModelConfig, e: int) -> int:
    """Per token outside the blocks: the final norm's input (fp32) and output, the gradient of the hidden
    states the loss computes in its forward pass, token and target ids."""
    return 4 * m.d_model + 2 * e * m.d_model + 20


def loss_head_bytes(m: ModelConfig, e: int, lora: Lora | None = None) -> int:
    """What the loss holds of the output projection's size besides its chunk: the projection's fp32 gradient,
    summed over the chunks, and its compute copy. Under LoRA lm_head is frozen (kiln.model.lora: no target
    adapts it) and the loss makes no gradient for it (kiln.model.loss): only the copy, where the base's dtype
    is not the compute dtype (none for a bf16 base under bf16 autocast)."""
    vd = (m.vocab_size or 0) * m.d_model
    if lora is None:
        return vd * (4 + e)
    return 0 if lora.base_bytes == e else vd * e


def loss_chunk_bytes(m: ModelConfig, tokens: int, compiled: bool, e: int, bf16: bool,
                     lora: Lora | None = None) -> int:
    """One chunk of logits and its gradient (the compiled kernel; eager adds fp32 temporaries), plus the
    output projection's fp32 gradient and its compute copy (`loss_head_bytes`; its products are made in slices of the
    vocabulary: kiln.model.loss.VOCAB_SLICE)."""
    v = m.vocab_size or 0
    rows = min(tokens, max(256, (LOGIT_CHUNK // max(v, 1)) // 256 * 256))
    # compiled kernel: the logits and their gradient; eager: also the fp32 copy, the one-hot, exp and a temporary
    per_logit = 2 * e if compiled else e + (4 if e < 4 else 0) + 12
    return rows * v * per_logit + loss_head_bytes(m, e, lora)


def activation_bytes(m: ModelConfig, tokens: int, ac: str, compiled: bool, e: int, experts: int = 1) -> int:
    out = tokens * (m.n_layers * act_per_layer_token(m, ac, compiled, e, experts) + loss_rest_per_token(m, e))
    return out + (ep.activations(m, tokens, ac, e) if experts > 1 else 0)


def state_bytes(n: int, layout: Layout) -> tuple[int, int, int]:
    """(weights, gradients, AdamW moments) of one process, on its device (0s under CPU offload)."""
    if layout.offload:
        return 0, 0, 0
    s = max(1, layout.shard)
    return -(-4 * n // s), -(-4 * n // s), -(-8 * n // s)


def accumulation_bytes(trained: int, layout: Layout, bf16: bool, reduce_fp32: bool = True,
                       every_microbatch: bool = True) -> int:
    """Unsharded gradients FSDP2 keeps between the micro-batches of a step, on each process (0 for one process
    and DDP, and for FSDP with dist.reduce_every_microbatch, `every_microbatch`: all accumulate into the
    gradients they always have): with its gradient sync off, each parameter's unsharded gradient, whole, cast to
    the reduce dtype (fp32 with dist.reduce_fp32; bf16 compute without it keeps its bf16 gradients; fp32
    training, fp32 ones), on the device even under CPU offload."""
    if layout.strategy != "fsdp" or every_microbatch:
        return 0
    return trained * (4 if reduce_fp32 or not bf16 else 2)


def compute_weight_bytes(m: ModelConfig, n: int, ac: str, bf16: bool, layout: Layout, compiled: bool = True,
                         fp8: int = 0, fp8_gather: bool = False) -> int:
    """Copies of the weights in the compute dtype alive at the end of the forward pass: eager autocast caches
    its bf16 copy of every weight until its block ends, whatever the activation checkpointing. `fp8`: parameters
    per block in float8 layers (kiln.plan.fp8), which autocast does not cache and FSDP gathers in 1 byte
    each with `fp8_gather`."""
    p, w = layer_params(m), (2 if bf16 else 4)
    fewer = fp8 * (w - 1) if fp8_gather else 0  # bytes a block's float8 gather saves
    if layout.strategy == "fsdp":
        grad_op = layout.sharding == "grad_op" and not layout.offload
        experts = ep.compute_weights(m, layout.experts, w, ac, m.n_layers if grad_op else 2) \
            if layout.experts > 1 else 0
        if grad_op:
            return w * n - m.n_layers * fewer + experts  # gathered from forward to backward
        root = (m.vocab_size or 0) * m.d_model * (1 if m.tie_embeddings else 2)
        # the root unit (embeddings) and a block with the next one prefetched
        return w * (root + 2 * p) - 2 * fewer + experts
    return 2 * m.n_layers * (p - fp8) if bf16 and (ac == "none" or not compiled) else 0  # autocast's bf16 casts


def backward_bytes(m: ModelConfig, tokens: int, ac: str, compiled: bool, e: int, bf16: bool,
                   layout: Layout) -> int:
    """Besides the gradients, at the end of the backward pass: the gradient flowing through the residual
    stream, the block being recomputed (AC), FSDP's unsharded gradients of a block or two."""
    p = layer_params(m)
    out = 2 * e * m.d_model * tokens
    x = layout.experts
    if ac == "full":
        out += tokens * act_per_layer_token(m, "none", compiled, e, x) + (2 * p if bf16 else 0)
    elif ac == "selective":
        out += tokens * (act_per_layer_token(m, "none", compiled, e, x) - act_per_layer_token(m, "selective", compiled,
                                                                                              e, x))
    if layout.strategy == "fsdp":
        out += 2 * p * ((2 if bf16 else 4) + 4)
    return out + (ep.backward(m, tokens, x, ac, e, 2 if bf16 else 4) if x > 1 else 0)


def peak_memory(m: ModelConfig, seq_len: int, batch: int, ac: str = "none", compiled: bool = True,
                bf16: bool = True, layout: Layout = Layout(), lora: Lora | None = None,
                fp8: int = 0, fp8_gather: bool = False, accumulate: bool = False, reduce_fp32: bool = True,
                every_microbatch: bool = True) -> Memory:
    """Peak bytes on one device of a training step with micro-batch `batch` (see the module doc).
    `fp8`, `fp8_gather`: float8 training (see `compute_weight_bytes`). `accumulate`: the step has more than
    one micro-batch, whose gradients are kept between them; `reduce_fp32`, `every_microbatch`: dist.reduce_fp32
    and dist.reduce_every_microbatch (without the latter FSDP keeps them unsharded, in the reduce dtype:
    `accumulation_bytes`).

    With `lora`, only the adapters have gradients and AdamW state; the frozen base takes lora.base_bytes
    a weight (no compute copies when that is bf16), and each block keeps the adapters' rank-wide
    intermediate outputs besides its usual activations."""
    n = param_count(m)
    tokens = seq_len * batch
    e = 2 if bf16 else 4
    weights, grads, optim = state_bytes(n, layout)
    compute = compute_weight_bytes(m, n, ac, bf16, layout, compiled, fp8, fp8_gather)
    acts = activation_bytes(m, tokens, ac, compiled, e, layout.experts)
    if lora is not None:
        s, trained = max(1, layout.shard), lora_params(m, lora)
        _, grads, optim = state_bytes(trained, layout)
        weights = 0 if layout.offload else -(-(base_bytes(m, n, lora) + 4 * trained) // s)
        if lora.base_bytes == 2 and layout.strategy != "fsdp":
            compute = 0  # the base is already in the compute dtype
        if lora.nf4:  # each NF4 layer dequantized to the compute dtype for its product: a block's at most
            compute += 2 * block_linear_params(m) // m.n_layers
        if ac != "full":
            targets = 7 if "all" in lora.targets else len(lora.targets)
            acts += tokens * m.n_layers * e * lora.rank * targets
    loss = loss_chunk_bytes(m, tokens, compiled, e, bf16, lora)
    back = backward_bytes(m, tokens, ac, compiled, e, bf16, layout)
    # gradients held while a later micro-batch runs forward and backward: the state's own (one process, DDP, FSDP
    # reducing every micro-batch), or FSDP's unsharded ones, which the last micro-batch's backward reduce-scatters
    # into the sharded gradients
    accumulated = accumulation_bytes(lora_params(m, lora) if lora else n, layout, bf16, reduce_fp32,
                                     every_microbatch) if accumulate else 0
    held = accumulated or (grads if accumulate else 0)
    forward_end = weights + optim + compute + acts + loss + held
    backward_end = weights + optim + max(grads, accumulated) + back
    if not compiled and layout.strategy != "fsdp":
        backward_end += compute  # eager: autocast's cache of bf16 copies lives until the autocast block ends
    # with checkpointing, the start of the backward pass: every block's checkpointed activations still alive and
    # the last block recomputed beside them, with the output projection's gradient the loss made (not its chunk
    # of logits; none for LoRA's frozen lm_head); at a large micro-batch this is the peak (an 8B block at 32K tokens
    # recomputes 4.3 GiB)
    recompute = tokens * (act_per_layer_token(m, "none", compiled, e, layout.experts)
                          - act_per_layer_token(m, ac, compiled, e, layout.experts))
    head = min(loss, loss_head_bytes(m, e)) if lora is None else 0
    backward_start = weights + optim + compute + acts + head + recompute + held if ac != "none" else 0
    peak, phase = max((forward_end, "forward"), (backward_start, "recompute"), (backward_end, "backward"))
    state = 16 * n if lora is None else base_bytes(m, n, lora) + 16 * lora_params(m, lora)
    host = -(-state // max(1, layout.shard)) if layout.offload else 0
    return Memory(weights, grads, optim, compute, acts, loss, back, peak, phase, host, accumulated)


def checkpoint_bytes(n: int) -> int:
    """A resumable checkpoint: fp32 weights and AdamW's two fp32 moments (12 bytes a parameter; the 1b
    state measured 13.2 GB in benchmarks/results/checkpoint.md), plus small JSON parts."""
    return 12 * n + (1 << 20)
