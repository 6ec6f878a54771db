"""`kiln eval TARGET --data SOURCES_OR_DATASET`: loss, perplexity and bits per byte of a model on any data.

    result = evaluate("runs/X", ["held-out/*.jsonl"], max_tokens=1_000_000)

TARGET is a run directory (its final model/, else its newest checkpoint), a model/ directory, a
checkpoint directory (checkpoints/step_...) or a Hugging Face model directory (config.json +
safetensors, read into Kiln's native model). The data is either a prepared dataset directory (made
by `kiln prepare` with the model's tokenizer; its 'val' split by default) or sources, which are
prepared here with the model's tokenizer into a temporary directory (nothing is added to the cache).
Documents are packed into rows of seq_len tokens exactly as in training, with document masking as
the run trained (or on), and the rows are read once each (up to max_tokens) in the seeded order in
which training's validation reads them (train.seed of the run, else 0): on the run's own prepared
dataset, `--split val --max-tokens eval_batches*batch_size*seq_len` reproduces the run's val_loss.

Bits per byte = summed negative log-likelihood (nats) / (ln 2 x UTF-8 bytes of the predicted tokens),
so models with different tokenizers compare on the same text (see kiln.data.prepare.token_bytes).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.config import DataConfig, ModelConfig, RunConfig
from kiln.errors import ConfigError, DataError, StateError
from kiln.files import atomic_write


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: Any
    kind: str  # "model", "checkpoint" or "hf"
    path: Path
    run_cfg: RunConfig | None  # the config of the run it came from (None for a Hugging Face directory)
    step: int | None = None
    default_out: Path | None = None


def _run_config(path: Path) -> RunConfig | None:
    from kiln.state.rundir import run_config

    return run_config(path) if (path / "config.yaml").is_file() else None


def _transformer(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from kiln.model.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    state = dict(state)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for name, table in model.rope_tables(cfg.max_seq_len, torch.device("cpu")).items():
        setattr(model, name, table)  # buffers not in the state dict: computed on the CPU
    return model


def load_target(target: str | Path, command: str = "kiln eval") -> Target:
    """What TARGET holds (see the module doc), loaded on the CPU; `command` (kiln eval, kiln generate) is named in
    the errors."""
    from kiln.data.prepare.tokenizer import Tokenizer
    from kiln.state.rundir import checkpoint_of, model_saved
    from kiln.state.weights import load_model

    p = Path(target).expanduser()
    if not p.is_dir():
        raise StateError(f"{p} is not a directory; give a run directory, its model/ folder, a checkpoint directory "
                         "(checkpoints/step_...) or a Hugging Face model directory")
    model_dir = p / "model" if model_saved(p / "model") else p  # a partial model/: the newest checkpoint
    if (model_dir / "model_config.json").is_file():
        run_dir = model_dir.parent if model_dir.name == "model" and (model_dir.parent / "config.yaml").is_file() else p
        run_cfg = _run_config(run_dir)
        model, tok = load_model(model_dir)
        if tok is None:
            raise StateError(f"{model_dir} holds no tokenizer.json; {command} needs the model's tokenizer")
        if run_cfg is not None:
            tok = Tokenizer.load(model_dir / "tokenizer.json", run_cfg.data.eos_token, run_cfg.data.bos_token,
                                 named_in=run_cfg.data.tokenizer)  # its EOS, where that directory named it
        return Target(model, tok, "model", model_dir, run_cfg, default_out=run_dir / "eval.json"
                      if run_cfg is not None else model_dir / "eval.json")
    if (p / "config.json").is_file() and not (p / "meta.json").is_file():
        from kiln.model.hf_import import import_hf, native_architecture, weight_files

        try:  # documents start as its tokenizer starts a text (AutoTokenizer's BOS), as its training data did
            tok = Tokenizer.load(p, bos_token="tokenizer")
        except DataError as e:  # its message speaks of data.tokenizer, which kiln eval does not read
            raise StateError(f"{str(e).split('; ')[0]}: {command} needs the model's own tokenizer; save it beside "
                             "the model (tokenizer.save_pretrained(DIR))") from None
        weight_files(p, command=command)  # pickled weights are refused with advice for this command
        if native_architecture(p):
            cfg, state = import_hf(p)
            model = _transformer(cfg, state)
        else:  # any other causal LM, as kiln train's auto path builds it
            from kiln.model.hf_auto import open_directory

            model = open_directory(p)
        return Target(model, tok, "hf", p, None, default_out=p.with_name(p.name + ".eval.json"))
    ckpt = checkpoint_of(p)
    from kiln.state.export import read_checkpoint_auto, read_checkpoint_model
    from kiln.state.verify import read_meta

    meta = read_meta(ckpt)
    run_cfg = RunConfig.model_validate(meta["config"])
    if run_cfg.model.hf_class == "auto":  # a transformers model (kiln.model.hf_auto)
        model, tok = read_checkpoint_auto(ckpt)
    else:
        cfg, state, tok = read_checkpoint_model(ckpt)
        model = _transformer(cfg, state)
    run_dir = ckpt.parent.parent
    return Target(model, tok, "checkpoint", ckpt, run_cfg, step=int(meta["step"]),
                  default_out=run_dir / f"eval-{ckpt.name}.json")


def open_eval_data(data: list[str], tok, run_cfg: RunConfig | None, tmp: Path, split: str | None,
                   min_tokens: int, **data_fields: Any):
    """(PreparedDataset, split) to evaluate on: a prepared dataset directory, or `data` sources prepared with
    `tok` under `tmp`. `data_fields` are DataConfig fields (format, field, text_unit) for the sources."""
    from kiln.data.format.dataset import open_dataset
    from kiln.data.prepare.pipeline import prepare

    if not data:
        raise ConfigError("--data: give source files, directories or globs, or a prepared dataset directory")
    first = Path(data[0]).expanduser()
    if len(data) == 1 and (first / "manifest.json").is_file():
        try:
            ds = open_dataset(first, tok.hash)
        except DataError as e:
            raise DataError(f"--data {first}: {e}. Prepare the data with the model's tokenizer (data.tokenizer), or "
                            "give the source files instead") from None
        splits = ds.manifest["splits"]
        if split is None:
            split = "val" if int(splits.get("val", {}).get("tokens", 0)) >= min_tokens else "train"
        if int(splits.get(split, {}).get("tokens", 0)) < min_tokens:
            raise DataError(f"--data {first}: its '{split}' split has fewer than {min_tokens} tokens (one row of "
                            "--seq-len + 1); choose another --split or a shorter --seq-len")
        return ds, split
    base = run_cfg.data if run_cfg is not None else DataConfig()
    given = {k: v for k, v in data_fields.items() if v is not None}
    bos = base.bos_token
    if bos == "tokenizer":  # the BOS the model's tokenizer put first in training, by name: `tok` is given, not trained
        bos = tok.tk.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    fields = {"on_bad_record": base.on_bad_record, "eos_token": base.eos_token, "bos_token": bos,
              "format": base.format, "field": base.field, "text_unit": base.text_unit,
              "csv_quoting": base.csv_quoting, "parse_special_tokens": base.parse_special_tokens}
    try:  # the options given on the command line win over the run's own data settings
        dcfg = DataConfig(sources=list(data), tokenizer=None, val_fraction=0.0, dedup=False, min_chars=0,
                          max_chars=None, max_bytes=None, cache_dir=str(tmp), **{**fields, **given})
    except ValueError as e:
        raise ConfigError(f"kiln eval: {e}") from None
    ds = prepare(dcfg, None, progress=False, tokenizer=tok)
    if split not in (None, "train"):
        raise ConfigError(f"--split {split}: sources are evaluated whole; --split applies to a prepared dataset")
    if int(ds.manifest["splits"].get("train", {}).get("tokens", 0)) < min_tokens:
        raise DataError(f"--data {' '.join(data)}: fewer than {min_tokens} tokens (one row of --seq-len + 1); give "
                        "more text or a shorter --seq-len")
    return ds, "train"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                          "use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cpu", "cuda") and not getattr(getattr(torch, dev.type, None), "is_available", bool)():
        raise ConfigError(f"--device {name}: no such device on this machine; use auto, cpu, cuda or cuda:N")
    return dev


@torch.no_grad()
def evaluate(target: str | Path, data: list[str], *, split: str | None = None, max_tokens: int | None = None,
             batch_size: int | None = None, seq_len: int | None = None, device: str = "auto",
             document_mask: bool | None = None, seed: int | None = None, **data_fields: Any) -> dict[str, Any]:
    """Loss, perplexity and bits per byte of TARGET on `data` (see the module doc), as a JSON-ready dict."""
    from kiln.data.format.shards import TokenStream
    from kiln.data.load.loader import PackedRows
    from kiln.data.prepare.token_bytes import token_byte_lengths
    from kiln.model.loss import IGNORE_INDEX

    t = load_target(target)
    rc = t.run_cfg
    T = seq_len or (rc.train.seq_len if rc is not None else min(t.model.cfg.max_seq_len, 1024))
    B = batch_size or (rc.train.batch_size if rc is not None else 8)
    if T < 1 or B < 1 or (max_tokens is not None and max_tokens < T):
        raise ConfigError(f"--seq-len {T}, --batch-size {B}, --max-tokens {max_tokens}: give positive sizes, and "
                          "--max-tokens of at least one row (--seq-len)")
    if T > t.model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {T} is longer than the model's {t.model.cfg.max_seq_len} positions")
    mask = document_mask if document_mask is not None else (rc.data.document_mask if rc is not None else True)
    dev = _device(device)
    model = t.model.to(dev).eval()
    table = torch.from_numpy(token_byte_lengths(t.tokenizer, t.model.cfg.vocab_size)).to(dev)
    bf16 = dev.type == "cuda" and (rc is None or rc.train.precision != "fp32")
    with tempfile.TemporaryDirectory(prefix="kiln-eval-") as tmp:
        ds, split = open_eval_data(list(data), t.tokenizer, rc, Path(tmp), split, T + 1, **data_fields)
        stream = TokenStream(ds.shards(split), ds.dtype, name=f"{ds.manifest['id']}/{split}",
                             vocab=ds.manifest.get("vocab_size"))
        if seed is None:  # the order the run's validation reads its rows in
            seed = rc.train.seed if rc is not None else 0
        rows = PackedRows([stream], T, B, seed=seed, document_mask=mask, shuffle=True)
        n_rows = rows.layouts[0].rows if max_tokens is None else min(rows.layouts[0].rows, max_tokens // T)
        nats = count = nbytes = 0.0
        done = 0
        while done < n_rows:
            x, y, docs = rows.next_batch()  # (B, T) each
            keep = min(B, n_rows - done)
            x, y = x[:keep].to(dev), y[:keep].to(dev)
            docs = docs[:keep].contiguous() if docs is not None else None
            with torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = model(x, y, docs).float()
            counted = y != IGNORE_INDEX
            n = int(counted.sum())
            nats += float(loss) * n
            count += n
            nbytes += float((table[y.clamp_min(0)] * counted).sum())
            done += keep
    loss = nats / count
    result = {
        "target": str(t.path), "kind": t.kind, "step": t.step, "data": [str(d) for d in data], "split": split,
        "dataset": ds.manifest["id"], "tokenizer": t.tokenizer.hash, "seq_len": T, "batch_size": B,
        "document_mask": mask, "seed": seed, "tokens": int(count), "bytes": int(nbytes), "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / (math.log(2) * nbytes) if nbytes else None,
        "bytes_per_token": nbytes / count if count else None,
    }
    result["default_out"] = str(t.default_out) if t.default_out is not None else None
    return result


def write_result(result: dict[str, Any], out: str | Path | None) -> Path:
    """Write `result` as JSON to `out` (default: next to the target, as `evaluate` chose). Returns the path."""
    path = Path(out).expanduser() if out else Path(result["default_out"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({k: v for k, v in result.items() if k != "default_out"}, indent=1) + "\n")
    return path
