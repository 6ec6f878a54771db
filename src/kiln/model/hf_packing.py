"""Documents packed in a row, kept apart on the auto path (model.hf_class=auto).

Attention keeps documents apart through `position_ids` that restart at each document (`doc_positions`):
transformers' models that build their masks through `masking_utils` then attend inside each document.
A model on SDPA whose masks ignore the positions (transformers 5.17's Falcon) is given a (B, 1, T, T) mask of
the documents as its `attention_mask` instead (`takes_document_masks`, `document_attention_mask`).
A recurrent layer (Mamba's selective scan, a gated delta net, a short convolution) carries its state from
one position to the next whatever the positions say, so the second document of a row would start from the
first's state. transformers' PyTorch scans take no document boundaries (their kernels' `seq_idx` is
dropped), so for a model with such layers (`recurrent_layers`), and for one whose forward takes no
`position_ids`, each document runs as its own sequence: `split_documents` moves every document to the start
of a row of its own (right-padded: a causal model's padding never reaches the tokens before it), and
`merge_documents` puts their logits back in the packed layout. The logits are those of each document alone;
the cost is the padding (rows of the longest document's length: with documents of uneven length, several
times the compute of the packed rows). A run chooses it with data.document_mask=split; with true such a model
is refused (`check_packing`), with false its documents see each other.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kiln.errors import ConfigError

# class names of layers whose state runs along the sequence (not attention)
_RECURRENT = re.compile(r"Mamba|Mixer|DeltaNet|DeltaAttention|ShortConv|Recurrent|Rwkv|LinearAttention|Lightning")
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local"}
_NOT_MIXERS = {"mlp", "moe", "ffn"}


def recurrent_layers(model: nn.Module) -> list[str]:
    """The kinds of layers of `model` that carry state along the sequence (class names, or the config's layer
    types other than attention); empty for a model of attention layers only."""
    config = getattr(model, "config", None)
    kinds = {type(m).__name__ for m in model.modules() if _RECURRENT.search(type(m).__name__)}
    for key in ("layer_types", "layers_block_type"):
        types = getattr(config, key, None) or getattr(getattr(config, "text_config", None), key, None) or ()
        kinds |= {str(t) for t in types if isinstance(t, str) and t not in _ATTENTION_TYPES | _NOT_MIXERS}
    return sorted(kinds)


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> position_ids (B, T) that count from 0 at the start of every document."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values


def split_documents(tokens: torch.Tensor, doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, doc_ids (B, T) -> (rows (N, L): each of the N documents at the start of its own row, padded with
    its first token; seg (B, T) and pos (B, T): where each packed position went, rows[seg, pos])."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    seg = start.flatten().long().cumsum(0).view(B, T) - 1  # (B, T): a row starts a document too
    pos = doc_positions(doc_ids)
    n, length = int(seg[-1, -1]) + 1, int(pos.max()) + 1
    rows = tokens.new_zeros(n, length)
    rows[:, :] = tokens.flatten()[start.flatten()][:, None]  # padding: a token of the document itself
    rows[seg, pos] = tokens
    return rows, seg, pos


def merge_documents(logits: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The (N, L, V) logits of `split_documents`' rows -> (B, T, V) in the packed layout."""
    return logits[seg, pos]


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, 1, T, T) bool: True where a position may attend to another, an earlier one (or
    itself) of its own document (the `attention_mask` of an SDPA model whose masks do not follow the positions)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def takes_document_masks(model: nn.Module) -> bool:
    """Whether `model` (a transformers causal LM on its own attention, whose masks do not follow the position ids,
    with neither sliding windows nor soft-capped scores: the caller checks) keeps the documents of a packed row
    apart given `document_attention_mask` as its `attention_mask`: a model on SDPA where two packed documents then
    get the logits each has alone. transformers 5.17's Falcon builds its mask without the position ids but takes a
    4D mask as it is: so its packed rows stay packed, instead of each document running as a row of its own padded
    to the longest (several times the tokens, and the attention scores of each)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "_attn_implementation", None) != "sdpa":  # eager attention adds its mask: not a boolean one
        return False
    return positions_keep_documents_apart(model, masked=True)


@torch.no_grad()
def positions_keep_documents_apart(model: nn.Module, masked: bool = False) -> bool:
    """Whether `model` (a transformers causal LM on its own attention) given position ids that restart at the
    second of two documents packed in a row gives each the logits it has alone: transformers' mask builders
    (masking_utils) find the documents in the positions, but a model that builds its masks without them
    (GPT-OSS) lets the second attend to the first. `masked`: with `document_attention_mask` as the attention mask
    too. A model whose forward fails so is taken as not keeping them."""
    training, device = model.training, next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, vocab, (1, n), generator=g).to(device) for n in (6, 5))
    docs = torch.tensor([[0] * 6 + [1] * 5], device=device)
    extra = {"attention_mask": document_attention_mask(docs)} if masked else {}
    model.eval()
    try:
        got = model(input_ids=torch.cat([a, b], 1), position_ids=doc_positions(docs), use_cache=False,
                    **extra).logits.float()
        want = torch.cat([model(input_ids=p, use_cache=False).logits.float() for p in (a, b)], 1)
    except Exception:  # noqa: BLE001  (any model code: it cannot be shown to keep them apart)
        return False
    finally:
        model.train(training)
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    return (got - want).abs().max().item() <= tol * (1 + want.abs().max().item())


def check_packing(model, data) -> str:
    """Why `model` (an HFCausalLM whose documents must run as rows of their own) cannot keep the documents of a
    packed row apart; ConfigError unless data.document_mask is 'split'."""
    why = (f"recurrent layers: {', '.join(model.recurrent)}" if model.recurrent else
           "its forward takes no position_ids" if not model.takes_positions else
           "its attention masks do not follow the position ids")
    if data.document_mask != "split":
        raise ConfigError(f"data.document_mask=true: {type(model.base).__name__} cannot keep the documents of a packed "
                          f"row apart ({why}). Set data.document_mask=split to run each document as a row of its own "
                          "(padded to the longest document of each batch: up to several times the compute), or "
                          "data.document_mask=false to let the documents of a row see each other")
    return why
