"""One offline W&B run per Kiln run, across resumes.

W&B cannot resume an offline run: each process that opens run id X offline writes its own folder
wandb/offline-run-<time>-X, whose history starts again at `_step` 0, and `wandb sync` of several folders of
one id keeps the last one it uploads. So each process that opens X offline first logs again, into its new
folder, the history its predecessors left (`resolved_history`), and at its end moves their folders to
wandb/superseded/: the newest folder holds the whole run, and `wandb sync wandb/offline-run-*` uploads it.

A process can be killed while it copies. Before copying, it writes into its folder REPLAYED, the number of
rows it is about to log again; a folder with fewer rows than that (its copy was not all written) adds
nothing, and its predecessors stand. The history is read from each folder's run-<id>.wandb transaction log:
a 7-byte header, then records in LevelDB's log framing (32 KiB blocks, each piece of a record with a 7-byte
header: crc32, length, type 1 full / 2 first / 3 middle / 4 last), each a protobuf `Record` of W&B's.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

REPLAYED = "kiln-replayed.json"  # in an offline run folder: {"rows": rows it logged again before its own}
SUPERSEDED = "superseded"
BLOCK = 32768


def records(path: Path) -> list:
    """The protobuf records of a .wandb transaction log, up to the first incomplete one (a killed writer)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return []
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a piece's header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + n > len(data):
            break
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            try:
                rec.ParseFromString(part)
            except Exception:  # a record cut short: the log ends here  # noqa: BLE001
                break
            out.append(rec)
            part = b""
    return out


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_folder(folder: Path) -> tuple[float, list[dict]]:
    """(start time, history rows) of an offline run folder; a row holds the logged values without W&B's own
    `_step`, `_runtime` and `_timestamp`."""
    start, rows = 0.0, []
    for log in folder.glob("run-*.wandb"):
        for rec in records(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run" and rec.run.HasField("start_time"):
                start = rec.run.start_time.seconds + rec.run.start_time.nanos / 1e9
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return start, rows


def _replayed(folder: Path) -> int:
    try:
        return int(json.loads((folder / REPLAYED).read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def resolved_history(wandb_dir: Path, run_id: str, exclude: Path | None = None) -> tuple[list[dict], list[Path]]:
    """(the run's history, the folders it comes from) from the offline folders of `run_id` in `wandb_dir`
    but `exclude` (the folder of this process), in the order they started."""
    name = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")  # -N: a second in the same second
    folders = [f for f in wandb_dir.glob("offline-run-*") if name.fullmatch(f.name) and f.is_dir() and f != exclude]
    read = sorted((read_folder(f) + (f,) for f in folders), key=lambda t: (t[0], t[2].name))
    history: list[dict] = []
    used: list[Path] = []
    for _, rows, folder in read:
        copied = _replayed(folder)
        if len(rows) < copied:  # killed while it copied its predecessors: they stand, it adds nothing
            used.append(folder)
            continue
        history = rows if copied else history + rows
        used.append(folder)
    return history, used


def mark_replaying(folder: Path, rows: int) -> None:
    (folder / REPLAYED).write_text(json.dumps({"rows": rows}) + "\n")


def set_aside(folders: list[Path]) -> None:
    """Move folders whose history the newest folder holds to wandb/superseded/ (kept, not synced by
    `wandb sync wandb/offline-run-*`)."""
    for f in folders:
        if f.is_dir():
            dest = f.parent / SUPERSEDED
            dest.mkdir(exist_ok=True)
            shutil.move(str(f), str(dest / f.name))
