"""The frozen base of a LoRA run: referenced by hash, never copied into a checkpoint.

A LoRA run's checkpoints hold the adapters (and their optimizer moments) only; the base weights come
from model.init_from at every start and resume. Its identity is the sha256 of its weight files
(`base_hash`), recorded in each checkpoint's fingerprints under "base_model"; a resume or an export
whose init_from hashes differently is refused (`check_base`): adapters trained on one base mean
nothing on another.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.errors import StateError
from kiln.files import sha256_file

KEY = "base_model"  # under a checkpoint's fingerprints


def base_hash(init_from: str | Path, allow_pickle: bool = False) -> str:
    """sha256 over the (name, sha256) of each weight file of a Hugging Face model directory, in order
    (files hashed in parallel: hashlib releases the GIL)."""
    from kiln.model.hf_import import weight_files

    files = weight_files(init_from, allow_pickle)
    with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(sha256_file, files))
    h = hashlib.sha256()
    for f, d in zip(files, digests):
        h.update(f"{f.name} {d}\n".encode())
    return h.hexdigest()


def check_base(saved: dict[str, Any], current: str | None, where: str, init_from: str | None) -> None:
    """StateError unless the base recorded in `saved` (a checkpoint's fingerprints) is `current`."""
    recorded = saved.get(KEY)
    if recorded is None and current is None:
        return
    if recorded is None:
        raise StateError(f"{where} was saved without LoRA (its model part holds every weight), but lora.rank is "
                         "set now: resume it with lora.rank=0, or start a LoRA run with --resume never")
    if current is None:
        raise StateError(f"{where} holds LoRA adapters (lora.rank was set), but lora.rank is 0 now: set the saved "
                         "lora settings again (see `kiln inspect`)")
    if recorded != current:
        raise StateError(f"{where} holds LoRA adapters trained on a base model whose weights hash to "
                         f"{recorded[:16]}..., but model.init_from={init_from} hashes to {current[:16]}...: the "
                         "base changed. Point model.init_from at the base the run started from (adapters mean "
                         "nothing on another base), or start a new run with --resume never")
