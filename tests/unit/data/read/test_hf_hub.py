"""hf://datasets/... sources: read through whatever fsspec filesystem is registered under 'hf'
(huggingface_hub's HfFileSystem; here a local stand-in laid out like a Hub dataset repository, since
tests have no network). Prepare and streaming read every data file; nothing is passed over silently."""

from __future__ import annotations

import importlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.load.streaming import StreamRows
from kiln.data.prepare.pipeline import prepare
from kiln.data.prepare.tokenizer import train_bpe
from kiln.data.read.sources import expand, iter_documents
from kiln.errors import ConfigError

fsspec = pytest.importorskip("fsspec")
registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is its read-only view)
from fsspec.implementations.dirfs import DirFileSystem  # noqa: E402
from fsspec.implementations.local import LocalFileSystem  # noqa: E402

REPO = "hf://datasets/kiln-org/tiny"


def docs(part: str, n: int) -> list[str]:
    return [f"{part} document {i}: " + "some words here " * (i % 5 + 1) for i in range(n)]


@pytest.fixture
def hub(tmp_path):
    """A local directory laid out like the Hub dataset repo kiln-org/tiny, served under hf://."""
    root = tmp_path / "hub"
    repo = root / "datasets" / "kiln-org" / "tiny"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")  # the dataset card
    (repo / ".gitattributes").write_text("*.parquet filter=lfs\n")
    pq.write_table(pa.table({"text": docs("train-0", 7)}), repo / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": docs("train-1", 5)}), repo / "data" / "train-00001-of-00002.parquet")
    (repo / "data" / "extra.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs("extra", 4)))

    class LocalHub(DirFileSystem):  # stands in for huggingface_hub.HfFileSystem
        protocol = "hf"
        cachable = False

        def __init__(self, **kw):
            super().__init__(path=str(root), fs=LocalFileSystem(), **kw)

    saved = fsspec.registry.get("hf")
    fsspec.register_implementation("hf", LocalHub, clobber=True)
    yield tmp_path
    registry._registry.pop("hf", None)  # back to huggingface_hub's (known_implementations)
    if saved is not None:
        fsspec.register_implementation("hf", saved, clobber=True)


WANT = docs("train-0", 7) + docs("train-1", 5)


def test_hub_repo_files_are_found_and_read(hub):
    files = expand([REPO])
    assert [f.url for f in files] == [f"{REPO}/data/extra.jsonl", f"{REPO}/data/train-00000-of-00002.parquet",
                                      f"{REPO}/data/train-00001-of-00002.parquet"]
    assert files.passed_over == [f"{REPO}/README.md"]  # the card is reported, .gitattributes hidden
    cfg = DataConfig(sources=[REPO], cache_dir=str(hub / "cache"))
    assert [d.text for d in iter_documents(cfg)] == docs("extra", 4) + WANT
    glob = DataConfig(sources=[f"{REPO}/data/train-*.parquet"], cache_dir=str(hub / "cache"))
    assert [d.text for d in iter_documents(glob)] == WANT


def test_prepare_and_streaming_read_every_document(hub):
    tok = train_bpe(WANT * 3, 300)
    cfg = DataConfig(sources=[REPO], cache_dir=str(hub / "cache"), val_fraction=0.0, workers=1)
    ds = prepare(cfg, progress=False, tokenizer=tok)
    sources = ds.manifest["sources"]
    assert [s["path"] for s in sources] == [f.url for f in expand([REPO])]
    assert ds.manifest["splits"]["train"]["documents"] == 16
    rows = StreamRows(cfg, tok, "train", 16, 2, shuffle=False)
    seen = []
    for epoch, fi, ri, _, _, _ in rows._documents(0, (0, 0), 0):
        if epoch:
            break
        seen.append((fi, ri))
    assert sorted({fi for fi, _ in seen}) == [0, 1, 2] and len(seen) == 16


def test_hf_urls_without_huggingface_hub_name_the_package(monkeypatch):
    monkeypatch.delitem(registry._registry, "hf", raising=False)
    monkeypatch.setitem(registry.known_implementations, "hf",
                        {"class": "kiln_no_such_module.HfFileSystem", "err": "Install huggingface_hub to access "
                                                                             "HfFileSystem"})
    with pytest.raises(ConfigError, match="pip install huggingface_hub"):
        expand([REPO])


def test_a_missing_hub_dataset_while_offline_names_hf_hub_offline(hub, monkeypatch):
    from kiln.errors import DataError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set, so the Hugging Face Hub cannot be read"):
        expand(["hf://datasets/kiln-org/elsewhere"])  # not there (the offline Hub finds nothing)
    assert len(expand([REPO])) == 3  # what the filesystem does find is read as before
