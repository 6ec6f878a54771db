"""The directory a run started in, and the relative input paths of its config.yaml read from there.

A run's config.yaml names its inputs as they were given: `data.sources: [data/*.txt]` means data/ of the
directory `kiln train` ran in. A resume (`kiln train RUN_DIR`, `kiln eval RUN_DIR`) from another directory
reads them from that one, not from its own. The directory is recorded beside config.yaml, each time a process
writes it (`started_in.json`: the relative paths of that config.yaml are its writer's); a run written before
the record tells it by the relative train.run_dir its config names.

    data.sources, data.mixture's sources and datasets   made absolute where found there; a DataError (strict)
                                                        where found neither there nor here
    data.tokenizer, model.init_from, eval.include_path,  made absolute where found there; else as given (a Hub
    checkpoint.archive_url                              id, or a path the reader's own error names)
    data.cache_dir                                      always taken from there (a cache, made where missing)
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from kiln.errors import DataError
from kiln.files import atomic_write_json

RECORD = "started_in.json"
_LENIENT = ("data.tokenizer", "model.init_from", "checkpoint.archive_url")


def record_start(run_dir: str | Path) -> None:
    """Write the current directory as the one the relative paths of `run_dir`'s config.yaml are read from."""
    atomic_write_json(Path(run_dir) / RECORD, {"directory": os.getcwd()}, indent=1)


def start_of(run_dir: str | Path, saved_run_dir: Any) -> Path | None:
    """The directory the run in `run_dir` started in: its record, else what its config's train.run_dir
    (`saved_run_dir`) tells; None where neither tells."""
    try:
        recorded = json.loads((Path(run_dir) / RECORD).read_text())["directory"]
        if isinstance(recorded, str) and os.path.isabs(recorded):
            return Path(recorded)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return started_in(Path(run_dir), saved_run_dir)


def started_in(run_dir: Path, saved: Any) -> Path | None:
    """The directory a run started in, as the relative train.run_dir its config.yaml names (`saved`) tells: the
    path of `run_dir` less that one ('runs/20261127-1200' of /home/me/proj/runs/20261127-1200: /home/me/proj); None
    where it cannot tell (`saved` absolute or none, or the directory moved since)."""
    if not isinstance(saved, str) or not saved.strip():
        return None
    rel = Path(os.path.normpath(saved))
    here = run_dir.expanduser().absolute()
    n = len(rel.parts)
    if rel.is_absolute() or saved.startswith("~") or ".." in rel.parts or rel.parts == (".",) or \
            here.parts[-n:] != rel.parts:
        return None
    return Path(*here.parts[:-n])


def relative_local(spec: Any) -> bool:
    """Whether `spec` is a local path taken from the current directory (not absolute, ~, a URL or @stdlib)."""
    return isinstance(spec, str) and bool(spec.strip()) and "://" not in spec and \
        not spec.startswith(("~", "@")) and not os.path.isabs(spec)


def _exists(path: str) -> bool:
    return bool(glob.glob(path, recursive=True)) if glob.has_magic(path) else os.path.lexists(path)


def from_start(saved: dict[str, Any], start: Path, here: Path) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """({dotted key: value} with the relative inputs of the config dict `saved` read from `start`, [(key, spec)
    of the data inputs found neither under `start` nor under `here`])."""
    changes: dict[str, Any] = {}
    missing: list[tuple[str, str]] = []

    def moved(key: str, spec: Any, strict: bool) -> Any:
        if not relative_local(spec):
            return spec
        there = os.path.normpath(os.path.join(start, spec))
        if _exists(there):
            return there
        if strict and not _exists(os.path.join(here, spec)):
            missing.append((key, spec))
        return spec

    def section(name: str) -> dict[str, Any]:
        value = saved.get(name)
        return value if isinstance(value, dict) else {}

    data = section("data")
    if isinstance(data.get("sources"), list):
        sources = [moved("data.sources", s, True) for s in data["sources"]]
        if sources != data["sources"]:
            changes["data.sources"] = sources
    if isinstance(data.get("mixture"), list) and all(isinstance(e, dict) for e in data["mixture"]):
        mixture = [{**e, **({"sources": [moved("data.mixture", s, True) for s in e["sources"]]}
                            if isinstance(e.get("sources"), list) else {}),
                    **({"dataset": moved("data.mixture", e["dataset"], True)} if "dataset" in e else {})}
                   for e in data["mixture"]]
        if mixture != data["mixture"]:
            changes["data.mixture"] = mixture
    for key in _LENIENT:
        name, field = key.split(".")
        spec = section(name).get(field)
        if (there := moved(key, spec, False)) != spec:
            changes[key] = there
    include = section("eval").get("include_path")
    if isinstance(include, list) and (paths := [moved("eval.include_path", p, False) for p in include]) != include:
        changes["eval.include_path"] = paths
    cache = data.get("cache_dir")
    if relative_local(cache):  # written as given by Kiln before 2026-11 (absolute since): a cache, made if missing
        changes["data.cache_dir"] = str(start / cache)
    return changes, missing


def missing_error(missing: list[tuple[str, str]], start: Path, here: Path, config: Path) -> DataError:
    """What a resume says when inputs of the run's config are found neither where it started nor here."""
    listing = "\n".join(f"  - {key} '{spec}': neither {os.path.normpath(os.path.join(start, spec))} (where the run "
                        f"started) nor {os.path.normpath(os.path.join(here, spec))} (the current directory)"
                        for key, spec in missing)
    return DataError(f"the run's data is not where {config} names it, a path relative to the directory the run "
                     f"started in:\n{listing}\nPut the data back there, or give its new place as an absolute path "
                     "(kiln train RUN_DIR data.sources=[/new/place/...])")
