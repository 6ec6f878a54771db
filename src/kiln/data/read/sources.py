"""Where documents come from: files, directories, globs, fsspec URLs, saved Hugging Face datasets
and '@stdlib' (this Python's own standard library source), in any of the formats of `readers`.
A dataset on the Hugging Face Hub is an fsspec URL too: `hf://datasets/ORG/NAME/data/*.parquet` (or
the repository's folder) reads through huggingface_hub's HfFileSystem, its files in the same order.

    files = expand(["data/*.jsonl.zst", "s3://bucket/corpus/", "@stdlib"])
    for doc in iter_documents(cfg.data):           # validated documents, in a fixed order
        doc.text, doc.origin                       # "data/a.jsonl.zst:12"
    iter_documents(cfg.data, start=(3, 1000))      # resume: file 3, from its record 1000 on

The order is fixed: sources in the order given, the files of a directory or glob sorted by path.
A document's position is (file_index, record_index); `record_index` counts every record of the
file, skipped ones included, so `start=(d.file_index, d.record_index + 1)` resumes right after
document `d` even when records were skipped. Memory stays bounded by the largest record
(`data.max_record_bytes`), whatever the size of the files.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import posixpath
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from kiln.data.read import readers, tables
from kiln.data.read.records import RecordChecker, where
from kiln.errors import ConfigError, DataError
from kiln.files import hash_stream

STDLIB = "@stdlib"
# How files become documents: raised whenever a reader gives other documents for the same bytes (as when
# lone CR bytes began to end lines, or a UTF-16 file stopped giving lines of NULs under on_bad_record=skip),
# so datasets and tokenizers made by the old readers are not reused
READERS_VERSION = 4  # 4: a JSON Lines line may begin with a UTF-8 byte order mark
TEXT_SUFFIXES = {".txt", ".text", ".md", ".markdown", ".rst", ".py", ".tex"}
DATA_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
                 ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
ZSTD_WINDOW = 1 << 31  # the window a .zst frame may ask for: zstd's largest, as `zstd -d --long=31` allows


class Document(NamedTuple):
    text: str
    source: str  # the file's path or URL
    file_index: int  # position of the file in the expanded source list
    record_index: int  # position of the record in its file (skipped records count too)
    line: int | None  # 1-based line where the record starts, for line-based formats

    @property
    def origin(self) -> str:
        return where(self.source, self.record_index, self.line)


@dataclass(frozen=True)
class SourceFile:
    url: str  # what the user wrote or a file it expanded to: shown in messages and the manifest
    path: str  # path inside `fs`
    size: int
    format: str
    compression: str | None = None
    lenient: bool = False  # bad records are skipped whatever the policy ('@stdlib')
    fs: Any = None  # an fsspec filesystem; None for local files
    named: bool = True  # named in data.sources itself, not found in a directory or by a glob: read as a
    # whole document (data.text_unit=file), an empty file of a directory or glob is dropped whatever the policy

    def open_raw(self) -> BinaryIO:
        try:
            return self.fs.open(self.path, "rb") if self.fs is not None else open(self.path, "rb")
        except Exception as e:  # a remote filesystem's own errors too
            if not isinstance(e, OSError) and self.fs is None:
                raise
            raise DataError(f"{self.url}: cannot open ({type(e).__name__}: {e}); check data.sources") from None

    def open(self, raw: BinaryIO) -> BinaryIO:
        """`raw` decompressed as needed, buffered for readline."""
        if self.compression == "gzip":
            return gzip.GzipFile(fileobj=raw, mode="rb")
        if self.compression == "zstd":
            try:
                import zstandard
            except ImportError:
                raise DataError(f"{self.url}: reading .zst files needs the 'zstandard' package: "
                                "pip install 'kiln[zstd]'") from None
            # up to zstd's largest window (2 GiB): `zstd --long=31` writes such frames for big corpora, and the
            # library's default 128 MiB limit refuses them ('Frame requires too much memory for decoding')
            return io.BufferedReader(_Zstd(raw, zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW)),
                                     buffer_size=readers.CHUNK)
        return raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw, buffer_size=readers.CHUNK)


class _Zstd(io.RawIOBase):
    """Zstandard frames decompressed one after another. A stream that ends inside a frame (a
    truncated file) raises EOFError: zstandard's own readers end quietly there, which would drop
    the rest of the file without a word."""

    PIECE = 1 << 16  # compressed bytes fed at a time: bounds the output of one call

    def __init__(self, raw: BinaryIO, decompressor):
        self.raw, self.new = raw, decompressor.decompressobj
        self.d, self.in_frame, self.out = self.new(), False, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.out:
            data = self.raw.read(self.PIECE)
            if not data:
                if self.in_frame:
                    raise EOFError("the zstd stream ends inside a frame (the file is truncated)")
                return 0
            out = []
            while data:
                self.in_frame = True
                out.append(self.d.decompress(data))
                data = b""
                if self.d.eof:  # a frame ended; what follows it starts the next one
                    data, self.d, self.in_frame = self.d.unused_data, self.new(), False
            self.out = memoryview(b"".join(out))
        n = min(len(b), len(self.out))
        b[:n] = self.out[:n]
        self.out = self.out[n:]
        return n


def stdlib_files() -> list[Path]:
    """The non-empty .py files of the running interpreter's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library source was not found at {root}; "
                        "give data.sources explicitly")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in skip]
        found.extend(Path(d, n) for n in names if n.endswith(".py"))
    return sorted(p for p in found if p.is_file() and p.stat().st_size)


def _detect(name: str, fmt: str, explicit: bool) -> tuple[str | None, str | None]:
    """(format, compression) of a file name; format None if a directory walk should pass over it."""
    lower = name.lower()
    compression = None
    for suffix, kind in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = kind, lower[: -len(suffix)]
    if fmt != "auto":
        return fmt, compression
    suffix = Path(lower).suffix
    if suffix in DATA_SUFFIXES:
        return DATA_SUFFIXES[suffix], compression
    if suffix in TEXT_SUFFIXES or explicit:
        return "text", compression
    return None, compression


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE turns huggingface_hub's network off (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hf_saved(fs, path: str, split: str) -> list[str] | None:
    """The arrow files of a `save_to_disk` dataset directory (a Dataset or a DatasetDict's split)."""
    join = lambda *p: "/".join(x.rstrip("/") for x in p)  # noqa: E731
    if fs.isfile(join(path, "dataset_dict.json")):
        splits = json.loads(fs.cat_file(join(path, "dataset_dict.json"))).get("splits", [])
        if split not in splits:
            raise DataError(f"{path} is a saved DatasetDict without a '{split}' split (it has: "
                            f"{', '.join(splits)}); set data.dataset_split")
        path = join(path, split)
    if not fs.isfile(join(path, "state.json")):
        return None
    state = json.loads(fs.cat_file(join(path, "state.json")))
    return [join(path, d["filename"]) for d in state.get("_data_files", [])]


def _record_folders(kinds: dict[str, str | None]) -> set[str]:
    """The folders that hold record files (of `kinds`, {path: format}), directly or in a sub-folder."""
    out: set[str] = set()
    for p, kind in kinds.items():
        if kind in (None, "text"):
            continue
        folder = posixpath.dirname(p)
        while folder not in out:
            out.add(folder)
            folder, up = posixpath.dirname(folder), folder
            if folder == up:
                break
    return out


RUN_FILES = ("metrics.jsonl", "checkpoints", "model", "train.log")  # beside config.yaml: a run directory


def _kiln_folders(files: list[str], root: str) -> set[str]:
    """The folders below `root` that Kiln wrote, of `files` (all the files under it): a data cache (its
    source-hashes.json), a prepared dataset (manifest.json beside tokenizer.json) and a run directory (config.yaml
    beside its metrics, checkpoints or model). In a folder of sources (data.sources=. with the cache or runs/ in
    it), a second `kiln prepare` read the first one's manifests, tokenizer and checkpoints as records, and a run
    resumed read its own metrics.jsonl: other documents, another dataset, the checkpoint refused."""
    children: dict[str, set[str]] = {}
    for p in files:
        d, name = posixpath.split(p)
        while len(d) > len(root.rstrip("/")):
            children.setdefault(d, set()).add(name)
            d, name = posixpath.split(d)
    found = {d for d, names in children.items()
             if "source-hashes.json" in names or {"manifest.json", "tokenizer.json"} <= names
             or ("config.yaml" in names and not names.isdisjoint(RUN_FILES))}
    return {d for d in found if not any(d.startswith(o + "/") for o in found)}


class SourceList(list):
    """The files of `expand`, plus `passed_over`: the files of directories that were not read (of
    unknown type, or text beside record files) and folders a glob matched, reported by `kiln prepare`."""

    passed_over: list[str]


def expand(sources: list[str], fmt: str = "auto", dataset_split: str = "train") -> SourceList:
    """Resolve source specs to files in a fixed order; a spec that matches nothing is an error.

    A file reached twice (the same source given twice, a path and its file:// URL, a symbolic link
    and its target) is read once. In a directory, files of unknown type (README without a suffix,
    images) are passed over and listed in `passed_over`; hidden ones (.git, .DS_Store) silently. A
    folder that holds record files (jsonl, json, parquet, csv, tsv), itself or in its sub-folders, has
    its own text files (README.md, notes.txt) passed over too, unless data.format says otherwise; text
    files in sub-folders without records are read. A file a glob or path names is always read; a folder
    a glob matches without any of its files (corpus/* matching corpus/2024/) is listed in `passed_over`.
    """
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    out = SourceList()
    out.passed_over = []
    seen: set[tuple[str, str]] = set()

    def add(fs, path: str, url: str, explicit: bool, lenient: bool = False, force: str | None = None,
            named: bool = False) -> bool:
        """Whether `path` is a source file (added now or before); `named` if the spec is the file itself."""
        form, comp = _detect(path, force or fmt, explicit)
        if form is None:
            out.passed_over.append(url)
            return False
        local = isinstance(fs, LocalFileSystem)
        try:
            st = os.stat(path) if local else None
        except FileNotFoundError:
            raise DataError(f"{url} is a broken symbolic link (to {os.readlink(path)}); remove it or restore "
                            "its target") from None
        key = ("file", f"{st.st_dev}:{st.st_ino}") if local else (str(fs.protocol), fs._strip_protocol(path))
        if key not in seen:
            seen.add(key)
            size = st.st_size if local else int(fs.size(path) or 0)
            out.append(SourceFile(url, path, size, form, comp, lenient, None if local else fs, named))
        return True

    for spec in sources:
        if spec == STDLIB:
            local = fsspec.filesystem("file")
            for p in stdlib_files():
                add(local, str(p), str(p), True, lenient=True, force="text")
            continue
        if "://" in spec:
            prefix = spec.split("://", 1)[0] + "://"
            try:
                fs, path = fsspec.core.url_to_fs(spec)
            except ImportError as e:  # fsspec names the package of the protocol
                if prefix == "hf://":  # huggingface_hub's HfFileSystem: hf://datasets/ORG/NAME/...
                    raise ConfigError(f"data source '{spec}': reading the Hugging Face Hub needs huggingface_hub: "
                                      "pip install huggingface_hub (or pip install 'kiln[hf]'), or download the "
                                      "files and give their local path") from None
                raise DataError(f"data source '{spec}': {str(e).rstrip('. ')} (needed for {prefix} URLs), or copy "
                                "the files to a local path") from None
            except Exception as e:  # an implementation's own error (a malformed URL, ...)
                raise DataError(f"data source '{spec}': not a usable URL ({type(e).__name__}: {e})") from None
        else:
            fs, path, prefix = fsspec.filesystem("file"), str(Path(spec).expanduser()), ""

        def url(p: str, prefix: str = prefix) -> str:
            return p if p.startswith(prefix) else prefix + p
        found = matched_folder = False
        try:
            if fs.isdir(path):
                arrow = _hf_saved(fs, path, dataset_split)
                if arrow is not None:
                    for p in arrow:
                        found |= add(fs, p, url(p), True, force="arrow")
                else:
                    inside = [p for p in sorted(fs.find(path))
                              if not any(part.startswith(".") for part in p[len(path):].split("/"))]
                    own = _kiln_folders(inside, path)  # a data cache or a run directory among the sources
                    out.passed_over.extend(url(d) + "/" for d in sorted(own))
                    inside = [p for p in inside if not any(p.startswith(d + "/") for d in own)]
                    special = [p for p in inside if not prefix and os.path.exists(p) and not os.path.isfile(p)]
                    out.passed_over.extend(special)  # a pipe, a socket or a device: a read could never end
                    kinds = {p: _detect(p, fmt, False)[0] for p in inside if p not in special}
                    # in a folder of records (jsonl, parquet, ...) a text file is documentation (README.md)
                    documentation = _record_folders(kinds) if fmt == "auto" else set()
                    for p, kind in kinds.items():
                        if kind == "text" and posixpath.dirname(p) in documentation:
                            out.passed_over.append(url(p))
                        else:
                            found |= add(fs, p, url(p), False)
            elif fs.isfile(path):
                found = add(fs, path, spec, True, named=True)
            elif not glob.has_magic(path) and prefix == "hf://" and hub_offline():
                raise DataError(f"data source '{spec}': HF_HUB_OFFLINE is set, so the Hugging Face Hub cannot be "
                                "read. Unset HF_HUB_OFFLINE to read the dataset, or give a local copy of its files")
            elif not glob.has_magic(path) and not prefix and os.path.exists(path):  # a device, a pipe, a socket
                raise DataError(f"data source '{spec}' is not a regular file or directory (a device, a pipe or a "
                                "socket, which could be endless or never end); copy its text into a file and name that")
            elif not glob.has_magic(path):
                relative = "" if prefix or os.path.isabs(path) else (
                    f" (a relative path, read from the current directory {os.getcwd()}: run kiln from the directory "
                    "the run was started in, or give an absolute path)")
                raise DataError(f"data source '{spec}' does not exist{relative}. Check the path or URL in "
                                "data.sources.")
            else:
                matches = fs.glob(path, recursive=True) if "://" in spec else glob.glob(path, recursive=True)
                files = [p for p in sorted(matches) if fs.isfile(p) or _broken_link(p, prefix)]  # add() says which
                for p in files:
                    found |= add(fs, p, url(p), True)
                folders = {posixpath.dirname(p) for p in files}
                for f in list(folders):
                    while f not in ("", "/") and (f := posixpath.dirname(f)) not in folders:
                        folders.add(f)
                for p in sorted(matches):  # a folder the glob matched, none of whose files it did (corpus/*)
                    if p.rstrip("/") not in folders and p not in files and fs.isdir(p) and fs.ls(p):
                        out.passed_over.append(url(p).rstrip("/") + "/")
                        matched_folder = True
        except DataError:
            raise
        except Exception as e:  # remote filesystems raise their own errors too (credentials, HTTP, ...)
            if not isinstance(e, OSError) and not prefix:
                raise
            raise DataError(f"data source '{spec}': {type(e).__name__}: {str(e).rstrip('. ')}. Check the path or "
                            "URL in data.sources (and, for a URL, its credentials).") from None
        if not found:
            folders = (" It matches folders only: name a folder itself to read the files in it, or end the glob "
                       "with /** to match them.") if matched_folder else ""
            raise DataError(f"data source '{spec}' matches no readable file (formats: .txt .md .py .jsonl .json "
                            ".parquet .csv .tsv .arrow, optionally .gz or .zst). Check the path in data.sources."
                            + folders)
    return out


def _broken_link(path: str, prefix: str) -> bool:
    """A local symbolic link whose target is gone."""
    return not prefix and os.path.islink(path) and not os.path.exists(path)


def file_sha256(sf: SourceFile) -> dict:
    """{path, bytes, sha256} of a source file, read in full."""
    with sf.open_raw() as f:
        h, n = hash_stream(f)
    return {"path": sf.url, "bytes": n, "sha256": h.hexdigest()}


class _Tap(io.RawIOBase):
    """A raw file read in order (before decompression): reports the bytes read for progress and
    hashes them, so the file's sha256 comes with reading it."""

    def __init__(self, f: BinaryIO, progress: Callable[[int], None] | None):
        self.f, self.progress = f, progress
        self.sha256, self.bytes, self.at_end = hashlib.sha256(), 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        if n:
            self.sha256.update(memoryview(b)[:n])
            self.bytes += n
        self.at_end = n == 0
        if self.progress is not None:
            self.progress(n or 0)
        return n

    def digest(self, url: str) -> dict:
        """{path, bytes, sha256} of the whole file: what the reader left unread is read now."""
        if not self.at_end:
            buf = bytearray(1 << 16)
            while self.readinto(buf):
                pass
        return {"path": url, "bytes": self.bytes, "sha256": self.sha256.hexdigest()}

    def close(self) -> None:
        self.f.close()
        super().close()


def read_records(sf: SourceFile, f: BinaryIO, field: str, text_unit: str, limit: int,
                 skip: int = 0, csv_quoting: bool = True) -> Iterator[readers.Record]:
    if sf.format == "text":
        return readers.read_text(f, text_unit, limit, skip)
    if sf.format == "jsonl":
        return readers.read_jsonl(f, field, limit, skip)
    if sf.format == "json":
        return readers.read_json(f, field, limit, skip)
    if sf.format in ("csv", "tsv"):
        return tables.read_csv(f, field, "," if sf.format == "csv" else "\t", skip, limit, csv_quoting)
    if sf.compression:
        raise DataError(f"{sf.url}: {sf.format} files cannot be read compressed; decompress it first")
    if sf.format == "parquet":
        return tables.read_parquet(f, field, skip)
    return tables.read_arrow(f, field, skip)


def iter_documents(cfg, files: list[SourceFile] | None = None, start: tuple[int, int] = (0, 0),
                   checker: RecordChecker | None = None, progress: Callable[[int], None] | None = None,
                   hashes: dict[int, dict] | None = None) -> Iterator[Document]:
    """Validated documents of `cfg.sources` (a DataConfig) from position `start` on.

    `checker` applies `cfg.on_bad_record` and keeps the counts of skipped records by reason;
    `progress` is called with the number of raw (compressed) input bytes read as reading goes.
    `hashes`, if given, gets `{path, bytes, sha256}` under a file's index once its documents were
    all read: hashed as it is read (columnar formats, which are not read in order, just before).
    Exact-duplicate removal is not done here (see `records.Deduplicator`).
    """
    files = expand(cfg.sources, cfg.format, cfg.dataset_split) if files is None else files
    checker = checker or RecordChecker.from_config(cfg)
    for fi in range(start[0], len(files)):
        sf = files[fi]
        skip = start[1] if fi == start[0] else 0
        columnar = sf.format in ("parquet", "arrow")
        whole = sf.format == "text" and cfg.text_unit == "file"  # the file is one document
        digest = file_sha256(sf) if hashes is not None and columnar else None
        raw = sf.open_raw()
        if not columnar and (progress is not None or hashes is not None):
            raw = _Tap(raw, progress)
        try:
            with raw, (raw if columnar else sf.open(raw)) as f:
                head = None if columnar or skip else f.peek(64)[:64]
                if head is not None:
                    readers.check_kind(head, sf.url, sf.format)
                records = 0
                for index, line, value in read_records(sf, f, cfg.field, cfg.text_unit, cfg.max_record_bytes, skip,
                                                          cfg.csv_quoting):
                    records += 1
                    text = checker.check(value, sf, index, line, whole)
                    if text is not None:
                        yield Document(text, sf.url, fi, index, line)
                if not records and head is not None and not head.strip():  # a record file with nothing in it
                    checker.empty_file(sf, whole=False)
                if hashes is not None:
                    hashes[fi] = digest or raw.digest(sf.url)
        except Exception as e:
            damage = _damage(e)
            if damage is None:
                if not isinstance(e, DataError):
                    raise
                msg = str(e)
                raise DataError(msg if msg.startswith(sf.url) else f"{sf.url}: {msg}") from None
            checker.damaged(sf, damage, getattr(e, "fix", None))  # raises under data.on_bad_record=error
            if hashes is not None:
                hashes[fi] = digest or file_sha256(sf)
        if progress is not None and columnar:
            progress(sf.size)


def _damage(e: Exception) -> str | None:
    """What is wrong with a file whose reading raised `e`, if `e` says it is damaged (truncated, corrupt,
    not its format); None for other errors."""
    if isinstance(e, readers.DamagedFile):
        return str(e)
    if isinstance(e, DataError):
        return None
    if isinstance(e, (OSError, EOFError)) or type(e).__module__.startswith(("pyarrow", "zstandard")):
        return f"{type(e).__name__}: {e}"
    return None
