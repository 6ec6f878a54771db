"""Signals after a run is saved. Once `kiln train` has written all it was to write (model/, else the final
checkpoint), a Ctrl-C or SIGTERM while the process winds down (sinks closing, the run directory let go, the process
group left, loader workers and threads ending) loses nothing: it says so in one line, the shutdown goes on, and the
process exits 0, not 130 with a traceback. A second one ends the process at once, still 0; once the interpreter
tears itself down (after the last atexit function), signals are ignored until it has. Before that moment,
signals are handled as ever (kiln.state.preempt: a checkpoint, or Interrupted and 128 + the signal's number).

    install()      # `kiln`'s main, first: the process's handler, below every handler of the command and the run
    reset()        # kiln.train.run, as a run starts: nothing saved yet
    mark_saved()   # kiln.train.run, once model/ (or the final checkpoint) is complete
    is_saved()     # `kiln train`: an Interrupted of a saved run exits 0
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_state: dict[str, Any] = {"saved": False, "received": None, "pid": None, "previous": {}}


def install() -> None:
    """From here to the end of the process (main thread), SIGTERM, SIGINT and SIGHUP that no block of the run
    handles come here: handled as before until `mark_saved`, then as the module says. SIGHUP is left alone where it
    is ignored (under nohup)."""
    if _state["pid"] is None:
        atexit.register(_ignore_while_finalizing)  # the first registered runs last, after every other one
    # called again in this process (`kiln`'s main run twice in-process): a signal still on this handler keeps the
    # handler recorded the first time; recorded anew it would be SIG_DFL, and Ctrl-C would kill the process outright
    previous = _state["previous"] if _state["pid"] == os.getpid() else {}
    _state.update(pid=os.getpid(), previous=previous)
    reset()
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is _handle or (sig == signal.SIGHUP and current == signal.SIG_IGN):
            continue
        _state["previous"][sig] = current
        signal.signal(sig, _handle)


def reset() -> None:
    """A run starts: nothing of it is saved yet."""
    _state.update(saved=False, received=None)


def mark_saved() -> None:
    """The run (this process's part of it) has written all it was to write: a signal from here on loses nothing;
    under `kiln train --nproc`, torchrun is told too (once all of its workers are, a signal ends the job with 0)."""
    from kiln.parallel.launch.torchrun import record_saved

    if not _state["saved"]:
        record_saved()
    _state["saved"] = True


def is_saved() -> bool:
    return bool(_state["saved"])


def _ignore_while_finalizing() -> None:
    """The interpreter's last step, once the run is saved: Python gives every signal it handles its default action
    back before it tears its modules down (a second or more with torch loaded), so a signal then ended a saved run
    with 128 + its number and no word. Ignored instead, the process ends with the exit code it had."""
    if _state["saved"] and os.getpid() == _state["pid"]:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _handle(signum: int, frame) -> None:
    previous = _state["previous"].get(signum, signal.SIG_DFL)
    if os.getpid() != _state["pid"] or not _state["saved"]:  # a forked worker's, or a run not saved yet: as before
        if callable(previous):
            previous(signum, frame)  # Python's own for SIGINT: KeyboardInterrupt
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    name = signal.Signals(signum).name
    if _state["received"] is None:
        _state["received"] = name
        if os.environ.get("RANK", "0") == "0":  # one line for a job of several processes
            print(f"\n{name} after the run was saved: nothing is lost; finishing the shutdown (send it again to "
                  "exit now)", file=sys.stderr, flush=True)
        return
    print(f"second {name}: exiting now; the run was saved", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)
