"""Output nobody can read any more is dropped instead of stopping the process.

`kiln train ... 2>&1 | tee train.log` under Ctrl-C: the terminal's SIGINT ends `tee` as well, and every
later write of the job (the "SIGINT received" line, the console, torchrun's log) raised BrokenPipeError,
in the middle of the step or of the preemption checkpoint it was stopping to write; a closed terminal
(EIO) likewise. `keep_writing()` wraps sys.stdout and sys.stderr so that the first such write points the
stream's file descriptor at /dev/null (for every later writer, child processes included) and goes on.

`drop_log_lines` drops a library's log lines that kiln's own lines already say, or that do not apply to it.
"""

from __future__ import annotations

import errno
import logging
import os
import sys

GONE = (errno.EPIPE, errno.EIO)  # the reader of a pipe has exited; the terminal has hung up


class Unbroken:
    """`stream` (a text file), whose writes and flushes to a reader that is gone are dropped."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._drop(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._drop(e)

    def _drop(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        try:
            self._stream.flush()  # what the stream still buffers goes to /dev/null too
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def keep_writing() -> None:
    """Wrap sys.stdout and sys.stderr in `Unbroken` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Unbroken):
            setattr(sys, name, Unbroken(stream))


def drop_log_lines(logger: str, text: str) -> None:
    """Drop the records of the logger named `logger` whose message contains `text` (its other lines, errors
    included, stay). Once per logger and text, however often called."""
    log = logging.getLogger(logger)
    if any(getattr(f, "kiln", None) == text for f in log.filters):
        return

    def other_lines(record: logging.LogRecord) -> bool:
        return text not in str(record.msg)

    other_lines.kiln = text
    log.addFilter(other_lines)
