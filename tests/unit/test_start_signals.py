"""kiln.start_signals: a signal while kiln loads its libraries ends it with a line that says so, not in silence."""

from __future__ import annotations

import signal
import subprocess
import sys

from kiln import start_signals

# the CLI's start: the handlers, then a library that takes a while to load, during which the signal comes
STARTING = ("import os, signal; from kiln.start_signals import stop_while_starting; stop_while_starting(); "
            "os.kill(os.getpid(), signal.SIGTERM); import torch; print('went on')")


def test_a_signal_while_loading_libraries_says_so_and_exits_as_a_shell_would():
    done = subprocess.run([sys.executable, "-c", STARTING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM
    assert "went on" not in done.stdout
    assert done.stderr.strip() == ("kiln: SIGTERM while starting (loading libraries): stopped before any work began; "
                                   "nothing was written. Run the same command again to start")


def test_once_started_the_command_has_its_signals_back():
    before = signal.getsignal(signal.SIGTERM)
    start_signals.stop_while_starting()
    try:
        assert signal.getsignal(signal.SIGTERM) is start_signals._stop
    finally:
        start_signals.started()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_kiln_command_stops_with_that_line_while_it_loads(tmp_path):
    """`kiln` itself installs the handlers first thing (here the signal comes as it parses its command line)."""
    code = ("import os, signal, sys; import kiln.cli as cli; sys.argv = ['kiln', 'train', '--help']; "
            "import typer.main as t; real = t.get_command\n"
            "def get_command(app):\n"
            "    os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(10)\n"
            "t.get_command = get_command; cli.main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "kiln: SIGTERM while starting (loading libraries)" in done.stderr
