"""The one checkpointer: everything a run needs to continue exactly, under fixed keys.

A checkpoint is a directory `<run_dir>/checkpoints/step_NNNNNNNN/`:

    __R_N.distcp, .metadata   torch.distributed.checkpoint (DCP) files: keys "model" and "optim",
                              sharded per process (FSDP2 DTensors reshard to a new world size)
    state.json                "scheduler", "loader", "trainer" (step, tokens_seen, last_eval),
                              "fingerprints" (config and data), written by rank 0
    rank<R>.json              "rng" of process R (Python, NumPy, torch CPU, CUDA)
    meta.json                 written last: step, config, every file with size and sha256

It is written into `.tmp-step_NNNNNNNN/` and renamed when complete, so a kill at any moment leaves
either the whole checkpoint or none. With `async_save` the caller waits only while the state is
copied into reusable CPU buffers; one background thread writes, hashes, renames, prunes and
archives, one save at a time, and its failure is raised by the next `poll()`/`wait()`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map

from kiln import __version__
from kiln.config import RunConfig
from kiln.errors import KilnError, StateError
from kiln.state.resume import verified
from kiln.state.rng import rng_state, set_rng_state
from kiln.state.rundir import CHECKPOINTS, TMP_PREFIX, checkpoints, step_dir_name, step_of
from kiln.state.storage import ParallelFileSystemReader, hashing_writer
from kiln.state.verify import FORMAT, META, fsync_dir, hash_tree, read_meta, write_json


@dataclass
class Snapshot:
    """The whole state at one step, in CPU memory (tier one: rollback without touching the disk)."""

    step: int
    tensors: dict[str, Any]
    small: dict[str, Any]
    rng: dict[str, Any]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"{type(obj).__name__} in a state_dict() is not JSON data; return plain numbers and lists")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile keeps the module it compiled here


def _errno_of(exc: BaseException) -> OSError | None:
    """The OSError behind an exception, looking through causes and DCP's per-rank failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # DCP: rank -> (exception, traceback)
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)]
    return None


def _innermost(exc: BaseException) -> BaseException:
    """The first per-rank failure inside a DCP CheckpointException, else the exception itself."""
    for failure in getattr(exc, "failures", {}).values():
        for f in failure if isinstance(failure, tuple) else (failure,):
            if isinstance(f, BaseException):
                return f
    return exc


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: RunConfig, fingerprints: dict[str, Any],
                 log: Callable[[str], None] = print):
        self.run_dir, self.cfg, self.ccfg = Path(run_dir), cfg, cfg.checkpoint
        self.dir = self.run_dir / CHECKPOINTS
        self.fingerprints, self.log = fingerprints, log
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # checkpoint collectives run on their own gloo group, so a background save never interleaves
        # with the training collectives of the default (NCCL) group
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        # and the main thread's small collectives (did any rank get a signal?) on another, since a
        # background save may be running collectives on `group` at the same moment
        self.control_group = dist.new_group(backend="gloo") if self.distributed else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-checkpoint")
        self._pending: tuple[int, Future] | None = None
        self._buffers: dict[str, Any] | None = None  # reused CPU copies of the tensors (pinned on CUDA)
        self._buffers_ready: Future | None = None
        self.snapshot: Snapshot | None = None
        self.last_saved_step: int | None = None
        self._warned_slow = False
        self.archive = None
        if self.ccfg.archive_url and self.rank == 0:
            from kiln.state.archive import Archive

            self.archive = Archive(self.ccfg.archive_url, self.run_dir.name)

    # ------------------------------------------------------------------ capture

    def _tensors(self, trainer) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_sd, optim_sd = get_state_dict(_unwrap(trainer.model), trainer.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _small(self, trainer) -> dict[str, Any]:
        state = {
            "scheduler": trainer.scheduler.state_dict(),
            "loader": trainer.train_loader.state_dict(),
            "trainer": {"step": trainer.step, "tokens_seen": trainer.tokens_seen, "last_eval": trainer.last_eval},
            "fingerprints": self.fingerprints,
        }
        return json.loads(json.dumps(state, default=_json_default))  # a detached, JSON-safe copy

    def _copy_to_cpu(self, tensors: dict[str, Any], buffers: dict[str, Any] | None) -> dict[str, Any]:
        """Copy `tensors` into `buffers` (allocated on first use, pinned when CUDA is used)."""
        if buffers is None:
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            try:
                buffers = _create_cpu_state_dict(tensors, pin_memory=pin)
            except RuntimeError as e:  # pinned (page-locked) memory is scarcer than plain memory
                if not pin:
                    raise
                self.log(f"could not pin CPU memory for checkpoint staging ({e}); using plain memory (slower)")
                buffers = _create_cpu_state_dict(tensors, pin_memory=False)
        try:
            _copy_state_dict(tensors, buffers, non_blocking=True)
        except (ValueError, RuntimeError, KeyError):  # the state's layout changed: start over
            buffers = _create_cpu_state_dict(tensors, pin_memory=False)
            _copy_state_dict(tensors, buffers, non_blocking=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return buffers

    # ------------------------------------------------------------------ save

    def warm_up(self, trainer) -> None:
        """Allocate the pinned CPU buffers of the state in the background, so the first save only copies.

        Call after the first optimizer step (the optimizer's state exists then); a no-op off CUDA.
        """
        if self._buffers is not None or self._buffers_ready is not None or trainer.step == 0:
            return
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self._buffers_ready = self._pool.submit(_create_cpu_state_dict, self._tensors(trainer), pin_memory=True)

    def save(self, trainer, reason: str = "periodic", blocking: bool | None = None) -> Path | None:
        """Checkpoint the trainer's state at its current step. Returns where it will be complete.

        Nothing is saved before the first step: a fresh start is that state, and capturing the
        optimizer's state before it exists would create it (and change the run).
        """
        t0 = time.perf_counter()
        self.wait()  # one save at a time; raises an earlier background failure
        waited = time.perf_counter() - t0
        if waited > 1.0 and not self._warned_slow and reason == "periodic":
            self._warned_slow = True
            self.log(f"training waited {waited:.1f} s at step {trainer.step} for the previous checkpoint to finish "
                     f"writing; raise checkpoint.every (now {self.ccfg.every}) or use a faster disk")
        if trainer.step == 0:
            return None
        target = self.dir / step_dir_name(trainer.step)
        if self.last_saved_step == trainer.step and target.is_dir():
            return target
        blocking = (not self.ccfg.async_save) if blocking is None else blocking
        if self._buffers_ready is not None:
            ready, self._buffers_ready = self._buffers_ready, None
            try:
                self._buffers = ready.result()
            except RuntimeError as e:
                self.log(f"allocating pinned checkpoint buffers failed ({e}); trying again at this save")
        small, rng = self._small(trainer), rng_state()
        small["reason"] = reason
        self.last_saved_step = trainer.step
        if not self.ccfg.async_save:  # sync-only runs write straight from the live tensors: no CPU copy
            self._write(self._tensors(trainer), small, rng)
            return target
        self._buffers = self._copy_to_cpu(self._tensors(trainer), self._buffers)  # pinned, kept for the run
        if blocking:
            self._write(self._buffers, small, rng)
        else:
            self._pending = (trainer.step, self._pool.submit(self._write, self._buffers, small, rng))
        return target

    def poll(self) -> None:
        """Raise the failure of a finished background save (call once per step)."""
        if self._pending and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is complete; raise its failure."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except KilnError:
            raise
        except (Exception, dcp.CheckpointException) as e:  # a bug in a save thread: keep the traceback
            raise StateError(f"the background checkpoint of step {step} failed: {e!r}") from e

    def close(self) -> None:
        """Wait for the last save and stop the background thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _write(self, tensors: dict[str, Any], small: dict[str, Any], rng: dict[str, Any]) -> Path:
        step = small["trainer"]["step"]
        name = step_dir_name(step)
        tmp, final = self.dir / f"{TMP_PREFIX}{name}", self.dir / name
        t0 = time.perf_counter()
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self._barrier()
            writer = hashing_writer(tmp, self.ccfg.write_threads, self.ccfg.fsync)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(tensors, storage_writer=writer, process_group=self.group, no_dist=not self.distributed)
            write_json(tmp / f"rank{self.rank}.json", {"rng": rng}, fsync=self.ccfg.fsync)
            if self.rank == 0:
                write_json(tmp / "state.json", small, fsync=self.ccfg.fsync)
            digests = dict(getattr(writer.fs, "digests", {}))
            if self.group is not None:  # every rank's digests, to rank 0
                gathered = [None] * dist.get_world_size() if self.rank == 0 else None
                dist.gather_object(digests, gathered, dst=0, group=self.group)
                digests = {k: v for d in gathered or [] for k, v in d.items()}
            if self.rank == 0:
                self._complete(tmp, final, small, time.perf_counter() - t0, digests)
            self._barrier()
        except BaseException as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, KilnError):
                raise
            os_err = _errno_of(e)
            latest = checkpoints(self.run_dir)
            intact = f"Earlier checkpoints are intact (latest: {latest[-1]})." if latest else \
                "No earlier checkpoint exists."
            if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StateError(f"disk full while writing the checkpoint of step {step} to {self.dir} "
                                 f"({os_err.strerror}). {intact} Free space there, lower checkpoint.keep_last, "
                                 "or point train.run_dir to a larger disk, then resume.") from None
            if os_err is not None:
                raise StateError(f"writing the checkpoint of step {step} to {self.dir} failed: {os_err}. "
                                 f"{intact}") from None
            raise
        return final

    def _complete(self, tmp: Path, final: Path, small: dict[str, Any], seconds: float,
                  digests: dict[str, dict[str, Any]]) -> None:
        """Rank 0, after every rank wrote: hash the rest, write meta.json, rename into place, prune, archive."""
        t0 = time.perf_counter()
        files = hash_tree(tmp, threads=max(4, self.ccfg.write_threads), known=digests)
        hashing = time.perf_counter() - t0
        last_eval = small["trainer"]["last_eval"]
        step = small["trainer"]["step"]
        val_loss = last_eval["val_loss"] if last_eval and last_eval.get("step") == step else None
        meta = {
            "format": FORMAT, "step": step, "tokens_seen": small["trainer"]["tokens_seen"],
            "reason": small["reason"], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "write_seconds": round(seconds, 3), "hash_seconds": round(hashing, 3), "val_loss": val_loss,
            "world_size": dist.get_world_size() if self.distributed else 1,
            "versions": {"kiln": __version__, "torch": torch.__version__},
            "fingerprints": small["fingerprints"], "config": self.cfg.model_dump(mode="json"),
            "bytes": sum(f["bytes"] for f in files.values()), "files": files,
        }
        write_json(tmp / META, meta, fsync=self.ccfg.fsync)
        if final.exists():  # the same step saved before (e.g. resumed then stopped at once): keep that one
            shutil.rmtree(tmp, ignore_errors=True)
            return
        os.rename(tmp, final)
        fsync_dir(self.dir)
        self._retain(final)
        if self.archive is not None:
            self._archive(final, meta)

    def _retain(self, newest: Path) -> None:
        """Delete the oldest complete checkpoints beyond keep_last; the newest is complete already."""
        for old in checkpoints(self.run_dir)[: -self.ccfg.keep_last]:
            if old != newest and step_of(old) < step_of(newest):
                doomed = old.with_name(f"{TMP_PREFIX}del-{old.name}")
                os.rename(old, doomed)  # gone at once; a kill during the delete leaves only a .tmp- dir
                shutil.rmtree(doomed, ignore_errors=True)

    def _archive(self, ckpt: Path, meta: dict[str, Any]) -> None:
        every, m = self.ccfg.every, self.ccfg.archive_every
        if meta["reason"] == "final" or (m and every and meta["reason"] == "periodic" and
                                         (meta["step"] // every) % m == 0):
            self.archive.add(ckpt, "every")
        best = self.archive.best_loss()
        if self.ccfg.archive_best and meta["val_loss"] is not None and (best is None or meta["val_loss"] < best):
            self.archive.add(ckpt, "best", meta["val_loss"])

    # ------------------------------------------------------------------ restore

    def load(self, trainer, path: str | Path, check_hashes: bool = True) -> dict[str, Any]:
        """Restore the trainer from a complete checkpoint, its hashes checked first. Returns its meta.json."""
        path = Path(path)
        if check_hashes:  # rank 0 re-hashes; StateError naming the damaged file and the previous good one
            problem = None
            if self.rank == 0:
                try:
                    verified(path)
                except StateError as e:
                    problem = str(e)
            if self.distributed:
                box = [problem]
                dist.broadcast_object_list(box, src=0, group=self.control_group)
                problem = box[0]
            if problem:
                raise StateError(problem)
        meta = read_meta(path)
        tensors = self._tensors(trainer)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(tensors, storage_reader=ParallelFileSystemReader(path, self.ccfg.write_threads),
                         process_group=self.group,
                         no_dist=not self.distributed)
        except (Exception, dcp.CheckpointException) as e:
            why = _errno_of(e) or _innermost(e)
            raise StateError(f"checkpoint {path} does not fit this model and optimizer: {why}. Resume with the "
                             "model settings it was saved with (see `kiln inspect`).") from None
        try:
            small = json.loads((path / "state.json").read_text())
            rank_file = path / f"rank{self.rank}.json"
            rng = json.loads(rank_file.read_text())["rng"] if rank_file.is_file() else None
        except (OSError, ValueError, KeyError) as e:
            raise StateError(f"checkpoint {path} has an unreadable state.json or rank file: {e}") from None
        if rng is None:
            self.log(f"checkpoint {path} was saved by {meta['world_size']} process(es); process {self.rank} "
                     "has no saved random state and keeps its seeded one")
        self._restore(trainer, tensors, small, rng)
        self.last_saved_step = trainer.step
        return meta

    def _restore(self, trainer, tensors: dict[str, Any], small: dict[str, Any], rng: dict | None) -> None:
        opt, sched = trainer.optimizer, trainer.scheduler
        # the config decides hyperparameters (a forced resume may change them); the state brings moments
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in opt.param_groups]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_state_dict(_unwrap(trainer.model), opt, model_state_dict=tensors["model"],
                           optim_state_dict=tensors["optim"])
        for g, h, base in zip(opt.param_groups, hyper, sched.base_lrs):
            g.update(h)
            g["initial_lr"] = base
        saved = small["scheduler"]
        sched.last_epoch, sched._step_count = saved["last_epoch"], saved.get("_step_count", saved["last_epoch"] + 1)
        for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        trainer.train_loader.load_state_dict(small["loader"])
        t = small["trainer"]
        trainer.step, trainer.tokens_seen, trainer.last_eval = t["step"], t["tokens_seen"], t["last_eval"]
        if rng is not None:
            set_rng_state(rng)

    # ------------------------------------------------------------------ in-memory tier

    def take_snapshot(self, trainer) -> Snapshot:
        """Copy the whole state into CPU memory (buffers reused between snapshots)."""
        buffers = self.snapshot.tensors if self.snapshot else None
        tensors = self._copy_to_cpu(self._tensors(trainer), buffers)
        self.snapshot = Snapshot(trainer.step, tensors, self._small(trainer), rng_state())
        return self.snapshot

    def restore_snapshot(self, trainer) -> int:
        """Roll the trainer back to the last snapshot. Returns its step."""
        if self.snapshot is None:
            raise StateError("no in-memory snapshot to roll back to; set checkpoint.snapshot_every")
        s = self.snapshot
        copy = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, s.tensors)  # keep s intact
        self._restore(trainer, copy, s.small, s.rng)
        return s.step
