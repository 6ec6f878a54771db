"""The native model's attention inside a transformers model (model.hf_class=auto).

transformers' attention layers call whatever function the model's `config._attn_implementation` names
in its attention registry, with queries, keys and values already projected and rotated. `install` registers
`kiln_attention` there and points the model at it, so the auto path attends as the native model does
(kiln.model.masks): plain causal SDPA (flash / cuDNN) without documents, and with documents of a packed
row a mask built once per forward by `HFCausalLM` (a flex-attention block mask on CUDA, which skips the
blocks that cross documents; a boolean block-diagonal mask elsewhere), passed to every layer as the
keyword `kiln_mask` (transformers hands a model's extra keywords down to its attention function).
transformers then builds no mask of its own: a per-step (B, 1, T, T) mask from the position ids, and the
SDPA kernel that takes one, are what made packed rows slow on this path.

A sliding window (Mistral, Gemma 3's local layers, ...) joins the mask: a model whose config names one gets
{None: the full layers' mask, window: the windowed layers'} and each layer picks by the `sliding_window` its
attention passes. Soft-capped scores (Gemma 2) run as the native model runs them (flex attention with a score
modifier on CUDA, eager attention elsewhere: kiln.model.masks). A model whose attention is not causal
dot-product attention (attention sinks, ALiBi, attention dropout, ...) or whose layers do not pass the keyword
on keeps its own: `install` checks the structure, then runs a packed row of two documents through both
(`probe`, with any sliding window shortened below the documents' length) and keeps Kiln's only where the
logits agree.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.model import masks

NAME = "kiln"  # the name in transformers' attention registry
MASK_KEY = "kiln_mask"  # the keyword that carries the mask from HFCausalLM.forward to every layer
PROBE_WINDOW = 3  # the sliding window a model's check runs with (shorter than the check's documents)
_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


class NotPlain(RuntimeError):
    """A layer asked Kiln's attention for what it does not compute."""


def kiln_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask=None, dropout: float = 0.0, scaling: float | None = None, **kwargs
                   ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, T, hd), key and value (B, KV, T, hd) ->
    ((B, T, H, hd), no weights), causal, inside each document where `kiln_mask` holds a mask."""
    name = type(module).__name__
    if MASK_KEY not in kwargs:  # HFCausalLM always passes it: a layer that does not hand its keywords on
        raise NotPlain(f"{name} does not hand the model's keywords on to its attention function")
    if kwargs.get("s_aux") is not None:
        raise NotPlain(f"{name} asks for attention sinks")
    window = kwargs.get("sliding_window")
    if window is not None and not isinstance(kwargs[MASK_KEY], dict) and window < key.shape[2]:
        raise NotPlain(f"{name} asks for a sliding window of {window} its config does not name")
    if dropout:
        raise NotPlain(f"{name} asks for attention dropout")
    if query.shape[2] != key.shape[2]:
        raise NotPlain("Kiln's attention runs without a key-value cache (use_cache=False)")
    mask = kwargs[MASK_KEY]
    if isinstance(mask, dict):  # a model with a sliding window: {None: full layers' mask, window: the window's}
        if window not in mask:
            raise NotPlain(f"{name} asks for a sliding window of {window}, not its config's")
        mask = mask[window]
    dtype = value.dtype  # rotary embeddings in fp32 promote q and k: attend in the values' (autocast) dtype
    y = masks.attend(query.to(dtype), key.to(dtype), value, mask, scale=scaling, cap=kwargs.get("softcap"))
    return y.transpose(1, 2), None  # (B, T, H, hd)


def register() -> None:
    """Put `kiln_attention` in transformers' attention registry (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, kiln_attention)


def text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def sliding_window(model: nn.Module) -> int | None:
    """The model's sliding window (its config's `sliding_window`, unless `use_sliding_window` turns it off)."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    return window if getattr(config, "use_sliding_window", True) is not False else None


def capped(model: nn.Module) -> bool:
    """Whether the model soft-caps its attention scores (Gemma 2): then every layer needs a mask."""
    return bool(getattr(text_config(model), "attn_logit_softcapping", None))


def layer_masks(doc_ids: torch.Tensor | None, device: torch.device, T: int, window: int | None,
                always: bool = False):
    """What HFCausalLM hands every layer as `kiln_mask`: the mask (kiln.model.masks.doc_mask) of rows of T
    positions with documents `doc_ids` (None: one each), or with a sliding window {None: that of the full
    attention layers, window: that of the windowed ones}; `always`: a mask even for plain causal attention."""
    full = masks.doc_mask(doc_ids, device, T=T, always=always)
    if window is None:
        return full
    return {None: full, window: masks.doc_mask(doc_ids, device, window, T, always=always)}


def unsupported(model: nn.Module) -> str | None:
    """Why `model`'s attention is not Kiln's plain causal attention, from its config and modules (None: it may be;
    `probe` decides)."""
    config = text_config(model)
    if config is None or not hasattr(config, "_attn_implementation"):
        return "its config names no attention implementation"
    if getattr(config, "is_causal", True) is False:
        return "its attention is not causal"
    for key in _DROPOUT_KEYS:
        if (getattr(config, key, 0) or 0) > 0:
            return f"attention dropout ({key})"
    for m in model.modules():
        if getattr(m, "is_causal", True) is False:
            return f"{type(m).__name__} is not causal"
        if getattr(m, "sinks", None) is not None:
            return f"{type(m).__name__} has attention sinks"
    return None


def install(model: nn.Module, split_documents: bool) -> str | None:
    """Point `model` (a transformers causal LM, eval or train) at Kiln's attention where its logits stay the
    same. Returns None when installed, else why not (the model keeps its own attention)."""
    why = unsupported(model)
    if why:
        return why
    register()
    config = text_config(model)
    own = config._attn_implementation
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        return f"transformers does not take it ({type(e).__name__}: {e})"
    if config._attn_implementation != NAME:  # refused with a warning alone (BLOOM, Falcon: no AttentionInterface)
        return "transformers cannot change its attention (it does not use AttentionInterface)"
    try:
        why = probe(model, own, split_documents)
    except NotPlain as e:
        why = str(e)
    except Exception as e:  # a model whose code does not fit the attention function
        why = f"its forward fails with it ({type(e).__name__}: {str(e)[:200]})"
    if why:
        model.set_attn_implementation(own)
    return why


@torch.no_grad()
def probe(model: nn.Module, own: str, split_documents: bool) -> str | None:
    """Two documents packed in one row through Kiln's attention (a block-diagonal mask, position ids restarting
    at the second) against each alone through the model's own attention: None if their logits agree. A sliding
    window is shortened to PROBE_WINDOW meanwhile (in the config and in the layers that copied it), so that a
    model whose layers do not hand their window to the attention function shows it."""
    training, device = model.training, next(model.parameters()).device
    window, config = sliding_window(model), text_config(model)
    copies = [m for m in model.modules() if window is not None and getattr(m, "sliding_window", None) == window]
    model.eval()
    try:
        if window is not None:
            config.sliding_window = PROBE_WINDOW
            for m in copies:
                m.sliding_window = PROBE_WINDOW
        return _compare(model, own, split_documents, None if window is None else PROBE_WINDOW, device)
    finally:
        model.train(training)
        if window is not None:
            config.sliding_window = window
            for m in copies:
                m.sliding_window = window


def _compare(model: nn.Module, own: str, split_documents: bool, window: int | None, device) -> str | None:
    from kiln.model.hf_packing import doc_positions

    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (1, 7), generator=g), torch.randint(0, vocab, (1, 5), generator=g)
    a, b = a.to(device), b.to(device)
    if split_documents:  # documents run as rows of their own: one document
        rows, docs, pos, parts = a, None, None, [a]
    else:
        rows = torch.cat([a, b], 1)
        docs = torch.tensor([[0] * 7 + [1] * 5], device=device)
        pos, parts = doc_positions(docs), [a, b]
    mask = layer_masks(docs, device, rows.shape[1], window, capped(model))
    got = model(input_ids=rows, position_ids=pos, use_cache=False, **{MASK_KEY: mask}).logits.float()
    model.set_attn_implementation(own)
    try:
        want = torch.cat([model(input_ids=p, use_cache=False).logits.float() for p in parts], 1)
    finally:
        model.set_attn_implementation(NAME)
    tol = 1e-4 if got.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32 else 3e-2
    err = (got - want).abs().max().item()
    if not err <= tol * (1 + want.abs().max().item()):
        return f"its logits differ with it by {err:.2g}"
    return None
