"""The progress bar of `kiln prepare`: input bytes read, documents/s, tokens/s and the time left."""

from __future__ import annotations

import time


class PrepareBar:
    """A rich progress bar over input bytes, with documents/s, tokens/s and ETA; silent without console."""

    def __init__(self, console, total_bytes: int):
        self.p = None
        self.n_docs, self.n_tokens, self.t0 = 0, 0, time.perf_counter()
        if console is None:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                          TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console,
                          transient=True)
        self.task = self.p.add_task("prepare", total=max(total_bytes, 1), rate="")
        self.last = 0.0

    def __enter__(self):
        if self.p is not None:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.__exit__(*exc)

    def bytes(self, n: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, n)

    def docs(self, n: int) -> None:
        self.n_docs += n

    def tokens(self, n: int) -> None:
        self.n_tokens += n
        now = time.perf_counter()
        if self.p is not None and now - self.last > 0.5:
            dt = now - self.t0
            self.p.update(self.task, rate=f"{self.n_docs / dt:,.0f} docs/s {self.n_tokens / dt:,.0f} tokens/s")
            self.last = now
