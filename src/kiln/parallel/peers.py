"""The other processes of a job on this node, as the kernel sees them, and torchrun's word on a process that ended.

A process that is stopped (SIGSTOP, Ctrl-Z) or killed cannot say so itself. Its peers on the same node are
its siblings (torchrun started them all) and can read its state from /proc: `peer_state` finds the process of
a rank and says what it is doing, in words (`state_words`). Linux only; elsewhere nothing is known.

torchrun learns first, and alone, how a worker ended (its exit code or signal). Kiln's torchrun writes it to the
file named by FAILED_NOTE before it stops the other workers (kiln.parallel.launch.torchrun), so that they say
"rank 1 was killed by SIGKILL" rather than take torchrun's SIGTERM for a preemption (`failed_note`), and a
collective broken by it for an error of their own (`lost_peer`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from kiln.parallel.env import env_int

LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
        "ECONNRESET", "EPIPE")  # a collective's error when a peer's process has ended
FAILED_NOTE = "KILN_FAILED_FILE"  # environment: where torchrun notes how a worker ended, before it stops the others
STATES = {  # /proc/PID/stat's state letter: what the process does, in words
    "T": "stopped (SIGSTOP, SIGTSTP or Ctrl-Z; `kill -CONT {pid}` lets it go on)",
    "t": "stopped by a debugger",
    "D": "waiting on a device or a file system (uninterruptible sleep: a hung disk or network mount?)",
    "Z": "dead (killed or exited; torchrun has not yet collected it)",
    "X": "dead",
    "R": "running",
    "S": "sleeping (waiting for something: I/O, a lock, a collective)",
}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of process `pid`, or None if there is none (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return fields[0], int(fields[1])


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (T: stopped, Z: dead, ...), None if there is none."""
    stat = _stat(pid)
    return stat[0] if stat else None


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            value = item[5:].decode(errors="replace")
            return int(value) if value.isdigit() else None
    return None


def peer_state(rank: int) -> tuple[int, str] | None:
    """(pid, state letter) of the process of `rank` if it is this process's sibling (started by the same torchrun,
    on this node); None when it is on another node, or gone, or /proc cannot tell."""
    parent = os.getppid()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == parent and _rank_of(int(entry.name)) == rank:
                return int(entry.name), stat[0]
    return None


def state_words(rank: int) -> str:
    """What this node can tell of `rank`'s process, as a clause ("" when nothing: another node, or no /proc)."""
    found = peer_state(rank)
    if found is None:
        return ""
    pid, state = found
    return f"its process {pid} on this node is " + STATES.get(state, f"in state {state}").format(pid=pid)


def note_failure(message: str, rank: int, path: str | None = None) -> None:
    """torchrun: note how rank `rank` ended (`message`) for the workers it is about to stop."""
    path = path or os.environ.get(FAILED_NOTE)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": message, "rank": rank}, f)


def failed_note(wait_s: float = 0.0) -> str | None:
    """The note of this node's torchrun on a worker that ended (`note_failure`), waiting up to `wait_s` for it; None
    when there is none (no failure seen, or not under kiln's torchrun)."""
    path = os.environ.get(FAILED_NOTE)
    if not path:
        return None
    end = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            return json.load(f)["message"]
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def broken_by_a_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective broken because a peer's process ended (gloo's "Connection reset by peer")."""
    return isinstance(error, RuntimeError) and any(s in str(error) for s in LOST)


def lost_peer(error: BaseException, rank: int, world: int) -> str | None:
    """Why this rank stops, in words, if `error` is a collective broken because a peer's process ended (gloo's
    "Connection reset by peer"); None for any other error. Torchrun's note says which rank ended and how; without
    it (a peer on another node), the kernel of this node is asked which sibling process is gone."""
    if not broken_by_a_lost_peer(error):
        return None
    text = str(error)
    note = failed_note(wait_s=3.0)  # torchrun sees a worker end within its monitor interval (0.1 s)
    if note:
        return note
    local = max(1, env_int("LOCAL_WORLD_SIZE", world))
    node = range(rank // local * local, min(world, (rank // local + 1) * local))
    gone = [r for r in node if r != rank and (peer_state(r) or (0, "X"))[1] in "ZX"] if os.path.isdir("/proc") else []
    if gone:
        return f"rank {gone[0]}'s process ended (a collective with it broke here; torchrun's summary says how)"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"a process of this job ended, on another node (a collective with it broke here: {first[:200]})"
