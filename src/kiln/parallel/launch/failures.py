"""What kiln's torchrun does the moment it finds a worker failed, before it stops the others (torchrun stops them
within its poll of the processes, before its agent hears of the failure): `first_words`.

- It notes for the other workers how the failed one ended (kiln.parallel.peers.note_failure): they then say
  "rank 1 was killed by SIGKILL" as they stop, instead of taking torchrun's SIGTERM for a preemption (and
  promising a checkpoint that cannot come without that rank) or printing their broken collective's traceback.
- A worker killed by a signal prints nothing itself: it is said at once, naming the rank, its pid and the signal.
- A worker that is stopped (SIGSTOP, Ctrl-Z) cannot act on torchrun's SIGTERM: it is killed at once, instead of
  torchrun waiting its whole shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 120 s under kiln) for it.

The note is dropped as torchrun starts the workers again (--max-restarts: `forget_failures`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from kiln.parallel.launch.agent import HUNG, SHOWN, ended, wrap_agent


def first_words(failures: dict, running: dict[int, int], note: str | None = None) -> None:
    """As torchrun sees a worker fail (`failures`: rank -> torchrun's ProcessFailure), before it stops the others
    (`running`: rank -> pid): note for them how it ended (kiln.parallel.peers: they say so, instead of taking
    torchrun's SIGTERM for a preemption and a broken collective for an error of their own); say it at once if the
    worker was killed (no line of its own says so); and kill the workers that are stopped (SIGSTOP): they cannot
    stop by themselves, and torchrun would wait its whole shutdown timeout for them."""
    from kiln.parallel.peers import note_failure, process_state

    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    data = failure.error_file_data or {}
    if data.get(SHOWN):
        hung = data.get(HUNG, -1)
        what = (f"{'the store' if hung is None else f'rank {hung}'} hung (rank {rank}'s report says so)"
                if HUNG in data else f"rank {rank} failed (its error is printed)")
    else:
        what = ended(rank, failure)
        if failure.exitcode < 0:
            print(f"kiln: {what}; the other ranks are stopped", file=sys.stderr, flush=True)
    note_failure(what, rank, note)
    for other, pid in sorted(running.items()):
        if other not in failures and process_state(pid) == "T":
            print(f"kiln: rank {other} (pid {pid}) is stopped (SIGSTOP or SIGTSTP): killed with SIGKILL, as a stopped "
                  "process cannot stop by itself", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def say_failures_at_once(context_class=None) -> None:
    """Call `first_words` the moment torchrun finds a worker failed, before it stops the others (it does so
    within its poll of the processes, before its agent hears of it)."""
    if context_class is None:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext as context_class

    def wrap(capture):
        def _capture_process_failures(self, done_local_ranks):
            result = capture(self, done_local_ranks)
            failures = getattr(self, "_failures", None)
            if failures and not getattr(self, "_kiln_said", False):
                self._kiln_said = True
                ranks = {lr: int(self.envs[lr].get("RANK", lr)) for lr in self.envs}
                running = {ranks[lr]: h.proc.pid for lr, h in self.subprocess_handlers.items() if lr not in failures}
                first_words({ranks[lr]: f for lr, f in failures.items()}, running)
            return result
        return _capture_process_failures

    wrap_agent(context_class, "_capture_process_failures", wrap)


def forget_failures(agent_class=None) -> None:
    """The note of a failure (`first_words`) is dropped as torchrun starts the workers again (--max-restarts)."""
    from kiln.parallel.peers import FAILED_NOTE

    def wrap(initialize):
        def _initialize_workers(self, worker_group):
            with contextlib.suppress(OSError):
                os.remove(os.environ.get(FAILED_NOTE) or "")
            return initialize(self, worker_group)
        return _initialize_workers

    wrap_agent(agent_class, "_initialize_workers", wrap)
