"""The archive tier: checkpoints copied to any fsspec location (a directory, s3://, gs://, ...).

    <archive_url>/<run name>/step_00001200/...   a copy of a complete checkpoint; meta.json copied last
    <archive_url>/<run name>/index.json          why each copy is kept ("every", "best") and which is best

Each file is read back after the copy and its sha256 compared with the checkpoint's meta.json,
so an archive copy is known good before anything relies on it. A checkpoint kept only as the
former best is deleted once a better one is verified. `fetch` brings a copy back into a local
directory and verifies it there (meta.json against meta.sha256, every file against meta.json).
When and how failures are retried is the `Archiver` policy's business (archiver.py).
"""

from __future__ import annotations

import json
import posixpath
import shutil
from pathlib import Path
from typing import Any

from kiln.errors import StateError
from kiln.files import hash_stream
from kiln.state.verify import META, META_DIGEST, read_meta, verify

INDEX = "index.json"


class Archive:
    def __init__(self, url: str, run_name: str):
        import fsspec

        self.url = f"{url.rstrip('/')}/{run_name}"
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:
            raise StateError(f"checkpoint.archive_url={url!r} cannot be opened: {e}. Install the fsspec "
                             "backend for that scheme (e.g. s3fs for s3://) or give a directory.") from None

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def index(self) -> dict[str, Any]:
        try:
            with self.fs.open(self._path(INDEX), "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return {"checkpoints": {}, "best": None}

    def _write_index(self, index: dict[str, Any]) -> None:
        tmp = self._path(INDEX + ".tmp")
        with self.fs.open(tmp, "w") as f:
            json.dump(index, f, indent=1)
        self.fs.mv(tmp, self._path(INDEX))

    def _sha256(self, path: str) -> str:
        with self.fs.open(path, "rb") as f:
            return hash_stream(f)[0].hexdigest()

    def put(self, ckpt: Path) -> str:
        """Copy a complete local checkpoint, verify every file, then copy meta.json. Returns its URL."""
        meta = read_meta(ckpt)
        dest = self._path(ckpt.name)
        if self.fs.exists(posixpath.join(dest, META)):
            return dest
        try:
            if self.fs.exists(dest):
                self.fs.rm(dest, recursive=True)
            self.fs.makedirs(dest, exist_ok=True)
            for name in meta["files"]:
                target = posixpath.join(dest, name)
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self.fs.put_file(str(ckpt / name), target)
            for name, info in meta["files"].items():
                if self._sha256(posixpath.join(dest, name)) != info["sha256"]:
                    raise StateError(f"archive copy {posixpath.join(dest, name)} differs from {ckpt / name} after "
                                     "the copy; the archive location is unreliable. The local checkpoint is kept.")
            if (ckpt / META_DIGEST).is_file():  # absent in checkpoints of format 1
                self.fs.put_file(str(ckpt / META_DIGEST), posixpath.join(dest, META_DIGEST))
            self.fs.put_file(str(ckpt / META), posixpath.join(dest, META))
        except OSError as e:
            raise StateError(f"copying {ckpt} to the archive {self.url} failed: {e}. The local checkpoint is "
                             "kept; check the archive location (space, permissions, credentials).") from None
        return dest

    def add(self, ckpt: Path, reason: str, val_loss: float | None = None) -> None:
        """Archive `ckpt` for `reason` ("every" or "best"); a former best kept for no other reason goes."""
        self.put(ckpt)
        index = self.index()
        entry = index["checkpoints"].setdefault(ckpt.name, {"step": read_meta(ckpt)["step"], "kept_for": []})
        if reason not in entry["kept_for"]:
            entry["kept_for"].append(reason)
        old_best = index.get("best")
        if reason == "best":
            entry["val_loss"] = val_loss
            index["best"] = ckpt.name
        self._write_index(index)
        if reason == "best" and old_best and old_best != ckpt.name and old_best in index["checkpoints"]:
            old = index["checkpoints"][old_best]
            old["kept_for"] = [r for r in old["kept_for"] if r != "best"]
            old.pop("val_loss", None)
            if not old["kept_for"]:
                index["checkpoints"].pop(old_best)
            self._write_index(index)  # the index first: it never names a copy that is gone
            if old_best not in index["checkpoints"]:
                self.fs.rm(self._path(old_best), recursive=True)

    def best_loss(self) -> float | None:
        index = self.index()
        best = index.get("best")
        return index["checkpoints"].get(best, {}).get("val_loss") if best else None

    def list(self) -> list[str]:
        """Names of the complete checkpoints in the archive (their meta.json arrived)."""
        if not self.fs.exists(self.root):
            return []
        names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False)]
        return sorted(n for n in names if n.startswith("step_") and self.fs.exists(self._path(n, META)))

    def fetch(self, name: str, local: Path) -> Path:
        """Copy archived checkpoint `name` to the local directory `local` (absent) and verify it there.

        StateError naming what is wrong if the copy does not verify (the partial copy is removed)."""
        src = self._path(name)
        local.mkdir(parents=True)
        try:
            for meta_file in (META_DIGEST, META):
                if self.fs.exists(posixpath.join(src, meta_file)):
                    self.fs.get_file(posixpath.join(src, meta_file), str(local / meta_file))
            for file in read_meta(local)["files"]:
                (local / file).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(posixpath.join(src, file), str(local / file))
            problems = verify(local)
        except (OSError, StateError) as e:
            problems = [str(e)]
        if problems:
            shutil.rmtree(local, ignore_errors=True)
            raise StateError(f"the archive copy {src} is damaged or unreadable:\n" +
                             "\n".join(f"  - {p}" for p in problems))
        return local
