"""Sampling from a trained model: temperature, top-k, top-p, repetition penalty, seeded, stopping at any of the
model's stop tokens and stop strings."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.model.stop_strings import StopStrings


def start_ids(tok, prompt: str, bos: int | None = None) -> list[int]:
    """Token ids to start sampling from: the prompt's, after `bos` where the model's documents started with one
    (kiln.state.prompt_bos), or for an empty prompt the tokenizer's EOS (or BOS), the token every document
    follows."""
    ids = tok.encode(prompt) if prompt else []
    if ids and bos is not None:
        ids = [bos, *ids]
    if not ids:
        start = tok.eos_id if tok.eos_id is not None else tok.bos_id
        if start is None:
            raise ValueError("an empty prompt needs an EOS or BOS token to start from, and the tokenizer has none")
        ids = [start]
    return ids


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int | None = None, stop_ids: Iterable[int] = (),
             vocab_size: int | None = None, stop_strings: StopStrings | None = None, top_p: float | None = None,
             repetition_penalty: float | None = None) -> list[int]:
    """Up to max_new_tokens tokens sampled after `ids`; sampling stops after the first of `stop_ids` it produces
    (the model's EOS and other stop tokens: kiln.state.stop_tokens), which ends the result, or after the token that
    completes one of `stop_strings` (generation_config.json's), which ends it too.

    temperature 0 is greedy (the most likely token); top_k None or 0 samples among all tokens; top_p (0, 1]
    samples among the most likely tokens whose probabilities add up to it (None or 1: all); repetition_penalty
    above 1 makes the tokens already in the text less likely (a positive logit divided by it, a negative one
    multiplied), as transformers applies it, before the temperature.
    `vocab_size`: the tokenizer's; ids from there up to the model's (padded) vocabulary are never
    produced, as the tokenizer cannot decode them."""
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be 0 or more (0 or None: all tokens), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be above 0 and at most 1 (1 or None: all tokens), got {top_p}")
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be above 0 (1 or None: none), got {repetition_penalty}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    ctx_len = model.cfg.max_seq_len
    tokens = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    stops = set(stop_ids)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -ctx_len:])[:, -1, :].float()  # (1, V)
            if vocab_size is not None and vocab_size < logits.shape[-1]:
                logits = logits[:, :vocab_size]  # (1, V_tok): the padding rows are no tokens
            if not bool(torch.isfinite(logits).all()):
                raise ValueError("the model's logits are not finite (NaN or infinite weights): it diverged or its file "
                                 "is damaged")
            if repetition_penalty not in (None, 1):
                logits = _penalize(logits, tokens, repetition_penalty)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:  # shifted so the largest is 0: a tiny temperature gives 0 and -inf (greedy), never inf - inf = NaN
                logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                if top_p is not None and top_p < 1:
                    logits = _nucleus(logits, top_p)
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt], dim=1)
            if int(nxt) in stops or (stop_strings and stop_strings.ends(tokens[0, -stop_strings.window:].tolist())):
                break
    except KeyboardInterrupt as e:  # Ctrl-C: the ids sampled so far go with it (`kiln generate` prints them)
        e.sampled = tokens[0, len(ids):].tolist()
        raise
    finally:
        model.train(was_training)
    return tokens[0, len(ids):].tolist()


def _penalize(logits: torch.Tensor, tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """`logits` (1, V) with those of the tokens in `tokens` (1, T) made less likely by `penalty` (above 1)."""
    seen = tokens[:, tokens[0] < logits.shape[-1]]  # (1, T'): ids past the tokenizer's have no logit
    picked = logits.gather(-1, seen)
    return logits.scatter(-1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` (1, V) with -inf outside the fewest most likely tokens whose probabilities reach `top_p`
    (the most likely one always kept)."""
    ordered, order = torch.sort(logits, dim=-1, descending=True)  # (1, V)
    probs = torch.softmax(ordered, dim=-1)
    beyond = probs.cumsum(dim=-1) - probs >= top_p  # the mass of the more likely ones already reaches top_p
    return logits.masked_fill(torch.empty_like(beyond).scatter(-1, order, beyond), float("-inf"))
