"""torchrun as `kiln train --nproc N` runs it, and what a kiln process tells torchrun when it fails.

    python -m kiln.parallel.launch.torchrun --standalone --nproc_per_node=2 -m kiln.cli train CONFIG

is torchrun (`torch.distributed.run`, same arguments, same process) except at the end of a failed job:
torchrun prints its own traceback and a summary in which every rank's error reads "To enable traceback
see ...", well below the error the failing rank printed. Here a failure whose rank already printed its
error (a `KilnError`: it wrote `record_error`'s file) ends with one line naming that rank; any other
failure (a bug's traceback, a signal) with torchrun's summary, without torchrun's traceback. The exit
code is the failing rank's (2 for a config error, as `kiln train` in one process), else 1. Torchrun's log
lines that kiln's own lines repeat (the signal passed to each worker) are dropped (`quiet_torch_notes`).

A signal (SIGTERM from a scheduler, Ctrl-C, SIGHUP unless ignored as under nohup) makes torchrun pass it
to every worker, wait for them to write their checkpoint and exit, then raise its SignalException: here that
ends the job with one line and exit code 128 + the signal's number, instead of torchrun's traceback. A signal
delivered twice at once (to the whole process group, and again by `kiln train --nproc`, which forwards it; or
a closed terminal's SIGHUP and the SIGTERM of the launcher's death) is taken once (`stop_once`):
torchrun would break off its wait for the workers and send each the signal again, which a kiln worker takes
as "abort now, without a checkpoint". A second signal later still aborts, as a second Ctrl-C should.

`record_error` writes the message to the error file torchrun gives each worker (TORCHELASTIC_ERROR_FILE),
so under a plain `torchrun` too the summary's root cause shows the message instead of the link.

A process of the job outlives its parent only by mistake: `stop_with_parent` has the kernel send it SIGTERM
when the process that started it dies (torchrun when `kiln train --nproc` is killed with SIGKILL; the workers
when torchrun is). Torchrun then stops its workers as on a scheduler's SIGTERM, and workers whose torchrun is
gone write their checkpoint together and stop, instead of training on, holding their GPUs, beside the job
that is started again in the same run directory.

On several nodes, a signal may reach one node's torchrun alone (a scheduler preempting that node). Its
workers tell the others (kiln.state.preempt), all write one checkpoint together and exit; the other nodes'
torchrun see their workers finish and wait in torchrun's exit barrier for every node's torchrun, which the
signalled one, raising its SignalException, never joined: they waited 300 s (torch's exit barrier timeout).
`exit_barrier_on_signal` has the signalled torchrun join the barrier after its workers stopped, so every
node ends with them. A node lost (its torchrun killed with SIGKILL; its workers, sent SIGTERM by
`stop_with_parent`, write the checkpoint with the others) never joins: workers that stopped on a signal say so
(`record_stop`), and their torchrun then waits SIGNALLED_BARRIER_S at most (`short_exit_barrier_after_a_stop`)
and says why it stops waiting. A job that finished keeps torchrun's barrier (rank 0 may still write model/).
After a stop on a signal no torchrun closes the rendezvous (`quiet_rendezvous_shutdown`): the store may be gone
with the signalled node.
A node that loses the rendezvous store (the torchrun serving it is gone) stops its workers and says so in a
few lines (`lost_store`), instead of torch's traceback.

A config error is the same in every process: only the first process of each node prints it. The others
(`wait_for_first_rank`) wait to be stopped by torchrun, which stops them when that first process exits
with its error: leaving first, they would have torchrun stop it, perhaps before it printed anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import time

from kiln.parallel.launch.agent import HUNG, SHOWN, ended, wrap_agent

EXIT_CODE = "kiln_exit_code"  # key of the error file: the exit code of the process that printed it
DUPLICATE_S = 1.0  # a signal this soon after the same one is the same event delivered twice
STOPPED = "KILN_STOPPED_FILE"  # environment: where a worker that stopped on a signal writes the signal's name
SAVED = "KILN_SAVED_FILE"  # environment: where each worker notes that it has written all it was to (record_saved)
PARENT_PID = "KILN_PARENT_PID"  # environment: the pid of the process that started this one (stop_with_parent)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
SIGNALLED_BARRIER_S = 30.0  # how long a signalled torchrun waits in the exit barrier for the other nodes' ones
QUIET_WAIT_S = 60.0  # how long a quiet process waits for torchrun to stop it (the first process failed alike)
SHUTDOWN_TIMEOUT_S = 120  # seconds torchrun gives its workers between SIGTERM and SIGKILL
# What torchrun needs in its environment for kiln, wherever it is started (here, and in the Kubernetes and
# Slurm launch files); each is a default that the environment may override:
TORCHRUN_ENV = {
    # time for the preemption checkpoint: torchrun passes SIGTERM to the workers, then kills them after this
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S),
    # a restarted job needs a fresh key-value store: in the one torchrun shares across restarts, the new
    # processes read the dead ones' addresses and gloo's first connection fails (torch 2.13)
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


def stop_with_parent() -> bool:
    """Have this process sent SIGTERM when its parent dies (Linux; elsewhere nothing happens). If the parent
    named by PARENT_PID has died already, the signal comes now. Returns whether it is set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.environ.get(PARENT_PID, "")
    if parent.isdigit() and os.getppid() != int(parent):  # died before prctl: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def missing_env(env=os.environ) -> str | None:
    """What a torchrun started by hand lacks of TORCHRUN_ENV, and what that costs, in a
    line for rank 0 to print (None when nothing that matters is missing)."""
    why = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "on SIGTERM torchrun gives the workers 30 s to write their checkpoint, "
                                             "then kills them",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "a restart by torchrun may fail to connect (it reuses the store "
                                                 "of the processes that died)"}
    if env.get("TORCHELASTIC_MAX_RESTARTS", "0") in ("", "0"):
        why.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    unset = [k for k in why if k not in env]
    if not unset:
        return None
    return (f"torchrun was started without {' '.join(f'{k}={TORCHRUN_ENV[k]}' for k in unset)} in its environment: "
            f"{'; '.join(why[k] for k in unset)}. Export {'it' if len(unset) == 1 else 'them'} before torchrun "
            "(kiln train --nproc and kiln launch do)")


def wait_for_first_rank(seconds: float = QUIET_WAIT_S) -> None:
    """Wait (SIGTERM's default action ends it) while the node's first process prints the error all share."""
    time.sleep(seconds)


def record_error(message: str, exit_code: int = 2, culprit: int | None = None) -> None:
    """Tell torchrun (if it started this process) why it fails: its summary shows `message`, and the job
    ends with `exit_code` (this process's, which torchrun may not see: a peer's exit can have it stopped).
    `culprit`: the rank the watchdog found hung, which the job's last line names (this rank reported it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": message, "timestamp": int(time.time()), SHOWN: True, EXIT_CODE: exit_code}
    if culprit is not None:
        data[HUNG] = culprit
    # an unwritable file only makes torchrun's summary say less: the error itself is printed already
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)


def summary(error) -> tuple[str, int]:
    """What to print at the end of a failed job (`error`: torchrun's ChildFailedError), and the exit code.

    The rank that printed its error is the cause, though another may have exited first (one stopping for
    it, after which torchrun stopped the rest, the failed rank among them, perhaps before it exited)."""
    shown = [(f.timestamp, r) for r, f in error.failures.items() if f.error_file_data.get(SHOWN)]
    if shown:
        rank = min(shown)[1]
        failure = error.failures[rank]
        code = failure.error_file_data.get(EXIT_CODE) or (failure.exitcode if failure.exitcode > 0 else 1)
        if HUNG in failure.error_file_data:
            hung = failure.error_file_data[HUNG]
            return (f"kiln: the job stopped: {'the store' if hung is None else f'rank {hung}'} hung (exit code "
                    f"{code}); rank {rank}'s report is above"), code
        return f"kiln: the job stopped: rank {rank} failed (exit code {code}); its error is above", code
    killed = [(f.timestamp, r) for r, f in error.failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    if killed:  # a worker killed by a signal (not torchrun's SIGTERM to the others)
        rank = min(killed)[1]
        return f"kiln: the job stopped: {ended(rank, error.failures[rank])}", 128 - error.failures[rank].exitcode
    rank, failure = error.get_first_failure()
    return error.format_msg(), failure.exitcode if failure.exitcode > 0 else 1



def stop_once(handler, clock=time.monotonic):
    """torchrun's signal handler (`handler`), less the copies of its first signal: that one raises
    SignalException, which makes torchrun pass it to the workers and wait for them; a signal again within
    DUPLICATE_S (one event delivered twice: to the process group and by the launcher that forwards it, or a
    closed terminal's SIGHUP and the SIGTERM of the launcher's death) is ignored. A later one is a second
    request: torchrun passes it on, and the workers abort."""
    first: list[tuple[int, float]] = []

    def handle(signum: int, frame) -> None:
        if first and clock() - first[0][1] < DUPLICATE_S:
            return
        if not first:
            first.append((signum, clock()))
        handler(signum, frame)

    return handle


def no_restart_after_kiln_errors(agent_class=None) -> None:
    """Under --max-restarts, a job whose rank failed with an error it printed (a KilnError: a config, data or
    state error, or a disk that is full, is the same at every start) is not restarted: each start ended with it
    again. Other failures (a killed process, a bug's traceback, a hang) are restarted as before."""
    def wrap(monitor):
        def _monitor_workers(self, worker_group):
            result = monitor(self, worker_group)
            shown = [r for r, f in (result.failures or {}).items() if f.error_file_data.get(SHOWN)]
            if shown and getattr(self, "_remaining_restarts", 0) > 0:
                self._remaining_restarts = 0
                print(f"kiln: not restarting the job: rank {min(shown)}'s error is one a restart would meet again",
                      file=sys.stderr, flush=True)
            return result
        return _monitor_workers

    wrap_agent(agent_class, "_monitor_workers", wrap)



def exit_barrier_on_signal(agent_class=None) -> None:
    """A torchrun stopped by a signal joins the exit barrier after its workers stopped (see the module's
    docstring), waiting at most SIGNALLED_BARRIER_S there: if it serves the rendezvous store, the others
    still need it to pass the barrier. A node with no peer there (all signalled at once) passes at once."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def wrap(run):
        def run_joining_the_exit_barrier(self, *args, **kwargs):
            try:
                return run(self, *args, **kwargs)
            except SignalException:
                join_exit_barrier(self)
                raise
        return run_joining_the_exit_barrier

    wrap_agent(agent_class, "run", wrap)


def join_exit_barrier(agent, timeout_s: float | None = None) -> bool:
    """Join torchrun's exit barrier of `agent` (torchrun's SimpleElasticAgent, private attributes: absent, as
    torchrun does), waiting at most `timeout_s` (None: SIGNALLED_BARRIER_S) for the other agents; returns whether
    all came."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store as store_util

    group = getattr(agent, "_worker_group", None)
    store, size = getattr(agent, "_store", None), getattr(group, "group_world_size", None)
    prefix = getattr(api, "_TERMINAL_STATE_SYNC_ID", None)
    if store is None or not size or size < 2 or prefix is None:  # not past the rendezvous, or one node
        return False
    try:
        store_util.barrier(store=store, world_size=size, key_prefix=prefix,
                           barrier_timeout=timeout_s or SIGNALLED_BARRIER_S)
    except Exception:  # a second signal, a peer gone, a store gone with its host: leave, as torchrun would
        return False
    return True


def record_stop(signame: str) -> None:
    """Tell this node's torchrun (if kiln's started this process) that the job stopped on `signame`: it ends
    without waiting 300 s for a node that may be gone (`short_exit_barrier_after_a_stop`)."""
    path = os.environ.get(STOPPED)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(signame)


def record_saved() -> None:
    """Tell this node's torchrun (if kiln's started this process) that this worker has written all it was to write
    (kiln.state.after_save): a signal as the job ends then loses nothing, and the job exits 0 (`all_saved`)."""
    path = os.environ.get(SAVED)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(f"{os.environ.get('LOCAL_RANK', 0)} {os.environ.get('LOCAL_WORLD_SIZE', 1)}\n")


def all_saved() -> bool:
    """Whether every worker of this node said it has written all it was to write (`record_saved`)."""
    with contextlib.suppress(OSError, ValueError), open(os.environ.get(SAVED) or os.devnull) as f:
        noted = [tuple(int(v) for v in line.split()) for line in f if line.strip()]
        sizes = {size for _, size in noted}
        return len(sizes) == 1 and {rank for rank, _ in noted} == set(range(sizes.pop()))
    return False


def stop_signal() -> str:
    """The signal this node's workers stopped on (`record_stop`), or ""."""
    with contextlib.suppress(OSError), open(os.environ.get(STOPPED) or os.devnull) as f:
        return f.read().strip()
    return ""


def short_exit_barrier_after_a_stop(agent_class=None) -> None:
    """torchrun's exit barrier, at most SIGNALLED_BARRIER_S long when this node's workers stopped on a signal
    (`record_stop`): the nodes still there all come at once, and a lost one would never come."""
    def wrap(barrier):
        def _exit_barrier(self):
            signame = stop_signal()
            nodes = getattr(getattr(self, "_worker_group", None), "group_world_size", None) or 1
            if not signame or nodes < 2:  # a finished job (rank 0 may still write model/), or no other node
                return barrier(self)
            if not join_exit_barrier(self):
                print(f"kiln: the job stopped on {signame} and this node's workers have written their part of the "
                      f"checkpoint; the torchrun of another node did not stop within {SIGNALLED_BARRIER_S:g} s "
                      "(a node lost?), so this one stops without it", file=sys.stderr, flush=True)
        return _exit_barrier

    wrap_agent(agent_class, "_exit_barrier", wrap)


def quiet_rendezvous_shutdown(handler_class=None) -> None:
    """A torchrun whose workers stopped on a signal (`record_stop`) does not close the rendezvous at its end. Its
    store may be served by the signalled node's torchrun, which exits once the nodes leave the exit barrier: the
    close raced that exit and, losing, printed torch's warning with 30 lines of C++ frames after the job had ended
    well. The close only turns away nodes that come late; a stopped job is started again with a new store. After
    a finished job, torchrun closes it as it does."""
    if handler_class is None:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as handler_class

    def wrap(shutdown):
        def shutdown_unless_stopped(self):
            if not stop_signal():
                return shutdown(self)
            getattr(self, "_stop_heartbeats", lambda: None)()  # what shutdown does before the close
            return False
        return shutdown_unless_stopped

    wrap_agent(handler_class, "shutdown", wrap)


# torchrun's log lines (by logger) that kiln's own lines already say: each worker says the signal as it stops, and
# the job's last line names the signal or the failed rank
TORCH_NOTES = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
}


def quiet_torch_notes() -> None:
    """Drop TORCH_NOTES from torchrun's log (its other lines, errors included, stay)."""
    from kiln.streams import drop_log_lines

    for name, text in TORCH_NOTES.items():
        drop_log_lines(name, text)


def lost_store(endpoint: str) -> str:
    """What to say when this node's torchrun loses the job's rendezvous store at `endpoint` mid-job."""
    return (f"kiln: this node lost the job's rendezvous store at {endpoint or 'the rendezvous endpoint'}: the torchrun "
            "serving it (on the node whose address that is, or the first to reach it) stopped or cannot be reached "
            "(a node lost?). This node's workers were sent SIGTERM: they write a checkpoint if the workers of every "
            "node still can, else the last complete one is kept. Start torchrun on every node again to resume")


def port_in_use(error: BaseException) -> bool:
    """Whether `error` (or an error it came from) is a port another program holds (EADDRINUSE)."""
    while error is not None:
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def busy_port(args) -> str:
    """What to say when the port torchrun serves its store on (`args`: torchrun's) is taken."""
    endpoint = args.rdzv_endpoint or f"{args.master_addr or '127.0.0.1'}:{args.master_port}"
    return (f"kiln: torchrun cannot serve the job's store at {endpoint}: the port is in use (another job, or one "
            "still shutting down). Choose a free port (--master_port, or --rdzv_endpoint HOST:PORT), or use "
            "--standalone (or `kiln train --nproc N`), which picks one")


def refuse_pause() -> None:
    """Ctrl-Z (SIGTSTP) does not stop torchrun: its workers run in sessions of their own, out of the terminal's
    reach, and would train on while torchrun, stopped, could neither watch nor stop them. Pausing the workers too
    is no better: a collective waiting past its timeout ends the job when it goes on. Say so, and go on."""
    def said(signum, frame):
        print("kiln: Ctrl-Z does not pause a job of several processes (its collectives would time out); it goes "
              "on. Ctrl-C stops it with a checkpoint to resume from.", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTSTP, said)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import parse_args, run

    from kiln.parallel.launch.failures import forget_failures, say_failures_at_once
    from kiln.parallel.peers import FAILED_NOTE
    from kiln.streams import keep_writing

    keep_writing()  # its last line to a closed pipe (`| tee` under Ctrl-C) is not a traceback
    # torchrun installs this module attribute as its handler when it starts the workers
    api._terminate_process_handler = stop_once(api._terminate_process_handler)
    no_restart_after_kiln_errors()
    say_failures_at_once()
    forget_failures()
    exit_barrier_on_signal()
    short_exit_barrier_after_a_stop()
    quiet_rendezvous_shutdown()
    quiet_torch_notes()
    stop_with_parent()
    refuse_pause()
    os.environ[PARENT_PID] = str(os.getpid())  # the workers stop when this process dies
    stopped = os.path.join(tempfile.gettempdir(), f"kiln-torchrun-{os.getpid()}.stopped")
    failed = os.path.join(tempfile.gettempdir(), f"kiln-torchrun-{os.getpid()}.failed")
    saved = os.path.join(tempfile.gettempdir(), f"kiln-torchrun-{os.getpid()}.saved")
    for path in (stopped, failed, saved):
        with contextlib.suppress(OSError):
            os.remove(path)
    os.environ[STOPPED], os.environ[FAILED_NOTE], os.environ[SAVED] = stopped, failed, saved
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # under nohup: torchrun would stop the job on a hangup (torch before 2.10 has no --signals-to-handle to say so)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and hasattr(args, "signals_to_handle"):
        args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() != "SIGHUP")
    try:
        run(args)
    except ChildFailedError as e:
        text, code = summary(e)
        print(text, file=sys.stderr, flush=True)
        return code
    except api.SignalException as e:  # the workers had the signal and the time to stop; torchrun waited for them
        if all_saved():  # it came as the job ended, after each worker had written all it was to: nothing is lost
            print(f"kiln: {e.sigval.name} after the job was saved: nothing is lost", file=sys.stderr, flush=True)
            return 0
        print(f"kiln: the job stopped on {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except RendezvousConnectionError:  # torch's traceback and C++ frames said only "connection failed"
        print(lost_store(args.rdzv_endpoint), file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        if not port_in_use(e):
            raise
        print(busy_port(args), file=sys.stderr, flush=True)  # instead of torch's 40-line traceback
        return 1
    finally:
        for name, path in ((STOPPED, stopped), (FAILED_NOTE, failed), (SAVED, saved)):
            os.environ.pop(name, None)
            with contextlib.suppress(OSError):
                os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
