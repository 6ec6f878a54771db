"""How many bytes of text each token id stands for: the denominator of bits per byte.

    table = token_byte_lengths(tok)          # int64 numpy array, one entry per token id
    bpb = nll_nats / (math.log(2) * table[targets].sum())

Bits per byte divides a model's summed negative log-likelihood by the UTF-8 bytes of the text it
predicted, so models with different tokenizers compare on the same text. A token's bytes are what
it adds to the decoded text:

- byte-level BPE (GPT-2, Llama 3, Kiln's own): each character of the token's string stands for one
  byte (the ByteLevel alphabet), so a token that holds half of a multi-byte character counts the half;
- SentencePiece-style byte fallback tokens `<0xNN>`: one byte;
- any other tokenizer: the growth of the decoded text when the token follows an ordinary word;
- special tokens (EOS, BOS, padding...): no bytes. Their loss still counts (predicting where a
  document ends is part of modelling it), as every model evaluated on the same documents pays it.
"""

from __future__ import annotations

import json
import re
from functools import cache

import numpy as np

_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (character -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _has_type(node, name: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == name or any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def token_byte_lengths(tok, size: int | None = None) -> np.ndarray:
    """Bytes of text of every token id of `tok` (a kiln Tokenizer), as an int64 array of `size` entries
    (default the tokenizer's vocab_size; ids past the vocabulary get 0)."""
    tk = tok.tk
    n = tok.vocab_size
    out = np.zeros(max(size or n, n), dtype=np.int64)
    decoder = json.loads(tk.to_str()).get("decoder")
    added = {i: t for i, t in tk.get_added_tokens_decoder().items()}
    byte_level = _has_type(decoder, "ByteLevel")
    alphabet = _byte_level_alphabet()
    others: list[int] = []
    for i in range(n):
        if i in added:
            out[i] = 0 if added[i].special else len(added[i].content.encode())
            continue
        s = tk.id_to_token(i)
        if s is None:
            continue
        if byte_level and all(c in alphabet for c in s):
            out[i] = len(s)
        elif _BYTE_FALLBACK.match(s):
            out[i] = 1
        else:
            others.append(i)
    if others:
        anchor = _anchor(tk, n, added)
        base = len(tk.decode([anchor], skip_special_tokens=False).encode())
        texts = tk.decode_batch([[anchor, i] for i in others], skip_special_tokens=False)
        for i, text in zip(others, texts):
            out[i] = max(len(text.encode()) - base, 0)
    return out


def _anchor(tk, n: int, added: dict) -> int:
    """A token that decodes to a plain lowercase word, for measuring what other tokens add after it."""
    for word in ("the", "▁the", "Ġthe", "a", "▁a"):
        i = tk.token_to_id(word)
        if i is not None and i not in added:
            return i
    for i in range(n):
        if i not in added and tk.decode([i]).strip().isalpha():
            return i
    return 0
