"""Sampling from a trained model: temperature, top-k, seeded."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int | None = None, stop_id: int | None = None) -> list[int]:
    """Append up to max_new_tokens sampled tokens to `ids` (temperature 0 is greedy)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    ctx_len = model.cfg.max_seq_len
    tokens = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -ctx_len:])[:, -1, :].float()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt], dim=1)
        if stop_id is not None and int(nxt) == stop_id:
            break
    model.train(was_training)
    return tokens[0, len(ids):].tolist()
