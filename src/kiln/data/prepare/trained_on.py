"""The dataset a resumed run trained on, kept across Kiln versions. A new version of the readers
(kiln.data.read.sources.READERS_VERSION) names every prepared dataset anew, since the same bytes may now give other
documents: a run resumed after such an upgrade prepared its files again under another id, and its checkpoint was
refused (`prepared dataset: A -> B`), with --resume force too (the saved loader position counts rows of A). Its
own dataset, still in the cache, is what it trained on and what exact resume needs: it is reused where only the
reader version differs, made from these very files (their sha256), with the same tokenizer and other settings.
Where Kiln trained that tokenizer (no data.tokenizer), the dataset's own is used, not one trained anew on what the
new readers give (`trained_tokenizer`).

A data.mixture run is recorded by its entries' datasets, in order (a checkpoint's `datasets` fingerprint), and by
`mixture_id` of them (its `dataset`); for a checkpoint with the latter alone, `mixture_entries` finds the datasets
in the cache that make it up.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

VERSIONED = ("readers",)  # the settings a Kiln upgrade changes for the same files and config


def same_files_earlier_reader(path: Path, sources: list[dict], tokenizer, settings: dict) -> Path | None:
    """`path` (a finished dataset) if it was made from `sources` (their sha256, in order) with `tokenizer` and
    `settings` but for the reader version; else None."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        made = manifest["settings"]
        same = ([s["sha256"] for s in manifest["sources"]] == [s["sha256"] for s in sources]
                and manifest["tokenizer_hash"] == tokenizer.hash
                and {k: v for k, v in made.items() if k not in VERSIONED}
                == {k: v for k, v in settings.items() if k not in VERSIONED})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return path if same else None


def trained_tokenizer(cfg, path: Path, sources: list[dict], files):
    """The tokenizer of `path` (a resumed run's dataset, for a DataConfig `cfg` without data.tokenizer) if the
    dataset was made from `sources` with it and `cfg`'s settings but for the reader version: the BPE Kiln trained
    for the run, which a Kiln whose readers give other documents would train anew (another tokenizer, which the
    checkpoint refuses). Else None."""
    from kiln.data.prepare.keys import dataset_settings, special_tokens
    from kiln.data.prepare.tokenizer import Tokenizer
    from kiln.errors import DataError

    eos, bos, _ = special_tokens(cfg)
    try:
        tok = Tokenizer.load(path / "tokenizer.json", eos, bos)
    except (DataError, OSError, ValueError):
        return None
    return tok if same_files_earlier_reader(path, sources, tok, dataset_settings(cfg, tok, files)) else None


def mixture_id(ids: list[str]) -> str:
    """The dataset fingerprint of a data.mixture run: its entries' datasets, whatever the weights or order."""
    return "mix-" + hashlib.sha256(" ".join(sorted(ids)).encode()).hexdigest()[:16]


def mixture_entries(datasets: Path, mixed: str, entries: list[list[str] | str]) -> list[str] | None:
    """The ids, one per mixture entry, of the datasets in `datasets` (a cache's) whose `mixture_id` is `mixed`:
    an entry's candidates are the datasets made of the files it names (`entries[i]`, their paths; a str: the id of
    a prepared dataset it names). None if no choice of them gives `mixed`. Each one found is checked again by
    `same_files_earlier_reader` when it is prepared."""
    made: dict[tuple[str, ...], list[str]] = {}
    for manifest in datasets.glob("*/manifest.json"):
        try:
            m = json.loads(manifest.read_text())
            made.setdefault(tuple(s["path"] for s in m["sources"]), []).append(m["id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    options = [[e] if isinstance(e, str) else made.get(tuple(e), []) for e in entries]
    for ids in itertools.islice(itertools.product(*options), 10_000):
        if mixture_id(list(ids)) == mixed:
            return list(ids)
    return None
