"""Signals while `kiln` starts: between the command line and the command's own handling of signals (kiln.train's
StopSignals), the libraries load (torch alone takes seconds), and SIGTERM or SIGHUP killed the process without a
word, SIGINT with an import's traceback. `stop_while_starting` has them end it with a line that says so and the
exit code of a shell (128 + the signal's number); `started` gives the signals back once the command takes over.
Nothing is written before then, so the process may end where it stands."""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_previous: dict[int, object] = {}


def _stop(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else None
    who = f"kiln (rank {rank})" if rank is not None else "kiln"
    try:
        print(f"\n{who}: {name} while starting (loading libraries): stopped before any work began; nothing was "
              "written. Run the same command again to start", file=sys.stderr, flush=True)
    finally:
        os._exit(128 + signum)


def stop_while_starting() -> None:
    """Until `started`, SIGTERM, SIGINT and SIGHUP (unless ignored, as under nohup) end the process with a line."""
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN or sig in _previous:
            continue
        _previous[sig] = signal.signal(sig, _stop)


def started() -> None:
    """The command handles signals from here on: each gets its handler of before `stop_while_starting` back."""
    for sig, handler in list(_previous.items()):
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, handler)
        del _previous[sig]
