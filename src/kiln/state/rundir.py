"""The run directory: everything needed to reproduce, resume or sample from a run."""

from __future__ import annotations

import time
from pathlib import Path

from kiln.config import RunConfig
from kiln.errors import StateError


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
