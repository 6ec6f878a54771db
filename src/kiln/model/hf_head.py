"""The loss of a transformers model on its hidden states (model.hf_class=auto), as the native model computes it.

Most causal LMs of transformers end in `logits = lm_head(decoder(...).last_hidden_state)`: then `HFCausalLM`
calls the decoder for the hidden states and gives them, with the head's weight, to Kiln's chunked
cross-entropy (kiln.model.loss.linear_cross_entropy), which never holds the whole batch's logits (a 1b model's
(B*T, V) fp32 logits and their gradient are several GiB at 16K tokens a step). `plain_head` says whether a
model is such a model: its head a bias-free `nn.Linear`, its config free of the logit changes some models
make (scaling), and a short input's logits equal to the head applied to the decoder's output. Logits
soft-capped by `final_logit_softcapping` (Gemma 2 and 3) are capped inside the chunked loss, as the native
model caps them (`logit_cap`). Any other model computes its loss on its own full logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.model.softcap import softcap

# config fields of models whose logits are not the head's output alone (set to a value that changes them)
_LOGIT_CHANGES = {"logit_scale": (None, 1, 1.0),
                  "logits_scaling": (None, 1, 1.0), "output_multiplier_scale": (None, 1, 1.0),
                  "lm_head_multiplier": (None, 1, 1.0), "logit_softcapping": (None, 0, 0.0),
                  "mup_width_multiplier": (None, 1, 1.0)}


def decoder_of(model: nn.Module) -> nn.Module | None:
    """The transformers model's decoder (embeddings, blocks, final norm), or None where it names none."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if get is not None else None
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def logit_cap(model: nn.Module) -> float | None:
    """The soft-cap of the model's final logits (its config's final_logit_softcapping), or None."""
    config = getattr(model, "config", None)
    cap = getattr(getattr(config, "text_config", None) or config, "final_logit_softcapping", None)
    return float(cap) if isinstance(cap, int | float) and not isinstance(cap, bool) and cap > 0 else None


def plain_head(model: nn.Module, extra: Callable[[int, torch.device], dict] | None = None) -> str | None:
    """None if `model`'s logits are its output embedding (a bias-free nn.Linear) applied to its decoder's
    last hidden state (soft-capped by `logit_cap`); else why not. `extra(T, device)`: the keywords of a forward
    of T positions beyond the input ids (Kiln's attention mask, where the model has Kiln's attention:
    kiln.model.hf_attention)."""
    head, decoder = model.get_output_embeddings(), decoder_of(model)
    if decoder is None:
        return "it names no decoder (get_decoder)"
    if type(head) is not nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "its output layer has a bias"
    configs = [getattr(model, "config", None)]
    configs.append(getattr(configs[0], "text_config", None))
    for config in filter(None, configs):
        for key, plain in _LOGIT_CHANGES.items():
            if getattr(config, key, None) not in plain:
                return f"its config changes the logits ({key}={getattr(config, key)})"
    return _probe(model, decoder, head, extra)


@torch.no_grad()
def _probe(model: nn.Module, decoder: nn.Module, head: nn.Linear, extra) -> str | None:
    training, device = model.training, head.weight.device
    model.eval()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, head.weight.shape[0], (1, 6), generator=g).to(device)
        more = extra(x.shape[1], device) if extra else {}
        try:
            want = model(input_ids=x, use_cache=False, **more).logits.float()
            got = head(decoder(input_ids=x, use_cache=False, **more).last_hidden_state).float()
            cap = logit_cap(model)
            if cap is not None:
                got = softcap(got, cap)
        except Exception as e:  # a decoder that takes other arguments
            return f"its decoder cannot be called alone ({type(e).__name__}: {str(e)[:200]})"
    finally:
        model.train(training)
    if got.shape != want.shape:
        return "its logits are not the head's output"
    tol = 1e-5 if head.weight.dtype == torch.float32 else 1e-2
    err = (got - want).abs().max().item()
    return None if err <= tol * (1 + want.abs().max().item()) else f"its logits differ from the head's by {err:.2g}"
