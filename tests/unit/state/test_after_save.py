"""Signals after a run is saved: handled as before until then (Ctrl-C is KeyboardInterrupt), then noted in one line
and the process goes on (kiln.state.after_save; a real `kiln train` in tests/integration/test_run_dir.py)."""

import os
import signal

import pytest

from kiln.state import after_save


def test_a_signal_is_handled_as_before_until_the_run_is_saved_then_noted(capsys, monkeypatch, tmp_path):
    from kiln.parallel.launch.torchrun import SAVED

    monkeypatch.setenv(SAVED, str(tmp_path / "saved"))  # as kiln's torchrun gives it to rank 1 of 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    before = {sig: signal.getsignal(sig) for sig in after_save.SIGNALS}
    try:
        after_save.install()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert not after_save.is_saved()
        after_save.mark_saved()
        after_save.mark_saved()  # noted once
        assert (tmp_path / "saved").read_text() == "1 2\n"  # told to torchrun
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process before the mark
        assert after_save.is_saved()
        assert capsys.readouterr().err.strip() == ("SIGTERM after the run was saved: nothing is lost; finishing the "
                                                   "shutdown (send it again to exit now)")
        after_save.reset()  # a new run in the same process starts unsaved
        assert not after_save.is_saved()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_installed_twice_in_one_process_ctrl_c_is_still_keyboard_interrupt_until_saved():
    """`kiln`'s main run twice in one process: the second install forgot Python's SIGINT handler for the signals
    already on its own, so a Ctrl-C before the save killed the process (SIG_DFL) instead of raising."""
    before = {sig: signal.getsignal(sig) for sig in after_save.SIGNALS}
    try:
        after_save.install()
        after_save.install()
        assert signal.getsignal(signal.SIGINT) is after_save._handle
        # what it hands an unsaved run's Ctrl-C to (checked first: a SIG_DFL there would end the test process)
        assert after_save._state["previous"].get(signal.SIGINT) is before[signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            after_save._handle(signal.SIGINT, None)  # as the signal would run it, without risking the test process
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


LATE_SIGNAL = """
import os, signal, sys, time
from kiln.state import after_save
after_save.install()
after_save.mark_saved()
class Late:  # torn down with __main__, after the interpreter gave the signals their default action back
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGTERM, sleep=time.sleep):
        kill(pid, sig)
        sleep(0.05)
late = Late()
print("saved", flush=True)
"""


def test_a_signal_while_the_interpreter_ends_a_saved_run_leaves_its_exit_code(tmp_path):
    """The second or so torch takes to be torn down after `kiln train` returns: a SIGTERM there ended a saved run
    with 143 and no word (Python's default action again by then)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", LATE_SIGNAL], capture_output=True, text=True, timeout=60, env=env,
                       cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, "saved\n"), r.stderr
