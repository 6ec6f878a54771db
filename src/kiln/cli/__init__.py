"""The `kiln` command: one module per group of verbs (train, data, model, runs, launch) on the app of
`kiln.cli.app`; `main()` runs it and turns a KilnError into a message without a traceback."""

from __future__ import annotations

import importlib
import sys

from rich.text import Text

from kiln.cli.app import app, err_console, job_rank, state
from kiln.errors import KilnError

__all__ = ["app", "main"]

for _verbs in ("train", "data", "model", "runs", "launch"):  # each adds its verbs to the app: `kiln --help`'s order
    importlib.import_module(f"kiln.cli.{_verbs}")


def main() -> None:
    from kiln.start_signals import started, stop_while_starting
    from kiln.state import after_save
    from kiln.streams import keep_writing

    after_save.install()  # to the process's end: once a run is saved, a signal as it ends loses nothing, exits 0
    stop_while_starting()  # a signal while the libraries load says so (kiln.start_signals)
    keep_writing()  # a closed pipe (`| tee` under Ctrl-C) or terminal drops the output, not the run
    try:
        app()
    except KilnError as e:
        if state["debug"]:
            raise
        rank = job_rank()
        where = f"error (rank {rank}): " if rank is not None else "error: "  # kiln.parallel: which process failed
        err_console.print(Text.assemble((where, "bold red"), str(e)), highlight=False)
        if rank is not None:  # torchrun's summary of the failed job names this error (kiln.parallel.launch.torchrun)
            from kiln.parallel.launch.torchrun import record_error

            record_error(where + str(e))
        sys.exit(2)
    except SystemExit as e:  # typer ends a command that a KeyboardInterrupt stopped with 130, whatever its signal
        signum = _signal_of(e) if e.code == 130 else None
        if signum is None:
            raise
        _interrupted(signum)
    except KeyboardInterrupt as e:
        _interrupted(_signal_of(e))
    finally:
        started()  # a command that ended before it took the signals over gives them back too



def _signal_of(e: BaseException | None) -> int | None:
    """The signal of the KeyboardInterrupt that `e` is or wraps (typer's exit of 130 wraps it): kiln's interrupts of
    SIGTERM and SIGHUP carry theirs (kiln.data.prepare.bpe, kiln.state.preempt); None for a plain Ctrl-C."""
    for _ in range(4):
        if e is None or isinstance(e, KeyboardInterrupt):
            return getattr(e, "signum", None)
        e = e.__cause__ or e.__context__
    return None


def _interrupted(signum: int | None) -> None:
    """Say so and exit as a shell does for the signal: 128 + its number (130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    import signal

    signum = int(signum or signal.SIGINT)
    err_console.print("interrupted" + (f" ({signal.Signals(signum).name})" if signum != signal.SIGINT else ""))
    sys.exit(128 + signum)
