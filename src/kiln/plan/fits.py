"""What fits on which card: an 8B model (Llama-3-8B shape) in each way of training it, on the cards users have,
as `kiln plan` plans it.

    python -m kiln.plan.fits            # print the two tables (the docs page's and the README's)
    python -m kiln.plan.fits --write    # write them between their markers in docs/fits.md and README.md

Each row is a preset (its sequence and micro-batch as shipped), each column a card; a cell is the plan of that
preset there with the fastest activation checkpointing that fits the preset's micro-batch: its peak memory and
tokens/s per GPU, or what it would need. Nothing is measured here: docs/fits.md keeps the measured rows beside
these by hand, and a test keeps the planned tables equal to this module's output.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.plan.gpus import GIB, GPUS

SHAPE = ["model.init_from=null", "model.size=8b", "model.vocab_size=128256"]  # Llama-3-8B
# (row name, preset, what trains)
MODES = [("full", "cpt-8b-4gpu", "every weight; AdamW state in GPU memory, sharded by FSDP over several GPUs"),
         ("full, optimizer in host memory", "cpt-8b-24gb", "every weight; fp32 masters and AdamW on the CPU"),
         ("LoRA", "cpt-8b-1gpu", "adapters of rank 16 on a frozen bf16 base"),
         ("QLoRA", "cpt-8b-16gb", "adapters of rank 16 on a frozen base in 4-bit NF4")]
# (column title, card key, GPUs); the card's short name
CARDS = [("16 GB", "rtx4080", 1), ("24 GB", "rtx4090", 1), ("48 GB", "l40s", 1), ("80 GB", "h100", 1),
         ("4x 80 GB", "h100", 4)]
NAMES = {"rtx4080": "RTX 4080", "rtx4090": "RTX 4090", "l40s": "L40S", "h100": "H100"}
AC_ORDER = ("none", "selective", "full")  # fastest first
BEGIN, END = "<!-- kiln.plan.fits: {} (python -m kiln.plan.fits --write) -->", "<!-- end of kiln.plan.fits -->"


@dataclass(frozen=True)
class Cell:
    fits: bool
    ac: str | None  # the activation checkpointing planned (None: the mode does not run on this many GPUs)
    peak: float  # bytes per device (the least any AC needs where none fits)
    tokens_per_s_per_gpu: float | None
    why: str = ""


def plan_cell(preset: str, card: str, gpus: int) -> Cell:
    from kiln.config import load_config
    from kiln.plan.estimate import make_plan, needs

    gpu = GPUS[card]
    offload = load_config(preset, SHAPE).train.offload != "none"
    if gpus > 1 and offload:
        return Cell(False, None, 0.0, None, "one GPU only")
    best = None
    for ac in ("full",) if offload else AC_ORDER:  # the offloaded step recomputes each layer itself (full)
        plan = make_plan(load_config(preset, [*SHAPE, f"train.activation_checkpointing={ac}"]), gpus, gpu)
        need = needs(plan.memory, gpu)
        if plan.fits:
            tps = plan.tokens_per_s / gpus if plan.tokens_per_s else None
            return Cell(True, ac, plan.memory.peak, tps)
        best = min(best or need, need)
    return Cell(False, "full", best, None, f"needs {best / GIB:.0f} GiB")


def cells() -> dict[tuple[str, str], Cell]:
    return {(preset, title): plan_cell(preset, card, gpus) for _, preset, _ in MODES for title, card, gpus in CARDS}


def _rate(tps: float | None) -> str:
    return "" if tps is None else f", ~{tps / 1000:.1f}K tok/s" if tps >= 1000 else f", ~{tps:.0f} tok/s"


def _head() -> list[str]:
    titles = [f"{title} ({'4x ' if gpus > 1 else ''}{NAMES[card]})" for title, card, gpus in CARDS]
    return ["| | " + " | ".join(titles) + " |", "| --- |" + " --- |" * len(CARDS)]


def _row_name(name: str, preset: str) -> str:
    from kiln.config import load_config

    t = load_config(preset, SHAPE).train
    return f"{name} (`{preset}`: sequence {t.seq_len}, micro-batch {t.batch_size})"


def table(found: dict[tuple[str, str], Cell] | None = None) -> str:
    """The docs page's table: each cell's verdict, AC, peak GiB and tokens/s per GPU."""
    found = found or cells()
    lines = _head()
    for name, preset, _ in MODES:
        out = []
        for title, _, _ in CARDS:
            c = found[(preset, title)]
            if c.ac is None:
                out.append(f"- ({c.why})")
            elif c.fits:
                out.append(f"**yes**: AC {c.ac}, {c.peak / GIB:.0f} GiB{_rate(c.tokens_per_s_per_gpu)}")
            else:
                out.append(f"no ({c.why})")
        lines.append(f"| {_row_name(name, preset)} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def short_table(found: dict[tuple[str, str], Cell] | None = None) -> str:
    """The README's: yes (with the AC) or no."""
    found = found or cells()
    lines = ["| 8B model | " + " | ".join(title for title, _, _ in CARDS) + " |", "| --- |" + " --- |" * len(CARDS)]
    for name, preset, _ in MODES:
        out = []
        for title, _, _ in CARDS:
            c = found[(preset, title)]
            out.append("-" if c.ac is None else f"yes (AC {c.ac})" if c.fits else "no")
        lines.append(f"| {name} (`{preset}`) | " + " | ".join(out) + " |")
    return "\n".join(lines)


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the lines between the markers of `name` replaced by `body` (ValueError without them)."""
    begin = BEGIN.format(name)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no '{begin}' ... '{END}' section")
    return pattern.sub(lambda _: f"{begin}\n\n{body}\n\n{END}", text)  # blank lines: Markdown sees a table


def section(text: str, name: str) -> str | None:
    """The lines between the markers of `name` in `text`, or None."""
    m = re.search(re.escape(BEGIN.format(name)) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    return m.group(1).strip("\n") if m else None


TARGETS = {"docs/fits.md": ("planned", table), "README.md": ("short", short_table)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="write the tables into docs/fits.md and README.md")
    ap.add_argument("--root", default=".", help="the repository's root (for --write)")
    args = ap.parse_args(argv)
    found = cells()
    if not args.write:
        print(table(found), "", short_table(found), sep="\n")
        return
    for rel, (name, make) in TARGETS.items():
        path = Path(args.root) / rel
        path.write_text(replace_section(path.read_text(), name, make(found)))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
