"""The checkpointer: saves and loads a dict of `Stateful` parts under fixed keys (see parts.py).

A checkpoint is a directory `<run_dir>/checkpoints/step_NNNNNNNN/`:

    __R_N.distcp, .metadata   torch.distributed.checkpoint (DCP) files: keys "model" and "optim",
                              sharded per process (FSDP2 DTensors reshard to a new world size)
    state.json                "scheduler", "loader", "trainer" (step, tokens_seen, last_eval),
                              "fingerprints" (config and data), "reason"; written by rank 0
    rank<R>.json              "rng" of process R (Python, NumPy, torch CPU, CUDA)
    meta.json                 written last: step, config, every file with size and sha256
    meta.sha256               the sha256 of meta.json (so the file list is itself verified)

It is written into `.tmp-step_NNNNNNNN/` and renamed when complete, so a kill at any moment leaves
either the whole checkpoint or none. Before a save, the free space is checked against the size of
the newest checkpoint (retention may make room; see retention.py): a save that cannot fit does not
start. With `async_save` the loop waits only while the state is copied into reusable CPU buffers
(staging.py says why these are Kiln's own); Kiln's one checkpoint thread then writes the copy with
`dcp.save` (see `save` for why not `dcp.async_save`), hashes, writes meta.json, renames and runs the
policies, one save at a time; a failure
is raised by the next `poll()`/`wait()`. What happens around a save (cadence, retention, archive,
memory snapshots) are policies (policy.py), not this class's business.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kiln import __version__
from kiln.config import RunConfig
from kiln.errors import KilnError, StateError
from kiln.state import staging
from kiln.state.dcp_read import SafeLoadPlanner
from kiln.state.parts import KEYS, RANK_KEYS, SMALL_KEYS, TENSOR_KEYS, as_parts
from kiln.state.policy import CheckpointPolicy
from kiln.state.resume import verified
from kiln.state.retention import KeepBest, KeepLast, check_room
from kiln.state.rundir import CHECKPOINTS, TMP_PREFIX, checkpoints, from_rank0, step_dir_name
from kiln.state.snapshot import MemorySnapshots, Snapshot
from kiln.state.storage import ParallelFileSystemReader, hashing_writer
from kiln.state.verify import FORMAT, fsync_dir, hash_tree, read_meta, write_json, write_meta

__all__ = ["Checkpointer", "Snapshot", "default_policies"]

# DCP says so on every save and load of a single process; that is what Kiln asks for with no_dist
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


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


def default_policies(run_dir: Path, cfg: RunConfig, log: Callable[[str], None]) -> list[CheckpointPolicy]:
    """The archive (when checkpoint.archive_url is set), the best checkpoint's hold (checkpoint.keep_best) and
    retention (checkpoint.keep_last), in that order."""
    ccfg, policies = cfg.checkpoint, []
    if ccfg.archive_url:
        from kiln.state.archive import Archive
        from kiln.state.archiver import Archiver

        policies.append(Archiver(Archive(ccfg.archive_url, run_dir.name), run_dir, ccfg, log))
    if ccfg.keep_best:
        policies.append(KeepBest(run_dir))
    policies.append(KeepLast(run_dir, ccfg.keep_last, holders=list(policies), log=log))
    return policies


def _skipped_in(path: Path) -> list:
    """The skip list (kiln.train.rollback) of the checkpoint at `path` ([] if it has none or is unreadable)."""
    try:
        return json.loads((path / "state.json").read_text())["trainer"].get("skipped", [])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _verify_pending(state) -> bool:
    """Check a trainer's steps not yet checked for bad values (`Trainer.verify_pending`, set by
    kiln.train.rollback); True if a bad one rolled the state back. Parts dicts have none."""
    verify = getattr(state, "verify_pending", None)
    return bool(verify is not None and verify(state))


def _unlogged_over_ranks(trainer: dict[str, Any], group) -> dict[str, Any]:
    """The trainer's state (rank 0's, the one written) with its losses since the last log as each step's mean over
    the ranks, as the log averages them: a resume's first log is then the one an uninterrupted run writes, on any
    number of processes (rank 0's own losses alone gave another). Every rank has as many (one per step)."""
    unlogged = trainer.get("unlogged")
    if not unlogged:
        return trainer
    losses = torch.tensor(unlogged, dtype=torch.float64)
    dist.all_reduce(losses, group=group)
    return {**trainer, "unlogged": (losses / dist.get_world_size(group)).tolist()}


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: RunConfig, fingerprints: dict[str, Any],
                 log: Callable[[str], None] = print, policies: list[CheckpointPolicy] | None = None):
        self.run_dir, self.cfg, self.ccfg = Path(run_dir), cfg, cfg.checkpoint
        self.dir = self.run_dir / CHECKPOINTS
        self.fingerprints, self.log = fingerprints, log
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # checkpoint collectives run on their own gloo group, so a background save never interleaves
        # with the training collectives of the default (NCCL) group
        # with the run's collective timeout (torch's default for a new group is 30 minutes)
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        # and the main thread's small collectives (did any rank get a signal?) on another, since a
        # background save may be running collectives on `group` at the same moment
        self.control_group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-checkpoint")
        self._pending: tuple[int, Future] | None = None
        self._stager: staging.CpuStaging | None = None  # CPU buffers (pinned on CUDA), kept for the run
        self._stager_ready: Future | None = None
        self.staged: dict[str, Any] | None = None  # the CPU copy of the last async save
        self.snapshots = MemorySnapshots(log)
        self.last_saved_step: int | None = None
        self.room_hooks: list[Callable[[int, int, int], None]] = []  # (step, free, needed) after each room check
        self.completed: list[dict[str, Any]] = []  # saves complete since the last `take_completed` (rank 0)
        self._warned_slow = self._closed = False
        if self.rank != 0:
            policies = []
        else:
            _check_writable(self.dir)
        self.policies = default_policies(self.run_dir, cfg, log) if policies is None else list(policies)

    # ------------------------------------------------------------------ save

    def warm_up(self, state) -> None:
        """Allocate the pinned CPU buffers of the state in the background, so the first save only copies.

        Call after the first optimizer step (the optimizer's state exists then); a no-op off CUDA.
        """
        parts = as_parts(state)
        if self._stager is not None or parts["trainer"].state_dict()["step"] == 0 or not staging.on_cuda():
            return
        self._stager = staging.CpuStaging()
        tensors = {k: parts[k].state_dict() for k in TENSOR_KEYS}
        self._stager_ready = self._pool.submit(self._stager.allocate, tensors)

    def wait_warm_up(self) -> None:
        """Block until the buffers `warm_up` allocates are ready (for measurements)."""
        if self._stager_ready is not None:
            self._stager_ready.result()

    def _rank0_check(self, check: Callable[[], Any]) -> None:
        """Run `check` on rank 0; the StateError it raises is raised on every rank."""
        problem = None
        if self.rank == 0:
            try:
                check()
            except StateError as e:
                problem = str(e)
        if self.distributed:
            problem = from_rank0(problem, self.control_group)
        if problem:
            raise StateError(problem)

    def _check_room(self, step: int, tensors: dict[str, Any]) -> None:
        def check() -> None:
            free, needed = check_room(self.run_dir, lambda: staging.tensor_bytes(tensors), step, self.policies,
                                      self.log)
            for hook in self.room_hooks:  # the resource monitor's disk warning (kiln.monitor.resources)
                hook(step, free, needed)

        self._rank0_check(check)

    def save(self, state, reason: str = "periodic", blocking: bool | None = None) -> Path | None:
        """Checkpoint `state` (a Trainer, or a dict of parts) at its step. Returns where it will be complete.

        Nothing is saved before the first step: a fresh start is that state, and capturing the
        optimizer's state before it exists would create it (and change the run). A trainer's steps not yet
        checked for bad values (kiln.train.rollback) are checked first: a bad one rolls the state back to its
        snapshot, and that state, with the bad step's samples on its skip list, is what is saved. A checkpoint
        of the same step is kept, unless its skip list differs (a rollback to its step since): it is replaced.
        """
        t0 = time.perf_counter()
        self.wait()  # one save at a time; raises an earlier background failure
        _verify_pending(state)
        parts = as_parts(state)
        step = int(parts["trainer"].state_dict()["step"])
        waited = time.perf_counter() - t0
        if waited > 1.0 and not self._warned_slow and reason == "periodic":
            self._warned_slow = True
            self.log(f"training waited {waited:.1f} s at step {step} for the previous checkpoint to finish "
                     f"writing; raise checkpoint.every (now {self.ccfg.every}) or use a faster disk")
        if step == 0:
            return None
        target = self.dir / step_dir_name(step)
        replace = target.is_dir() and _skipped_in(target) != parts["trainer"].state_dict().get("skipped", [])
        if self.last_saved_step == step and target.is_dir() and not replace:
            return target
        blocking = (not self.ccfg.async_save) if blocking is None else blocking
        tensors = {k: parts[k].state_dict() for k in TENSOR_KEYS}
        self._check_room(step, tensors)
        small = staging.json_copy({**{k: parts[k].state_dict() for k in SMALL_KEYS},
                                   "fingerprints": self.fingerprints, "reason": reason})
        if self.group is not None:  # no save is in flight on the group here (waited for above)
            small["trainer"] = _unlogged_over_ranks(small["trainer"], self.group)
        rng = staging.json_copy({k: parts[k].state_dict() for k in RANK_KEYS})
        tmp = self.dir / f"{TMP_PREFIX}{target.name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                self._failed(e, step, tmp)
        self._barrier()
        writer = hashing_writer(tmp, self.ccfg.write_threads, self.ccfg.fsync)
        self.last_saved_step = step
        t0 = time.perf_counter()
        if not self.ccfg.async_save:  # sync-only runs write straight from the live tensors: no CPU copy
            self._finish(tensors, writer, tmp, target, small, rng, t0, replace)
            return target
        if self._stager_ready is not None:
            ready, self._stager_ready = self._stager_ready, None
            try:
                ready.result()
            except RuntimeError as e:
                self.log(f"allocating pinned checkpoint buffers failed ({e}); trying again at this save")
        self._stager = self._stager or staging.CpuStaging()
        try:
            self._stager, self.staged = staging.stage(self._stager, tensors, self.log)
        except BaseException as e:
            self._failed(e, step, tmp)
        # The staged copy is written by dcp.save in this checkpointer's own thread, not by dcp.async_save:
        # measured at 1B (H100 and H200, same call), async_save held the loop 0.02 s longer (0.28 against
        # 0.26 s) for the planning it does before returning; the files and their guarantees are the same.
        self._pending = (step, self._pool.submit(self._finish, self.staged, writer, tmp, target, small, rng, t0,
                                                     replace))
        if blocking:
            self.wait()
        return target

    def take_completed(self) -> list[dict[str, Any]]:
        """The saves completed since the last call, oldest first ({step, path, reason, bytes, seconds}; rank 0's
        list, the others' stay empty): kiln.state.callback tells the run's log of each."""
        done, self.completed = self.completed, []
        return done

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
        """Wait for the last save, stop the background thread, and let the policies finish."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            for policy in self.policies:
                try:
                    policy.close()
                except Exception as e:  # noqa: BLE001 - the checkpoints are complete; report and go on
                    self.log(f"closing {type(policy).__name__} failed: {e}")
            self._stager = self.staged = None

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _failed(self, e: BaseException, step: int, tmp: Path) -> None:
        """Remove the unfinished save and raise `e` as a StateError that says what helps."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KilnError):
            raise e
        os_err = _errno_of(e)
        latest = checkpoints(self.run_dir)
        intact = f"Earlier checkpoints are intact (latest: {latest[-1]})." if latest else \
            "No earlier checkpoint exists."
        if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StateError(f"disk full while writing the checkpoint of step {step} to {self.dir} "
                             f"({os_err.strerror}). {intact} The disk had room for the checkpoint's expected size when "
                             "the save began: another program wrote to it during the save, or the checkpoint grew "
                             "past that size. Free space there or move the run directory to a larger disk "
                             "(train.run_dir), then resume.") from None
        if os_err is not None:
            raise StateError(f"writing the checkpoint of step {step} to {self.dir} failed: {os_err}. "
                             f"{intact}") from None
        raise e

    def _finish(self, tensors: dict[str, Any], writer, tmp: Path, final: Path,
                small: dict[str, Any], rng: dict[str, Any], t0: float, replace: bool = False) -> Path:
        """Every rank: the DCP files (written here from `tensors`), then the JSON parts;
        rank 0 then completes the checkpoint (`replace`: one of the same step already there)."""
        step = small["trainer"]["step"]
        try:
            dcp.save(tensors, storage_writer=writer, process_group=self.group, no_dist=not self.distributed)
            error = writer.fs.error
            if error is None:
                try:
                    write_json(tmp / f"rank{self.rank}.json", rng, fsync=self.ccfg.fsync)
                    if self.rank == 0:
                        write_json(tmp / "state.json", small, fsync=self.ccfg.fsync)
                except OSError as e:
                    error = e
            report = {"digests": dict(writer.fs.digests), "error": error}
            if self.group is not None:  # every rank's digests and failure, to rank 0, and its verdict back
                gathered = [None] * dist.get_world_size() if self.rank == 0 else None
                dist.gather_object(report, gathered, dst=0, group=self.group)
                verdict = [None]
                if self.rank == 0:
                    errors = [r["error"] for r in gathered if r["error"] is not None]
                    report = {"digests": {k: v for r in gathered for k, v in r["digests"].items()},
                              "error": errors[0] if errors else None}
                    verdict = [report["error"]]
                dist.broadcast_object_list(verdict, src=0, group=self.group)
                error = verdict[0]
            if error is not None:
                raise error
            if self.rank == 0:
                self._complete(tmp, final, small, time.perf_counter() - t0, report["digests"], replace)
            self._barrier()
        except BaseException as e:
            self._failed(e, step, tmp)
        return final

    def _complete(self, tmp: Path, final: Path, small: dict[str, Any], seconds: float,
                  digests: dict[str, dict[str, Any]], replace: bool = False) -> None:
        """Rank 0, after every rank wrote: hash the rest, write meta.json + digest, rename, run the policies."""
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
            "stop_reason": small["trainer"].get("stop_reason"),
            "world_size": dist.get_world_size() if self.distributed else 1,
            "versions": {"kiln": __version__, "torch": torch.__version__},
            "fingerprints": small["fingerprints"], "config": self.cfg.model_dump(mode="json"),
            "bytes": sum(f["bytes"] for f in files.values()), "files": files,
        }
        write_meta(tmp, meta, fsync=self.ccfg.fsync)
        if final.exists() and not replace:  # the same step saved before (e.g. resumed then stopped at once): keep it
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if final.exists():  # a rollback to this step: the new state has the bad step's samples on its skip list
            old = final.with_name(f"{TMP_PREFIX}replaced-{final.name}")  # tidied by a resume if a kill comes now
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.dir)
        self.completed.append({"step": step, "path": str(final), "reason": meta["reason"], "bytes": meta["bytes"],
                               "seconds": round(seconds + hashing, 3)})
        for policy in self.policies:
            try:
                policy.after_save(final, meta)
            except Exception as e:  # noqa: BLE001 - the checkpoint is complete; a policy's trouble is reported
                self.log(f"{type(policy).__name__} after the checkpoint of step {step} failed: {e}")

    # ------------------------------------------------------------------ restore

    def load(self, state, path: str | Path, check_hashes: bool = True,
             keys: tuple[str, ...] = KEYS) -> dict[str, Any]:
        """Restore `state` (a Trainer, or a dict of parts) from a complete checkpoint, its hashes checked
        first; `keys`: only these parts (the model of a finished run needs no optimizer). Returns its meta.json."""
        path, parts = Path(path), as_parts(state)
        if check_hashes:  # rank 0 re-hashes; StateError naming the damaged file and the previous good one
            self._rank0_check(lambda: verified(path))
        meta = read_meta(path)
        tensors = {k: parts[k].state_dict() for k in TENSOR_KEYS if k in keys}  # the live layout DCP reads into
        reader = ParallelFileSystemReader(path, self.ccfg.write_threads)
        try:
            reader.read_metadata()  # a refused or damaged .metadata says so (kiln.state.dcp_read), not DCP's wrap
            dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self.group,
                     no_dist=not self.distributed)
            for key in tensors:
                parts[key].load_state_dict(tensors[key])
        except StateError:
            raise
        except (Exception, dcp.CheckpointException) as e:
            if isinstance(_innermost(e), StateError):  # a crafted value refused by SafeLoadPlanner
                raise _innermost(e) from None
            why = _errno_of(e) or _innermost(e)
            raise StateError(f"checkpoint {path} does not fit this model and optimizer: {why}. Resume with the "
                             "model settings it was saved with (see `kiln inspect`).") from None
        try:
            small = json.loads((path / "state.json").read_text())
            rank_file = path / f"rank{self.rank}.json"
            ranked = json.loads(rank_file.read_text()) if rank_file.is_file() else None
        except (OSError, ValueError) as e:
            raise StateError(f"checkpoint {path} has an unreadable state.json or rank file: {e}") from None
        for key in (k for k in SMALL_KEYS if k in keys):
            parts[key].load_state_dict(small[key])
        rank_keys = [k for k in RANK_KEYS if k in keys]
        if rank_keys and ranked is None:
            self.log(f"checkpoint {path} was saved by {meta['world_size']} process(es); process {self.rank} "
                     "has no saved random state and keeps its seeded one")
        for key in rank_keys if ranked is not None else ():
            parts[key].load_state_dict(ranked[key])
        self.last_saved_step = int(parts["trainer"].state_dict()["step"])
        return meta

    # ------------------------------------------------------------------ in-memory tier (snapshot.py)

    @property
    def snapshot(self) -> Snapshot | None:
        return self.snapshots.snapshot

    def take_snapshot(self, state) -> Snapshot:
        """Copy the whole state into CPU memory (buffers reused between snapshots); a trainer's steps not yet
        checked for bad values are checked first (kiln.train.rollback), so a snapshot only holds checked state."""
        _verify_pending(state)
        return self.snapshots.take(state)

    def restore_snapshot(self, state) -> int:
        """Roll `state` back to the last snapshot. Returns its step."""
        return self.snapshots.restore(state)


def _check_writable(directory: Path) -> None:
    """StateError before any training when `directory` (the run's checkpoints/) cannot take a checkpoint: found at
    the first save, it would lose the steps trained until then."""
    where = next(p for p in (directory, *directory.parents) if p.exists())  # the first one a save would write in
    if directory.exists() and not directory.is_dir():
        reason = "a file of that name is in the way"
    elif not os.access(where, os.W_OK | os.X_OK):
        reason = f"{where} is not writable"
    else:
        return
    raise StateError(f"cannot keep checkpoints in {directory}: {reason}. Move or rename what is there (or fix its "
                     "permissions), then run the same command again; nothing has been trained yet.")
