"""kiln.parallel.launch.torchrun and the CLI under torchrun: a config error is printed by the first process of a
node alone (the others wait, quiet, for torchrun to stop them), recorded in torchrun's error file, and the
end of a failed job names the rank whose error is above instead of torchrun's traceback and summary."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from kiln import cli
from kiln.parallel.launch import torchrun
from kiln.parallel.launch.local import torchrun_command


def torchrun_env(monkeypatch, tmp_path, rank: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error-{rank}.json"))


def kiln_main(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["kiln", *argv])
    with pytest.raises(SystemExit) as done:
        cli.main()
    return done.value.code


def test_a_config_error_is_printed_by_rank_0_and_recorded_for_torchrun(monkeypatch, tmp_path, capsys):
    torchrun_env(monkeypatch, tmp_path, 0)
    assert kiln_main(monkeypatch, "train", "quickstart", "train.lr=abc") == 2
    err = capsys.readouterr().err
    assert err.count("train.lr") == 1 and "error (rank 0)" in err
    recorded = json.loads((tmp_path / "error-0.json").read_text())
    assert "train.lr" in recorded["message"] and recorded[torchrun.SHOWN] is True


def test_the_other_ranks_wait_for_torchrun_quietly_and_exit_2(monkeypatch, tmp_path, capsys):
    waited = []
    monkeypatch.setattr(torchrun, "wait_for_first_rank", lambda: waited.append(True))
    torchrun_env(monkeypatch, tmp_path, 1)
    assert kiln_main(monkeypatch, "train", "quickstart", "train.lr=abc") == 2
    out = capsys.readouterr()
    assert out.err == "" and out.out == "" and waited == [True]
    assert not (tmp_path / "error-1.json").exists()


def failure(tmp_path, local_rank: int, exitcode: int, message: str | None) -> ProcessFailure:
    path = tmp_path / f"error-{local_rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": message, "timestamp": 1000 + local_rank, torchrun.SHOWN: True}))
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file=str(path))


def test_a_job_whose_rank_printed_its_error_ends_with_one_line_naming_it(tmp_path):
    shown = ChildFailedError("kiln.cli", {0: failure(tmp_path, 0, 2, "error (rank 0): bad config"),
                                          1: failure(tmp_path, 1, -15, None)})
    text, code = torchrun.summary(shown)
    assert text == "kiln: the job stopped: rank 0 failed (exit code 2); its error is above" and code == 2
    assert "bad config" not in text  # printed once, by the rank


def test_any_other_failure_ends_with_torchruns_summary(tmp_path):
    crashed = ChildFailedError("kiln.cli", {1: failure(tmp_path, 1, 1, None)})
    text, code = torchrun.summary(crashed)
    assert "Root Cause" in text and "rank      : 1" in text and code == 1


def test_kiln_train_nproc_runs_torchrun_through_this_module():
    assert torchrun_command(2, ["cfg.yaml"])[1:4] == ["-m", "kiln.parallel.launch.torchrun", "--standalone"]


def test_a_signal_ends_the_job_with_one_line_and_128_plus_its_number(monkeypatch, capsys):
    """torchrun stops its workers on SIGTERM, then raises SignalException: no traceback, exit code 143."""
    import signal

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api

    def stopped(args):
        raise api.SignalException("got signal: SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch_run, "run", stopped)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # main wraps it
    monkeypatch.setattr(torchrun, "stop_with_parent", lambda: True)  # not for pytest itself
    monkeypatch.setenv(torchrun.PARENT_PID, "1")  # main names itself to its workers: restored after the test
    assert torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "kiln.cli", "train"]) == 143
    assert os.environ[torchrun.PARENT_PID] == str(os.getpid())
    err = capsys.readouterr().err
    assert err == "kiln: the job stopped on SIGTERM\n"


@pytest.mark.parametrize("saved,code", [(["0 2", "1 2"], 0), (["1 2"], 130)], ids=["all", "one"])
def test_a_signal_after_every_worker_saved_ends_the_job_with_0(monkeypatch, capsys, saved, code):
    """Ctrl-C as a finished job ends (each worker has written all it was to: kiln.state.after_save) loses nothing:
    exit 0, not 130; a worker still saving (rank 0 writing model/) keeps 130."""
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api

    def stopped(args):
        for line in saved:  # as each worker's record_saved writes it
            monkeypatch.setenv("LOCAL_RANK", line.split()[0])
            monkeypatch.setenv("LOCAL_WORLD_SIZE", line.split()[1])
            torchrun.record_saved()
        raise api.SignalException("got signal: SIGINT", sigval=signal.SIGINT)

    monkeypatch.setattr(torch_run, "run", stopped)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # main wraps it
    monkeypatch.setattr(torchrun, "stop_with_parent", lambda: True)  # not for pytest itself
    monkeypatch.setenv(torchrun.PARENT_PID, "1")
    assert torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "kiln.cli", "train"]) == code
    expected = "SIGINT after the job was saved: nothing is lost" if code == 0 else "the job stopped on SIGINT"
    assert capsys.readouterr().err == f"kiln: {expected}\n"
    assert torchrun.SAVED not in os.environ


def test_torchrun_takes_a_signal_delivered_twice_at_once_as_one_and_a_later_one_as_a_second():
    """The same SIGTERM to the process group and forwarded by `kiln train --nproc`: torchrun must not break off
    its wait and signal the workers again (a kiln worker aborts its checkpoint on a second signal)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

    now = [100.0]
    handle = torchrun.stop_once(_terminate_process_handler, clock=lambda: now[0])
    with pytest.raises(SignalException):
        handle(signal.SIGTERM, None)
    now[0] += 0.01
    handle(signal.SIGTERM, None)  # the copy: ignored
    now[0] += torchrun.DUPLICATE_S
    with pytest.raises(SignalException):  # a second request, later: passed on (the workers abort)
        handle(signal.SIGTERM, None)


def test_torchrun_takes_another_signal_at_once_as_the_same_event():
    """A closed terminal sends torchrun SIGHUP, and its launcher's death SIGTERM (PR_SET_PDEATHSIG) a moment
    later: torchrun broke off its wait and sent the workers SIGTERM after SIGHUP, which they took as 'abort'."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

    now = [100.0]
    handle = torchrun.stop_once(_terminate_process_handler, clock=lambda: now[0])
    with pytest.raises(SignalException):
        handle(signal.SIGHUP, None)
    now[0] += 0.01
    handle(signal.SIGTERM, None)  # the same event: ignored


def test_under_nohup_torchrun_does_not_stop_the_job_on_sighup(monkeypatch):
    """nohup ignores SIGHUP for the job, but torchrun handled it anyway and stopped every worker."""
    import signal

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api

    if not hasattr(torch_run.parse_args(["x.py"]), "signals_to_handle"):
        pytest.skip("torchrun has --signals-to-handle from torch 2.10")
    seen = []
    monkeypatch.setattr(torch_run, "run", lambda args: seen.append(args.signals_to_handle))
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # main wraps it
    monkeypatch.setattr(torchrun, "stop_with_parent", lambda: True)  # not for pytest itself
    monkeypatch.setenv(torchrun.PARENT_PID, "1")
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "kiln.cli", "train"]) == 0
    finally:
        signal.signal(signal.SIGHUP, before)
    assert torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "kiln.cli", "train"]) == 0
    assert seen == ["SIGTERM,SIGINT,SIGQUIT", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"]


def test_the_rank_that_printed_its_error_is_named_with_its_exit_code_though_torchrun_stopped_it(tmp_path, monkeypatch):
    """Rank 1 printed a config error; rank 0 exited first (stopping for it, code 1) and torchrun then stopped
    rank 1 with SIGTERM: the job used to end 'rank 1 failed (exit code -15)' with code 1 instead of 2."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error-1.json"))
    torchrun.record_error("error (rank 1): bad replicas")  # as kiln.cli does, exit code 2
    stopping = failure(tmp_path, 0, 1, None)
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file=str(tmp_path / "error-1.json"))
    killed.timestamp = stopping.timestamp + 1  # rank 0's exit came first
    text, code = torchrun.summary(ChildFailedError("kiln.cli", {0: stopping, 1: killed}))
    assert text == "kiln: the job stopped: rank 1 failed (exit code 2); its error is above" and code == 2


# a process that asks for SIGTERM at its parent's death, says so, and waits
ORPHAN = ("import sys, time; from kiln.parallel.launch.torchrun import stop_with_parent; "
          "print(stop_with_parent(), flush=True); time.sleep(60)")
# a parent that starts it, tells its pid, and waits to be killed
PARENT = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
          "print(child.pid, flush=True); time.sleep(60)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_process_is_sent_sigterm_when_its_parent_is_killed():
    import signal
    import subprocess

    import psutil

    env = {k: v for k, v in os.environ.items() if k != torchrun.PARENT_PID}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, ORPHAN], stdout=subprocess.PIPE, text=True, env=env)
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline() == "True\n"  # the child's own line (it writes to the same pipe): set up
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    child.wait(timeout=30)  # else it sleeps on for a minute: psutil.TimeoutExpired


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_process_whose_parent_died_before_it_asked_is_sent_sigterm_at_once():
    import signal
    import subprocess

    # PARENT_PID names a process that is not its parent (as when the parent died and it was re-parented)
    env = {**os.environ, torchrun.PARENT_PID: str(os.getpid() + 10_000_000)}
    done = subprocess.run([sys.executable, "-c", ORPHAN], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == ""  # before it could say anything
    env[torchrun.PARENT_PID] = "not-a-pid"  # ignored: the signal only comes at the parent's death
    got = subprocess.Popen([sys.executable, "-c", ORPHAN], env=env, stdout=subprocess.PIPE, text=True)
    assert got.stdout.readline() == "True\n" and got.poll() is None
    got.kill()
    got.wait()


def test_a_torchrun_started_by_hand_without_kilns_environment_is_told_what_it_costs():
    assert torchrun.missing_env(torchrun.TORCHRUN_ENV) is None  # as kiln train --nproc and kiln launch start it
    plain = torchrun.missing_env({"TORCHELASTIC_MAX_RESTARTS": "0"})
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120" in plain and "30 s" in plain
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plain  # no restarts: the store does not matter
    restarts = torchrun.missing_env({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restarts and "SHUTDOWN" not in restarts


def test_a_job_whose_rank_printed_its_error_is_not_restarted_and_other_failures_are(tmp_path, capsys):
    """--max-restarts 2 and a config error found after start-up (model.vocab_size below the tokenizer's): each
    start ended with the same error, three times over."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    results = []

    class Agent:  # torchrun's agent as far as the restart decision goes
        _remaining_restarts = 2

        def _monitor_workers(self, worker_group):
            return results.pop(0)

    torchrun.no_restart_after_kiln_errors(Agent)
    agent = Agent()
    killed = {1: failure(tmp_path, 1, -9, None)}  # a killed process, no error of its own: restarted
    results.append(RunResult(state=WorkerState.FAILED, failures=killed))
    assert agent._monitor_workers(None).state == WorkerState.FAILED and agent._remaining_restarts == 2
    results.append(RunResult(state=WorkerState.HEALTHY))
    assert agent._monitor_workers(None).state == WorkerState.HEALTHY and agent._remaining_restarts == 2
    shown = {0: failure(tmp_path, 0, 1, None), 1: failure(tmp_path, 1, 2, "error (rank 1): model.vocab_size")}
    results.append(RunResult(state=WorkerState.FAILED, failures=shown))
    agent._monitor_workers(None)
    assert agent._remaining_restarts == 0
    assert capsys.readouterr().err == ("kiln: not restarting the job: rank 1's error is one a restart would meet "
                                       "again\n")


def test_a_torchrun_stopped_by_a_signal_joins_the_exit_barrier_the_other_nodes_wait_in():
    """Two nodes' torchrun agents on one rendezvous store: the workers of the node that was not signalled stop
    with the others (one checkpoint), and its agent waits in torchrun's exit barrier for every agent. The
    signalled agent, whose run raises SignalException, joined it (before: never, so the other waited 300 s)."""
    import datetime
    import threading

    import torch.distributed as dist
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.utils import store as store_util

    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    peer = dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=datetime.timedelta(seconds=30))

    class Agent:  # torchrun's agent as far as the exit barrier goes
        def __init__(self, store):
            self._store, self._worker_group = store, type("Group", (), {"group_world_size": 2})()

        def run(self, role="default"):
            raise SignalException("SIGTERM on this node", signal.SIGTERM)

    torchrun.exit_barrier_on_signal(Agent)
    torchrun.exit_barrier_on_signal(Agent)  # wrapped once
    passed = threading.Event()

    def other_node() -> None:  # its workers finished: torchrun's _exit_barrier
        store_util.barrier(peer, 2, api._TERMINAL_STATE_SYNC_ID, barrier_timeout=20)
        passed.set()

    waiter = threading.Thread(target=other_node, daemon=True)
    waiter.start()
    with pytest.raises(SignalException):
        Agent(host).run()
    waiter.join(timeout=20)
    assert passed.is_set()
    assert not torchrun.join_exit_barrier(type("Agent", (), {"_store": None})())  # before the rendezvous: nothing


def test_after_a_stop_on_a_signal_torchrun_waits_for_a_lost_node_briefly_and_says_so(monkeypatch, tmp_path, capsys):
    """One node lost (its torchrun killed with SIGKILL): its workers, sent SIGTERM, wrote the checkpoint with the
    others and the node's torchrun never joins the exit barrier. The others, whose workers recorded the stop,
    wait SIGNALLED_BARRIER_S there, not torch's 300 s, and say why; after a finished job, torchrun's own barrier."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    waited = []

    class Agent:  # torchrun's agent as far as the exit barrier goes
        def __init__(self, nodes: int = 2):
            self._store, self._worker_group = store, type("Group", (), {"group_world_size": nodes})()

        def _exit_barrier(self):
            waited.append("torchrun's 300 s")

    torchrun.short_exit_barrier_after_a_stop(Agent)
    monkeypatch.setenv(torchrun.STOPPED, str(tmp_path / "stopped"))
    Agent()._exit_barrier()  # the job finished: nothing recorded
    assert waited == ["torchrun's 300 s"]
    monkeypatch.setattr(torchrun, "SIGNALLED_BARRIER_S", 0.5)
    torchrun.record_stop("SIGTERM")  # what a worker does when the job stops on a signal
    Agent(nodes=1)._exit_barrier()  # one node: no other to wait for, nothing to say
    assert waited == ["torchrun's 300 s"] * 2 and capsys.readouterr().err == ""
    Agent()._exit_barrier()
    assert waited == ["torchrun's 300 s"] * 2
    assert "kiln: the job stopped on SIGTERM and this node's workers have written their part of the checkpoint; " \
           "the torchrun of another node did not stop within 0.5 s (a node lost?)" in capsys.readouterr().err


def test_a_node_that_loses_the_rendezvous_store_says_so_in_a_few_lines_not_torchs_traceback(monkeypatch, capsys):
    """The node serving the c10d store lost (its torchrun killed with SIGKILL): the other node's torchrun found
    the store gone at its next check and ended with a traceback of torch's 80 lines ending in 'The connection to
    the C10d store has failed'; now with what happened and what to do, exit code 1."""
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def lost(args):
        assert os.environ[torchrun.STOPPED]  # where the workers say they stopped on a signal
        raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception")

    monkeypatch.setattr(torch_run, "run", lost)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # main wraps it
    monkeypatch.setattr(torchrun, "stop_with_parent", lambda: True)  # not for pytest itself
    monkeypatch.setenv(torchrun.PARENT_PID, "1")
    assert torchrun.main(["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29500", "-m", "kiln.cli",
                          "train"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("kiln: this node lost the job's rendezvous store at node-a:29500: the torchrun serving it")
    assert "Start torchrun on every node again to resume" in err and "Traceback" not in err
    assert torchrun.STOPPED not in os.environ



def test_after_a_stop_on_a_signal_torchrun_does_not_close_the_rendezvous(monkeypatch, tmp_path):
    """The node whose torchrun served the rendezvous store was preempted; the other node's workers wrote the
    checkpoint with it and exited 0, and then its torchrun printed torch's warning with 30 lines of C++ frames:
    its close of the rendezvous raced the exit of the store's torchrun. After a stop on a signal it does not
    close the rendezvous; after a finished job it does, as torchrun does."""
    done = []

    class Handler:  # torchrun's DynamicRendezvousHandler as far as its shutdown goes
        def _stop_heartbeats(self):
            done.append("heartbeats stopped")

        def shutdown(self):
            done.append("closed")
            return True

    torchrun.quiet_rendezvous_shutdown(Handler)
    torchrun.quiet_rendezvous_shutdown(Handler)  # wrapped once
    monkeypatch.setenv(torchrun.STOPPED, str(tmp_path / "stopped"))
    assert Handler().shutdown() and done == ["closed"]  # the job finished
    torchrun.record_stop("SIGTERM")  # what a worker does when the job stops on a signal
    assert not Handler().shutdown() and done == ["closed", "heartbeats stopped"]
    monkeypatch.delenv(torchrun.STOPPED)  # not started by kiln's torchrun: nothing recorded
    assert Handler().shutdown() and done[-1] == "closed"


def test_torchruns_lines_that_kilns_own_repeat_are_dropped_and_its_others_kept():
    """On a signal torchrun logged, before kiln's own lines, one line for itself and one for each worker it
    passed the signal to. Those go; its other lines (errors included) stay."""
    import logging

    torchrun.quiet_torch_notes()
    torchrun.quiet_torch_notes()  # once
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    procs = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    assert len([f for f in procs.filters if getattr(f, "kiln", False)]) == 1
    seen: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: seen.append(record.getMessage())
    for logger in (agent, procs):
        logger.addHandler(keep)
    try:
        agent.warning("Received %s death signal, shutting down workers", "SIGTERM")
        procs.warning("Sending process %s closing signal %s", 123, "SIGTERM")
        procs.error("failed (exitcode: %s) local_rank: %s", 2, 1)
        agent.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 123, "SIGTERM", "SIGKILL")
    finally:
        for logger in (agent, procs):
            logger.removeHandler(keep)
    assert seen == ["failed (exitcode: 2) local_rank: 1",
                    "Unable to shutdown process 123 via SIGTERM, forcefully exiting via SIGKILL"]


def test_a_job_stopped_by_the_watchdog_names_the_hung_rank_not_the_rank_that_reported_it(tmp_path, monkeypatch):
    """Rank 1 stopped (SIGSTOP); rank 0 found it and exited 124: torchrun's summary named rank 0 the root cause."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error-0.json"))
    torchrun.record_error("rank 1 hung: it stopped answering", 124, culprit=1)
    reporter = ProcessFailure(local_rank=0, pid=100, exitcode=124, error_file=str(tmp_path / "error-0.json"))
    stopped = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none.json"))
    text, code = torchrun.summary(ChildFailedError("kiln.cli", {0: reporter, 1: stopped}))
    assert text == "kiln: the job stopped: rank 1 hung (exit code 124); rank 0's report is above" and code == 124


def test_a_job_whose_rank_was_killed_ends_naming_it_and_the_signal(tmp_path):
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none-1.json"))
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=str(tmp_path / "none-0.json"))
    text, code = torchrun.summary(ChildFailedError("kiln.cli", {0: stopped, 1: killed}))
    assert text.startswith("kiln: the job stopped: rank 1 (pid 101) was killed by SIGKILL") and code == 137


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_as_a_worker_fails_torchrun_notes_how_says_a_kill_at_once_and_kills_a_stopped_worker(tmp_path, capsys,
                                                                                            monkeypatch):
    """A stopped worker (SIGSTOP) ignores torchrun's SIGTERM: the job waited torchrun's whole shutdown timeout."""
    import subprocess
    import time

    from kiln.parallel.launch.failures import first_words
    from kiln.parallel.peers import FAILED_NOTE, failed_note, process_state

    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(frozen.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none.json"))
        note = tmp_path / "failed"
        first_words({1: killed}, {0: frozen.pid}, note=str(note))
        assert frozen.wait(10) == -signal.SIGKILL
    finally:
        frozen.kill()
    err = capsys.readouterr().err
    assert "kiln: rank 1 (pid 101) was killed by SIGKILL" in err
    assert f"kiln: rank 0 (pid {frozen.pid}) is stopped (SIGSTOP or SIGTSTP): killed with SIGKILL" in err
    monkeypatch.setenv(FAILED_NOTE, str(note))  # what the other workers read
    assert failed_note().startswith("rank 1 (pid 101) was killed by SIGKILL")


def test_a_busy_port_ends_kilns_torchrun_with_one_line_not_a_traceback():
    """torchrun --master_port P with P held by another program printed a 42-line EADDRINUSE traceback."""
    import socket
    import subprocess

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kiln.parallel.launch.torchrun", "--nnodes=1",
                               "--nproc_per_node=1", f"--master_port={port}", "-m", "kiln.cli", "train", "quickstart"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"kiln: torchrun cannot serve the job's store at 127.0.0.1:{port}: the port is in use" in done.stderr
    assert torchrun.port_in_use(RuntimeError("x")) is False
