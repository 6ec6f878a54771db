"""Memory of a one-GPU run with its optimizer in host memory (train.offload: optimizer; kiln.parallel.offload).

On the device: the weights in the compute dtype (2 bytes a parameter under bf16, no fp32 copy and no autocast
casts), the activations and loss buffers of the plain path, the two fp32 slices the sums move through (allocated
once, always there), and the gradients in flight: each leaves for the host as soon as the backward pass makes it,
so at most the largest parameter's gradient and the next one exist at once. No AdamW state. On the host: fp32
master weights (4), AdamW's moments (8) and the step's fp32 gradient sums (4): 16 bytes a parameter.

The peak is the largest of three moments: the end of the forward pass (the loss's chunk of logits beside its fp32
output-projection gradient), the loss's backward (`head_bytes`: that fp32 gradient, which becomes the compute-dtype
one in its own memory) and the end of the backward pass (the gradients in flight, a block recomputed). Since the loss
stopped making a second (V, d) buffer there, the end of the forward pass holds more than the loss's backward.
"""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.model.registry import param_count
from kiln.plan.memory import Layout, Memory, layer_params, peak_memory

HOST_BYTES = 4 + 8 + 4  # fp32 masters, two fp32 moments, fp32 gradient sums
WAVE_TOKENS = 1 << 15  # kiln.parallel.offload_layers.WAVE_TOKENS: micro-batches run through a layer together
TRANSFER_SLICES = 2 * 4 * (1 << 24)  # bytes: kiln.parallel.offload's two fp32 slices of SLICE elements
LOSS_ROOM = 2 << 30  # kiln.parallel.offload.LOSS_ROOM: left free beside a vocabulary matrix's sum on the device


def largest_param(m: ModelConfig) -> int:
    """Elements of the model's largest parameter: the embedding or output projection (V x d), or an MLP matrix."""
    return max((m.vocab_size or 0) * m.d_model, m.d_model * m.mlp_hidden, layer_params(m) // 3)


def head_bytes(m: ModelConfig, e: int) -> int:
    """The output projection's gradient at the loss's backward.

    The chunked loss (kiln.model.loss) sums the projection's gradient in fp32 over the forward pass, a whole (V, d)
    buffer it keeps for its backward; there it scales it in place and, for bf16 weights (`e` = 2), writes the
    gradient autograd hands on over that buffer's own bytes (kiln.model.loss_weight_grad), through a one-row fp32
    temporary: V d 4 bytes and a row, whatever `e`. The offload's hook then takes the compute-dtype gradient, which
    owns half of those bytes, to the host.

    Before, the backward made that gradient as a second (V, d) buffer beside the fp32 one, through an fp32 slice of
    8192 rows: V d (4 + e) bytes and the slice, measured with torch.cuda.max_memory_allocated on an H200 under
    `cpt-8b-24gb` (benchmarks/results/offload.md) as the step's peak: 23.2 GiB for the Nemotron-3-8B shape (V 256K:
    5.9 GiB of head gradients), 19.2-19.3 GiB for Llama-3-8B (V 128K: 2.9 GiB)."""
    return (m.vocab_size or 0) * m.d_model * 4 + 4 * m.d_model


def offload_memory(m: ModelConfig, seq_len: int, batch: int, ac: str, compiled: bool, bf16: bool,
                   rows: int = 0, room: int = 0) -> Memory:
    """Peak bytes on the device, and host bytes, of a step with the optimizer offloaded (see the module doc); `rows`:
    a step's, whose layer inputs the layer-by-layer step keeps on the host (kiln.parallel.offload_layers); `room`:
    the bytes the process may allocate on its card (0: unknown), which decides where an untied output layer's
    gradient sum is made."""
    n, e = param_count(m), (2 if bf16 else 4)
    plain = peak_memory(m, seq_len, batch, ac, compiled, bf16, Layout("single"), None)
    weights = e * n
    # one being summed on the host while the next is made, and the two fp32 slices the sums move through
    grads = e * (largest_param(m) + m.d_model * m.mlp_hidden) + TRANSFER_SLICES
    # the weights are already in the compute dtype: the plain path's casts of them (compute copies, the output
    # projection's copy in the loss) do not exist
    loss = plain.loss - ((m.vocab_size or 0) * m.d_model * e if bf16 else 0)
    # the layer-by-layer step (kiln.parallel.offload_layers) holds every micro-batch's hidden states, their
    # gradients and the next layer's inputs copied up (3 x a wave's rows), and a layer's fp32 gradient sums
    rows = min(rows, max(1, WAVE_TOKENS // (batch * seq_len)) * batch)  # a wave's (kiln.parallel.offload_layers)
    layered = 3 * rows * seq_len * m.d_model * e if m.moe is None else 0
    sums = 4 * layer_params(m) if layered else 0
    forward_end = weights + plain.activations + loss + TRANSFER_SLICES + layered
    loss_backward = weights + plain.activations + head_bytes(m, e) + TRANSFER_SLICES + layered
    # the layer-by-layer step makes an untied output layer's fp32 sum on the device, beside the loss, where it and
    # LOSS_ROOM fit in what is left (kiln.parallel.offload.OptimizerOffload._vocab_fits); else on the host
    vocab_sum = 4 * (m.vocab_size or 0) * m.d_model
    if layered and not m.tie_embeddings and room and loss_backward + vocab_sum + LOSS_ROOM <= room:
        loss_backward += vocab_sum
    backward_end = weights + grads + plain.backward - (2 * layer_params(m) if bf16 and ac == "full" else 0) + \
        layered + sums
    peak, phase = max((forward_end, "forward"), (loss_backward, "loss"), (backward_end, "backward"))
    return Memory(weights, grads, 0, 0, plain.activations, loss, plain.backward, peak, phase,
                  host_bytes(n) + kept_bytes(m, rows, seq_len, e))


def kept_bytes(m: ModelConfig, rows: int, seq_len: int, e: int) -> int:
    """kiln.parallel.offload_layers.kept_bytes, without torch: each layer's input of a wave's rows (none for a mixture
    of experts, which keeps the per-micro-batch schedule)."""
    return 0 if m.moe is not None else m.n_layers * rows * seq_len * m.d_model * e


# AdamW on the host reads and writes about 28 bytes a parameter (fp32 weight, gradient, two moments; three written
# back) and its weights go back to the GPU: the pace of host memory. Fitted to the layer-by-layer step measured on
# a 2x H200 host (benchmarks/results/offload.md, 2026-11-28 18:55, past the first AdamW): Llama-3-8B at 8 x 4096,
# 6.15 s a step of which the GPU's part is planned at 3.73 s, the forward pass's 0.93 of it beside AdamW, so AdamW
# 3.35 s for 8.03B parameters (the phases timed on a 4x H200 host: 3.5 s). What a plan assumes for another machine's
# host; a plan for this machine measures its own (kiln.plan.host)
HOST_STEP_BYTES_PER_S = 67e9
# the GPU's part of the layer-by-layer step that runs beside the last step's AdamW: its forward pass, a quarter of
# full activation checkpointing's arithmetic (forward, the forward again, the backward pass at twice the forward)
BESIDE_ADAMW = 0.25


def host_seconds(n: int, bytes_per_s: float = HOST_STEP_BYTES_PER_S) -> float:
    """Seconds of AdamW over `n` parameters in host memory at `bytes_per_s` (kiln.plan.host.HostPace)."""
    return 28 * n / bytes_per_s


def exposed_seconds(on_gpu: float, adamw: float) -> float:
    """What AdamW's `adamw` seconds add to the layer-by-layer step whose GPU part takes `on_gpu`: the forward pass
    runs beside it (each layer once its weights are stepped), the loss and backward pass after it."""
    return max(0.0, adamw - BESIDE_ADAMW * on_gpu)


def host_bytes(n: int) -> int:
    """kiln.parallel.offload.host_bytes, without torch."""
    return HOST_BYTES * n


def offload_rows(mem: Memory, ac: str, compute: str) -> list[tuple[str, int]]:
    """The rows of `kiln plan`'s memory table for an offloaded run."""
    return [(f"weights, {compute} (fp32 masters on the host)", mem.weights),
            (f"gradients in flight to the host, {compute}", mem.grads),
            ("AdamW moments: on the host", 0),
            (f"activations (AC {ac})", mem.activations),
            ("loss buffers", mem.loss)]
