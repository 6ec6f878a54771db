"""Where documents come from: files, directories, globs, and '@stdlib' (this Python's own source).

A source yields `Document`s one at a time, so memory stays bounded by what the consumer holds.
"""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import DataError

STDLIB = "@stdlib"
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst"}


@dataclass(frozen=True)
class Document:
    text: str
    origin: str  # file (and line/row) it came from, for error messages


def stdlib_files() -> list[Path]:
    """The .py files of the running interpreter's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library source was not found at {root}; "
                        "give data.sources explicitly")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def expand(sources: list[str]) -> list[Path]:
    """Resolve source specs to a sorted list of files; a spec that matches nothing is an error."""
    files: list[Path] = []
    for spec in sources:
        if spec == STDLIB:
            files.extend(stdlib_files())
            continue
        p = Path(spec).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES))
        else:
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"data source '{spec}' matches no file. Check the path in data.sources.")
            files.extend(matches)
    return files


def read_documents(files: list[Path], max_bytes: int | None = None) -> Iterator[Document]:
    """One document per file, decoded as UTF-8; stops once max_bytes have been read."""
    total = 0
    for f in files:
        raw = f.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f}: not valid UTF-8 at byte {e.start}. Fix or remove the file.") from None
        if not text.strip():
            continue
        yield Document(text, str(f))
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            return
