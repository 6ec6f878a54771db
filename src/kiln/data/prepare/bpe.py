"""Training a byte-level BPE in a child process, with progress, that Ctrl-C, SIGTERM and SIGHUP stop at once.

    train_in_child(texts, vocab_size, specials, out, console, total_chars)   # writes `out` (tokenizer.json)

The tokenizers library trains in Rust without returning to Python until it is done, so a signal
handler of the process that trains runs only at the end (minutes or hours later). So this process
reads the sources and sends their texts, in batches, to a child that trains; it shows the
characters sent, then a spinner while the child learns its merges, and waits in a loop that a
signal interrupts. On Ctrl-C, SIGTERM or SIGHUP (`sigterm_interrupts`) or an error, the child is killed and
nothing is written. The child ignores SIGINT and SIGHUP (a Ctrl-C or a closed terminal reaches the whole process
group: this process decides) and, on Linux, dies with its parent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.errors import DataError, ResourceError

EOS = "<|endoftext|>"  # the end-of-text token of a BPE trained here

SEND_CHARS = 1 << 20  # characters of text per message to the child


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt raised by SIGTERM or SIGHUP (`sigterm_interrupts`); `kiln` exits 128 + its number (143,
    129) for it."""

    signum = signal.SIGTERM

    def __init__(self, *args, signum: int = signal.SIGTERM):
        super().__init__(*args)
        self.signum = signum


STOPS = (signal.SIGTERM, signal.SIGHUP)  # the signals `sigterm_interrupts` turns into an Interrupted


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While active (in the main thread), SIGTERM and SIGHUP (a closed terminal or ssh session) stop the process as
    Ctrl-C does: an `Interrupted` (a KeyboardInterrupt) is raised, so cleanup runs and locks are released. A signal
    ignored (SIGHUP under nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield  # another thread: signals come to the main one
        return

    def raise_interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name, signum=signum)

    previous = {}
    for sig in STOPS:
        current = signal.getsignal(sig)
        # `kiln`'s main gives the whole process kiln.state.after_save's handler, which until a run is saved does what
        # was there before it (the default: the process ends without a word, its lock and staging files left)
        if current is signal.SIG_DFL or getattr(current, "__module__", None) == "kiln.state.after_save":
            previous[sig] = signal.signal(sig, raise_interrupt)  # else handled already (`kiln train`'s own interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_name(e: KeyboardInterrupt) -> str:
    signum = getattr(e, "signum", None)  # kiln train's interrupt carries its signal, as `sigterm_interrupts`' does
    return signal.Signals(signum).name if signum in STOPS else "Ctrl-C"


def _child(conn, vocab_size: int, specials: list[str], out: str, parent: int) -> None:
    """The training process: texts come in batches over `conn` (None ends them); sends None when `out`
    is written, or the error's text."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal's, sent to the group: as Ctrl-C's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked: not the parent's handler (which raises)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
        if os.getppid() != parent:  # it died before that call
            os._exit(1)
    def texts() -> Iterator[str]:
        while (batch := conn.recv()) is not None:
            yield from batch

    try:
        train_bpe(texts(), vocab_size, specials).save(out)
    except BaseException as e:  # noqa: BLE001 (sent to the parent, which raises it)
        conn.send(f"{type(e).__name__}: {e}")
    else:
        conn.send(None)
    conn.close()


class _Bar:
    """Characters sent to the trainer, then a spinner while it learns merges; silent without console."""

    def __init__(self, console, total_chars: int, vocab_size: int):
        self.console, self.vocab_size, self.p = console, vocab_size, None
        if console is None:
            return
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.p = Progress(TextColumn("tokenizer"), SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.fields[done]}"), TimeElapsedColumn(), console=console, transient=True)
        self.task = self.p.add_task("reading", total=max(total_chars, 1), done="")

    def __enter__(self) -> _Bar:
        if self.p is not None:
            self.p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.p is not None:
            self.p.__exit__(*exc)

    def sent(self, chars: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, chars)
            self.p.update(self.task, done=f"{self.p.tasks[0].completed / 1e6:,.1f}M characters")

    def merging(self, chars: int) -> None:
        if self.p is not None:
            self.console.print(f"training the tokenizer: {chars:,} characters read; learning {self.vocab_size:,} "
                               "tokens (Ctrl-C stops it)", highlight=False)
            self.p.update(self.task, description="learning merges", total=None, done="")


def train_in_child(texts: Iterable[str], vocab_size: int, specials: list[str], out: Path, console=None,
                   total_chars: int = 0) -> None:
    """Train a BPE on `texts` (read here) in a child process and save it at `out` (written whole, by
    rename). `console` (rich) gets the progress; `total_chars` is what `texts` holds at most."""
    import multiprocessing as mp

    from kiln.data.prepare.encode import START_METHOD

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name.removesuffix('.json')}.tmp{os.getpid()}")
    ctx = mp.get_context(START_METHOD)
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn, vocab_size, specials, str(tmp), os.getpid()),
                       name="kiln-tokenizer-trainer", daemon=True)
    proc.start()  # before the progress bar's thread
    child_conn.close()
    try:
        with _Bar(console, total_chars, vocab_size) as bar:
            batch, size, sent = [], 0, 0
            for text in texts:
                batch.append(text)
                size += len(text)
                if size >= SEND_CHARS:
                    _send(conn, batch, proc)
                    bar.sent(size)
                    sent, batch, size = sent + size, [], 0
            _send(conn, batch, proc)
            _send(conn, None, proc)
            bar.sent(size)
            bar.merging(sent + size)
            while not conn.poll(0.2):  # a signal interrupts this wait; the child's result or end ends it
                pass
            try:
                error = conn.recv()
            except EOFError:
                raise _died(proc) from None
        if error is not None:
            raise RuntimeError(f"training the tokenizer failed: {error}")
        proc.join()
        os.replace(tmp, out)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        conn.close()
        tmp.unlink(missing_ok=True)


def _send(conn, obj, proc) -> None:
    try:
        conn.send(obj)
    except (BrokenPipeError, ConnectionResetError):
        raise _died(proc) from None


def _died(proc) -> ResourceError:
    proc.join(5)
    how = f"killed by signal {-proc.exitcode}" if proc.exitcode is not None and proc.exitcode < 0 else \
        f"exit code {proc.exitcode}"
    return ResourceError(f"the process training the tokenizer died ({how}): out of memory? Lower "
                         "data.tokenizer_train_bytes or data.vocab_size, or give a trained one with data.tokenizer")


WORD_BYTES = 256  # a pre-tokenized word longer than this many bytes is cut into pieces of at most this many


def bpe_pre_tokenizer():
    """GPT-2's byte-level pre-tokenisation, with words cut into pieces of at most WORD_BYTES bytes: the BPE
    trainer's time grows with the square of a word's length (a 200K-character run of one letter took 76 s,
    3 MB hours), and no merge is learnt across a cut, so encoding stays lossless and cuts long words alike."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False),
                                    pre_tokenizers.Split(Regex(f".{{1,{WORD_BYTES}}}"), "isolated")])


def check_vocab_size(vocab_size: int, specials: list[str]) -> None:
    if vocab_size < 256 + len(specials):
        raise DataError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
                        f"{256 + len(specials)} (256 bytes + special tokens)")


def train_bpe(texts: Iterable[str], vocab_size: int, specials: list[str] | None = None):
    """A byte-level BPE (`tokenizers.Tokenizer`; GPT-2 style pre-tokenisation, words of at most WORD_BYTES
    bytes) trained on `texts` in this process, its special tokens first."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = specials or [EOS]
    check_vocab_size(vocab_size, specials)
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = bpe_pre_tokenizer()
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    return tk
