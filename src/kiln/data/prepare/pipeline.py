"""Prepare: sources -> validated, deduplicated, tokenized, content-addressed token shards.

    ds = prepare(cfg.data)          # a PreparedDataset (reused when already complete)

The dataset's id hashes the sources' contents (sha256 of every file), the tokenizer's hash and
every setting that changes the output, so the same inputs reuse a dataset and any change makes
a new one: a stale cache cannot be used. Documents are read in a fixed order by this process,
validated, deduplicated by content hash and split train/val by that hash; a pool of worker
processes encodes them in batches, and shards are written in order.

The sources are read once: each file is hashed while it is read for encoding, so the id is
known only at the end. Until then the shards go to `datasets/partial-<key>`, the key naming the
inputs without reading them (a local file's path, size, inode and times, a remote one's ETag or
checksum; a file with neither is hashed first), the tokenizer and the settings. At the end
`manifest.json` is written and the directory renamed to `datasets/<id>`: a directory named by
an id is complete. File hashes are remembered by that key (`source-hashes.json`), so unchanged
sources give the id without reading and a finished dataset is reused at once. Files not
recognised (copied, touched) whose sizes match those a dataset was made from (a
`datasets/sizes-<hash>` marker) are hashed before anything else, so that copies reuse it too.

Each finished shard is marked complete on disk; an interrupted prepare (Ctrl-C, kill -9) run
again finds the same partial directory, reads the sources again, passes over the documents of
complete shards without encoding them and goes on from there; a source changed in between
changes the key, and the work starts again. Processes preparing the same sources take turns on
a lock on the key: the later ones then find the hashes remembered and the dataset done. Copies
of the same files at other paths may be prepared at once: the later to finish finds the
dataset in place and drops its own.

A finished dataset is reused only after a cheap check: its manifest is whole and consistent and
every file it names has the size it says (stat calls, no reading). A damaged one (a shard truncated
or deleted, the manifest edited) is removed and made again, saying so. A changed byte of the same
size is found only by re-hashing every shard: `kiln prepare --verify DIR` does that; remove the
directory it condemns and prepare again. Before it takes its lock, a prepare removes what
interrupted ones left and no live process uses (`kiln.data.prepare.cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kiln.data.format.dataset import FORMAT, PreparedDataset, open_dataset
from kiln.data.prepare.bpe import sigterm_interrupts
from kiln.data.prepare.cache import INPUTS, cache_errors, open_cache, remove_stale, write_inputs
from kiln.data.prepare.encode import Encoder
from kiln.data.prepare.keys import dataset_settings, digest, read_forms, train_chars
from kiln.data.prepare.progress import PrepareBar
from kiln.data.prepare.report import build_report, print_report
from kiln.data.prepare.tokenizer import Tokenizer, describe_specials, load_or_train
from kiln.data.prepare.trained_on import same_files_earlier_reader, trained_tokenizer
from kiln.data.prepare.writer import ShardWriter, completed_shards
from kiln.data.read.records import Deduplicator, RecordChecker, is_val
from kiln.data.read.sources import SourceFile, expand, file_sha256, iter_documents
from kiln.errors import DataError
from kiln.files import atomic_write, file_lock

BATCH_BYTES = 1 << 18  # text per encoding task: small enough to keep every worker busy to the end
BATCH_DOCS = 4096
POOL_MIN_BYTES = 2_000_000  # smaller inputs are encoded in this process (no pool start-up)
SPLITS = ("train", "val")


class SourceHashes:
    """The sha256 of source files, known without reading them where possible: remembered under
    `cache` by what identifies a file's content (`_memo_key`); a file with no such key is hashed now."""

    def __init__(self, files: list[SourceFile], cache: Path):
        self.files, self.path = files, cache / "source-hashes.json"
        self.keys = [_memo_key(sf) for sf in files]  # taken before any reading: a later write changes them
        self.unkeyed = {i: file_sha256(files[i]) for i, k in enumerate(self.keys) if k is None}

    def known(self) -> list[dict | None]:
        """{path, bytes, sha256} of each file whose hash is known, None for the others."""
        memo = self._load()
        return [self.unkeyed.get(i) or ({"path": sf.url, "bytes": sf.size, "sha256": memo[k]} if k in memo else None)
                for i, (sf, k) in enumerate(zip(self.files, self.keys))]

    def all(self) -> list[dict]:
        """{path, bytes, sha256} of every file; those not known are read now (and remembered)."""
        out = [s or file_sha256(sf) for s, sf in zip(self.known(), self.files)]
        self.remember(out)
        return out

    def remember(self, sources: list[dict]) -> None:
        memo = self._load()
        fresh = {k: s["sha256"] for k, s in zip(self.keys, sources) if k is not None and memo.get(k) != s["sha256"]}
        if not fresh:
            return
        memo.update(fresh)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(memo))

    def identities(self) -> list[str]:
        """What names each file's content before it is read: its key, or its sha256 when it has none."""
        return [k if k is not None else "sha256:" + self.unkeyed[i]["sha256"] for i, k in enumerate(self.keys)]

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}


def _memo_key(sf: SourceFile) -> str | None:
    """What identifies a file's content without reading it, or None when nothing does: a local
    file's path, size, inode, mtime and ctime (any write changes ctime, which no tool can set
    back), a remote one's URL, size and ETag or checksum."""
    if sf.fs is None:
        return _local_key(sf.path)
    try:  # object stores: an ETag or content checksum changes with the content
        info = sf.fs.info(sf.path)
    except OSError:
        return None
    tag = next((info[k] for k in ("ETag", "etag", "md5Hash", "crc32c", "checksum") if info.get(k)), None)
    return f"{sf.url}|{info.get('size')}|{tag}" if tag else None


def _local_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _local_key_now(recorded: str) -> str | None:
    """The memo key the local file of a recorded key has now (None: it is gone)."""
    try:
        return _local_key(recorded.rsplit("|", 4)[0])
    except OSError:
        return None


def _limited(docs: Iterator, max_bytes: int | None) -> Iterator:
    """Documents until `max_bytes` of text were taken (the one crossing the limit included)."""
    total = 0
    for d in docs:
        yield d
        total += len(d.text)
        if max_bytes is not None and total >= max_bytes:
            return


def _train_texts(cfg, files: list[SourceFile]) -> Iterator[str]:
    checker = RecordChecker.from_config(cfg)
    for d in _limited(iter_documents(cfg, files, checker=checker), train_chars(cfg)):
        yield d.text


def prepare(cfg, console=None, progress: bool = True, tokenizer: Tokenizer | None = None,
            trained_on: str | None = None) -> PreparedDataset:
    """Prepare `cfg.sources` (a DataConfig), or reuse the complete dataset of the same id.

    `console` (a rich Console) gets the progress bar and the report; None prints nothing. `trained_on`: the id of
    the dataset a resumed checkpoint trained on, reused where a Kiln of another reader version made it from these
    very files (kiln.data.prepare.trained_on).
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # a spawned tokenizer worker is importing the caller's script, which calls prepare at import
        # time: without this it would wait forever on the lock its parent holds
        raise DataError("prepare() ran while a worker process was starting: call it under "
                        "`if __name__ == \"__main__\":` in your script (worker processes import it)")
    start = time.perf_counter()
    cache = open_cache(cfg.cache_dir)
    with cache_errors(cache), sigterm_interrupts():  # SIGTERM stops it as Ctrl-C does: finished shards are kept
        ds, reused = _prepare(cfg, cache, console, progress, tokenizer, start, trained_on)
    if console is not None:
        print_report(ds.manifest["report"], console, ds.path, reused)
    return ds


def _prepare(cfg, cache: Path, console, progress: bool, tokenizer: Tokenizer | None,
             start: float, trained_on: str | None = None) -> tuple[PreparedDataset, bool | str]:
    files = expand(cfg.sources, cfg.format, cfg.dataset_split)
    hashes = SourceHashes(files, cache)
    if tokenizer is None and cfg.tokenizer:
        tokenizer = Tokenizer.load(cfg.tokenizer, cfg.eos_token, cfg.bos_token)
    elif tokenizer is None and trained_on is not None:  # the BPE a resumed run's own dataset was made with
        tokenizer = trained_tokenizer(cfg, cache / "datasets" / trained_on, hashes.all(), files)
    if tokenizer is None:  # a BPE trained on the sources is cached under their hashes
        content = [[s["sha256"], form] for s, form in zip(hashes.all(), read_forms(files))]
        tokenizer = load_or_train(cfg, _train_texts(cfg, files), content, cache,
                                  console if progress else None)
    if tokenizer.eos_id is None:
        raise DataError("the tokenizer has no end-of-text token (tried <|endoftext|>, <|end_of_text|>, </s>, <eos>, "
                        "and the eos_token of a tokenizer directory's tokenizer_config.json); name one with "
                        "data.eos_token")
    settings = dataset_settings(cfg, tokenizer, files)
    datasets = cache / "datasets"
    tokenizer_json = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()  # cheaper than tokenizer.hash
    sizes = datasets / ("sizes-" + digest({"format": FORMAT, "bytes": [sf.size for sf in files],
                                              "tokenizer": tokenizer_json, "settings": settings})[:16])
    known = hashes.known()
    if None in known and sizes.is_file():  # files of these sizes made a dataset: these may be copies of them
        known = hashes.all()
    out = None if trained_on is None else same_files_earlier_reader(datasets / trained_on, hashes.all(), tokenizer,
                                                                   settings)  # a resumed run's own, kept
    kept = out is not None and out.name != _dataset_id(hashes.all(), tokenizer, settings)
    out = out or _finished(datasets, known, tokenizer, settings)
    if out is not None and _damage(out, tokenizer) is not None:
        out = None  # replaced below, under the lock
    reused = out is not None
    if reused and kept:
        return open_dataset(out, tokenizer.hash), ("the dataset this run trained on, made of the same files by an "
                                                   "earlier Kiln's readers")
    if not reused:
        key = digest({"format": FORMAT, "sources": hashes.identities(), "tokenizer": tokenizer_json,
                       "settings": settings})[:16]
        partial = datasets / f"partial-{key}"
        remove_stale(datasets, partial.name, _local_key_now, console)
        with file_lock(datasets / f"{partial.name}.lock",
                       f"waiting for another process preparing the same dataset ({partial})", console):
            out = _finished(datasets, hashes.known(), tokenizer, settings)  # finished meanwhile by another process
            why = _damage(out, tokenizer) if out is not None else None
            if why is not None:
                if console is not None:
                    console.print(f"{out} is damaged ({why}); removing it and preparing it again",
                                  highlight=False)
                _remove(out)
                out = None
            reused = out is not None
            if not reused:
                try:
                    out = _build(cfg, hashes, tokenizer, settings, partial, console if progress else None, start)
                except DataError:  # bad data: the same inputs and settings fail the same way, and fixed ones
                    shutil.rmtree(partial, ignore_errors=True)  # have another key; nothing to go on from
                    raise
                sizes.write_text(out.name)
    return open_dataset(out, tokenizer.hash), reused


def _dataset_id(sources: list[dict], tokenizer: Tokenizer, settings: dict) -> str:
    return digest({"format": FORMAT, "sources": [s["sha256"] for s in sources], "tokenizer": tokenizer.hash,
                    "settings": settings})[:16]


def _finished(datasets: Path, sources: list[dict | None], tokenizer: Tokenizer, settings: dict) -> Path | None:
    """The complete dataset of these sources (all hashes known), or None."""
    if any(s is None for s in sources):
        return None
    out = datasets / _dataset_id(sources, tokenizer, settings)
    return out if (out / "manifest.json").is_file() else None


def _damage(out: Path, tokenizer: Tokenizer) -> str | None:
    """Why the finished dataset `out` cannot be reused (from its manifest and file sizes), or None."""
    try:
        return open_dataset(out, tokenizer.hash).damage()
    except DataError as e:
        return str(e)


def _remove(d: Path) -> None:
    """Delete a directory, renamed first so that no reader takes it for complete meanwhile."""
    aside = d.with_name(f"damaged-{d.name}-{os.getpid()}")
    try:
        os.rename(d, aside)
    except FileNotFoundError:  # removed by another process meanwhile
        return
    shutil.rmtree(aside, ignore_errors=True)


def _workers(cfg, files: list[SourceFile]) -> int:
    n = cfg.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    total = sum(f.size for f in files)
    return 1 if total < POOL_MIN_BYTES else max(1, n)


def _build(cfg, hashes: SourceHashes, tokenizer: Tokenizer, settings: dict, partial: Path, console,
           start: float) -> Path:
    """Write the dataset in `partial` (going on from its complete shards), then rename it to its id."""
    files = hashes.files
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    encoder = Encoder(tokenizer, dtype, _workers(cfg, files), cfg.parse_special_tokens)  # before any thread
    partial.mkdir(parents=True, exist_ok=True)
    write_inputs(partial, hashes.keys)
    done = {s: completed_shards(partial, s, dtype) for s in SPLITS}
    skip = {s: sum(e["documents"] for e in done[s]) for s in SPLITS}
    seen = dict.fromkeys(SPLITS, 0)
    writers = {s: ShardWriter(partial, s, dtype, cfg.shard_tokens, first=len(done[s])) for s in SPLITS}
    checker = RecordChecker.from_config(cfg)
    dedup = Deduplicator() if cfg.dedup else None
    total_bytes = sum(f.size for f in files)
    if cfg.max_bytes is not None:
        total_bytes = min(total_bytes, cfg.max_bytes)
    bar = PrepareBar(console, total_bytes)
    read_hashes: dict[int, dict] = {}
    batch: dict[str, list[str]] = {s: [] for s in SPLITS}
    size = dict.fromkeys(SPLITS, 0)
    read, chars = 0, 0

    def write(drain: bool = False) -> None:
        for split, tokens, lengths in encoder.results(drain):
            writers[split].add(tokens, lengths)
            bar.tokens(len(tokens))

    def flush(split: str) -> None:
        encoder.submit(split, batch[split])
        batch[split], size[split] = [], 0
        write()

    try:
        with bar:
            docs = iter_documents(cfg, files, checker=checker, progress=bar.bytes, hashes=read_hashes)
            for doc in _limited(docs, cfg.max_bytes):
                read += 1
                chars += len(doc.text)
                bar.docs(1)
                data = doc.text.encode("utf-8")
                h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
                if dedup is not None and dedup.seen(h):
                    checker.drop("duplicate", doc.source, doc.record_index, doc.line)
                    continue
                split = "val" if is_val(h, cfg.val_fraction) else "train"
                seen[split] += 1
                if seen[split] <= skip[split]:
                    continue  # in a shard completed by an earlier, interrupted run
                batch[split].append(doc.text)
                size[split] += len(data)
                if size[split] >= BATCH_BYTES or len(batch[split]) >= BATCH_DOCS:
                    flush(split)
            for split in SPLITS:
                if batch[split]:
                    encoder.submit(split, batch[split])
            # while the workers finish: hash the files cut short by max_bytes or never reached, name the dataset
            sources = [read_hashes.get(i) or file_sha256(sf) for i, sf in enumerate(files)]
            ds_id = _dataset_id(sources, tokenizer, settings)
            tokenizer.save(partial / "tokenizer.json")
            write(drain=True)
            for w in writers.values():
                w.finish()
    except KeyboardInterrupt:
        encoder.close(cancel=True)
        kept = sum(w.index for w in writers.values())
        if console is not None:
            console.print(f"prepare interrupted: {kept} shard(s) complete in {partial}; run it again to finish")
        raise
    except BaseException:
        encoder.close(cancel=True)  # no waiting on workers after a failure (a dead one can hang the pool)
        raise
    finally:
        encoder.close()

    splits = {s: done[s] + writers[s].written for s in SPLITS}
    if not sum(e["tokens"] for e in splits["train"]):
        dropped = ", ".join(f"{n} {r}" for r, n in checker.dropped.items()) or "none"
        val = sum(e["documents"] for e in splits["val"])
        fix = (f"give more documents or lower data.val_fraction={cfg.val_fraction}" if val else
               "check the files, data.format and data.field")
        raise DataError(f"no training documents in data.sources={cfg.sources} ({read} documents read; dropped: "
                        f"{dropped}; to validation: {val}); {fix}")
    hashes.remember(sources)
    report = build_report(partial, splits, checker, files=len(files), input_bytes=sum(s["bytes"] for s in sources),
                          read_documents=read, seconds=time.perf_counter() - start,
                          resumed_shards=sum(len(done[s]) for s in SPLITS), passed_over=files.passed_over,
                          max_bytes=cfg.max_bytes if cfg.max_bytes is not None and chars >= cfg.max_bytes else None,
                          specials=describe_specials(tokenizer, cfg.bos_token),
                          unknown=None if tokenizer.unk_id is None else
                          (tokenizer.unk_id, tokenizer.tk.id_to_token(tokenizer.unk_id), dtype))
    (partial / "report.json").write_text(json.dumps(report, indent=2))
    manifest = {
        "format": FORMAT, "id": ds_id, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "tokenizer_hash": tokenizer.hash,
        "settings": settings, "settings_hash": digest(settings)[:16], "sources": sources,
        "splits": {s: {"documents": sum(e["documents"] for e in v), "tokens": sum(e["tokens"] for e in v),
                       "shards": v} for s, v in splits.items()},
        "report": report, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (partial / INPUTS).unlink(missing_ok=True)
    atomic_write(partial / "manifest.json", json.dumps(manifest, indent=1))
    out = partial.parent / ds_id
    _publish(partial, out)
    return out


def _publish(partial: Path, out: Path) -> None:
    """Rename the finished `partial` directory to `out`, unless a complete `out` is already there."""
    try:
        os.rename(partial, out)
        return
    except OSError:
        if not out.is_dir():
            raise
    if (out / "manifest.json").is_file():  # the same content, prepared meanwhile from files at other paths
        shutil.rmtree(partial)
    else:  # an incomplete one, written in place by an earlier Kiln
        shutil.rmtree(out)
        os.rename(partial, out)
