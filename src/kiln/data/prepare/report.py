"""The prepare report: what went in, what came out, what was dropped and why.

Built at the end of `prepare` from the shard indexes (so it is exact, also after a resumed run),
saved as report.json beside the shards, copied into the manifest and printed as a table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.data.read.records import EXAMPLES, REASONS, RecordChecker


def doc_lengths(root: Path, shards: list[dict], cap: int = 10_000_000) -> np.ndarray:
    """Token counts of the documents of `shards` (an even sample of at most `cap` of them)."""
    total = sum(s["documents"] for s in shards)
    step = max(1, -(-total // cap))
    parts = []
    for s in shards:
        ends = np.fromfile(root / f"{s['name']}.idx", dtype="<u8").astype(np.int64)
        parts.append(np.diff(ends, prepend=0)[::step])
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def unknown_tokens(root: Path, shards: list[dict], dtype, unk_id: int) -> int:
    """How many tokens of `shards` are the unknown token `unk_id`."""
    return sum(int(np.count_nonzero(np.memmap(root / f"{s['name']}.bin", dtype=dtype, mode="r") == unk_id))
               for s in shards if s["tokens"])


def build_report(root: Path, splits: dict[str, list[dict]], checker: RecordChecker, *, files: int,
                 input_bytes: int, read_documents: int, seconds: float, resumed_shards: int,
                 max_bytes: int | None = None, passed_over: list[str] = (), specials: str | None = None,
                 unknown: tuple[int, str, object] | None = None) -> dict:
    """The report of a prepared dataset; `passed_over`: files in source directories not read (see `expand`);
    `unknown`: (id, text, shard dtype) of the tokenizer's unknown token, if it has one, to count it."""
    lengths = doc_lengths(root, [s for shards in splits.values() for s in shards])
    out = {s: {"documents": sum(x["documents"] for x in v), "tokens": sum(x["tokens"] for x in v),
               "shards": len(v)} for s, v in splits.items()}
    docs = sum(v["documents"] for v in out.values())
    tokens = sum(v["tokens"] for v in out.values())
    pct = {}
    if lengths.size:
        qs = np.percentile(lengths, [0, 10, 50, 90, 99, 100])
        pct = {"min": int(qs[0]), "p10": int(qs[1]), "p50": int(qs[2]), "p90": int(qs[3]), "p99": int(qs[4]),
               "max": int(qs[5]), "mean": round(float(lengths.mean()), 1)}
    dropped = dict(sorted(checker.dropped.items()))
    unk = {}
    if unknown is not None:
        n = sum(unknown_tokens(root, shards, unknown[2], unknown[0]) for shards in splits.values())
        unk = {"unknown_tokens": n, "unknown_token": unknown[1]}
    return {
        "files": files, "files_passed_over": len(passed_over), "passed_over_examples": list(passed_over[:EXAMPLES]),
        "input_bytes": input_bytes, "documents_read": read_documents,
        "stopped_at_max_bytes": max_bytes,
        "documents": docs, "tokens": tokens, "splits": out, "special_tokens": specials,
        "dropped": dropped, "dropped_examples": {k: checker.examples[k] for k in dropped},
        "duplicates_removed": dropped.get("duplicate", 0),
        "document_tokens": pct, "seconds": round(seconds, 2),
        "documents_per_s": round(read_documents / seconds, 1) if seconds else None,
        "tokens_per_s": round(tokens / seconds, 1) if seconds and not resumed_shards else None,
        "resumed_shards": resumed_shards, **unk,
    }


def passed_over_text(count: int, examples: list[str]) -> str:
    """What `kiln prepare` (and a streaming run) says of the files of source directories it did not read."""
    return (f"{count:,} file(s) in source directories not read: of unknown type, text in a folder of record "
            f"files, no regular file (a pipe, a socket), or a folder a glob matched (e.g. "
            f"{', '.join(examples[:EXAMPLES])}); name a file or folder to read it")


def print_report(report: dict, console, path: Path, reused: bool | str = False) -> None:
    """`reused`: True, or why a dataset of other settings was (kiln.data.prepare.trained_on)."""
    from rich.table import Table

    why = reused if isinstance(reused, str) else "same inputs, tokenizer and settings"
    title = f"reused the prepared dataset {path} ({why})" if reused else f"prepared {path}"
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("input", f"{report['files']:,} files, {report['input_bytes'] / 1e6:,.1f} MB, "
                       f"{report['documents_read']:,} documents read"
                       + (f" (stopped at data.max_bytes={report['stopped_at_max_bytes']:,} characters)"
                          if report.get("stopped_at_max_bytes") else ""))
    if report.get("files_passed_over"):
        t.add_row("passed over", passed_over_text(report["files_passed_over"], report["passed_over_examples"]))
    if report.get("special_tokens"):
        t.add_row("each document", report["special_tokens"])
    for name, s in report["splits"].items():
        t.add_row(name, f"{s['documents']:,} documents, {s['tokens']:,} tokens, {s['shards']} shard(s)")
    d = report["document_tokens"]
    if d:
        t.add_row("tokens/doc", f"mean {d['mean']:,}  p10 {d['p10']:,}  p50 {d['p50']:,}  p90 {d['p90']:,}  "
                                f"p99 {d['p99']:,}  max {d['max']:,}")
    if report.get("unknown_tokens"):
        n, share = report["unknown_tokens"], report["unknown_tokens"] / max(1, report["tokens"])
        t.add_row("unknown", f"{n:,} tokens ({share:.2%}) are the tokenizer's unknown token "
                             f"{report['unknown_token']}: text it has no token for (other scripts, emoji) is lost "
                             "there; a tokenizer with byte fallback (a byte-level BPE: data.tokenizer unset) keeps it")
    for reason, n in report["dropped"].items():
        ex = ", ".join(report["dropped_examples"].get(reason, []))
        if reason == "damaged_file":  # files, not records
            t.add_row(f"cut short: {reason}", f"{n:,} file(s) could not be read to their end (truncated or corrupt; "
                                              f"the records before the damage were kept): {ex}")
        else:
            t.add_row(f"dropped: {reason}", f"{n:,} (record {REASONS[reason]}; e.g. {ex})")
    speed = f"{report['seconds']:.1f} s"
    if report["tokens_per_s"]:
        speed += f", {report['documents_per_s']:,.0f} docs/s, {report['tokens_per_s']:,.0f} tokens/s"
    if report["resumed_shards"]:
        speed += f" ({report['resumed_shards']} shard(s) kept from an interrupted run)"
    t.add_row("prepared in" if reused else "time", speed)
    console.print(t)
