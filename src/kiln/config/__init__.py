"""Typed run config: one pydantic section per component, loaded from YAML plus dotted overrides.

    cfg = load_config("my.yaml", ["train.lr=3e-4", "model.n_layers=4"])

Every field has a type, a default where one makes sense and a one-line docstring, which is what
`kiln train --help-config` prints. Unknown keys and bad values raise one `ConfigError` that lists
every problem with its full key path and, for typos, the closest valid key.

Bounds of single values are pydantic constraints on the fields; checks that involve several fields
are each section's `problems()`. `load_config` reports all of them in one pass: it validates with
those checks deferred, sets aside the values that failed, and runs every check whose fields are
all valid, so a typo in one section never hides a wrong value in another.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kiln.errors import ConfigError
from kiln.sizes import SIZES

PRESETS_DIR = Path(__file__).parents[1] / "configs"


# a problem found by a cross-field check: (the fields it involves, relative to the section; the message)
Problem = tuple[tuple[str, ...], str]
_DEFER = "kiln_defer_checks"  # validation context key: skip the cross-field checks (load_config runs them)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are the docs. Frozen: a
    validated config is never changed in place; `derive()` makes a new one."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def problems(self) -> list[Problem]:
        """Every inconsistency between this section's fields (their single values are already valid)."""
        return []

    @model_validator(mode="after")
    def _check_problems(self, info: ValidationInfo) -> Section:
        if not (info.context or {}).get(_DEFER):
            found = self.problems()
            if found:
                raise ValueError("; ".join(msg for _, msg in found))
        return self


class RopeScaling(Section):
    type: Literal["llama3", "linear"] = "llama3"
    """'llama3' (Llama 3.1: low frequencies divided by factor, a smooth band between) or 'linear' (all of them)."""
    factor: float = 8.0
    """How much longer the context is than the one the model was trained on."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are left as they are."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length the model was first trained with."""


class ModelConfig(Section):
    size: str | None = None
    """Named size from the registry (tiny, 124m, 350m, 1b, 3b, 8b); fields set here override it."""
    vocab_size: int | None = Field(None, ge=1, le=1 << 31)
    """Vocabulary size; null takes the tokenizer's, rounded up to a multiple of 64."""
    d_model: int = Field(256, ge=2)
    """Width of the residual stream."""
    n_layers: int = Field(4, ge=1)
    """Number of transformer blocks."""
    n_heads: int = Field(4, ge=1)
    """Number of query heads; d_model must divide evenly by it."""
    n_kv_heads: int | None = Field(None, ge=1)
    """Number of key/value heads (grouped-query attention); null means n_heads."""
    ffn_hidden: int | None = Field(None, ge=1)
    """Hidden width of the SwiGLU MLP; null means 8/3 * d_model rounded up to a multiple of 64."""
    max_seq_len: int = Field(2048, ge=1)
    """Longest sequence the model is meant for (recorded in exports)."""
    rope_theta: float = Field(10000.0, gt=0)
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = Field(1e-5, gt=0, lt=1)
    """Epsilon of the RMSNorm layers."""
    tie_embeddings: bool = True
    """Share the input embedding and output projection weights."""
    init_std: float = Field(0.02, gt=0, le=1)
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    # --- options of imported architectures (Llama 3.1, Mistral, Qwen2, Nemotron); the defaults are Llama's
    head_size: int | None = Field(None, ge=2)
    """Width of each attention head (Hugging Face's head_dim); null means d_model / n_heads."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Biases in attention: none (Llama, Mistral), on the q/k/v projections (Qwen2), or on all four."""
    mlp_bias: bool = False
    """Biases on the MLP's linear layers."""
    mlp: Literal["swiglu", "relu2"] = "swiglu"
    """MLP: 'swiglu' (gate, up, down projections) or 'relu2' (up, squared ReLU, down; Nemotron)."""
    norm: Literal["rmsnorm", "layernorm1p"] = "rmsnorm"
    """Normalisation: 'rmsnorm', or 'layernorm1p' (LayerNorm with bias whose scale is stored minus one; Nemotron)."""
    rotary_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's dimensions that rotary embeddings rotate (the first ones; Nemotron: 0.5)."""
    rope_scaling: RopeScaling | None = None
    """Rotary frequency scaling for longer contexts (Llama 3.1 'llama3', or 'linear'); null: none."""
    sliding_window: int | None = Field(None, ge=1)
    """Each token attends to at most this many latest tokens, itself included (Mistral); null: no limit."""
    hf_model_type: Literal["llama", "mistral", "qwen2", "nemotron"] | None = None
    """Hugging Face architecture that `kiln export` writes (set by init_from); null: the simplest that fits."""
    init_from: str | None = None
    """A local Hugging Face model directory (config.json + safetensors) whose architecture, weights and
    tokenizer the run starts from; its config sets the model fields (set only max_seq_len beside it)."""
    hf_class: Literal["native", "auto"] = "native"
    """'native': Kiln's own model (Llama, Mistral, Qwen2, Nemotron from init_from); 'auto': any other causal LM
    of model.init_from through transformers' AutoModelForCausalLM (slower; see the README)."""
    trust_remote_code: bool = False
    """With hf_class 'auto': let transformers run the model code shipped in the init_from directory (off by
    default, since that code runs with your permissions; turn it on only for a directory you trust)."""
    allow_pickle: bool = False
    """Let init_from load pickled weights (.bin/.pt) when it has no safetensors: loading a pickle can run code."""

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("size") is not None:
            size = data["size"]
            if size not in SIZES:
                close = difflib.get_close_matches(str(size), list(SIZES), n=1)
                hint = f" did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"unknown model size '{size}'; known: {', '.join(SIZES)}.{hint}")
            data = {**SIZES[size], **data}
        return data

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.head_size is None and self.d_model % self.n_heads:
            out.append((("d_model", "n_heads"), f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"))
        elif self.head_dim % 2:
            out.append((("d_model", "n_heads", "head_size"), f"head dimension {self.head_dim} must be even for "
                                                              "rotary embeddings"))
        elif int(self.head_dim * self.rotary_fraction) % 2:
            out.append((("rotary_fraction",), f"rotary_fraction={self.rotary_fraction} must rotate an even number "
                                              f"of the {self.head_dim} head dimensions"))
        if self.n_heads % self.kv_heads:
            out.append((("n_heads", "n_kv_heads"),
                        f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"))
        if self.hf_class == "auto" and not self.init_from:
            out.append((("hf_class", "init_from"), "model.hf_class=auto trains a Hugging Face model directory: set "
                                                   "model.init_from to it (or use hf_class native)"))
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-int(8 * self.d_model / 3) // 64) * 64


class MixtureEntry(Section):
    dataset: str | None = None
    """A prepared dataset directory (made by `kiln prepare`); its tokenizer must be the run's."""
    sources: list[str] | None = None
    """Or raw input files, directories or globs, prepared here with the run's tokenizer and data settings."""
    weight: float = Field(1.0, gt=0)
    """Share of the samples drawn from this entry; weights are normalised to sum to one."""

    def problems(self) -> list[Problem]:
        if (self.dataset is None) == (self.sources is None):
            return [(("dataset", "sources"),
                     "a mixture entry needs exactly one of 'dataset' (a prepared directory) or 'sources'")]
        return []


class DataConfig(Section):
    sources: list[str] = ["@stdlib"]
    """Input files, directories, globs, fsspec URLs (s3://, gs://, memory://...), save_to_disk dataset
    directories, or '@stdlib' (this Python's standard library source). .gz/.zst are decompressed."""

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # data.sources=corpus.jsonl means a list of one
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
    with its file and line, 'skip' drops it and counts it in the prepare report."""
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
    """Token appended after every document; 'auto': the tokenizer's <|endoftext|>, <|end_of_text|>, </s> or <eos>."""
    bos_token: str | None = None
    """Token put before every document (null: none; 'auto': the tokenizer's <|begin_of_text|>, <s> or <bos>)."""
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
    """Where tokenizers and prepared datasets are cached, keyed by their content hashes."""
    mixture: list[MixtureEntry] = []
    """Train on a weighted mix instead of data.sources: a list of {dataset: DIR or sources: [...], weight: W}."""
    document_mask: bool = True
    """Keep attention inside each document of a packed row, so no token attends across an EOS."""
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

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.mixture and "sources" in self.model_fields_set:
            out.append((("sources", "mixture"), "give either data.sources or data.mixture, not both"))
        if not self.mixture and not self.sources:
            out.append((("sources", "mixture"),
                        "data.sources is empty: name files, directories, globs or URLs (or '@stdlib')"))
        if self.mixture and self.streaming:
            out.append((("mixture", "streaming"), "data.streaming reads data.sources; it does not take a data.mixture"))
        if self.max_chars is not None and self.max_chars < self.min_chars:
            out.append((("max_chars", "min_chars"),
                        f"data.max_chars={self.max_chars} is below data.min_chars={self.min_chars}"))
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


class EarlyStopConfig(Section):
    """Stop training when the validation loss stops improving (needs a validation split and train.eval_every)."""

    patience: int = Field(0, ge=0)
    """Stop after this many evaluations in a row without improvement (0: early stopping off)."""
    min_delta: float = Field(0.0, ge=0)
    """An evaluation improves only when its validation loss is below the best so far by more than this."""


class TrainConfig(Section):
    seq_len: int = Field(256, ge=1)
    """Tokens per training sequence."""
    batch_size: int | Literal["auto"] = 8
    """Sequences per micro-batch on each device; 'auto' tries real training steps before the run and takes the
    largest that fits with recovery.auto_batch_margin to spare (on the CPU: from a memory budget), needs
    train.global_batch_tokens, and caches the result per model, sequence, precision, device and world size."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step (derived from train.global_batch_tokens when that is set)."""
    global_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per optimizer step over all data-parallel ranks, a multiple of train.seq_len; the micro-batch
    may change (auto, or halved after an out-of-memory error) while this stays. null: batch_size x
    grad_accum x ranks x seq_len."""
    max_steps: int = Field(300, ge=1)
    """Optimizer steps to train for."""
    lr: float = Field(2e-3, gt=0, le=1)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = Field(30, ge=0)
    """Linear warmup steps from zero to the peak learning rate."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """For 'wsd': the fraction of steps, at the end, spent decaying to min_lr."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""
    eval_every: int = Field(100, ge=0)
    """Evaluate on the validation split every N steps (0: only at the end)."""
    eval_batches: int = Field(8, ge=1)
    """Validation batches per evaluation."""
    seed: int = Field(1337, ge=0, lt=1 << 63)
    """Seed of weight initialisation, data order and sampling."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    threads: int | None = Field(None, ge=1, le=1024)
    """CPU threads of PyTorch in each process of a run on the CPU (torch.set_num_threads; GPU runs keep
    PyTorch's default). null: 1 for a model under 20M parameters, whose small matrix products lose more to
    keeping threads in step than they gain (measured: benchmarks/threads.py), else PyTorch's default (one per
    physical core, or OMP_NUM_THREADS)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'bf16': autocast, with fp32 weights and optimizer state and a bf16 residual stream; 'fp32';
    or 'auto' (bf16 on CUDA, fp32 on CPU)."""
    compile: bool = False
    """Compile the model and the loss kernel with torch.compile (fastest on GPU; slow to start on CPU)."""
    compile_scope: Literal["blocks", "model"] = "blocks"
    """With compile: 'blocks' compiles each transformer block (one graph for all, quick to compile);
    'model' the whole forward pass up to the loss (1-2% faster at 124m, longer to compile; under DDP torch
    splits that graph at the gradient buckets, so their reduction overlaps the backward pass; under FSDP it
    is compiled per block, each block being a shard unit)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in the backward pass to save memory: 'selective' keeps each block's matrix
    product and attention outputs and recomputes its elementwise ops; 'full' recomputes whole blocks
    (3b on an H100 at batch 8: 61 GiB and 54% MFU selective, 46 GiB and 45% MFU full)."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak dense bf16 TFLOP/s of one device for the MFU metric; null looks the GPU up in a table."""
    run_dir: str | None = None
    """Run directory; null makes runs/<timestamp>."""
    sample_prompt: str = "def "
    """Prompt of the sample printed at the end of training."""
    sample_tokens: int = Field(80, ge=0)
    """Tokens generated for that sample (0: no sample)."""
    early_stop: EarlyStopConfig = EarlyStopConfig()
    """Early stopping on validation loss: patience (evaluations) and min_delta; off unless patience > 0."""

    @field_validator("batch_size", mode="plain")
    @classmethod
    def _batch_size(cls, v: Any) -> int | str:
        if v == "auto":
            return v
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("Input should be a whole number of sequences, or 'auto'")
        if v < 1:
            raise ValueError("Input should be greater than or equal to 1")
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", v):
            raise ValueError("not a device; use auto, cpu, cuda or cuda:N")
        return v

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        g = self.global_batch_tokens
        if self.batch_size == "auto" and g is None:
            out.append((("batch_size", "global_batch_tokens"), "train.batch_size=auto needs train.global_batch_tokens "
                        "(the tokens of one optimizer step), so the batch the optimizer sees does not depend on "
                        "the device; set it, e.g. train.global_batch_tokens=" f"{8 * self.seq_len * 8}"))
        if g is not None and g % self.seq_len:
            out.append((("global_batch_tokens", "seq_len"), f"train.global_batch_tokens={g} is not a multiple of "
                        f"train.seq_len={self.seq_len}; use {max(1, g // self.seq_len) * self.seq_len}"))
        elif g is not None and self.grad_accum != 1:  # 1, the default, is what a run's config.yaml records
            out.append((("global_batch_tokens", "grad_accum"), "give train.global_batch_tokens or train.grad_accum, "
                        "not both: the accumulation follows from the global batch and the micro-batch"))
        if self.early_stop.patience and not self.eval_every:
            out.append((("early_stop", "eval_every"), f"train.early_stop.patience={self.early_stop.patience} counts "
                        "evaluations during training, and train.eval_every=0 makes none; set train.eval_every (or "
                        "train.early_stop.patience=0)"))
        return out

    def step_rows(self, world: int) -> int:
        """Sequences each of `world` data-parallel ranks trains on per optimizer step (ConfigError if the
        global batch does not split evenly between them)."""
        if self.global_batch_tokens is None:
            return int(self.batch_size) * self.grad_accum
        rows = self.global_batch_tokens // self.seq_len
        if rows % world:
            raise ConfigError(f"train.global_batch_tokens={self.global_batch_tokens} is {rows} sequences, which "
                              f"{world} data-parallel ranks cannot share evenly; make it a multiple of "
                              f"{world * self.seq_len}")
        return rows // world

    def loader_rows(self, world: int) -> int:
        """Sequences in each batch a loader yields: the micro-batch, or with batch_size auto a whole step's."""
        rows = self.step_rows(world)
        if self.batch_size == "auto":
            return rows
        if rows % self.batch_size:
            raise ConfigError(f"train.global_batch_tokens={self.global_batch_tokens} gives {rows} sequences per "
                              f"rank per step, not a multiple of train.batch_size={self.batch_size}; choose a "
                              "batch_size that divides it, or train.batch_size=auto")
        return self.batch_size


class OptimConfig(Section):
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, applied to matrices only (not norms, biases or embeddings)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    fused: bool | None = None
    """Use the fused AdamW kernel; null: on CUDA only."""


class CheckpointConfig(Section):
    save_final: bool = True
    """Save the trained model (safetensors + config) in the run directory at the end."""
    every: int = Field(100, ge=0)
    """Write a resumable checkpoint to <run_dir>/checkpoints/ every N steps (0: only at the end and on signals)."""
    keep_last: int = Field(3, ge=1)
    """Keep the newest N checkpoints in the run directory; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """Write checkpoints in the background: the loop only waits while the state is copied to CPU memory
    (a pinned CPU copy of this process's share of the state is kept for the whole run)."""
    snapshot_every: int = Field(0, ge=0)
    """Keep an in-memory copy of the whole state every N steps, for fast rollback (0: off; costs one state in RAM)."""
    archive_url: str | None = None
    """Archive location (a directory or any fsspec URL, e.g. s3://bucket/runs); null: no archive."""
    archive_every: int = Field(0, ge=0)
    """Copy every M-th checkpoint to archive_url, verified after the copy (0: none but the best)."""
    archive_best: bool = True
    """Also keep the checkpoint with the lowest validation loss in archive_url."""
    fsync: bool = True
    """Flush checkpoint files to disk before a checkpoint is marked complete (survives power loss)."""
    write_threads: int = Field(4, ge=1, le=256)
    """Threads (and files per process) that write a checkpoint; more threads, faster saves on fast disks."""
    on_signal: bool = True
    """On SIGTERM/SIGINT finish the step, write a checkpoint and exit 0; on a crash write an emergency one."""
    keep_best: bool = True
    """Keep the local checkpoint with the lowest validation loss even when keep_last would delete it (a
    checkpoint records the loss when an evaluation falls on its step: align train.eval_every with every)."""
    at_end: bool = True
    """Write a checkpoint when training ends; false: the newest periodic checkpoint stays the last, and running the
    command again repeats the steps after it (for a disk that holds one checkpoint of a large model only)."""

    def problems(self) -> list[Problem]:
        if not self.at_end and self.save_final:
            return [(("at_end", "save_final"), "checkpoint.at_end=false leaves no checkpoint to finish an interrupted "
                     "final model save from: set checkpoint.save_final=false too, or keep checkpoint.at_end")]
        return []


class RecoveryConfig(Section):
    """What a run does on its own when a step runs out of memory or goes bad (kiln.train.oom, rollback)."""

    auto_batch_margin: float = Field(0.1, ge=0, lt=1)
    """With train.batch_size auto: the fraction of device memory left free (on the CPU: of available memory
    left unplanned) by the micro-batch chosen."""
    auto_batch_cache: bool = True
    """With train.batch_size auto: remember the micro-batch found (auto_batch.json in data.cache_dir, keyed by
    model, sequence length, precision, compile and checkpointing, device and world size) so a restart does not
    search again."""
    oom_retries: int = Field(3, ge=0)
    """Times one step may run out of device memory: each time the step's gradients are dropped, the micro-batch
    is halved (more accumulation, same samples in the same order) and the step runs again; one more stops the
    run with a ResourceError and an emergency checkpoint (0: the first one stops it). One process only."""
    rollback: bool = True
    """Roll back a bad step (non-finite loss or gradient norm, or a loss spike): restore the newest in-memory
    snapshot, pass over the step's samples (recorded, so a resume passes over them too) and go on. Costs one
    copy of the state in host memory and a host read of the loss every step."""
    snapshot_every: int = Field(50, ge=1)
    """Steps between the in-memory snapshots a rollback restores, when checkpoint.snapshot_every is 0
    (that cadence wins when set); the first is taken at the start."""
    spike_zscore: float = Field(6.0, ge=0)
    """A step whose loss is this many standard deviations above the mean of the last spike_window good steps
    is a spike (0: spikes are not checked, only non-finite values)."""
    spike_window: int = Field(50, ge=2)
    """Good steps the spike check compares against; no step is called a spike before there are this many."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks allowed within rollback_window steps; one more bad step stops the run with a TrainingError
    (the last good state saved as an emergency checkpoint, the offending samples named)."""
    rollback_window: int = Field(1000, ge=1)
    """Steps over which max_rollbacks counts."""
    lr_factor: float = Field(1.0, gt=0, le=1)
    """Multiply the learning rate by this after each rollback (1: unchanged); kept across resumes."""


class LoggingConfig(Section):
    every: int = Field(10, ge=1)
    """Read the loss back from the device and log every N steps."""
    console: bool = True
    """Show a progress bar and log lines on the console."""
    jsonl: bool = True
    """Write metrics to metrics.jsonl in the run directory."""
    plots: bool = True
    """At the end of a run, draw plots.png from metrics.jsonl (needs matplotlib: pip install 'kiln[plot]')."""
    tensorboard: bool = False
    """Write every metric, the config and the samples for TensorBoard to <run_dir>/tensorboard (extra: tensorboard)."""
    wandb: bool = False
    """Log the config, the metrics, the samples and at the end the run's files to Weights & Biases (extra: wandb)."""
    wandb_project: str = "kiln"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B team or user that owns the project (null: your default entity)."""
    wandb_name: str | None = None
    """Name of the run in W&B (null: the run directory's name)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """'online' sends to the W&B server as the run goes; 'offline' writes <run_dir>/wandb/ for `wandb sync` later."""
    mlflow: bool = False
    """Log the config as params, the metrics, tags, the samples and the final model to MLflow (extra: mlflow)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server, databricks, a database); null: a local store, <run_dir>/mlflow.db."""
    mlflow_experiment: str = "kiln"
    """MLflow experiment the run is recorded in (made if missing)."""
    tags: dict[str, str] = {}
    """Tags of the run: MLflow tags as given, W&B tags as 'key:value'."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve the latest metrics at http://HOST:PORT/metrics for Prometheus on rank 0 (0: a free port, logged;
    null: off; extra: prometheus)."""
    prometheus_addr: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on ('127.0.0.1': this machine only)."""


class ProfileConfig(Section):
    """A torch.profiler window (off unless profile.steps > 0): a trace of a few steps in <run_dir>/profile/."""

    start: int = Field(10, ge=1)
    """First optimizer step recorded (counted from 1; the step before it warms the profiler up)."""
    steps: int = Field(0, ge=0)
    """Steps recorded from profile.start on (0: no profiler at all)."""
    memory_snapshot: bool = False
    """On CUDA, also record every allocation in the window and write a memory snapshot (for OOM debugging)."""


class MonitorConfig(Section):
    """The resource monitor and the hang detector (kiln.monitor.resources, kiln.monitor.hang)."""

    resources: bool = True
    """Sample GPU (NVML: utilisation, memory, power, temperature, clocks), CPU, host memory, disk rates and free
    space in a background thread at every logging step; the readings go to every sink as sys/* metrics."""
    data_wait_warn: float = Field(0.10, ge=0, le=1)
    """Warn once when the training loop waits for data more than this fraction of the time."""
    gpu_memory_warn: float = Field(0.95, gt=0, le=1)
    """Warn once when a GPU's used memory passes this fraction of its total."""
    disk_checkpoints_warn: float = Field(2.0, ge=0)
    """Warn once when the run directory's disk has less free space than this many checkpoints (checked before
    every save and at logging steps; 0: no warning). A save that cannot fit at all is refused regardless."""
    hang_factor: float = Field(10.0, ge=0)
    """A step slower than this multiple of the median step time is treated as a hang: the stack of every thread
    goes to <run_dir>/hang-step<N>.txt (0: steps are not watched)."""
    hang_min_s: float = Field(60.0, gt=0)
    """A step is never treated as a hang before this many seconds, whatever the median."""
    hang_between_s: float = Field(1800.0, ge=0)
    """The time between two steps (evaluation, checkpoint saves, sinks) is a hang past this many seconds
    (0: not watched)."""
    hang_exit_s: float = Field(900.0, ge=0)
    """This long after a hang's stack dump with still no progress, write an emergency checkpoint (when the
    state is between steps, in a one-process run) and exit with code 124 (0: never exit, only dump)."""



# --------------------------------------------------------------------------- dist (kiln.parallel)


class DistConfig(Section):
    """How a run started under torchrun (several processes) spreads over its devices."""

    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """'ddp': every process holds the whole model, gradients are all-reduced (bucketed, overlapped with
    the backward pass); 'fsdp': parameters, gradients and optimizer state are sharded (FSDP2); 'auto'
    (one process trains as always; several pick ddp when the model, its gradients and AdamW state fit
    one device with room for activations, else fsdp; the choice is logged)."""
    sharding: Literal["full", "grad_op", "hybrid"] = "full"
    """With fsdp: 'full' (ZeRO-3) gathers each block's parameters for its forward and backward and frees
    them after; 'grad_op' (ZeRO-2) keeps them gathered from forward to backward (more memory, one
    all-gather less); 'hybrid' (HSDP) shards inside each group of dist.replicas and replicates across."""
    replicas: int | None = None
    """With sharding 'hybrid': the number of replica groups (null: one per node); the processes of a group
    shard the model between them, the groups all-reduce gradients."""
    cpu_offload: bool = False
    """With fsdp: keep parameters, gradients and optimizer state in CPU memory and run the optimizer step
    on the CPU (FSDP2's CPUOffloadPolicy): fits a model too large for the GPUs, at a cost in speed."""
    reduce_fp32: bool = True
    """With bf16 precision under fsdp: reduce gradients in fp32 (exact sums); false reduces in bf16
    (half the traffic). Parameters are gathered in bf16 for compute; the master weights stay fp32."""
    bucket_mb: float = Field(25.0, gt=0)
    """With ddp: gradients are all-reduced in buckets of about this many MB, each as soon as the backward pass
    has made all of its gradients (smaller: the first starts sooner; larger: fewer, faster collectives)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: 'auto' is nccl on GPUs and gloo on CPUs."""
    timeout_s: int = 600
    """Seconds a collective may wait for the other processes before the run stops with an error."""
    watchdog_s: int = 0
    """Stop every process when one has made no progress for this many seconds (stuck in I/O or a
    collective), naming it and printing the stacks of its threads (0: off)."""

    @model_validator(mode="after")
    def _check_dist(self) -> DistConfig:
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"dist.replicas must be at least 1, got {self.replicas}")
        if self.timeout_s < 1 or self.watchdog_s < 0:
            raise ValueError("dist.timeout_s must be positive and dist.watchdog_s 0 or more")
        if self.cpu_offload and self.strategy == "ddp":
            raise ValueError("dist.cpu_offload needs dist.strategy=fsdp (or auto); DDP keeps the model on the GPU")
        return self

    def problems(self) -> list[Problem]:
        if self.replicas is not None and self.sharding != "hybrid":
            return [(("replicas",), f"dist.replicas={self.replicas} applies to dist.sharding=hybrid only (it is "
                                    f"{self.sharding}); remove dist.replicas or set dist.sharding=hybrid")]
        return []



# --------------------------------------------------------------------------- LoRA (kiln.model.lora)


class LoraConfig(Section):
    """Low-rank adapters: the base model is frozen and only small matrices A (r x in) and B (out x r)
    train, added to the chosen linear layers as W x + (alpha / r) * B A dropout(x)."""

    rank: int = Field(0, ge=0)
    """Rank r of each adapter (0: LoRA off, every weight trains)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""
    targets: list[str] = ["q", "k", "v", "o"]
    """Layers that get adapters: any of q, k, v, o (attention) and gate, up, down (MLP); 'all' for every one."""
    base_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the frozen base weights (bf16 halves their memory; the adapters train in fp32)."""

    def problems(self) -> list[Problem]:
        known = {"q", "k", "v", "o", "gate", "up", "down", "all"}
        bad = [t for t in self.targets if t not in known]
        if bad:
            return [(("targets",), f"unknown LoRA target(s) {bad}; choose from {sorted(known)}")]
        if self.rank and not self.targets:
            return [(("targets",), "lora.targets is empty: name the layers that get adapters")]
        return []

    def require_base(self, model: ModelConfig) -> None:
        """A ConfigError for LoRA without a base model to adapt (model.init_from), said when training starts (the
        config itself may lack one: `kiln plan` sizes LoRA on a model shape alone)."""
        if self.rank and not model.init_from:
            raise ConfigError("lora.rank is set but model.init_from is not: LoRA adapts a trained base model; set "
                              "model.init_from to its Hugging Face directory, or lora.rank=0 to train every weight")


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    """The network: size and shape."""
    data: DataConfig = DataConfig()
    """What to train on and how to tokenize it."""
    train: TrainConfig = TrainConfig()
    """Length, batch, schedule, evaluation and device of the run."""
    optim: OptimConfig = OptimConfig()
    """Optimizer hyperparameters."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """What is saved and when."""
    logging: LoggingConfig = LoggingConfig()
    """Where metrics go."""
    recovery: RecoveryConfig = RecoveryConfig()
    """Automatic micro-batch, out-of-memory retries and rollback of bad steps."""
    profile: ProfileConfig = ProfileConfig()
    """A torch.profiler trace of a few training steps (off unless profile.steps > 0)."""
    monitor: MonitorConfig = MonitorConfig()
    """Resource readings, warnings before things go wrong, and hang detection."""
    dist: DistConfig = DistConfig()
    """Several processes and devices (torchrun): DDP or FSDP2, sharding, offload, watchdog."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters (off unless lora.rank > 0)."""

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_of_init_from(cls, data: Any) -> Any:
        """With model.init_from and no data.tokenizer, the data is tokenized with the model's own tokenizer."""
        if isinstance(data, dict):
            model, dcfg = data.get("model"), data.get("data")
            src = model.get("init_from") if isinstance(model, dict) else getattr(model, "init_from", None)
            if src and isinstance(dcfg, dict | None) and not (dcfg or {}).get("tokenizer"):
                data = {**data, "data": {**(dcfg or {}), "tokenizer": src}}
            elif src and isinstance(dcfg, DataConfig) and not dcfg.tokenizer:
                data = {**data, "data": dcfg.model_copy(update={"tokenizer": src})}
        return data

    def problems(self) -> list[Problem]:
        """The checks across sections (each section checks its own fields: see `all_problems`)."""
        out: list[Problem] = []
        t, m = self.train, self.model
        from_model = m.init_from and "max_seq_len" not in m.model_fields_set  # checked once init_from is read
        if t.seq_len > m.max_seq_len and not from_model:
            out.append((("train.seq_len", "model.max_seq_len"),
                        f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}; raise "
                        "model.max_seq_len or shorten train.seq_len"))
        return out

    def all_problems(self) -> list[tuple[str, tuple[str, ...], str]]:
        """Every cross-field problem of every section, as (where, full keys involved, message)."""
        found = [(name, tuple(f"{name}.{k}" for k in keys), msg)
                 for name in type(self).model_fields for keys, msg in getattr(self, name).problems()]
        for i, entry in enumerate(self.data.mixture):
            where = f"data.mixture.{i}"
            found += [(where, tuple(f"{where}.{k}" for k in keys), msg) for keys, msg in entry.problems()]
        return found + [("", keys, msg) for keys, msg in self.problems()]

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        if self.data.mixture:  # the unused default sources would make the file name both (refused on load)
            data["data"].pop("sources", None)
        return yaml.safe_dump(data, sort_keys=False)


# --------------------------------------------------------------------------- loading


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 0.002, ...}: the values of a nested dict (a config's model_dump) under dotted keys, as
    overrides name them."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML file or preset name (or defaults) plus KEY=VALUE overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        file = resolve_config_path(path)
        source = str(file)
        data = _read_yaml(file)
    problems: list[str] = []
    keys = {item.partition("=")[0].strip() for item in overrides}
    for given, other in (("data.mixture", "data.sources"), ("data.sources", "data.mixture")):
        if given in keys and other not in keys and isinstance(data.get("data"), dict):
            data["data"].pop(other.split(".")[1], None)  # an override of one replaces the file's other
    if "model.size" in keys and isinstance(data.get("model"), dict):  # a size given here: the file's shape gives
        shape = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")  # way (overrides of its fields win)
        data["model"] = {k: v for k, v in data["model"].items() if k not in shape}
    if "model.init_from" in keys and isinstance(data.get("model"), dict):  # its config.json is the architecture:
        keep = ("init_from", "max_seq_len", "init_std", "allow_pickle", "hf_class", "trust_remote_code")
        # the file's other model fields give way to it
        data["model"] = {k: v for k, v in data["model"].items() if k in keep}
    for item in overrides:
        try:
            _apply_override(data, item)
        except ValueError as e:
            problems.append(str(e))
    cfg, found = _validate_all(data)
    problems += found
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problem(s) in the config ({source}):\n{lines}")
    assert cfg is not None
    return cfg


def _validate_all(data: dict[str, Any]) -> tuple[RunConfig | None, list[str]]:
    """Validate `data` and describe every problem in it, of all sections, in one list.

    The first pass checks single values (types, bounds, unknown keys) with the cross-field checks
    deferred. The values that failed are set aside (their defaults stand in) and the config is built
    again, then every cross-field check runs whose fields were all valid as given."""
    found: list[tuple[int, str]] = []  # (section order, description)
    order = {name: i for i, name in enumerate(RunConfig.model_fields)}

    def add(key: str, text: str) -> None:
        item = (order.get(key.split(".")[0], -1), text)
        if item not in found:
            found.append(item)

    bad: list[str] = []  # keys of the values set aside
    cfg = None
    for _ in range(4):  # setting values aside cannot fail, but keep a bound on it
        try:
            cfg = RunConfig.model_validate(data, context={_DEFER: True})
            break
        except ValidationError as e:
            for err in e.errors():
                loc = _clean_loc(err["loc"])
                add(".".join(map(str, loc)), _describe(err))
                bad.append(".".join(map(str, loc)))
                data = _without(data, loc)
    if cfg is not None:
        for where, keys, msg in cfg.all_problems():
            if not any(k == b or k.startswith(b + ".") or b.startswith(k + ".") for k in keys for b in bad):
                add(where or keys[0], f"{where}: {msg}" if where and not msg.startswith(where + ".") else msg)
    found.sort(key=lambda item: item[0])  # stable: grouped by section, in the order found
    return (cfg if not found else None), [text for _, text in found]


def _clean_loc(loc: tuple) -> tuple:
    """The key path of an error: validator names dropped, a list item's error set on the whole list."""
    loc = tuple(p for p in loc if not str(p).startswith("function-"))
    return loc[:-1] if loc and isinstance(loc[-1], int) else loc


def _without(data: dict[str, Any], loc: tuple) -> dict[str, Any]:
    """A copy of `data` without the value at `loc` (so the field's default stands in)."""
    if not loc:
        return data
    data = copy.deepcopy(data)
    node: Any = data
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return data
    if isinstance(node, dict):
        node.pop(loc[-1], None)
    return data


def derive(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """A new validated config: `cfg` with the dotted keys of `changes` set (`{"train.run_dir": "runs/a"}`).

    `cfg` itself is frozen and stays as it was. The values `cfg` was given (not its defaults) are
    validated again with the changes, so defaults that depend on them (a size preset, the quickstart's
    data.max_bytes) come out as they would have from a file holding them all."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for key, value in changes.items():
        *sections, name = key.split(".")
        node = data
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
    cfg, problems = _validate_all(data)
    if cfg is None:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"the config with {', '.join(changes)} changed is not valid:\n{lines}")
    return cfg


def resolve_config_path(path: str | Path) -> Path:
    """A path to a YAML file, or the name of a preset in kiln/configs/."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    preset = PRESETS_DIR / f"{path}.yaml"
    if preset.is_file():
        return preset
    names = sorted(f.stem for f in PRESETS_DIR.glob("*.yaml"))
    raise ConfigError(f"config file '{path}' does not exist and is not a preset. Presets: {', '.join(names)}.")


def _read_yaml(file: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)}). Fix the syntax there.") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping of sections (model:, train:, ...), got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override '{item}' is not KEY=VALUE (for example train.lr=3e-4)")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    text = _text_field(tuple(parts))
    if text is not None and not raw.lstrip().startswith(("'", '"')) and not (text == "nullable" and value is None):
        value = raw  # a text field takes the text as typed: YAML would strip 'The ' and read 'Q: a' as a mapping
    node = data
    for i, part in enumerate(parts[:-1]):
        path = tuple(parts[: i + 1])
        parent = _section_at(path[:-1])
        if parent is not None and part in parent.model_fields and _section_at(path) is None:
            raise ValueError(f"override '{item}': '{'.'.join(path)}' is a value, not a section")
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override '{item}': '{'.'.join(path)}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _text_field(key: tuple[str, ...]) -> str | None:
    """'text' for a str field at `key`, 'nullable' for a `str | None` one, None for any other key."""
    section = _section_at(key[:-1])
    field = section.model_fields.get(key[-1]) if section is not None else None
    if field is None:
        return None
    if field.annotation is str:
        return "text"
    if typing.get_origin(field.annotation) in (typing.Union, types.UnionType) and \
            set(typing.get_args(field.annotation)) == {str, type(None)}:
        return "nullable"
    return None


def _section_at(loc: tuple) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in loc:
        if isinstance(part, int):  # an item of a list field (data.mixture.0): its section was taken below
            continue
        field = cls.model_fields.get(str(part))
        ann = field.annotation if field else None
        if typing.get_origin(ann) is list:  # list[Section]
            ann = typing.get_args(ann)[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        name = str(loc[-1])
        hint = ""
        field, colon, value = name.partition(":")
        if colon and parent is not None and field.strip() in parent.model_fields:
            hint = f"; YAML needs a space after the colon: '{field.strip()}: {value.strip()}'"
        elif parent is not None:
            close = difflib.get_close_matches(name, list(parent.model_fields), n=1, cutoff=0.6)
            if close:
                suggestion = ".".join(map(str, loc[:-1] + (close[0],)))
                hint = f"; did you mean '{suggestion}'?"
            else:
                others = [f"{s}.{name}" for s, f in RunConfig.model_fields.items()
                          if isinstance(f.annotation, type) and name in f.annotation.model_fields]
                if others:
                    hint = f"; did you mean '{others[0]}'?"
                else:
                    hint = f"; valid keys here: {', '.join(parent.model_fields)}"
        return f"{key}: unknown key{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
        return f"{key}: {msg} (got {err['input']!r})"
    return f"{key}: {msg}"


def describe_fields() -> str:
    """Every config key with its type, default and doc, for `kiln train --help-config`."""
    lines = []
    for sname, sfield in RunConfig.model_fields.items():
        section = sfield.annotation
        lines.append(f"{sname}: {sfield.description or ''}")
        for name, f in section.model_fields.items():  # type: ignore[union-attr]
            ann = getattr(f.annotation, "__name__", None) or str(f.annotation).replace("typing.", "")
            bounds = "".join(f", {op} {getattr(c, attr)}" for c in f.metadata for attr, op in
                             (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if hasattr(c, attr))
            lines.append(f"  {sname}.{name} ({ann}{bounds}, default {f.default!r}): {f.description or ''}")
    return "\n".join(lines)
