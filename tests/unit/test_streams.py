"""kiln.streams: writes to a pipe whose reader is gone are dropped, and so are all later ones."""

from __future__ import annotations

import os
import subprocess
import sys

# writes a line, waits for its reader to be gone, then prints and flushes on both streams as kiln does
WRITER = r"""
import os, sys
from kiln.streams import keep_writing
keep_writing()
print("first", flush=True)
sys.stdin.read()  # the test closes the pipe's reader, then this
print("to nobody", flush=True)
print("to nobody either", file=sys.stderr, flush=True)
print("x" * 100000)  # buffered, flushed at exit
os.write(int(sys.argv[1]), b"done")
"""


def test_output_to_a_pipe_whose_reader_exited_is_dropped_and_the_process_goes_on(tmp_path):
    """`kiln train ... 2>&1 | tee log` under Ctrl-C: tee exits and each later write raised BrokenPipeError."""
    r, w = os.pipe()
    done_r, done_w = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(done_w)], stdin=subprocess.PIPE, stdout=w, stderr=w,
                            env=env, pass_fds=(done_w,))
    os.close(w)
    os.close(done_w)
    with os.fdopen(r) as reader:
        assert reader.readline() == "first\n"
    proc.stdin.close()  # the reader is gone: go on
    assert proc.wait(timeout=60) == 0
    with os.fdopen(done_r, "rb") as done:
        assert done.read() == b"done"


def test_drop_log_lines_drops_only_the_lines_named_once_each():
    import logging

    from kiln.streams import drop_log_lines

    log = logging.getLogger("kiln.test.drop_log_lines")
    for _ in range(2):
        drop_log_lines(log.name, "death signal")
        drop_log_lines(log.name, "closing signal")
    assert len(log.filters) == 2

    def passes(msg: str) -> bool:
        return bool(log.filter(logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, None, None)))

    assert not passes("Received %s death signal, shutting down workers")
    assert not passes("Sending process %s closing signal %s")
    assert passes("failed (exitcode: %s) local_rank: %s")
