"""`data:` what a run trains on (sources or a mixture) and how it is read and tokenized."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kiln.config.base import Problem, Section, Source, not_blank


class MixtureEntry(Section):
    dataset: str | None = None
    """A prepared dataset directory (made by `kiln prepare`); its tokenizer must be the run's."""
    sources: list[Source] | None = None
    """Or raw input files, directories or globs, prepared here with the run's tokenizer and data settings."""
    weight: float = Field(1.0, gt=0)
    """Share of the samples drawn from this entry; weights are normalised to sum to one."""

    def problems(self) -> list[Problem]:
        if (self.dataset is None) == (self.sources is None):
            return [(("dataset", "sources"),
                     "a mixture entry needs exactly one of 'dataset' (a prepared directory) or 'sources'")]
        if self.sources == []:
            return [(("sources",), "the entry's sources are empty: name files, directories, globs or URLs")]
        return []


class ScheduleStage(Section):
    at: int = Field(ge=0)
    """Where this stage begins, in data.schedule.unit (optimizer steps or tokens trained); the first is 0."""
    weights: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]]
    """One weight per data.mixture entry, in its order; normalised to sum to one. A zero leaves that entry
    out of this stage."""
    blend: bool = False
    """false: these weights take over at `at`. true: the weights move linearly from the previous stage's,
    beginning where it begins, and reach these at `at` (a linear blend between two mixtures)."""


class ScheduleConfig(Section):
    unit: Literal["steps", "tokens"] = "steps"
    """What each stage's `at` counts: optimizer steps, or tokens trained (a stage then begins at the first
    sample after that many tokens)."""
    stages: list[ScheduleStage] = Field(min_length=1)
    """The stages, in the order they begin: [{at: 0, weights: [...]}, {at: N, weights: [...], blend: B}, ...]."""

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.stages[0].at != 0:
            out.append((("stages",), f"data.schedule.stages: the first stage must have at: 0, not {self.stages[0].at}"))
        if self.stages[0].blend:
            out.append((("stages",), "data.schedule.stages: the first stage cannot blend (there is none before it)"))
        ats = [st.at for st in self.stages]
        if any(b <= a for a, b in zip(ats, ats[1:])):
            out.append((("stages",), f"data.schedule.stages must begin at increasing {self.unit}, got at: {ats}"))
        for i, st in enumerate(self.stages):
            if not any(w > 0 for w in st.weights):
                out.append((("stages",), f"data.schedule.stages.{i}: its weights {st.weights} are all zero; give "
                                         "at least one entry a positive weight"))
        return out


class DataConfig(Section):
    sources: list[Source] = ["@stdlib"]
    """Input files, directories, globs, fsspec URLs (s3://, gs://, memory://...), save_to_disk dataset
    directories, or '@stdlib' (this Python's standard library source). .gz/.zst are decompressed."""

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # data.sources=corpus.jsonl means a list of one

    _named = field_validator("field", "dataset_split", "tokenizer", "eos_token", "bos_token", "cache_dir")(
        classmethod(not_blank))
    format: Literal["auto", "text", "jsonl", "json", "parquet", "csv", "tsv", "arrow"] = "auto"
    """Format of the source files; 'auto' goes by the file suffix (unknown suffixes read as text)."""
    text_unit: Literal["file", "line", "paragraph"] = "file"
    """For text files: a document per file, per non-blank line, or per blank-line-separated block
    (lines end at \\n, \\r\\n or a lone \\r)."""
    field: str = "text"
    """The field (JSON) or column (parquet, CSV/TSV, arrow) that holds each document's text; 'meta.text'
    reads key 'text' inside object or struct 'meta' (a key or column literally named 'meta.text' wins)."""
    csv_quoting: bool = True
    """.csv/.tsv fields may be quoted with '"' (as pandas, Python's csv module and spreadsheets write them,
    so a field can hold the delimiter or a newline). Set false for files whose quotes are plain text, as in
    tab-separated corpora where no field holds a tab or newline: with quoting on, a field that begins with
    a quote there loses its quotes."""
    dataset_split: str = "train"
    """For a saved Hugging Face DatasetDict directory: the split to read."""
    max_bytes: int | None = Field(8_000_000, ge=1)
    """Read at most this many characters of documents (null: all of them). Left unset, it is 8 MB when
    the sources are the built-in '@stdlib' (keeps the quickstart quick) and null for any other data."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A record with a missing field, wrong type, invalid UTF-8, empty or over-long text: 'error' stops
    with its file and line, 'skip' drops it and counts it in the prepare report. An empty text file found in a
    directory or by a glob (a package's empty __init__.py) is dropped and counted whatever this says."""
    max_record_bytes: int = Field(16 << 20, ge=1)
    """A record longer than this many bytes (16 MiB) is bad (too_long). It bounds the memory one record
    may take: reading it, and encoding it, where the tokenizer library needs about 120 bytes per byte of
    the document in each worker (2 GB for 16 MiB)."""
    min_chars: int = Field(0, ge=0)
    """Filter: drop documents shorter than this many characters (counted in the report)."""
    max_chars: int | None = Field(None, ge=1)
    """Filter: drop documents longer than this many characters (null: no limit)."""
    dedup: bool = True
    """Drop exact duplicate documents (same content hash), keeping the first."""
    tokenizer: str | None = None
    """A tokenizer.json or a local Hugging Face tokenizer directory; null trains a byte-level BPE on the sources."""
    vocab_size: int = Field(4096, ge=1, le=1 << 31)
    """Vocabulary size of a tokenizer trained here."""
    tokenizer_train_bytes: int = Field(200_000_000, ge=1)
    """A tokenizer trained here learns from at most this many bytes of the documents."""
    eos_token: str = "auto"
    """Token appended after every document; 'auto': the tokenizer's <|endoftext|>, <|end_of_text|>, </s> or <eos>,
    else the eos_token a tokenizer directory's tokenizer_config.json names."""
    bos_token: str | None = None
    """Token put before every document (null: none; 'auto': the tokenizer's <|begin_of_text|>, <s> or <bos>;
    'tokenizer': the one the tokenizer's own post-processor puts first, if any: the default with model.init_from,
    so the data starts as the model's inputs do at inference). Without a BOS, the tokenizer of `kiln export` puts
    none first either."""
    parse_special_tokens: bool = False
    """Read special-token text inside documents (a literal '<|endoftext|>') as that special token; false
    encodes it as plain text, so no document can inject an EOS or BOS."""
    val_fraction: float = Field(0.02, ge=0, lt=1)
    """Fraction of documents held out for validation, chosen by document hash."""
    shard_tokens: int = Field(100_000_000, ge=1)
    """Tokens per shard file; a shard is also the unit an interrupted prepare does not redo."""
    workers: int | None = Field(None, ge=1)
    """Processes that tokenize in `kiln prepare` (null: one per CPU core)."""
    cache_dir: str = "~/.cache/kiln"
    """Where tokenizers and prepared datasets are cached, keyed by their content hashes. A relative path is
    taken from the directory the command runs in, and made absolute when the config is read: the run's
    config.yaml names that cache, so a run resumed from another directory reads the data it was prepared
    into (`kiln prepare`, `kiln train` and torchrun's processes started in one directory share it)."""

    @field_validator("cache_dir")
    @classmethod
    def _absolute_cache(cls, v: str) -> str:
        return v if not v.strip() or v.startswith("~") or os.path.isabs(v) else os.path.abspath(v)
    mixture: list[MixtureEntry] = []
    """Train on a weighted mix instead of data.sources: a list of {dataset: DIR or sources: [...], weight: W}."""
    schedule: ScheduleConfig | None = None
    """A curriculum over data.mixture: weights that change at given steps or token counts, or blend
    linearly from one mixture to another ({unit: steps, stages: [{at: 0, weights: [1, 0]}, {at: 500,
    weights: [0.5, 0.5], blend: true}]}). The stages' weights replace the entries' `weight`; validation
    reads the last stage's mix."""
    document_mask: bool | Literal["split"] = True
    """Keep attention inside each document of a packed row, so no token attends across an EOS. A model of
    model.hf_class=auto whose layers cannot keep documents apart (recurrent layers: Mamba, ...; a forward without
    position_ids) is refused with true; 'split' runs each of its documents as a row of its own instead (padded
    to the longest document: up to several times the compute); false lets documents see each other."""
    shuffle: bool = True
    """Visit packed rows in a new seeded order each epoch (streaming: the files); false keeps stream order."""
    streaming: bool = False
    """Read and tokenize the sources on the fly while training instead of preparing token shards first."""
    prefetch: int = Field(2, ge=0)
    """Batches made ahead in a background thread (0: made inside the training loop)."""
    pin_memory: bool = True
    """On CUDA, give batches in pinned memory so copies to the GPU overlap compute."""

    @model_validator(mode="before")
    @classmethod
    def _default_max_bytes(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_bytes" not in data:
            quickstart = data.get("sources", ["@stdlib"]) == ["@stdlib"] and not data.get("mixture")
            data = {**data, "max_bytes": 8_000_000 if quickstart else None}
        return data

    @property
    def trains_tokenizer(self) -> bool:
        """True when a byte-level BPE of data.vocab_size is trained here (no tokenizer given or inherited
        from a prepared dataset that comes first in the mixture)."""
        return self.tokenizer is None and (not self.mixture or self.mixture[0].dataset is None)

    def _schedule_problems(self, schedule: ScheduleConfig) -> list[Problem]:
        if len(self.mixture) < 2:
            return [(("schedule", "mixture"), "data.schedule weighs the entries of data.mixture: list at least two "
                                              "datasets there (data.mixture: [{dataset: ...}, {sources: [...]}])")]
        out: list[Problem] = [(tuple(f"schedule.{k}" for k in keys), msg) for keys, msg in schedule.problems()]
        for i, st in enumerate(schedule.stages):
            if len(st.weights) != len(self.mixture):
                out.append((("schedule", "mixture"), f"data.schedule.stages.{i} has {len(st.weights)} weights for "
                                                     f"the {len(self.mixture)} entries of data.mixture; give one each"))
        if any("weight" in e.model_fields_set for e in self.mixture):
            out.append((("schedule", "mixture"), "data.mixture entries' 'weight' is unused under data.schedule, whose "
                                                 "stages give the weights: remove it from the entries"))
        return out

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.mixture and "sources" in self.model_fields_set:
            out.append((("sources", "mixture"), "give either data.sources or data.mixture, not both"))
        if not self.mixture and not self.sources:
            out.append((("sources", "mixture"),
                        "data.sources is empty: name files, directories, globs or URLs (or '@stdlib')"))
        if self.mixture and self.streaming:
            out.append((("mixture", "streaming"), "data.streaming reads data.sources; it does not take a data.mixture"))
        if self.schedule is not None:
            out += self._schedule_problems(self.schedule)
        if self.max_chars is not None and self.max_chars < self.min_chars:
            out.append((("max_chars", "min_chars"),
                        f"data.max_chars={self.max_chars} is below data.min_chars={self.min_chars}"))
        if self.trains_tokenizer and self.bos_token == "tokenizer":
            out.append((("bos_token", "tokenizer"),
                        "data.bos_token=tokenizer follows a given tokenizer's post-processor, and a BPE trained here "
                        "has none: set data.bos_token to auto, a token, or null"))
        if self.trains_tokenizer:
            eos = "<|endoftext|>" if self.eos_token == "auto" else self.eos_token  # as data/prepare/tokenizer.py
            bos = None if self.bos_token is None else "<|startoftext|>" if self.bos_token == "auto" else self.bos_token
            need = 256 + len({eos, bos} - {None})
            if self.vocab_size < need:
                out.append((("vocab_size", "tokenizer", "eos_token", "bos_token", "mixture"),
                            f"data.vocab_size={self.vocab_size} is too small for the byte-level BPE trained here: it "
                            f"needs at least {need} (256 bytes + {need - 256} special token(s)); raise it (4096 is the "
                            "default) or set data.tokenizer"))
        return out
