"""Checkpoint metadata (`meta.json`) and content hashes.

Every checkpoint directory ends with a `meta.json` that lists each of its files with size and
sha256, and a `meta.sha256` beside it (`<sha256 of meta.json>  meta.json`, the `sha256sum -c`
format) so that the list itself is verified: an edited entry cannot vouch for an altered file.
Both are written last, inside the temporary directory, before the directory is renamed into place:
a checkpoint directory without `meta.json` is not a checkpoint. `verify()` checks the digest of
`meta.json`, then re-hashes the files and names each one that is missing, truncated or altered.

Checkpoints of format `kiln-checkpoint/1` (before `meta.sha256` existed) are still read: their
file list is trusted as written. From `kiln-checkpoint/2` on, a missing `meta.sha256` is damage.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.errors import StateError
from kiln.files import atomic_write, atomic_write_json, fsync_dir, sha256_file

__all__ = ["FORMAT", "META", "fsync_dir", "hash_tree", "read_meta", "sha256_file", "verify", "write_json"]

FORMAT = "kiln-checkpoint/2"
LEGACY_FORMATS = ("kiln-checkpoint/1",)  # no meta.sha256: read, with the file list trusted as written
META = "meta.json"
META_DIGEST = "meta.sha256"


def hash_tree(root: Path, threads: int = 8, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} of every file under `root` except meta.json, hashed in parallel.

    `known` digests (computed while writing) are taken for files whose size on disk matches them.
    """
    known = known or {}
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if p.is_file() and str(p.relative_to(root)) not in (META, META_DIGEST))
    sizes = {n: (root / n).stat().st_size for n in names}
    todo = [n for n in names if known.get(n, {}).get("bytes") != sizes[n]]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        digests = dict(zip(todo, pool.map(lambda n: sha256_file(root / n), todo)))
    return {n: {"bytes": sizes[n], "sha256": digests[n] if n in digests else known[n]["sha256"]} for n in names}


def write_json(path: Path, data: dict, fsync: bool = True) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half of it."""
    atomic_write_json(path, data, fsync=fsync, indent=1)


def write_meta(ckpt: Path, meta: dict[str, Any], fsync: bool = True) -> None:
    """Write meta.json and its digest, meta.sha256 (both through a temporary file and a rename)."""
    write_json(ckpt / META, meta, fsync=fsync)
    atomic_write(ckpt / META_DIGEST, f"{sha256_file(ckpt / META)}  {META}\n", fsync=fsync)


def meta_digest_problem(ckpt: str | Path, meta_format: str | None) -> str | None:
    """Why meta.json of `ckpt` cannot be trusted (its digest is missing or differs), or None."""
    root = Path(ckpt)
    try:
        recorded = (root / META_DIGEST).read_text().split()[0]
    except FileNotFoundError:
        if meta_format in LEGACY_FORMATS:
            return None
        return f"{root / META_DIGEST}: missing (the digest of {META}; the file list cannot be trusted)"
    except (OSError, IndexError, UnicodeDecodeError) as e:
        return f"{root / META_DIGEST}: unreadable ({e})"
    if sha256_file(root / META) != recorded:
        return f"{root / META}: sha256 differs from {META_DIGEST} (the file list was altered or corrupted)"
    return None


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
    if meta.get("format") not in (FORMAT, *LEGACY_FORMATS):
        raise StateError(f"{path} has format {meta.get('format')!r}; this Kiln reads {FORMAT!r}. Use the Kiln "
                         "version that wrote it (see its 'versions' entry).")
    return meta


def verify(ckpt: str | Path, threads: int = 8) -> list[str]:
    """Problems found in a checkpoint directory: missing, resized or altered files. Empty if all is well."""
    root = Path(ckpt)
    try:
        meta = read_meta(root)
    except StateError as e:
        return [str(e)]
    problem = meta_digest_problem(root, meta.get("format"))
    if problem:
        return [problem]
    files = meta["files"]
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
