"""Shared by the end-to-end tests: a small corpus of Python standard library source."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_corpus(directory: Path, documents: int, modules: int = 40) -> Path:
    """Write `documents` text files of 2 kB each, cut from the first `modules` stdlib modules, into `directory`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:modules])
    for i in range(documents):
        (directory / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    return directory


def tiny_cpu_run(cache: Path, corpus: Path, steps: int, every: int) -> list[str]:
    """`kiln train` overrides of a short run of the tiny model on the CPU over `corpus`: a checkpoint every
    `every` steps, every step logged to metrics.jsonl, no console."""
    return ["model.size=tiny", "train.seq_len=32", f"train.max_steps={steps}", "train.warmup_steps=2",
            "train.eval_every=0", "train.eval_batches=2", "train.sample_tokens=0", "train.device=cpu",
            "train.precision=fp32", f"checkpoint.every={every}", "logging.every=1", "logging.console=false",
            f"data.sources=[{corpus}]", "data.val_fraction=0.1", "data.vocab_size=512", f"data.cache_dir={cache}"]
