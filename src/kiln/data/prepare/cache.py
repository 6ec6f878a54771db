"""The cache directory (`data.cache_dir`): opened writable, its write errors made clear, and the
housekeeping of what interrupted or superseded prepares leave in `datasets/`.

    root = open_cache(cfg.cache_dir)            # ConfigError if it cannot be a writable directory
    with cache_errors(root): ...                # OSErrors on files under root: ResourceError/ConfigError
    remove_stale(datasets, keep="partial-<key>", key_of=..., console=...)   # at the start of a prepare

A prepare writes its shards in `partial-<key>` while it holds the lock `partial-<key>.lock` (an
flock: the kernel drops it when the process dies, kill -9 included). So a staging directory whose
lock another process holds is being filled, and is never touched; one whose lock can be taken was
left by a prepare that was interrupted. Holding that lock, it is removed when it can never be
resumed or is old:

- its sources changed: the key named their exact path, size, inode and times (`inputs.json`,
  written when the directory is made), so a changed, touched or removed file means no prepare will
  ever pick it up again;
- nothing was written in it for `PARTIAL_KEEP_DAYS` days (a prepare run again soon after its
  interruption still finds its finished shards).

Also removed: `sizes-*` markers of datasets that are gone, `damaged-*` directories (a damaged dataset
being deleted), lock files no process holds (left by earlier versions), and temporary files of a
process killed while it wrote the source-hash memo or a trained tokenizer (`*.tmp*` older than a day:
a live writer renames its own within seconds).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.errors import ConfigError, ResourceError
from kiln.files import atomic_write, try_lock

PARTIAL_KEEP_DAYS = 7
TMP_KEEP_SECONDS = 86400
INPUTS = "inputs.json"


def open_cache(cache_dir: str) -> Path:
    """`cache_dir` (made if missing), checked to be a directory this process can write in."""
    root = Path(cache_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = "a file is in the way" if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror
        raise ConfigError(f"data.cache_dir={cache_dir}: cannot write there ({why}: {e.filename}); set "
                          "data.cache_dir to a writable directory") from None
    return root


@contextmanager
def cache_errors(root: Path) -> Iterator[None]:
    """Turn an OSError on a file under `root` into a KilnError that says what to do (others pass)."""
    try:
        yield
    except OSError as e:
        names = [str(n) for n in (e.filename, e.filename2) if n]
        if not any(n == str(root) or n.startswith(str(root) + os.sep) for n in names) \
                and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = names[0] if names else str(root)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceError(f"no space left writing {where} ({e.strerror}); free some or set data.cache_dir "
                                "to a larger disk, then run again: finished shards are kept") from None
        raise ConfigError(f"cannot write {where} in data.cache_dir ({e.strerror}); set data.cache_dir to a "
                          "writable directory, or fix that path's permissions") from None


def write_inputs(partial: Path, keys: list[str | None]) -> None:
    """Record what names the sources of `partial` (their memo keys), unless already recorded."""
    f = partial / INPUTS
    if not f.is_file():
        atomic_write(f, json.dumps({"keys": keys}))


def _last_write(d: Path) -> float:
    times = [d.stat().st_mtime]
    for sub in ("train", "val"):
        try:
            times.append((d / sub).stat().st_mtime)
        except OSError:
            pass
    return max(times)


def _why_stale(partial: Path, key_of: Callable[[str], str | None], now: float) -> str | None:
    """Why an abandoned staging directory can go, or None to keep it."""
    try:
        keys = json.loads((partial / INPUTS).read_text())["keys"]
    except (OSError, ValueError, KeyError, TypeError):
        keys = []
    for k in keys:
        if isinstance(k, str) and k.startswith("/") and key_of(k) != k:
            return f"its source {k.rsplit('|', 4)[0]} changed or is gone, so it cannot be resumed"
    try:
        age = now - _last_write(partial)
    except OSError:
        return None
    if age > PARTIAL_KEEP_DAYS * 86400:
        return f"untouched for {age / 86400:.0f} days"
    return None


def remove_stale(datasets: Path, keep: str, key_of: Callable[[str], str | None], console=None) -> list[Path]:
    """Remove what interrupted prepares left in `datasets` and no live process uses (see the module doc);
    `keep` is the staging directory this prepare resumes. `key_of(key)` is the memo key a local source
    file has now (None if gone), given its recorded key. Returns what was removed."""
    if not datasets.is_dir():
        return []
    removed: list[Path] = []
    now = time.time()
    names = sorted(p.name for p in datasets.iterdir())
    partials = {n.removesuffix(".lock") for n in names if n.startswith("partial-")}
    for name in sorted(partials - {keep}):
        d = datasets / name
        with try_lock(datasets / f"{name}.lock") as held:  # the lock file goes when released
            if not held or not d.is_dir():
                continue
            why = _why_stale(d, key_of, now)
            if why:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
                if console is not None:
                    console.print(f"removed {d}: an interrupted prepare's shards; {why}", highlight=False)
    for name in names:
        p = datasets / name
        if name.startswith("damaged-"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif name.startswith("sizes-") and "." not in name:
            try:
                target = p.read_text().strip()
            except OSError:
                continue
            if target and not (datasets / target / "manifest.json").is_file():
                p.unlink(missing_ok=True)
                removed.append(p)
    tokenizers = datasets.parent / "tokenizers"
    for lock in tokenizers.glob("*.lock") if tokenizers.is_dir() else []:
        with try_lock(lock):  # taken: no process trains that tokenizer; released: the file is gone
            pass
    for tmp in [*datasets.parent.glob("*.tmp"), *tokenizers.glob("*/tokenizer.tmp*")]:
        try:
            if now - tmp.stat().st_mtime > TMP_KEEP_SECONDS:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            pass
    return removed
