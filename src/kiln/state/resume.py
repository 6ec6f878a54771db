"""Choosing the checkpoint to resume from, and checking that it fits the config and the data.

`--resume auto` takes the newest checkpoint whose files all match their hashes, and falls back,
saying so, past damaged ones. When no local checkpoint is good (all damaged, or none left) and
checkpoint.archive_url is set, the newest archive copy that verifies is fetched into the run
directory and resumed from. A config that differs in what shapes the run (model, data, optimizer,
schedule, batch) is refused with the list of differences; `--resume force` accepts it. Settings
that do not change the numbers (logging, checkpoint cadence, device, evaluation) may always change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.config import RunConfig, dotted
from kiln.errors import ConfigError, StateError
from kiln.state.rundir import (
    DAMAGED_PREFIX,
    check_outside_sources,
    checkpoints,
    fresh_sibling,
    from_rank0,
    make_run_dir,
    missing_dirs,
    process_rank,
    remove_unfinished,
    step_of,
    unfinished,
    without_meta,
)
from kiln.state.verify import verify

MODES = ("auto", "never", "force")
# settings that may change between a save and a resume without --resume force: where things are, how fast
# they run, what is logged. Where the data lives (sources, tokenizer path) is free too: the data's identity
# is checked by its content fingerprints (dataset id, tokenizer hash) instead; so is where the base model lives
# (its architecture is the model's fields; under LoRA its weights' hash is checked).
FREE = ("train.run_dir", "model.init_from", "train.device", "train.compile", "train.activation_checkpointing",
        "train.peak_tflops", "train.eval_every", "train.eval_batches", "train.sample_prompt", "train.sample_tokens",
        "data.sources", "data.tokenizer", "data.cache_dir", "data.workers", "data.prefetch", "data.pin_memory",
        "optim.fused", "logging.", "checkpoint.", "dist.", "profile.", "monitor.", "eval.")


def config_differences(saved: dict[str, Any], current: dict[str, Any], all_keys: bool = False) -> list[str]:
    """'key: saved -> current' for each setting that differs (only those that matter unless all_keys)."""
    a, b = dotted(saved), dotted(current)
    defaults = dotted(RunConfig().model_dump(mode="json"))
    out = []
    for key in sorted(b):  # a key the saved config lacks (added to Kiln later) counts as its default
        if not all_keys and key.startswith(FREE):
            continue
        old = a.get(key, defaults.get(key))
        if key == "data.mixture" and not all_keys:  # where each entry's data lives is free, as data.sources
            old, now = _weights_of(old), _weights_of(b[key])
            if old != now:
                out.append(f"{key}: {old!r} -> {now!r}")
            continue
        if old != b[key]:
            out.append(f"{key}: {old!r} -> {b[key]!r}")
    return out


def _weights_of(mixture: Any) -> Any:
    """A data.mixture without its entries' places (sources, dataset): what identifies them is their data."""
    if not isinstance(mixture, list):
        return mixture
    return [{k: v for k, v in e.items() if k not in ("sources", "dataset")} if isinstance(e, dict) else e
            for e in mixture]


def fingerprints(cfg: RunConfig, dataset) -> dict[str, Any]:
    """What a checkpoint records to recognise its config and its data."""
    relevant = {k: v for k, v in dotted(cfg.model_dump(mode="json")).items() if not k.startswith(FREE)}
    manifest = dataset.manifest
    out = {
        "config": hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16],
        "dataset": manifest.get("id") or Path(dataset.path).name,
        "tokenizer": dataset.tokenizer.hash,
        "train_tokens": manifest.get("splits", {}).get("train", {}).get("tokens"),
    }
    entries = getattr(dataset, "datasets", [])
    if len(entries) > 1:  # a mixture: each entry's dataset, so a resume after an upgrade finds them (trained_on)
        out["datasets"] = [ds.manifest["id"] for ds in entries]
    return out


def check_compatible(meta: dict[str, Any], cfg: RunConfig, prints: dict[str, Any], force: bool,
                     log: Callable[[str], None], world: int = 1) -> None:
    """StateError naming every difference of config or data, unless `force` (then they are listed).

    A train.batch_size that keeps the global batch on another number of processes (`world`; 16 x 2
    saved, 32 x 1 now; with train.global_batch_tokens any micro-batch) is no difference: that is an elastic
    resume, and the loader continues exactly."""
    diffs = config_differences(meta.get("config", {}), cfg.model_dump(mode="json"))
    saved_train = meta.get("config", {}).get("train", {})
    saved_world = int(meta.get("world_size", 1))
    rows = cfg.train.step_rows(world) * world
    if saved_world != world and _global_rows(saved_train, saved_world) == rows:
        diffs = [d for d in diffs if not d.startswith("train.batch_size:")]
        saved_batch = saved_train.get("batch_size")
        change = f", train.batch_size {saved_batch} -> {cfg.train.batch_size}" \
            if saved_batch != cfg.train.batch_size else ""
        log(f"elastic resume: {saved_world} -> {world} process(es){change} keeps the global batch of {rows} sequences")
    saved = meta.get("fingerprints", {})
    for key, what in (("dataset", "prepared dataset"), ("tokenizer", "tokenizer")):
        if saved.get(key) != prints.get(key):
            diffs.append(f"{what}: {saved.get(key)} -> {prints.get(key)}")
    if not diffs:
        return
    listing = "\n".join(f"  - {d}" for d in diffs)
    if force:
        log(f"resuming with deliberate changes (--resume force):\n{listing}")
        return
    raise StateError(f"the config or data differ from checkpoint step {meta['step']} of this run:\n{listing}\n"
                     "Put the saved values back, resume with --resume force to accept the changes, or start a "
                     "new run with --resume never.")


def _global_rows(train: dict[str, Any], world: int) -> int | None:
    """Sequences per optimizer step of a saved train section on `world` processes (None: not known)."""
    tokens, batch = train.get("global_batch_tokens"), train.get("batch_size")
    if tokens:
        return int(tokens) // int(train.get("seq_len", 1))
    return int(batch) * int(train.get("grad_accum", 1)) * world if isinstance(batch, int) else None


def latest_good(run_dir: str | Path, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint whose files all verify; damaged ones are skipped with a message."""
    found = checkpoints(run_dir)
    damaged = []
    for path in reversed(found):
        problems = verify(path)
        if not problems:
            if damaged:
                log(f"falling back to {path}: newer checkpoint(s) are damaged:\n" +
                    "\n".join(f"  - {p}" for p in damaged))
            return path
        damaged.append(f"{path.name}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    if damaged:
        raise StateError(f"every checkpoint in {Path(run_dir) / 'checkpoints'} is damaged:\n" +
                         "\n".join(f"  - {p}" for p in damaged) +
                         "\nRestore them from the archive, or start fresh with --resume never.")
    return None


def verified(path: str | Path) -> Path:
    """A checkpoint given by the user: StateError naming the bad file and the previous good checkpoint."""
    path = Path(path)
    problems = verify(path)
    if not problems:
        return path
    run_dir = path.parent.parent
    earlier = [p for p in checkpoints(run_dir) if p.name < path.name]
    fallback = next((p for p in reversed(earlier) if not verify(p)), None)
    hint = f"The previous good checkpoint is {fallback}." if fallback else "No earlier good checkpoint exists."
    raise StateError(f"checkpoint {path} is damaged:\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{hint}")


def resume_target(cfg: RunConfig, mode: str, log: Callable[[str], None]) -> tuple[Path, Path | None]:
    """The run directory to use and the checkpoint to resume from (None: a fresh start).

    auto/force: resume from the newest good checkpoint in train.run_dir, if it has one.
    never: start fresh; when train.run_dir holds checkpoints, in a new directory beside it.
    `kiln train` holds the directory (`hold_run_dir`) between the two steps, before anything is tidied.
    """
    run_dir, may_resume, _ = run_directory(cfg, mode, log)
    return run_dir, (choose_checkpoint(run_dir, log, cfg.checkpoint.archive_url) if may_resume else None)


def run_directory(cfg: RunConfig, mode: str, log: Callable[[str], None]) -> tuple[Path, bool, list[Path]]:
    """The run directory (created; rank 0's choice on every rank), whether it may hold a run to resume, and the
    directories this call made for it (the run directory and parents that were not there, deepest first; on rank 0
    only, which alone takes them away again: `kiln.state.rundir.unmade_if_empty`)."""
    if mode not in MODES:
        raise StateError(f"--resume {mode!r}: expected one of {', '.join(MODES)}")
    rank, shared = process_rank()
    found: tuple[Path | None, bool, str | None] = (None, False, None)
    made: list[Path] = []
    if rank == 0 or not shared:
        run_dir = Path(cfg.train.run_dir).expanduser() if cfg.train.run_dir else None
        if run_dir and mode == "never" and (checkpoints(run_dir) or unfinished(run_dir)):
            new = fresh_sibling(run_dir)
            log(f"--resume never: {run_dir} holds checkpoints, so this fresh run goes to {new}")
            run_dir = new
        may_resume = bool(run_dir) and mode != "never" and (run_dir.is_dir() or bool(cfg.checkpoint.archive_url))
        try:
            check_outside_sources(run_dir or Path("runs"), cfg)  # runs/: where a run without one goes
            before = missing_dirs(run_dir or Path("runs"))
            new = make_run_dir(run_dir)
            made = before if run_dir else [new, *before]  # without one: a new runs/<timestamp> (and runs/)
            found = (new, may_resume, None)
        except (StateError, ConfigError) as e:
            found = (None, False, str(e))
    run_dir, may_resume, error = from_rank0(found)
    if error:
        raise StateError(error)
    return make_run_dir(run_dir), may_resume, made if rank == 0 else []


def choose_checkpoint(run_dir: Path, log: Callable[[str], None], archive_url: str | None = None) -> Path | None:
    """The newest good checkpoint of `run_dir` (None: none), or when no local one is good, the newest
    verified copy in the archive at `archive_url`. Rank 0 verifies and tidies (removes saves
    that never completed, sets damaged checkpoints aside), so call it only while holding the directory;
    with a process group, the other ranks take its choice."""
    rank, shared = process_rank()
    latest, error = None, None
    if rank == 0 or not shared:
        try:
            if rank == 0:
                for p in remove_unfinished(run_dir):
                    log(f"removed {p}: a save that never completed (the process was killed while writing it)")
                for p in without_meta(run_dir):
                    aside = p.with_name(f"{DAMAGED_PREFIX}{p.name}")
                    p.rename(aside)
                    log(f"moved {p.name} to {aside}: it has no meta.json, so it cannot be verified (kept)")
            try:
                latest = latest_good(run_dir, log)
            except StateError as e:
                if not archive_url or rank != 0:
                    raise
                damaged = str(e)
            else:
                damaged = None
            if latest is None and archive_url and rank == 0:
                try:
                    latest = from_archive(run_dir, archive_url, log)
                except StateError as e:
                    if damaged:
                        raise StateError(f"{damaged}\n{e}") from None
                    log(f"{e}; starting without it")
                if latest is None and damaged:
                    raise StateError(damaged)
            for p in checkpoints(run_dir) if latest is not None and rank == 0 else []:
                if step_of(p) > step_of(latest):  # newer than the chosen one means damaged: keep, out of the way
                    aside = p.with_name(f"{DAMAGED_PREFIX}{p.name}")
                    p.rename(aside)
                    log(f"moved damaged {p.name} to {aside} (kept for inspection; delete it when done)")
        except StateError as e:
            error = str(e)
    if shared:
        latest, error = from_rank0((latest, error))
    if error:
        raise StateError(error)
    return latest


def from_archive(run_dir: Path, url: str, log: Callable[[str], None]) -> Path | None:
    """The newest archived checkpoint of this run that verifies, fetched into run_dir/checkpoints; None if
    the archive has none. A local directory of the same name (damaged) is set aside first."""
    from kiln.state.archive import Archive
    from kiln.state.rundir import CHECKPOINTS, TMP_PREFIX

    archive = Archive(url, run_dir.name)
    try:
        names = archive.list()
    except Exception as e:  # noqa: BLE001 - an unreachable archive is reported, not a traceback
        raise StateError(f"could not list the archive {archive.url}: {e}") from None
    for name in reversed(names):
        local = Path(run_dir) / CHECKPOINTS / name
        tmp = local.with_name(f"{TMP_PREFIX}fetch-{name}")
        try:
            archive.fetch(name, tmp)
        except StateError as e:
            log(f"skipping archive copy {name}: {e}")
            continue
        if local.exists():
            aside = local.with_name(f"{DAMAGED_PREFIX}{name}")
            local.rename(aside)
            log(f"moved damaged {name} to {aside} (kept for inspection)")
        tmp.rename(local)
        log(f"no good local checkpoint: fetched {name} from the archive {archive.url} (verified)")
        return local
    return None
