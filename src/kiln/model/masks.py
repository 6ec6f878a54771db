"""Attention masks for packed rows: causal attention that stays inside each document.

`doc_mask(doc_ids, device)` is built once per forward pass from the loader's doc_ids (B, T) (the
index of each position's document within its row; on any device) and handed to every layer;
`attend(q, k, v, mask)` runs attention with it:

- no mask: plain causal SDPA (cuDNN / flash kernels);
- on CUDA: flex attention with a block mask, so blocks that cross documents are skipped, not
  computed and thrown away. Measured against variable-length flash attention and cuDNN's ragged
  kernel in benchmarks/attention.py: flex was as fast or faster (results/attention.md);
- elsewhere: SDPA with a boolean (B, 1, T, T) block-diagonal causal mask.

The mask is always built eagerly (`doc_mask` is excluded from compilation), so a compiled block
or a whole compiled model receives it as an input and never retraces its construction.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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
def _block_mask_builder():
    # compiled, the block mask is built block by block instead of from a (B, T, T) boolean tensor
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


def block_mask(doc_ids: torch.Tensor, device: torch.device):
    """doc_ids (B, T), on any device -> a flex-attention block mask on `device` (CUDA)."""
    B, T = doc_ids.shape
    _gpu["hopper"] = torch.cuda.get_device_capability(device)[0] == 9
    docs = doc_ids.to(device, non_blocking=True)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return _block_mask_builder()(same_doc_causal, B, None, T, T, device=device)


def dense_mask(doc_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """doc_ids (B, T) -> a boolean (B, 1, T, T) block-diagonal causal mask for SDPA."""
    doc_ids = doc_ids.to(device)
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


@torch.compiler.disable  # built eagerly: a compiled model takes the finished mask as an input
def doc_mask(doc_ids: torch.Tensor | None, device: torch.device | None = None):
    """doc_ids (B, T), on any device -> a mask `attend` understands on `device` (None: plain causal)."""
    if doc_ids is None:
        return None
    device = doc_ids.device if device is None else device
    return block_mask(doc_ids, device) if device.type == "cuda" else dense_mask(doc_ids, device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """q (B, H, T, hd), k and v (B, KV, T, hd) -> (B, H, T, hd), causal, within documents if masked."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=_tiles(q))
    return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=_tiles(q))
