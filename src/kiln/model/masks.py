"""Attention masks for packed rows: causal attention that stays inside each document.

`doc_mask(doc_ids, device)` is built once per forward pass from the loader's doc_ids (B, T) (the
index of each position's document within its row; on any device) and handed to every layer;
`attend(q, k, v, mask)` runs attention with it:

- no mask: plain causal SDPA (cuDNN / flash kernels);
- on CUDA: flex attention with a block mask, so blocks that cross documents are skipped, not
  computed and thrown away. Measured against variable-length flash attention and cuDNN's ragged
  kernel in benchmarks/attention.py: flex was as fast or faster (results/attention.md);
- elsewhere: SDPA with a boolean (B, 1, T, T) block-diagonal causal mask.

A sliding window (Mistral: each position sees itself and the window - 1 before it) joins the same
mask: the row positions of one document are consecutive, so "within the window" counts the same
tokens in a packed row as in the document alone. Without doc_ids a window needs a mask of its own
(a (1, 1, T, T) band, or a flex block mask, which skips the blocks left of the band); a window at
least as long as the row is no constraint and keeps plain causal SDPA.

Scores soft-capped (Gemma 2: `attend(..., softcap=cap)`) need a mask on every layer, since SDPA cannot cap
them: `doc_mask(..., always=True)` gives one even where plain causal attention would do, and `attend` runs
flex attention with kiln.model.softcap's score modifier on it (CUDA) or eager attention (elsewhere).

The mask is always built eagerly (`doc_mask` is excluded from compilation), so a compiled block
or a whole compiled model receives it as an input and never retraces its construction.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.model import softcap

# flex attention's tiles (forward BLOCK_M x BLOCK_N, backward BLOCK_M1/N1/M2/N2) for 16-bit 64-wide
# heads on Hopper GPUs: measured 12% faster (forward + backward) than PyTorch's defaults on an H100 at
# the 124m and 1b shapes (benchmarks/results/attention.md); other GPUs and shapes keep the defaults
HOPPER_HD64_TILES = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
                     "BLOCK_N2": 64, "num_stages": 3, "num_warps": 4}
_gpu = {"hopper": False}  # set (eagerly) by block_mask for the GPU the mask is built on


def _tiles(q: torch.Tensor) -> dict | None:
    if _gpu["hopper"] and q.shape[-1] == 64 and q.dtype in (torch.bfloat16, torch.float16):
        return HOPPER_HD64_TILES
    return None


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _block_mask_builder(backend: str = "inductor"):
    # compiled, the block mask is built block by block instead of from a (B, T, T) boolean tensor. Not
    # dynamic=False: that compiles a graph for every batch size, and a process that sees many (auto-batch
    # trials, OOM halving, evaluation) passed torch's recompile limit (8), past which the mask was built
    # eagerly, from a dense (B, T, T) construction. Automatic dynamic shapes compile a second graph with the
    # batch size symbolic when a second size comes (and one for a batch of 1), and no more; the masks are the
    # same bits (checked on an H200 against the eager builder, batches of 1 to 64)
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, backend=backend)


def block_mask(doc_ids: torch.Tensor | None, device: torch.device, window: int | None = None, T: int = 0):
    """doc_ids (B, T), on any device (or None: one document) -> a flex-attention block mask on `device`
    (CUDA); with `window`, each position also sees only itself and the window - 1 positions before it."""
    B, T = (None, T) if doc_ids is None else doc_ids.shape
    _gpu["hopper"] = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    docs = None if doc_ids is None else doc_ids.to(device, non_blocking=True)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    def windowed(b, h, q_idx, kv_idx):
        inside = (q_idx >= kv_idx) & (q_idx - kv_idx < window)
        return inside if docs is None else inside & (docs[b, q_idx] == docs[b, kv_idx])

    mod = same_doc_causal if window is None else windowed
    if docs is None and window is None:  # a mask for attention that needs one (soft-capped scores)
        mod = causal
    return _block_mask_builder()(mod, B, None, T, T, device=device)


def dense_mask(doc_ids: torch.Tensor | None, device: torch.device, window: int | None = None,
               T: int = 0) -> torch.Tensor:
    """doc_ids (B, T) -> a boolean (B, 1, T, T) block-diagonal causal mask for SDPA (doc_ids None: (1, 1, T, T));
    with `window`, each position also sees only itself and the window - 1 positions before it."""
    T = T if doc_ids is None else doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    if window is not None:
        causal.triu_(1 - window)  # q - kv < window
    if doc_ids is None:
        return causal[None, None]
    doc_ids = doc_ids.to(device)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def doc_mask(doc_ids: torch.Tensor | None, device: torch.device | None = None, window: int | None = None,
             T: int = 0, always: bool = False):
    """doc_ids (B, T), on any device -> a mask `attend` understands on `device` (None: plain causal).

    window: a sliding window (None: none); T: the row length, needed without doc_ids; always: a causal mask
    where None would do (for soft-capped attention, which SDPA's is_causal cannot run).
    A model compiled whole builds it outside its graph (`kiln.parallel.compile`) and takes the mask as an input."""
    if window is not None and (window >= (T if doc_ids is None else doc_ids.shape[1])):
        window = None  # the window reaches the start of every row: plain causal
    if doc_ids is None and window is None and not always:
        return None
    device = (doc_ids.device if doc_ids is not None else torch.device("cpu")) if device is None else device
    build = block_mask if device.type == "cuda" else dense_mask
    return build(doc_ids, device, window, T)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, scale: float | None = None,
           cap: float | None = None) -> torch.Tensor:
    """q (B, H, T, hd), k and v (B, KV, T, hd) -> (B, H, T, hd), causal, within documents if masked.
    scale: of the scores (None: 1/sqrt(hd)); cap: their soft-cap (None: none; see the module doc)."""
    gqa = k.shape[1] != q.shape[1]
    if cap is not None and not _is_block_mask(mask):
        return softcap.eager_attention(q, k, v, mask, scale, cap)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    mod = None if cap is None else softcap.score_mod(cap)
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=mod, block_mask=mask, scale=scale, enable_gqa=gqa,
                              kernel_options=_tiles(q))
    return _flex()(q, k, v, score_mod=mod, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=_tiles(q))


def _is_block_mask(mask) -> bool:
    return mask is not None and not isinstance(mask, torch.Tensor)
