"""Preemption and crashes: stop at a step boundary with a checkpoint, never mid-step.

The first SIGTERM, SIGINT or SIGHUP asks the loop to stop: the current step finishes, a checkpoint is
written, and `kiln train` exits 0 saying how to resume. A second signal aborts at once (the last
complete checkpoint is still there). An unexpected exception writes an emergency checkpoint
when the trainer is between steps, then propagates.
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.parallel.launch.torchrun import DUPLICATE_S, record_stop


class Preempted(Exception):
    """Raised out of the loop after the preemption checkpoint is complete."""

    def __init__(self, signame: str, step: int, path: Path | None):
        super().__init__(f"stopped by {signame} after step {step}; checkpoint {path}")
        self.signame, self.step, self.path = signame, step, path


_stopped: list[str] = []  # the signal that stopped this process's last run after its checkpoint (train_guarded)


def stopped_by() -> str | None:
    """The name of the signal that stopped this process's last `train_guarded` run, its checkpoint written (None:
    it was not stopped). `kiln train` exits 128 + its number: the run is not finished, and a scheduler that
    restarts a job on a non-zero exit (Kubernetes' OnFailure, Kubeflow's exit codes 128-255) resumes it."""
    return _stopped[-1] if _stopped else None


class _Handler(abc.ABC):
    """SIGTERM, SIGINT and SIGHUP go to `on_signal` while the block runs (main thread only). A process forked
    meanwhile (tokenizer or loader workers) inherits the handler, and dies of the signal instead. SIGHUP (a
    closed terminal; torchrun passes on the one it gets) is left alone where it is ignored (under nohup)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __enter__(self):
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.__dict__.pop("_previous", {}).items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked process: not ours to handle
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.on_signal(signum, signal.Signals(signum).name)

    @abc.abstractmethod
    def on_signal(self, signum: int, name: str) -> None:
        """What a signal does while this handler is installed (each kind of handler says)."""


class SignalGuard(_Handler):
    """While active, the first SIGTERM/SIGINT/SIGHUP sets `requested`; a second one aborts the process."""

    COLLECTIVE_EVERY = 10  # most steps between two checks across processes
    CHECK_SECONDS = 1.0  # and fewer where steps are slow: about one check a second (torchrun's grace is 30 s)
    DUPLICATE_S = DUPLICATE_S  # with several processes, the same signal again this soon is one delivered twice

    def __init__(self, log: Callable[[str], None] = print, group=None):
        self.requested: str | None = None
        self.log, self.group = log, group
        self._next: int | None = None  # the step of the next check (None: the next multiple of COLLECTIVE_EVERY)
        self._last: tuple[int, float] | None = None  # step and time of the last check

    def on_signal(self, signum: int, name: str) -> None:
        if self.requested is None and self.group is not None:
            from kiln.parallel.peers import failed_note

            failed = failed_note()
            if failed:  # torchrun stops this worker because another ended: no checkpoint can be written without it
                print(f"rank {dist.get_rank()}: stopping, because {failed}; no checkpoint (each rank writes its part), "
                      "the last complete one is kept", file=sys.stderr, flush=True)
                self.__exit__()
                raise SystemExit(1)
        if self.requested is None:
            self.requested, self._first_at = name, time.monotonic()
            if self.group is None or dist.get_rank() == 0:  # every rank got it (torchrun passes it on): said once
                print(f"\n{name} received: finishing this step and writing a checkpoint (send it again to abort "
                      "now)", file=sys.stderr, flush=True)
            return
        if self.group is not None and time.monotonic() - self._first_at < self.DUPLICATE_S:
            return  # one event delivered twice: from the scheduler to every process, and passed on by torchrun
        print(f"\nsecond {name}: aborting without a checkpoint; the last complete checkpoint is kept",
              file=sys.stderr, flush=True)
        self.__exit__()
        signal.signal(signum, signal.SIG_DFL)  # die of the signal now, without waiting for a save in flight
        os.kill(os.getpid(), signum)

    def should_stop(self, step: int | None = None) -> str | None:
        """The signal's name if any process of the run got one (all processes agree on the step).

        With several processes the answer takes a collective, so it is asked at a step cadence (the
        same steps on every rank; None asks now): every `COLLECTIVE_EVERY`-th step at first, then every
        k-th, k chosen from the slowest rank's step time so that checks come about every `CHECK_SECONDS`
        (every step at 8B scale, every 10th for a small model): no barrier between the ranks' hosts in
        every fast step, and a stop well within a preemption's grace period when steps are slow."""
        if self.group is None:
            return self.requested
        if step is not None and (step % self.COLLECTIVE_EVERY if self._next is None else step < self._next):
            return None
        now = time.monotonic()
        per_step = 0.0
        if step is not None and self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
        signum = int(signal.Signals[self.requested]) if self.requested else 0  # its name, for ranks that got none
        flag = torch.tensor([float(signum), per_step], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        stop, slowest = flag.tolist()
        if step is not None:  # every rank derives the same cadence from the same reduced numbers
            every = self.COLLECTIVE_EVERY if slowest <= 0 else int(self.CHECK_SECONDS / slowest)
            self._next, self._last = step + max(1, min(self.COLLECTIVE_EVERY, every)), (step, now)
        return (self.requested or signal.Signals(int(stop)).name) if stop else None


def verify_first(trainer, log: Callable[[str], None]) -> bool:
    """Before an emergency checkpoint: check the trainer's steps not yet checked for bad values
    (kiln.train.rollback), so what is saved is checked; a bad one rolls the state back to its snapshot, which is
    then saved. False (save nothing) when they cannot be read, as after a device error."""
    verify = getattr(trainer, "verify_pending", None)
    if verify is None:
        return True
    try:
        verify(trainer)
    except Exception as e:  # noqa: BLE001 - the original error matters more; report this one beside it
        if getattr(e, "emergency", False):  # too many rollbacks: the last good state is restored, save it
            log(str(e))
            return True
        log(f"no emergency checkpoint: the steps since the last check for bad values could not be checked ({e}); "
            "resume from the last complete checkpoint")
        return False
    return True


def emergency_checkpoint(trainer, checkpointer, error: BaseException, log: Callable[[str], None]) -> Path | None:
    """After an unexpected error: checkpoint if the trainer is between steps, else say why not."""
    if checkpointer.distributed:
        from kiln.parallel.peers import broken_by_a_lost_peer

        if broken_by_a_lost_peer(error):  # a peer's process ended: this rank says so as it stops
            return None
        log("no emergency checkpoint in a multi-process run (the other processes may be stuck in a collective); "
            "resume from the last complete checkpoint")
        return None
    if not getattr(trainer, "consistent", False):
        log(f"no emergency checkpoint: the error ({type(error).__name__}) came in the middle of step "
            f"{trainer.step + 1}, so the state is half-updated; resume from the last complete checkpoint")
        return None
    if not verify_first(trainer, log):
        return None
    try:
        path = checkpointer.save(trainer, "emergency", blocking=True)
    except Exception as e:  # the original error matters more; report this one beside it
        log(f"the emergency checkpoint failed too: {e}")
        return None
    if path is None:  # step 0: nothing trained, a fresh start is that state (Checkpointer.save)
        log("no emergency checkpoint: no step was trained yet")
    else:
        log(f"emergency checkpoint of step {trainer.step} written to {path}")
    return path


def resume_command(run_dir: Path) -> str:
    """The command that resumes the run in `run_dir` on as many processes as this one has: `kiln train RUN_DIR`
    alone would resume a job of several on one process, which refuses its per-rank batch."""
    command = f"kiln train {run_dir}"
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world <= 1:
        return command
    from kiln.parallel.env import env_int

    if env_int("LOCAL_WORLD_SIZE", world) == world:
        return f"{command} --nproc {world}"
    return f"{command} under torchrun on every node, as this job was started"


def train_guarded(trainer, checkpointer, guard: SignalGuard | None, run_dir: Path,
                  log: Callable[[str], None]) -> dict[str, Any] | None:
    """`trainer.train()` with signal handling and emergency checkpoints. None when preempted."""
    from kiln.errors import KilnError

    _stopped.clear()
    try:
        with guard if guard is not None else contextlib.nullcontext():
            return trainer.train()
    except Preempted as p:
        _stopped.append(p.signame)
        checkpointer.close()
        if dist.is_available() and dist.is_initialized():  # this node's torchrun waits no longer for lost nodes
            record_stop(p.signame)
        saved = f"checkpoint {p.path} is complete" if p.path else "nothing to save before the first step"
        log(f"stopped by {p.signame} after step {p.step}; {saved}.\nResume with: {resume_command(run_dir)}")
        return None
    except KeyboardInterrupt:
        raise  # a second signal: abort now
    except Exception as e:
        # a KilnError is the user's to fix, unless it asks for the state first (out of memory, too many rollbacks)
        if guard is not None and (not isinstance(e, KilnError) or getattr(e, "emergency", False)):
            emergency_checkpoint(trainer, checkpointer, e, log)
        try:
            checkpointer.close()
        except Exception as e2:
            log(f"also, a background checkpoint failed: {e2}")
        raise
    finally:
        checkpointer.close()



class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the training loop (start-up, the final save). It unwinds like Ctrl-C, so
    `finally` blocks run and the run directory's lock is released; `kiln train` prints the message without
    a traceback and exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


class StopSignals(_Handler):
    """While active, SIGTERM, SIGINT and SIGHUP raise `Interrupted(signum, f"{name} {during}: {then}")`, whatever is
    running (set `during` and `then` as the work moves on). With `defer`, the first signal is only noted
    (`received`, with `deferred` printed if given) and the work goes on; a second one raises. In a process of several
    (torchrun), a signal within DUPLICATE_S of the first is its copy (to every process, and passed on by
    torchrun) and is ignored, also after the block is left: it neither aborts a deferred save nor kills the
    process, silently, as it unwinds."""

    def __init__(self, during: str, then: str, defer: bool = False, deferred: str = ""):
        self.during, self.then, self.defer, self.deferred = during, then, defer, deferred
        self.received: str | None = None
        self._first_at: float | None = None

    def __enter__(self):
        self._several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return super().__enter__()

    def on_signal(self, signum: int, name: str) -> None:
        now = time.monotonic()
        if self._several and self._first_at is not None and now - self._first_at < DUPLICATE_S:
            return
        self._first_at = self._first_at or now
        if self.defer and self.received is None:
            self.received = name
            if self.deferred:
                print(f"\n{name} received {self.during}: {self.deferred} (send it again to abort now)",
                      file=sys.stderr, flush=True)
            return
        previous = dict(self._previous)
        self.__exit__()  # a third signal while unwinding gets the default handling
        if self._several:  # the copy of this one may still come, after the block
            for sig in previous:
                signal.signal(sig, partial(_copy_or_previous, self._first_at, previous[sig]))
        raise Interrupted(signum, f"{'second ' if self.received else ''}{name} {self.during}: {self.then}")


def _copy_or_previous(first_at: float, previous, signum: int, frame) -> None:
    """A signal after a stop: ignored if it is the stop's copy (within DUPLICATE_S), else handled as before."""
    if time.monotonic() - first_at < DUPLICATE_S:
        return
    signal.signal(signum, previous)
    os.kill(os.getpid(), signum)
