"""The native model's precision policy on a transformers model (model.hf_class=auto), applied through hooks.

Under bf16 autocast the native model carries its residual stream in bf16 (half the memory traffic of every
norm, residual add and saved activation; the weights and the norms' arithmetic stay fp32) and rotates queries
and keys in fp32. A transformers model trained with fp32 weights under autocast instead carries an fp32
residual stream (its embeddings come out in fp32) and, where its rotary module casts its tables to the
hidden states' dtype, rotates in that dtype. `match_native` adds two hooks: the input embeddings' output is
cast to the autocast dtype, and a rotary module at the decoder's top level is given fp32 input, so its
cos/sin tables stay fp32. Outside autocast (fp32 training, evaluation) both do nothing.
"""

from __future__ import annotations

import torch
from torch import nn


def _residual_in_autocast_dtype(module: nn.Module, args, out):
    if isinstance(out, torch.Tensor) and out.is_floating_point() and torch.is_autocast_enabled(out.device.type):
        return out.to(torch.get_autocast_dtype(out.device.type))
    return None


def _rotary_tables_in_fp32(module: nn.Module, args):
    if args and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.float32 \
            and torch.is_autocast_enabled(args[0].device.type):
        return (args[0].float(), *args[1:])  # its dtype and device are all a rotary module reads of it
    return None


def match_native(decoder: nn.Module) -> list:
    """Hook `decoder` (a transformers model's decoder: embeddings, blocks, norm) to Kiln's precision policy;
    returns the hooks' handles."""
    handles = []
    embed = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    if isinstance(embed, nn.Module):
        handles.append(embed.register_forward_hook(_residual_in_autocast_dtype))
    rotary = getattr(decoder, "rotary_emb", None)
    if isinstance(rotary, nn.Module):
        handles.append(rotary.register_forward_pre_hook(_rotary_tables_in_fp32))
    return handles
