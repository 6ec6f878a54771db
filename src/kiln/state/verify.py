"""Checkpoint metadata (`meta.json`) and content hashes.

Every checkpoint directory ends with a `meta.json` that lists each of its files with size and
sha256. The file is written last, inside the temporary directory, before the directory is renamed
into place: a checkpoint directory without it is not a checkpoint. `verify()` re-hashes the files
and names each one that is missing, truncated or altered.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.errors import StateError
from kiln.files import atomic_write_json, fsync_dir, sha256_file

__all__ = ["FORMAT", "META", "fsync_dir", "hash_tree", "read_meta", "sha256_file", "verify", "write_json"]

FORMAT = "kiln-checkpoint/1"
META = "meta.json"


def hash_tree(root: Path, threads: int = 8, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} of every file under `root` except meta.json, hashed in parallel.

    `known` digests (computed while writing) are taken for files whose size on disk matches them.
    """
    known = known or {}
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != META)
    sizes = {n: (root / n).stat().st_size for n in names}
    todo = [n for n in names if known.get(n, {}).get("bytes") != sizes[n]]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        digests = dict(zip(todo, pool.map(lambda n: sha256_file(root / n), todo)))
    return {n: {"bytes": sizes[n], "sha256": digests[n] if n in digests else known[n]["sha256"]} for n in names}


def write_json(path: Path, data: dict, fsync: bool = True) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half of it."""
    atomic_write_json(path, data, fsync=fsync, indent=1)


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    """The parsed meta.json of a checkpoint directory; StateError if it is missing or unreadable."""
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{ckpt} is not a complete checkpoint: it has no {META} (a save that never finished). "
                         "Use another checkpoint of the run.") from None
    except (OSError, ValueError) as e:
        raise StateError(f"{path} is unreadable or corrupted ({e}). Use another checkpoint of the run.") from None
    if not isinstance(meta, dict):
        raise StateError(f"{path} is not a Kiln checkpoint description (a JSON {type(meta).__name__}).")
    if meta.get("format") != FORMAT:
        raise StateError(f"{path} has format {meta.get('format')!r}; this Kiln reads {FORMAT!r}. Use the Kiln "
                         "version that wrote it (see its 'versions' entry).")
    return meta


def verify(ckpt: str | Path, threads: int = 8) -> list[str]:
    """Problems found in a checkpoint directory: missing, resized or altered files. Empty if all is well."""
    root = Path(ckpt)
    try:
        files = read_meta(root)["files"]
    except StateError as e:
        return [str(e)]
    problems: list[str] = []
    present = []
    for name, info in files.items():
        p = root / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != info["bytes"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, expected {info['bytes']} (truncated or overwritten)")
        else:
            present.append(name)
    with ThreadPoolExecutor(max(1, min(threads, len(present) or 1))) as pool:
        for name, digest in zip(present, pool.map(lambda n: sha256_file(root / n), present)):
            if digest != files[name]["sha256"]:
                problems.append(f"{root / name}: sha256 differs from {META} (the file is corrupted)")
    return problems
