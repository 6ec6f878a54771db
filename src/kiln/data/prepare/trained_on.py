"""The dataset a resumed run trained on, kept across Kiln versions. A new version of the readers
(kiln.data.read.sources.READERS_VERSION) names every prepared dataset anew, since the same bytes may now give other
documents: a run resumed after such an upgrade prepared its files again under another id, and its checkpoint was
refused (`prepared dataset: A -> B`), with --resume force too (the saved loader position counts rows of A). Its
own dataset, still in the cache, is what it trained on and what exact resume needs: it is reused where only the
reader version differs, made from these very files (their sha256), with the same tokenizer and other settings.
"""

from __future__ import annotations

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
