"""Typed run config: one pydantic section per component, loaded from YAML plus dotted overrides.

    cfg = load_config("my.yaml", ["train.lr=3e-4", "model.n_layers=4"])

Every field has a type, a default where one makes sense and a one-line docstring, which is what
`kiln train --help-config` prints. Unknown keys and bad values raise one `ConfigError` that lists
every problem with its full key path and, for typos, the closest valid key.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kiln.errors import ConfigError

PRESETS_DIR = Path(__file__).parent / "configs"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are the docs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    size: str | None = None
    """Named size from the registry (tiny, 124m, 350m, 1b, 3b, 8b); fields set here override it."""
    vocab_size: int | None = None
    """Vocabulary size; null takes the tokenizer's, rounded up to a multiple of 64."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads; d_model must divide evenly by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); null means n_heads."""
    ffn_hidden: int | None = None
    """Hidden width of the SwiGLU MLP; null means 8/3 * d_model rounded up to a multiple of 64."""
    max_seq_len: int = 2048
    """Longest sequence the model is meant for (recorded in exports)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorm layers."""
    tie_embeddings: bool = True
    """Share the input embedding and output projection weights."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("size") is not None:
            from kiln.model.registry import SIZES

            size = data["size"]
            if size not in SIZES:
                close = difflib.get_close_matches(str(size), list(SIZES), n=1)
                hint = f" did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"unknown model size '{size}'; known: {', '.join(SIZES)}.{hint}")
            data = {**SIZES[size], **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension (d_model / n_heads) must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
    weight: float = 1.0
    """Share of the samples drawn from this entry; weights are normalised to sum to one."""

    @model_validator(mode="after")
    def _one_input(self) -> MixtureEntry:
        if (self.dataset is None) == (self.sources is None):
            raise ValueError("a mixture entry needs exactly one of 'dataset' (a prepared directory) or 'sources'")
        if not self.weight > 0:
            raise ValueError(f"weight must be positive, got {self.weight}")
        return self


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
    max_bytes: int | None = 8_000_000
    """Read at most this many characters of documents (null: all of them). Left unset, it is 8 MB when
    the sources are the built-in '@stdlib' (keeps the quickstart quick) and null for any other data."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A record with a missing field, wrong type, invalid UTF-8, empty or over-long text: 'error' stops
    with its file and line, 'skip' drops it and counts it in the prepare report."""
    max_record_bytes: int = 16 << 20
    """A record longer than this many bytes (16 MiB) is bad (too_long). It bounds the memory one record
    may take: reading it, and encoding it, where the tokenizer library needs about 120 bytes per byte of
    the document in each worker (2 GB for 16 MiB)."""
    min_chars: int = 0
    """Filter: drop documents shorter than this many characters (counted in the report)."""
    max_chars: int | None = None
    """Filter: drop documents longer than this many characters (null: no limit)."""
    dedup: bool = True
    """Drop exact duplicate documents (same content hash), keeping the first."""
    tokenizer: str | None = None
    """A tokenizer.json or a local Hugging Face tokenizer directory; null trains a byte-level BPE on the sources."""
    vocab_size: int = 4096
    """Vocabulary size of a tokenizer trained here."""
    tokenizer_train_bytes: int = 200_000_000
    """A tokenizer trained here learns from at most this many bytes of the documents."""
    eos_token: str = "auto"
    """Token appended after every document; 'auto': the tokenizer's <|endoftext|>, <|end_of_text|>, </s> or <eos>."""
    bos_token: str | None = None
    """Token put before every document (null: none; 'auto': the tokenizer's <|begin_of_text|>, <s> or <bos>)."""
    parse_special_tokens: bool = False
    """Read special-token text inside documents (a literal '<|endoftext|>') as that special token; false
    encodes it as plain text, so no document can inject an EOS or BOS."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation, chosen by document hash."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file; a shard is also the unit an interrupted prepare does not redo."""
    workers: int | None = None
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
    prefetch: int = 2
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

    @model_validator(mode="after")
    def _check_loader(self) -> DataConfig:
        if self.mixture and "sources" in self.model_fields_set:
            raise ValueError("give either data.sources or data.mixture, not both")
        if not self.mixture and not self.sources:
            raise ValueError("data.sources is empty: name files, directories, globs or URLs (or '@stdlib')")
        if self.mixture and self.streaming:
            raise ValueError("data.streaming reads data.sources; it does not take a data.mixture")
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch must be 0 or more, got {self.prefetch}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1 or self.max_record_bytes < 1 or (self.workers is not None and self.workers < 1):
            raise ValueError("data.shard_tokens, data.max_record_bytes and data.workers must be positive")
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError(f"data.max_chars={self.max_chars} is below data.min_chars={self.min_chars}")
        return self


class TrainConfig(Section):
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per micro-batch on each device."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    max_steps: int = 300
    """Optimizer steps to train for."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = 30
    """Linear warmup steps from zero to the peak learning rate."""
    decay_fraction: float = 0.2
    """For 'wsd': the fraction of steps, at the end, spent decaying to min_lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    eval_every: int = 100
    """Evaluate on the validation split every N steps (0: only at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    seed: int = 1337
    """Seed of weight initialisation, data order and sampling."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'bf16': autocast, with fp32 weights and optimizer state and a bf16 residual stream; 'fp32';
    or 'auto' (bf16 on CUDA, fp32 on CPU)."""
    compile: bool = False
    """Compile the model and the loss kernel with torch.compile (fastest on GPU; slow to start on CPU)."""
    compile_scope: Literal["blocks", "model"] = "blocks"
    """With compile: 'blocks' compiles each transformer block (one graph for all, quick to compile);
    'model' the whole forward pass up to the loss (1-2% faster at 124m, longer to compile)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in the backward pass to save memory: 'selective' keeps each block's matrix
    product and attention outputs and recomputes its elementwise ops; 'full' recomputes whole blocks
    (3b on an H100 at batch 8: 61 GiB and 54% MFU selective, 46 GiB and 45% MFU full)."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one device for the MFU metric; null looks the GPU up in a table."""
    run_dir: str | None = None
    """Run directory; null makes runs/<timestamp>."""
    sample_prompt: str = "def "
    """Prompt of the sample printed at the end of training."""
    sample_tokens: int = 80
    """Tokens generated for that sample (0: no sample)."""


class OptimConfig(Section):
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not norms, biases or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool | None = None
    """Use the fused AdamW kernel; null: on CUDA only."""


class CheckpointConfig(Section):
    save_final: bool = True
    """Save the trained model (safetensors + config) in the run directory at the end."""
    every: int = 100
    """Write a resumable checkpoint to <run_dir>/checkpoints/ every N steps (0: only at the end and on signals)."""
    keep_last: int = 3
    """Keep the newest N checkpoints in the run directory; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """Write checkpoints in the background: the loop only waits while the state is copied to CPU memory
    (a pinned CPU copy of this process's share of the state is kept for the whole run)."""
    snapshot_every: int = 0
    """Keep an in-memory copy of the whole state every N steps, for fast rollback (0: off; costs one state in RAM)."""
    archive_url: str | None = None
    """Archive location (a directory or any fsspec URL, e.g. s3://bucket/runs); null: no archive."""
    archive_every: int = 0
    """Copy every M-th checkpoint to archive_url, verified after the copy (0: none but the best)."""
    archive_best: bool = True
    """Also keep the checkpoint with the lowest validation loss in archive_url."""
    fsync: bool = True
    """Flush checkpoint files to disk before a checkpoint is marked complete (survives power loss)."""
    write_threads: int = 4
    """Threads (and files per process) that write a checkpoint; more threads, faster saves on fast disks."""
    on_signal: bool = True
    """On SIGTERM/SIGINT finish the step, write a checkpoint and exit 0; on a crash write an emergency one."""

    @model_validator(mode="after")
    def _check_counts(self) -> CheckpointConfig:
        for name in ("every", "keep_last", "snapshot_every", "archive_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1 (the newest checkpoint is what a resume needs)")
        if self.write_threads < 1:
            raise ValueError("write_threads must be at least 1")
        return self


class LoggingConfig(Section):
    every: int = 10
    """Read the loss back from the device and log every N steps."""
    console: bool = True
    """Show a progress bar and log lines on the console."""
    jsonl: bool = True
    """Write metrics to metrics.jsonl in the run directory."""



# --------------------------------------------------------------------------- dist (kiln.dist)


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
    dist: DistConfig = DistConfig()
    """Several processes and devices (torchrun): DDP or FSDP2, sharding, offload, watchdog."""

    @model_validator(mode="after")
    def _check_lengths(self) -> RunConfig:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} is longer than model.max_seq_len="
                             f"{self.model.max_seq_len}; raise model.max_seq_len or shorten train.seq_len")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------- loading


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
    for item in overrides:
        try:
            _apply_override(data, item)
        except ValueError as e:
            problems.append(str(e))
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        problems.extend(_describe(err) for err in e.errors())
        cfg = None
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problem(s) in the config ({source}):\n{lines}")
    assert cfg is not None
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
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
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
            lines.append(f"  {sname}.{name} ({ann}, default {f.default!r}): {f.description or ''}")
    return "\n".join(lines)
