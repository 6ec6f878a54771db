"""The run directory: everything needed to reproduce, resume or sample from a run.

    <run_dir>/config.yaml                the resolved config of the latest start or resume (written once
                                         the run has started or its checkpoint has loaded)
    <run_dir>/started_in.json            the directory config.yaml's relative paths are read from (its writer's)
    <run_dir>/.lock, .lock-holder.json   while a `kiln train` runs in it: its lock, and who holds it
    <run_dir>/metrics.jsonl              metrics, appended across resumes
    <run_dir>/train.log                  the progress as time-stamped lines, appended across resumes
    <run_dir>/checkpoints/step_00001200/ one complete checkpoint (meta.json lists its files)
    <run_dir>/checkpoints/.tmp-...       a save in progress, or one killed midway (never loaded)
    <run_dir>/checkpoints/.damaged-...   a damaged checkpoint a resume set aside (kept for inspection)
    <run_dir>/model/                     final weights (safetensors) for `kiln generate` and export
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from kiln.config import RunConfig
from kiln.errors import ConfigError, StateError
from kiln.files import atomic_write, atomic_write_json, try_lock
from kiln.state.start_dir import RECORD, from_start, missing_error, record_start, start_of
from kiln.state.verify import META

CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"  # checkpoints found damaged and set aside by a resume; never deleted by Kiln
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
CONFIG = "config.yaml"
LOCK, HOLDER = ".lock", ".lock-holder.json"


def make_run_dir(path: str | Path | None, root: str | Path = "runs") -> Path:
    """Create the run directory `path` (None: a new runs/<timestamp>); config.yaml comes later (write_config)."""
    if path:
        path = Path(path).expanduser()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(root) / stamp
        n = 1
        while path.exists():
            path, n = Path(root) / f"{stamp}-{n}", n + 1
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateError(f"cannot create run directory {path}: {e.strerror}. Choose another train.run_dir.") from None
    return path


def missing_dirs(path: str | Path) -> list[Path]:
    """`path` and those of its parents that are not there (yet), deepest first."""
    out, p = [], Path(path).expanduser()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


@contextmanager
def unmade_if_empty(made: list[Path]) -> Iterator[None]:
    """Directories a `kiln train` made for its run (`made`, deepest first: kiln.state.resume.run_directory) are
    taken away again if its start fails or is stopped and they are still empty: an empty run directory is no run,
    and the next `kiln train` on it took it for one (`kiln train DIR` refused it as a directory without
    config.yaml). Anything written there, and any directory the user had, stays."""
    try:
        yield
    except BaseException:
        for d in made:
            try:
                d.rmdir()  # only an empty one
            except OSError:
                break
        raise


def check_outside_sources(run_dir: Path, cfg: RunConfig) -> None:
    """ConfigError when the run directory is, or lies within, a local directory named in data.sources (or a
    mixture entry's): the run's own files (config.yaml, metrics.jsonl, checkpoints' JSON) would be read as data by
    the next start, and a resume would stop on them or on a dataset that changed."""
    named = [*cfg.data.sources, *(s for e in cfg.data.mixture for s in (e.sources or []))]
    inside = run_dir.expanduser().absolute()
    for spec in named:
        if "://" in spec or spec.startswith("@") or any(c in spec for c in "*?["):
            continue  # URLs, the built-in corpus and globs (which name some files of a directory, not all)
        source = Path(spec).expanduser().absolute()
        if source.is_dir() and (inside == source or source in inside.parents):
            raise ConfigError(f"train.run_dir {run_dir} is inside the data source {spec} (data.sources): the run's "
                              "own files would be read as training data when it starts again. Give a run directory "
                              "outside it (a run already there can be moved out whole, then resumed from there)")


def check_config_is_a_runs(run_dir: Path) -> None:
    """ConfigError where `run_dir`, before any run there (no checkpoints, no metrics.jsonl), holds a config.yaml that
    no start of Kiln wrote: the user's own config file (`kiln train exp/` or `kiln train exp/config.yaml
    train.run_dir=exp`), which the run wrote its resolved config over, its comments and layout lost."""
    from kiln.config import load_config
    from kiln.errors import KilnError

    path = run_dir / CONFIG
    if not path.is_file() or (run_dir / CHECKPOINTS).exists() or (run_dir / "metrics.jsonl").exists():
        return
    try:
        if path.read_text() == load_config(path).to_yaml():  # as a start wrote it (one killed in its first seconds)
            return
    except (KilnError, OSError, ValueError):
        return  # loading the config says what is wrong with it
    raise ConfigError(f"{path} is your config file, not one a run wrote (no run has started in {run_dir}), and the "
                      "run writes its resolved config there as config.yaml, over it. Keep your file elsewhere or "
                      f"under another name and give it: kiln train FILE train.run_dir={run_dir}")


def run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), strict: bool = False) -> RunConfig:
    """The config of the run in `run_dir` (its config.yaml, then `overrides`), its relative input paths (data.sources,
    ...) and data.cache_dir read from the directory the run started in, not the current one (kiln.state.start_dir);
    an override still wins. Where that directory cannot be told, the current one. `strict` (a resume that trains):
    a DataError naming both places where data the config names is found in neither."""
    from kiln.config import derive, load_config

    file = Path(run_dir) / CONFIG
    try:
        saved = yaml.safe_load(file.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        saved = None  # load_config says what is wrong
    cfg = load_config(file, overrides)
    if not isinstance(saved, dict):
        return cfg
    train = saved.get("train")
    start, here = start_of(run_dir, train.get("run_dir") if isinstance(train, dict) else None), Path.cwd()
    if start is None or start == here:
        return cfg
    given = {o.partition("=")[0].strip() for o in overrides}
    changes, missing = from_start(saved, start, here)
    if {"data.sources", "data.mixture"} & given:  # the data given anew: the saved one is not read
        given |= {"data.sources", "data.mixture"}
    changes = {k: v for k, v in changes.items() if k not in given}
    missing = [(k, spec) for k, spec in missing if k not in given]
    if strict and missing:
        raise missing_error(missing, start, here, file)
    return derive(cfg, changes) if changes else cfg


def write_config(run_dir: str | Path, cfg: RunConfig) -> None:
    """Write `cfg` as the run's config.yaml, whole or not at all (a reader or a crash never sees half), and beside it
    the current directory, the one its relative paths are read from (kiln.state.start_dir)."""
    try:
        atomic_write(Path(run_dir) / CONFIG, cfg.to_yaml())
        record_start(run_dir)
    except OSError as e:
        raise StateError(f"cannot write {Path(run_dir) / CONFIG}: {e.strerror}. Check the run directory's "
                         "permissions and free space.") from None


@contextmanager
def config_while_starting(run_dir: str | Path, cfg: RunConfig, writes: bool) -> Iterator[None]:
    """A new run's config.yaml from the moment it holds its directory (`writes`: rank 0, and none is there yet): a
    start killed in its first seconds (kill -9, before training) is then resumed by `kiln train RUN_DIR` as by its
    own command. A start that fails or is stopped cleanly takes it away again, unless the run wrote its own since
    (`write_config` once started): a directory is not a run before one has started there."""
    path = Path(run_dir) / CONFIG
    first = None
    if writes and not path.is_file():
        write_config(run_dir, cfg)
        first = path.stat().st_ino
    try:
        yield
    except BaseException:
        with suppress(OSError):
            if first is not None and path.stat().st_ino == first:  # the start never got as far as its own
                path.unlink()
                (Path(run_dir) / RECORD).unlink(missing_ok=True)
        raise


def process_rank() -> tuple[int, bool]:
    """(rank of this process, whether a process group joins it to others)."""
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized()
    return (dist.get_rank() if shared else int(os.environ.get("RANK", "0"))), shared


def from_rank0(value: Any, group=None) -> Any:
    """Rank 0's `value` on every process of `group` (the default group; the value itself without one)."""
    import torch.distributed as dist

    if not process_rank()[1]:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


@contextmanager
def hold_run_dir(run_dir: str | Path) -> Iterator[None]:
    """Hold the run directory for this job while the block runs: a second `kiln train` on it is refused
    with a StateError naming the holder (process id, host, start time).

    The lock is an OS lock (flock), so it dies with its process: a run killed with kill -9 never blocks
    its resume. Rank 0 takes it for the whole job (the other ranks of the job read the directory and
    never refuse each other); every rank gets rank 0's answer."""
    run_dir = Path(run_dir)
    rank, _ = process_rank()
    if rank != 0:
        error = from_rank0(None)
        if error:
            raise StateError(error)
        yield
        return
    with ExitStack() as stack:
        try:
            held = stack.enter_context(try_lock(run_dir / LOCK))
            error = None if held else _refusal(run_dir)
        except OSError as e:  # told to every rank, so none waits for the others forever
            error = f"cannot lock the run directory {run_dir}: {e.strerror}. Check its permissions."
        from_rank0(error)
        if error:
            raise StateError(error)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        atomic_write_json(run_dir / HOLDER, holder, indent=1)  # beside the lock file: waiters may rewrite that
        try:
            yield
        finally:
            with suppress(OSError):
                (run_dir / HOLDER).unlink()


def started_by(run_dir: str | Path) -> str | None:
    """The command line of the last process that held `run_dir` and was killed before it let go (its holder file
    stays behind), or None."""
    try:
        program, _, args = str(json.loads((Path(run_dir) / HOLDER).read_text())["command"]).partition(" ")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if program.endswith(("kiln/cli.py", "/kiln")):  # `python -m kiln.cli` or the script: as a user types it
        program = "kiln"
    return f"{program} {args}".strip()


def _refusal(run_dir: Path) -> str:
    try:
        h = json.loads((run_dir / HOLDER).read_text())
        who = f"process {h['pid']} on host {h['host']} (running since {h['since']}: {h['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        who = "another process (it is starting and has not written who it is yet)"
    return (f"{run_dir} is in use by {who}. Two runs in one directory would overwrite each other's "
            "checkpoints and metrics. Wait for it to finish or stop it (a killed run leaves no lock behind), "
            "or give this run another train.run_dir.")


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


def checkpoint_of(path: str | Path) -> Path:
    """`path` if it is a checkpoint directory, else the newest complete checkpoint of the run at `path`;
    StateError when it is neither."""
    p = Path(path)
    if (p / META).is_file():
        return p
    found = checkpoints(p)
    if not found:
        raise StateError(f"{p} holds no final model (model/), no checkpoint and no Hugging Face model; give the "
                         "directory of a `kiln train` run, one of its checkpoints or a Hugging Face model")
    return found[-1]


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


def model_saved(path: Path) -> bool:
    """Whether `path` holds the whole final model: weights, tokenizer and model config (written last, so its presence
    says the others are whole)."""
    try:
        json.loads((path / "model_config.json").read_text())
    except (OSError, ValueError):
        return False
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return weights and (path / "tokenizer.json").is_file()
