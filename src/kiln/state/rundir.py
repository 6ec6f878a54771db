"""The run directory: everything needed to reproduce, resume or sample from a run.

    <run_dir>/config.yaml                the resolved config of the latest start or resume
    <run_dir>/metrics.jsonl              metrics, appended across resumes
    <run_dir>/checkpoints/step_00001200/ one complete checkpoint (meta.json lists its files)
    <run_dir>/checkpoints/.tmp-...       a save in progress, or one killed midway (never loaded)
    <run_dir>/checkpoints/.damaged-...   a damaged checkpoint a resume set aside (kept for inspection)
    <run_dir>/model/                     final weights (safetensors) for `kiln generate` and export
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from kiln.config import RunConfig
from kiln.errors import StateError
from kiln.state.verify import META

CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"  # checkpoints found damaged and set aside by a resume; never deleted by Kiln
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def make_run_dir(cfg: RunConfig, root: str | Path = "runs") -> Path:
    """Create the run directory (train.run_dir, or runs/<timestamp>) and write config.yaml into it."""
    if cfg.train.run_dir:
        path = Path(cfg.train.run_dir).expanduser()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(root) / stamp
        n = 1
        while path.exists():
            path, n = Path(root) / f"{stamp}-{n}", n + 1
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(cfg.to_yaml())
    except OSError as e:
        raise StateError(f"cannot create run directory {path}: {e.strerror}. Choose another train.run_dir.") from None
    return path


def fresh_sibling(path: Path) -> Path:
    """`path-1`, `path-2`, ...: the first name next to `path` that does not exist yet."""
    n = 1
    while (candidate := path.with_name(f"{path.name}-{n}")).exists():
        n += 1
    return candidate


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (their meta.json exists), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / META).is_file()]
    return sorted(found, key=lambda p: step_of(p))


def unfinished(run_dir: str | Path) -> list[Path]:
    """Directories of saves that never completed (killed or failed midway): Kiln's own temporaries."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(TMP_PREFIX))


def without_meta(run_dir: str | Path) -> list[Path]:
    """Step directories that lost their meta.json (Kiln never leaves one: a manual change or partial copy)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and not (p / META).is_file())


def remove_unfinished(run_dir: str | Path) -> list[Path]:
    """Delete leftovers of saves that died; call only when no save of this run is in progress."""
    gone = unfinished(run_dir)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def set_aside(run_dir: str | Path) -> list[Path]:
    """Damaged checkpoints a resume moved out of the way."""
    root = Path(run_dir) / CHECKPOINTS
    return sorted(p for p in root.iterdir() if p.name.startswith(DAMAGED_PREFIX)) if root.is_dir() else []
