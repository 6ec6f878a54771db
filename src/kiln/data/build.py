"""From `cfg.data` to a tokenizer and the train / validation loaders a run reads.

Three ways in: data.sources prepared into token shards (the default), data.mixture (several
prepared datasets drawn in proportion to their weights), or data.streaming (the sources read and
tokenized while training). Ranks default to the data-parallel position of torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.config import DataConfig, RunConfig
from kiln.data.prepare.trained_on import mixture_id
from kiln.errors import DataError


@dataclass
class RunData:
    """What a run reads. `manifest`, `path` and `tokenizer` let checkpoints fingerprint the data."""

    tokenizer: Any
    train: Any
    val: Any
    datasets: list = field(default_factory=list)  # PreparedDataset of each mixture entry (none when streaming)
    summary: str = ""
    stream_key: str = ""  # streaming: fingerprint of the source files

    @property
    def manifest(self) -> dict:
        if len(self.datasets) == 1:
            return self.datasets[0].manifest
        if self.datasets:  # a mixture: its identity is the set of datasets, whatever the weights
            tokens = sum(_split_tokens(ds, "train") for ds in self.datasets)
            return {"id": mixture_id([ds.manifest["id"] for ds in self.datasets]),
                    "splits": {"train": {"tokens": tokens}}}
        return {"id": f"stream-{self.stream_key}", "splits": {}}

    @property
    def path(self):
        return self.datasets[0].path if self.datasets else None


def data_position() -> tuple[int, int]:
    """(rank, world) of this process among the data-parallel ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def prepare_all(data: DataConfig, console=None, trained_on: str | list[str] | None = None) -> list:
    """The prepared dataset of data.sources, or of each data.mixture entry (all with one tokenizer:
    the first entry's, which the later `sources` entries are prepared with); `trained_on`: the dataset id a resumed
    checkpoint names, or for a mixture its entries' ids (kiln.data.prepare.trained_on)."""
    from kiln.data.format.dataset import open_dataset
    from kiln.data.prepare.pipeline import prepare

    if not data.mixture:
        return [prepare(data, console, trained_on=trained_on if isinstance(trained_on, str) else None)]
    entries = _mixture_trained_on(data, trained_on)
    out: list = []
    for i, entry in enumerate(data.mixture):
        where = f"data.mixture[{i}]"
        if entry.dataset is not None:
            if out:
                expected = out[0].tokenizer.hash
            else:  # the first entry sets the tokenizer: it must be data.tokenizer's, where one is given
                from kiln.data.prepare.tokenizer import Tokenizer

                expected = Tokenizer.load(data.tokenizer).hash if data.tokenizer else None
            try:
                ds = open_dataset(entry.dataset, expected)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
        else:
            sub = data.model_copy(update={"mixture": [], "sources": list(entry.sources or [])})
            ds = prepare(sub, console, tokenizer=out[0].tokenizer if out else None, trained_on=entries[i])
        if out and ds.tokenizer.hash != out[0].tokenizer.hash:
            raise DataError(f"{where}: dataset {ds.path} was made with tokenizer {ds.tokenizer.hash}, but the "
                            f"first entry's is {out[0].tokenizer.hash}; prepare it again with --tokenizer "
                            f"{out[0].path / 'tokenizer.json'}")
        out.append(ds)
    return out


def _mixture_trained_on(data: DataConfig, trained_on: str | list[str] | None) -> list[str | None]:
    """The dataset each data.mixture entry of a resumed run trained on, where known: the checkpoint's list, or
    for one that records only their mixture id, the datasets in the cache that make it up."""
    n = len(data.mixture)
    if isinstance(trained_on, list) and len(trained_on) == n:
        return list(trained_on)
    if isinstance(trained_on, str) and trained_on.startswith("mix-"):
        from pathlib import Path

        from kiln.data.prepare.trained_on import mixture_entries
        from kiln.data.read.sources import expand

        try:
            named = [_dataset_id(e.dataset) if e.dataset is not None else
                     [sf.url for sf in expand(list(e.sources or []), data.format, data.dataset_split)]
                     for e in data.mixture]
        except (DataError, OSError):  # a source gone: prepare says so
            return [None] * n
        found = mixture_entries(Path(data.cache_dir).expanduser() / "datasets", trained_on, named)
        if found is not None:
            return found
    return [None] * n


def _dataset_id(path: str) -> str:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path).expanduser() / "manifest.json").read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return Path(path).name


def _split_tokens(ds, split: str) -> int:
    return int(ds.manifest["splits"].get(split, {}).get("tokens", 0))


def build_data(cfg: RunConfig, device: torch.device, rank: int | None = None, world: int | None = None,
               console=None, trained_on: str | None = None) -> RunData:
    """Prepare (or open, or stream) what cfg.data names and build this rank's loaders.

    `console` (rich) shows prepare's progress and report; `trained_on`: the dataset id of the checkpoint a run
    resumes from."""
    if rank is None or world is None:
        rank, world = data_position()
    d, t = cfg.data, cfg.train
    rows = t.loader_rows(world)  # a micro-batch, or with train.batch_size auto one step's rows (kiln.train)
    common = dict(seed=t.seed, document_mask=d.document_mask, prefetch=d.prefetch,
                  pin_memory=d.pin_memory and device.type == "cuda", per_step=t.step_rows(world) // rows)
    if d.streaming:
        from kiln.data.load.streaming import StreamingLoader, streaming_tokenizer

        tok = streaming_tokenizer(d, console)
        train = StreamingLoader(d, tok, "train", t.seq_len, rows, rank=rank, world=world, **common)
        val = None
        if d.val_fraction > 0:
            val = StreamingLoader(d, tok, "val", t.seq_len, rows, rank=rank, world=world, **{**common, "prefetch": 0})
        lines = [f"data: streaming {', '.join(d.sources)} (vocab {tok.vocab_size})"]
        if train.rows.files.passed_over:  # as `kiln prepare` reports them
            from kiln.data.prepare.report import passed_over_text

            lines.append("passed over: " + passed_over_text(len(train.rows.files.passed_over),
                                                              train.rows.files.passed_over))
        if val is None:
            lines.append("validation: none, data.val_fraction=0")
        return RunData(tok, train, val, [], "\n".join(lines), stream_key=train.rows.key)

    from kiln.data.load.loader import PackedLoader

    datasets = prepare_all(d, console, trained_on)
    weights = [e.weight for e in d.mixture] or [1.0]
    schedule = None
    if d.schedule is not None:  # a curriculum; validation reads its last stage's mix
        from kiln.data.load.schedule import stages_in_samples

        schedule = stages_in_samples(d.schedule.stages, d.schedule.unit, t.seq_len, t.step_rows(world) * world)
        weights = list(d.schedule.stages[-1].weights)
    train = PackedLoader.from_datasets(datasets, "train", t.seq_len, rows, weights=weights, rank=rank,
                                       world=world, shuffle=d.shuffle, schedule=schedule, **common)
    with_val = [(ds, w) for ds, w in zip(datasets, weights) if w > 0 and _split_tokens(ds, "val") > t.seq_len]
    val = None
    if with_val:
        val = PackedLoader.from_datasets([ds for ds, _ in with_val], "val", t.seq_len, rows,
                                         weights=[w for _, w in with_val], rank=rank, world=world,
                                         **{**common, "prefetch": 0})
    lines = [f"data: {ds.path} ({_split_tokens(ds, 'train'):,} train / {_split_tokens(ds, 'val'):,} val tokens"
             + (f", weight {w / sum(weights):.3f})" if len(datasets) > 1 and schedule is None else ")")
             for ds, w in zip(datasets, weights)]
    if schedule is not None:
        lines.append("schedule: " + "; ".join(
            f"{'blend to' if st.blend else 'from'} {d.schedule.unit[:-1]} {st.at}: {st.weights}"
            for st in d.schedule.stages))
    step_tokens, held = t.step_rows(world) * world * t.seq_len, sum(_split_tokens(ds, "train") for ds in datasets)
    if 0 < held < step_tokens:  # a batch larger than the data: said, as the loss then falls for the wrong reason
        lines.append(f"warning: one optimizer step reads {step_tokens:,} tokens, more than the {held:,} of the train "
                     f"split, so every step repeats all of it ({step_tokens / held:.1f} times): lower "
                     "train.batch_size or train.grad_accum, or give more data")
    if val is None:
        lines.append(f"validation: none, no run is evaluated (no 'val' split holds train.seq_len + 1 = "
                     f"{t.seq_len + 1} tokens; raise data.val_fraction, now {d.val_fraction}, to evaluate)")
    tok = datasets[0].tokenizer
    return RunData(tok, train, val, datasets, "\n".join(lines) + f"\ntokenizer: vocab {tok.vocab_size}")
