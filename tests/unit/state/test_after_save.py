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
