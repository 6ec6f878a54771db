"""Shared by the end-to-end tests: a small corpus of Python standard library source."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_corpus(directory: Path, documents: int, modules: int = 40) -> Path:
    """Write `documents` text files of 2 kB each, cut from the first `modules` stdlib modules, into `directory`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:modules])
    for i in range(documents):
        (directory / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    return directory
