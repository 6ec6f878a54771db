"""Expert parallelism in the plan (dist.expert_parallel = N, kiln.parallel.experts): what it changes in a step.

Each of the N processes keeps n_experts / N whole experts of every layer, never gathered, and each layer's routed
rows travel to their experts' owners and back by all-to-all; the rest of the model is FSDP-sharded as without it.
With P = one layer's routed expert parameters (gate_up (E, 2h, d) and down (E, d, h): 3 E d h), w the compute
dtype's bytes, e an activation's, T a process's tokens, k = top_k and R = e T k d (a layer's routed rows: what a
process sends, and on average receives, in each all-to-all), per process and layer, against FSDP alone:

    weights, gradients, moments     unchanged: 1/N of the experts (whole ones) as FSDP's 1/N of every tensor
    compute copies                  - 2 w P   FSDP's gathered block and its prefetched next hold no experts
                                    + w P / N the local experts cast for the dispatch, one layer's (bf16 only);
                                              every layer's without AC: the dispatch saves its weight inputs
                                              for its backward, and torch's compiler keeps the casts too
    activations, full AC            + R       the dispatch's output, kept rather than recomputed (its all-to-alls
                                              are not repeated)
    activations, none / selective   - the routed experts' hidden activations (gate, up and their product):
                                      the dispatch saves its input rows only and redoes its gate/up products
                                      in its backward (kiln.plan.memory.act_per_layer_token)
    end of the backward pass        - 2 P (w + 4)  FSDP's unsharded gradients of a block or two hold no experts
                                    + w P / N      the local experts' gradients the dispatch's backward returns
                                    + 4 R          its rows and their output gradients, received and regrouped
    the block recomputed (full AC)  - w P (1 - 1 / N)  its weights: the local experts, not all; and none of the
                                                       routed hidden activations, as without AC

Time: the all-to-alls of a layer are 2 in the forward pass (rows out, outputs back) and 3 in the backward (the rows
again, their output gradients, their input gradients), none in the recomputation under full AC; each moves
R (N - 1) / N bytes off a process over the link (`LINK_BYTES_PER_S`), and the step waits for them. The backward
redoes the rows' gate/up products, 4 T k h d FLOPs a layer, where FSDP without AC or with selective AC keeps them;
under full AC FSDP instead recomputes the whole expert forward (6 T k h d), so expert parallelism makes 2 T k h d
fewer. The expert weights' all-gathers and reduce-scatters disappear, but the plan's FSDP speed has no time of its
own for them (its measured data-parallel factor, with the collectives overlapped with the compute), so nothing is
taken off for them here. The rest of the dispatch's cost, its host read of the row counts (one a layer in the
forward pass and one in the backward, none in the recomputation: each stops the host queueing work until the GPU
gets there) and the regrouping of the rows, is `DISPATCH_SECONDS` a layer and pass: what the one measurement leaves
unexplained (moe.md, 2 x H200, 8 layers of the Qwen3-30B-A3B shape, 4096 tokens, full AC: 9,650 tokens/s a GPU
against FSDP alone's 11,359, a step 64 ms longer where the all-to-alls and the FLOPs above make it 4 ms shorter).
"""

from __future__ import annotations

from kiln.config import ModelConfig

# bytes a second one process sends to the others of its node in an all-to-all: NVLink 4 (H100, H200: 450 GB/s each
# way), NVLink 3 (A100: 300) and PCIe 4.0 x16 (32) at 80% of nominal; not measured by Kiln
LINK_BYTES_PER_S = {"h100": 360e9, "h200": 360e9, "a100": 240e9, "a100-40": 240e9, "l40s": 25e9, "rtx4090": 25e9,
                    "rtx4080": 25e9, "rtx3090": 25e9, "a10g": 25e9, "l4": 25e9}
ALL_TO_ALLS = 5  # per layer and step: dispatch and combine forward; rows, output and input gradients backward
# seconds a layer and pass (forward, backward) of the dispatch beyond its all-to-alls and FLOPs: fitted to the one
# measurement (moe.md 2026-11-28 04:51 UTC: 4.26 ms), so good at that shape and card only
DISPATCH_SECONDS = 4.3e-3


def routed_params(m: ModelConfig) -> int:
    """One layer's routed experts' parameters, P: what expert parallelism keeps whole on their owners."""
    return m.moe.n_experts * 3 * m.d_model * m.moe.expert_hidden if m.moe else 0


def rows_bytes(m: ModelConfig, tokens: int, e: int) -> int:
    """One layer's routed rows, R = e T k d: what a process sends, and receives on average, in each all-to-all."""
    return e * tokens * m.moe.top_k * m.d_model if m.moe else 0


def compute_weights(m: ModelConfig, ways: int, w: int, ac: str, gathered: int) -> int:
    """The change in compute copies of the weights: the `gathered` FSDP blocks hold no experts (2, or every layer
    with sharding grad_op), and the local experts' casts for the dispatch (none in fp32, where no cast is made):
    every layer's without AC, compiled or not (checked: torch's partitioner saves a custom operator's cast weight
    inputs rather than casting again in the backward), one layer's at a time with AC, which recomputes them."""
    p = routed_params(m)
    casts = (m.n_layers if ac == "none" else 1) * p // ways if w == 2 else 0
    return w * (casts - gathered * p)


def activations(m: ModelConfig, tokens: int, ac: str, e: int) -> int:
    """Full AC's added activations: each layer's dispatch output (the routed hidden activations other modes no
    longer keep are left out in kiln.plan.memory.act_per_layer_token)."""
    return m.n_layers * rows_bytes(m, tokens, e) if ac == "full" else 0


def backward(m: ModelConfig, tokens: int, ways: int, ac: str, e: int, w: int) -> int:
    """The change at the end of the backward pass (see the module doc), including the recomputed block's weights."""
    p = routed_params(m)
    out = w * p // ways + 4 * rows_bytes(m, tokens, e) - 2 * p * (w + 4)
    if ac == "full" and w == 2:
        out -= w * p - w * p // ways
    return out


def extra_seconds(m: ModelConfig, tokens: int, ways: int, ac: str, e: int, gpu_key: str,
                  flops_per_s: float) -> float:
    """Seconds a process's step takes beyond FSDP alone's, at `flops_per_s` model FLOPs a second: the
    all-to-alls over the link (an H100's where the card is not in the table), the experts' FLOPs redone (or,
    under full AC, not recomputed) and the rest of the dispatch (`DISPATCH_SECONDS`, measured)."""
    link = LINK_BYTES_PER_S.get(gpu_key, LINK_BYTES_PER_S["h100"])
    moved = m.n_layers * ALL_TO_ALLS * rows_bytes(m, tokens, e) * (ways - 1) / ways
    flops = m.n_layers * tokens * m.moe.top_k * m.moe.expert_hidden * m.d_model * (-2 if ac == "full" else 4)
    return moved / link + flops / flops_per_s + 2 * m.n_layers * DISPATCH_SECONDS


def note(m: ModelConfig, ways: int, gpu_key: str) -> str:
    """The plan's line saying what it assumed."""
    link = LINK_BYTES_PER_S.get(gpu_key)
    where = f"{link / 1e9:.0f} GB/s" if link else f"{LINK_BYTES_PER_S['h100'] / 1e9:.0f} GB/s (an H100's NVLink)"
    return (f"dist.expert_parallel={ways}: {m.moe.n_experts // ways} whole experts of every layer on each process, "
            f"never gathered; the rest FSDP-sharded; each layer's routed rows sent to their experts and back by "
            f"{ALL_TO_ALLS} all-to-alls a step at {where} a process (not overlapped), the expert gathers' time not "
            "taken off (the plan's FSDP speed counts none of its own), and the rest of the dispatch (its host read "
            f"of the row counts) at {DISPATCH_SECONDS * 1e3:.1f} ms a layer and pass, measured once on 2 H200s "
            "(kiln.plan.experts)")
