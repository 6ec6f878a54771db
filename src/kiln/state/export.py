"""Export a model in the Hugging Face layout, which transformers, vLLM and llama.cpp's converters read.

    export_hf(model, cfg, tokenizer, "out/")            # from a model in memory
    export_from("runs/X", "out/", dtype="bf16")         # what `kiln export` does

The directory gets `config.json` (the architecture from `kiln.model.hf`), `generation_config.json`,
the weights as safetensors (`model.safetensors`, or shards `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json` above `max_shard_bytes`), the tokenizer (`tokenizer.json`,
`tokenizer_config.json` naming its special tokens) and a model card (`README.md`). Sources `export_from`
reads: a run's final `model/` directory (or the run directory holding it), a checkpoint directory (DCP), a run
directory without a final model (its newest checkpoint), or a Hugging Face model directory.

A LoRA run exports its merged weights (base + (alpha / r) B A, fp32 unless `dtype` says otherwise) in
the same layout, or with `adapters=True` (`kiln export --adapters`) its adapters alone in PEFT's format
(`adapter_model.safetensors`, `adapter_config.json`: see kiln.model.lora_peft). From a checkpoint,
which holds the adapters only, the base is read from the run's model.init_from, after its hash is
checked against the one the checkpoint recorded.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from kiln.config import ModelConfig
from kiln.data.prepare.tokenizer import Tokenizer, resolve_eos
from kiln.errors import StateError
from kiln.files import default_mode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExportWarning(UserWarning):
    """What an export could not do as asked, said without stopping it (`kiln export` prints it as a warning line)."""


class ExportNote(ExportWarning):
    """What an export changed on purpose that a user should know (`kiln export` prints it as a note line)."""


MAX_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained


def export_hf(model: torch.nn.Module | dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer | None,
              out: str | Path, dtype: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
              source: Path | None = None, tokenizer_source: Path | None = None, bos_free: bool = False) -> Path:
    """Write `model` (a Transformer or its state dict) and `tokenizer` to `out` in the Hugging Face layout;
    `dtype` (fp32, bf16 or fp16) casts the floating-point weights, None keeps them as they are. `source`: the
    Hugging Face directory the model came from (default: cfg.init_from), whose other files the export keeps
    (kiln.state.hf_source). `tokenizer_source`: the Hugging Face directory `tokenizer` came from (data.tokenizer),
    whose special tokens, chat template and stop tokens the export keeps where the model's source does not ship
    this tokenizer (a model trained from scratch on it). `bos_free`: the run put no BOS before its documents, so
    the tokenizer the export writes (the source's too) puts none either (kiln.state.tokenizer_bos)."""
    from kiln.model import hf_nemotron_h
    from kiln.model.hf import hf_model_type, to_hf_config_dict, to_hf_state_dict, zero_o_bias
    from kiln.state.hf_source import carry_files, same_tokenizer, source_config, written_lengths

    if dtype is not None and dtype not in DTYPES:
        raise StateError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    state = model if isinstance(model, dict) else model.state_dict()
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    kind = hf_model_type(cfg)
    name_of = hf_nemotron_h.file_key if kind == "nemotron_h" else str  # Nemotron-H files: the decoder `backbone.`
    tensors = {name_of(k): v.detach().to("cpu", DTYPES[dtype] if dtype and v.is_floating_point() else v.dtype)
               .contiguous() for k, v in to_hf_state_dict(state, cfg.tie_embeddings, zero_o_bias(cfg), kind).items()}
    src = source if source is not None else _source_of(cfg)
    keep_tokenizer = src is not None and same_tokenizer(src, tokenizer)
    specials, tok_dir = _run_tokenizer(tokenizer, tokenizer_source, keep_tokenizer)
    name = str(state["embed_tokens.weight"].dtype if dtype is None else DTYPES[dtype]).removeprefix("torch.")
    config = to_hf_config_dict(cfg, **specials, dtype=name, torch_dtype=name)
    if src is not None:
        before = read_hf_json(src / "config.json").get("max_position_embeddings")
        config = source_config(src, cfg, name, config, keep_tokenizer)
    _write_json(out / "config.json", config)
    write_safetensors(tensors, out, max_shard_bytes)
    if src is not None:
        carry_files(src, out, keep_tokenizer)
    if keep_tokenizer:
        written_lengths(out, cfg.max_seq_len, before)
        if bos_free:  # the source's tokenizer, for a run that put no BOS before its documents (data.bos_token=null)
            _drop_bos(out)
        return out
    _write_run_tokenizer(out, tokenizer, specials, tok_dir, cfg.max_seq_len, bos_free)
    return out


def _run_tokenizer(tokenizer: Tokenizer | None, tokenizer_source: Path | None, keep_tokenizer: bool
                   ) -> tuple[dict[str, Any], Path | None]:
    """(special token ids, Hugging Face directory) of the run's tokenizer as an export ships it where the model's
    source does not (`keep_tokenizer` False): the directory is `tokenizer_source` when it holds this very
    tokenizer (data.tokenizer=DIR), whose stop tokens then join the ids (kiln.state.hf_source.stop_ids)."""
    from kiln.state.hf_source import same_tokenizer, stop_ids

    specials = _special_ids(tokenizer)
    if tokenizer is None or keep_tokenizer or tokenizer_source is None or not same_tokenizer(tokenizer_source,
                                                                                             tokenizer):
        return specials, None
    return stop_ids(tokenizer_source, tokenizer, specials), tokenizer_source


def _write_run_tokenizer(out: Path, tokenizer: Tokenizer | None, specials: dict[str, Any], tok_dir: Path | None,
                         max_len: int, bos_free: bool) -> None:
    """The run's tokenizer (`_run_tokenizer`) into `out`: generation_config.json of its special ids (and its
    directory's stop_strings), tokenizer.json and Kiln's tokenizer_config.json, or its directory's tokenizer files
    (chat template, special tokens); with `bos_free` (the run put no BOS first), without the BOS its post-processor
    puts first."""
    from kiln.state.hf_source import carry_tokenizer_files, stop_strings

    texts = stop_strings(tok_dir) if tok_dir is not None else []
    _write_json(out / "generation_config.json", {"_from_model_config": True, **specials,
                                                 **({"stop_strings": texts} if texts else {})})
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, max_len)
    if tok_dir is not None:
        carry_tokenizer_files(tok_dir, out, max_len)
    if bos_free and tokenizer is not None:
        _drop_bos(out)


def _drop_bos(out: Path) -> None:
    """The BOS out of the exported tokenizer of a model trained without one, said in a note (kiln export's line)."""
    from kiln.state.tokenizer_bos import drop_bos

    bos, gone = drop_bos(out)
    if bos is not None and gone:
        warnings.warn(ExportNote(f"the exported tokenizer puts no {bos} before a text, as the model trained without "
                                 "a BOS (data.bos_token=null): its post-processor and add_bos_token say so. To train "
                                 f"a model with {bos} first, set data.bos_token=tokenizer"), stacklevel=4)
    elif bos is not None:
        warnings.warn(ExportWarning(f"the exported tokenizer puts {bos} before a text, which the model never saw in "
                                    "training (data.bos_token=null), and its post-processor is of a kind Kiln cannot "
                                    "change: encode with add_special_tokens=False"), stacklevel=4)


def _source_of(cfg: ModelConfig) -> Path | None:
    """cfg.init_from's directory, warning when it is gone (the export then has Kiln's own tokenizer files)."""
    from kiln.state.hf_source import source_dir

    src = source_dir(cfg)
    if src is None and cfg.init_from:
        warnings.warn(f"model.init_from={cfg.init_from} is not there any more, so the export cannot keep its "
                      "tokenizer settings, chat template and generation config: it gets Kiln's own tokenizer files. "
                      "Restore the directory and export again to keep them", ExportWarning, stacklevel=3)
    return src


def read_hf_json(path: Path) -> dict[str, Any]:
    from kiln.state.hf_source import read_json

    return read_json(path)


def finish_auto_export(out: Path, cfg: ModelConfig, tokenizer: Tokenizer | None, tokenizer_source: Path | None = None,
                       bos_free: bool = False, source: Path | None = None) -> Path:
    """After an auto-path model's save_pretrained into `out`: config.json as its source's (the weights' dtype
    changed), and the source's tokenizer files and generation config (kiln.state.hf_source); where the run's
    tokenizer is another, that tokenizer (with `tokenizer_source`, its directory's files and stop tokens, as
    `export_hf` ships them, and without a BOS where `bos_free`) and its special ids in config.json and
    generation_config.json. `source`: the directory of its source's files (default: cfg.init_from)."""
    from kiln.state.hf_source import SPECIAL_IDS, carry_files, same_tokenizer, source_config

    src = source if source is not None else _source_of(cfg)
    keep_tokenizer = tokenizer is None or (src is not None and same_tokenizer(src, tokenizer))
    specials, tok_dir = _run_tokenizer(tokenizer, tokenizer_source, keep_tokenizer)
    written = read_hf_json(out / "config.json")
    if not keep_tokenizer:  # save_pretrained wrote the source's ids
        written = {**{k: v for k, v in written.items() if k not in SPECIAL_IDS}, **specials}
    if src is not None:
        dtype = next((written[k] for k in ("dtype", "torch_dtype") if isinstance(written.get(k), str)), None)
        written = source_config(src, None, dtype, written, keep_tokenizer)
        carry_files(src, out, keep_tokenizer)
    _write_json(out / "config.json", written)
    if not keep_tokenizer:
        _write_run_tokenizer(out, tokenizer, specials, tok_dir, cfg.max_seq_len, bos_free)
    elif bos_free and src is not None:
        _drop_bos(out)
    return out


def _special_ids(tokenizer: Tokenizer | None) -> dict[str, Any]:
    if tokenizer is None:
        return {}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[Path]:
    """One model.safetensors, or shards in key order plus model.safetensors.index.json above the limit."""
    from safetensors.torch import save_file

    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous export's shards would mix with these
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    for name, shard in zip(names, shards):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata=meta)
        default_mode(tmp)
        tmp.replace(out / name)
    if len(shards) > 1:
        _write_json(out / "model.safetensors.index.json", index)
    return [out / n for n in names]


def write_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    """tokenizer.json, plus a tokenizer_config.json that AutoTokenizer reads (a fast tokenizer with its
    BOS/EOS tokens; the EOS doubles as padding)."""
    tokenizer.save(out / "tokenizer.json")
    name = tokenizer.tk.id_to_token
    eos = name(tokenizer.eos_id) if tokenizer.eos_id is not None else None
    bos = name(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "bos_token": bos,
        "eos_token": eos, "pad_token": eos, "add_bos_token": bos is not None, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    })


# --------------------------------------------------------------------------- sources of an export


def export_from(src: str | Path, to: str | Path, dtype: str | None = None, tokenizer: str | Path | None = None,
                max_shard_bytes: int = MAX_SHARD_BYTES, adapters: bool = False, repo: str | None = None) -> Path:
    """`kiln export SRC --to TO`: find what SRC holds (see the module doc) and export it, with a model card
    (README.md: kiln.state.model_card; `repo`: the Hub repository it is meant for); `adapters`: a LoRA run's
    adapters in PEFT's format instead of the merged model."""
    from kiln.data.prepare.bpe import sigterm_interrupts
    from kiln.files import write_failure
    from kiln.state.model_card import write_model_card

    dest = Path(to).expanduser()
    before = {name: _stamp(dest / name) for name in MARKERS}
    made = not dest.exists()
    try:
        with sigterm_interrupts():  # SIGTERM and SIGHUP as Ctrl-C: the partial export below goes with any of them
            out = _export(src, to, dtype, tokenizer, max_shard_bytes, adapters)
            if adapters:
                _base_tokenizer(Path(src).expanduser(), out)
            write_model_card(Path(src).expanduser(), out, repo, adapters)
    except KeyboardInterrupt:  # a weights file being written (the size of the model) is not left behind, nor
        for tmp in dest.glob("*.tmp"):  # the config.json this export wrote, by which a loader took the directory
            with contextlib.suppress(OSError):  # for a model (its weights written, its tokenizer not yet)
                tmp.unlink()
        for name, stamp in before.items():
            if _stamp(dest / name) != stamp:
                with contextlib.suppress(OSError):
                    (dest / name).unlink()
        if made:  # a directory this export made, left empty: not left behind
            with contextlib.suppress(OSError):
                dest.rmdir()
        raise
    except Exception as e:  # a full or read-only disk: said, with what to do, instead of the writer's traceback
        reason = write_failure(e)
        if reason is None:
            raise
        partial = f"{to} holds an incomplete export, not to be loaded: " if Path(to).expanduser().is_dir() else ""
        raise StateError(f"writing the export to {to} failed: {reason}. {src} is untouched; {partial}free space "
                         "there (or give another --to) and export again") from None
    return out


MARKERS = ("config.json", "adapter_config.json")  # the file a loader takes a directory for a model (or adapters) by


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _base_tokenizer(src: Path, out: Path) -> None:
    """Beside PEFT adapters, the tokenizer files of their base (the run's model.init_from, where it is a local
    directory: the run's tokenizer is its base's), as the Hugging Face Trainer's output has them, so AutoTokenizer
    reads the adapter directory with its chat template, special and stop tokens; without its BOS where the run put
    none first (data.bos_token=null)."""
    import shutil

    from kiln.state.hf_source import TOKENIZER_FILES, copy_chat_templates

    base = _run_section(src, "model").get("init_from")
    if not isinstance(base, str) or not base:
        return
    base_dir = Path(base).expanduser()  # else the run's copy of its files, where it is gone
    base_dir = base_dir if (base_dir / "config.json").is_file() else _kept_source(ModelConfig(init_from=base), src)
    if base_dir is None:
        return
    for name in sorted(TOKENIZER_FILES):
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, out / name)
    copy_chat_templates(base_dir, out)
    data = _run_section(src)
    if data and data.get("bos_token") is None:
        _drop_bos(out)


def _export(src: str | Path, to: str | Path, dtype: str | None, tokenizer: str | Path | None, max_shard_bytes: int,
            adapters: bool) -> Path:
    from kiln.model.hf_import import stored_dtype
    from kiln.state.hf_source import tokenizer_dir
    from kiln.state.rundir import model_saved
    from kiln.state.weights import load_model

    p = Path(src).expanduser()
    if not p.is_dir():
        raise StateError(f"{p} is not a directory; give a run directory, its model/ folder, a checkpoint "
                         "directory (checkpoints/step_...) or a Hugging Face model directory")
    if dtype is not None and dtype not in DTYPES:
        raise StateError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    _check_destination(p, Path(to).expanduser())
    if adapters:
        return _export_adapters(p, to, dtype)
    if tokenizer is not None and not Path(tokenizer).expanduser().exists():  # not data.tokenizer's words
        raise StateError(f"--tokenizer {tokenizer} does not exist; give a tokenizer.json or a directory holding one, "
                         "or leave it out to ship the run's")
    tok = Tokenizer.load(tokenizer) if tokenizer is not None else None
    data = _run_section(p)
    tok_dir = tokenizer_dir(tokenizer if tokenizer is not None else data.get("tokenizer"))
    if (p / "model_config.json").is_file() or model_saved(p / "model"):  # else a run's checkpoint (below)
        model, saved_tok = load_model(p)
        if tok is not None:
            check_tokenizer(tok, tokenizer, saved_tok, int(model.cfg.vocab_size))
        kept = _kept_source(model.cfg, p)  # where model.init_from is gone, its run's copy of its files
        dtype = dtype or stored_dtype(kept or model.cfg.init_from)  # the weights come back in the dtype they came in
        run_tok, bos_free = _as_trained(tok or saved_tok, data)
        if model.cfg.hf_class == "auto":  # a transformers model: its own save_pretrained
            return _export_auto(model, run_tok, to, dtype, tok_dir, bos_free, kept)
        return export_hf(model, model.cfg, run_tok, to, dtype, max_shard_bytes, source=kept, tokenizer_source=tok_dir,
                         bos_free=bos_free)
    if (p / "config.json").is_file():  # a Hugging Face directory: converted (e.g. to bf16, or re-sharded)
        from kiln.model.hf_import import import_hf, native_architecture, weight_files

        weight_files(p, command="kiln export")  # pickled weights are refused with advice for this command
        if not native_architecture(p):  # any other causal LM, as kiln train's auto path builds it
            from kiln.model.hf_auto import open_directory

            model = open_directory(p)
            if tok is not None:
                check_tokenizer(tok, tokenizer, _own_tokenizer(p), int(model.cfg.vocab_size))
            return _export_auto(model, tok or Tokenizer.load(p), to, dtype or stored_dtype(p))
        cfg, state = import_hf(p)
        if tok is not None:
            check_tokenizer(tok, tokenizer, _own_tokenizer(p), state["embed_tokens.weight"].shape[0])
        return export_hf(state, cfg, tok or Tokenizer.load(p), to, dtype, max_shard_bytes, source=p)
    from kiln.state.rundir import checkpoint_of

    ckpt = p if (p / ".metadata").is_file() else checkpoint_of(p)
    kept = _kept_source(_run_config(ckpt).model, ckpt)
    dtype = dtype or stored_dtype(kept or _run_config(ckpt).model.init_from)
    if _run_config(ckpt).model.hf_class == "auto":
        model, found_tok = read_checkpoint_auto(ckpt, need_tokenizer=tok is None)
        if tok is not None:
            check_tokenizer(tok, tokenizer, found_tok, int(model.cfg.vocab_size))
        run_tok, bos_free = _as_trained(tok or found_tok, data)
        return _export_auto(model, run_tok, to, dtype, tok_dir, bos_free, kept)
    cfg, state, found_tok = read_checkpoint_model(ckpt, need_tokenizer=tok is None)
    if tok is not None:
        check_tokenizer(tok, tokenizer, found_tok, state["embed_tokens.weight"].shape[0])
    run_tok, bos_free = _as_trained(tok or found_tok, data)
    return export_hf(state, cfg, run_tok, to, dtype, max_shard_bytes, source=kept, tokenizer_source=tok_dir,
                     bos_free=bos_free)


def _run_section(src: Path, name: str = "data") -> dict[str, Any]:
    """A section of the config of the run an export's `src` belongs to ("data", "model"); {} where it is no
    run's."""
    from kiln.state.model_card import _run_of

    config = _run_of(src)[2] or {}
    return config.get(name) if isinstance(config.get(name), dict) else {}


def _as_trained(tok: Tokenizer | None, data: dict[str, Any]) -> tuple[Tokenizer | None, bool]:
    """`tok` with the BOS and EOS ids the run's data.bos_token and data.eos_token put around its documents, and
    whether it put no BOS first; `tok` as it is and False where the run's data section is unknown (`data` {})."""
    from kiln.errors import DataError

    if tok is None or not data:
        return tok, False
    try:
        eos = resolve_eos(tok.tk, data.get("eos_token", "auto"), data.get("tokenizer"))  # as the run's load found it
        trained = Tokenizer(tok.tk, eos, data.get("bos_token"))
    except DataError:  # a --tokenizer without the run's special tokens (check_tokenizer said what it may)
        return tok, False
    return trained, trained.bos_id is None


def _export_auto(model, tok: Tokenizer | None, to: str | Path, dtype: str | None,
                 tokenizer_source: Path | None = None, bos_free: bool = False, source: Path | None = None) -> Path:
    """An auto-path model through its own save_pretrained, then its source's files or the run's tokenizer
    (finish_auto_export)."""
    out = model.save_pretrained(to, None, dtype=DTYPES[_dtype(dtype)] if dtype else None)
    return finish_auto_export(Path(out), model.cfg, tok, tokenizer_source, bos_free, source)


def _kept_source(cfg: ModelConfig, src: Path) -> Path | None:
    """The copy of cfg.init_from's files that the run an export's `src` belongs to kept (kiln.state.hf_source.KEPT),
    where that directory is gone; None where it is there, or the run kept none."""
    from kiln.state.hf_source import kept_source
    from kiln.state.model_card import _run_of

    return kept_source(cfg, _run_of(src)[0])


def _check_destination(src: Path, to: Path) -> None:
    """--to must be a directory (new or existing) other than the source, and outside the parts of its run that
    Kiln reads back: the run's model/ (written over with Hugging Face names, `kiln generate` and the run could no
    longer read it) and its checkpoints."""
    if to.exists() and not to.is_dir():
        raise StateError(f"--to {to}: a file of that name exists; give a directory to write the model into")
    target, source = to.resolve(), src.resolve()
    if target == source:
        raise StateError(f"--to {to} is the source itself; give another directory")
    run = source.parent.parent if source.parent.name == "checkpoints" else source
    for kept in (run / "model", run / "checkpoints") if (run / "config.yaml").is_file() else ():
        if target == kept or kept in target.parents:
            raise StateError(f"--to {to} is inside {kept}, which the run reads back: the export would write over "
                             "its files. Give a directory outside it (e.g. beside the run)")


def _own_tokenizer(directory: Path) -> Tokenizer | None:
    """The tokenizer a Hugging Face model directory ships, None where it has none Kiln can read."""
    from kiln.errors import KilnError

    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return Tokenizer.load(directory)
    except (KilnError, ValueError, OSError):
        return None


def check_tokenizer(tok: Tokenizer, given: str | Path, own: Tokenizer | None, rows: int) -> None:
    """Refuse `--tokenizer given` where the model would decode garbage with it: ids beyond its embedding, a
    vocabulary other than that of the tokenizer it was trained with (`own`, where it is known), or, with none
    known, a vocabulary that covers less than half of its embedding rows (a model pads its embedding by a
    little, not by half)."""
    where = f"--tokenizer {given}"
    if tok.vocab_size > rows:
        raise StateError(f"{where} has ids up to {tok.vocab_size - 1}, but the model embeds only {rows} tokens: it "
                         "is not this model's tokenizer. Leave out --tokenizer to ship the model's own")
    if own is not None and own.tk.get_vocab(with_added_tokens=True) != tok.tk.get_vocab(with_added_tokens=True):
        raise StateError(f"{where} maps tokens to other ids than the tokenizer the model was trained with "
                         f"({tok.vocab_size} against {own.vocab_size} ids; hashes {tok.hash} and {own.hash}), so the "
                         "exported model would decode garbage. Leave out --tokenizer to ship the model's own")
    if own is None and tok.vocab_size * 2 < rows:
        raise StateError(f"{where} has {tok.vocab_size} tokens for a model that embeds {rows}: it is not the "
                         "tokenizer this model was trained with. Give the model's own tokenizer")


def _dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise StateError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    return dtype


def _run_config(ckpt: Path):
    from kiln.config import RunConfig
    from kiln.state.verify import read_meta

    try:
        return RunConfig.model_validate(read_meta(ckpt)["config"])
    except (KeyError, ValueError) as e:
        raise StateError(f"{ckpt}: its meta.json has no valid config ({e})") from None


def read_checkpoint_auto(ckpt: Path, need_tokenizer: bool = True):
    """(HFCausalLM, tokenizer) of a checkpoint of a `model.hf_class=auto` run: the architecture of its
    model.init_from (and, under LoRA, its frozen base weights), the checkpoint's weights; the tokenizer is None
    where it is not found and not `need_tokenizer`."""
    from kiln.state.verify import read_meta

    run_cfg = _run_config(ckpt)
    return load_checkpoint_auto(ckpt, run_cfg), _checkpoint_tokenizer(ckpt, run_cfg, read_meta(ckpt), need_tokenizer)


def load_checkpoint_auto(ckpt: Path, run_cfg, base_weights: bool = True):
    """The HFCausalLM a checkpoint of an auto run saved: every weight that trains, and the buffers, from the
    checkpoint; under LoRA the frozen base from model.init_from (`base_weights` False: left as initialised,
    for the adapters alone)."""
    from kiln.model.hf_auto import build_auto
    from kiln.state.dcp_read import read_part
    from kiln.state.parts import ModelState

    model = build_auto(run_cfg.model, run_cfg.lora, weights=base_weights and run_cfg.lora.rank > 0)
    part = ModelState(model)
    state = part.state_dict()
    read_part(ckpt, "model", state, f"the {type(model.base).__name__} of {run_cfg.model.init_from}")
    part.load_state_dict(state)
    return model.eval()


def read_checkpoint_model(ckpt: Path, need_tokenizer: bool = True
                          ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """The model config, model weights and tokenizer of a checkpoint directory (None where it is not found and
    not `need_tokenizer`; else not found is an error).

    Reads only the "model" key of the DCP files through `torch.distributed.checkpoint`'s public load,
    in this one process: a sharded checkpoint of any world size is gathered whole."""
    run_cfg, meta, state = _checkpoint_tensors(ckpt)
    cfg = run_cfg.model
    if run_cfg.lora.rank:  # adapters only: the base comes from init_from, checked against the recorded hash
        from kiln.state.lora_base import base_hash, check_base, merged_model

        current = base_hash(cfg.init_from, cfg.allow_pickle) if cfg.init_from and Path(cfg.init_from).exists() \
            else None
        if current is None:
            raise StateError(f"{ckpt} holds LoRA adapters only, and their base model.init_from={cfg.init_from} is "
                             "not there: restore it, or export the adapters alone with --adapters")
        check_base(meta.get("fingerprints") or {}, current, f"checkpoint {ckpt}", cfg.init_from)
        state = merged_model(cfg, run_cfg.lora, state).state_dict()
    return cfg, state, _checkpoint_tokenizer(ckpt, run_cfg, meta, need_tokenizer)


def _checkpoint_tensors(ckpt: Path) -> tuple[Any, dict, dict[str, torch.Tensor]]:
    """(run config, meta.json, the "model" part of the checkpoint): every weight, or a LoRA run's adapters."""
    from kiln.config import RunConfig
    from kiln.model.llama import Transformer
    from kiln.model.lora import adapter_state_dict, apply_lora
    from kiln.state.dcp_read import read_part
    from kiln.state.verify import read_meta

    meta = read_meta(ckpt)
    try:
        run_cfg = RunConfig.model_validate(meta["config"])
    except (KeyError, ValueError) as e:
        raise StateError(f"{ckpt}: its meta.json has no valid config ({e})") from None
    cfg = run_cfg.model
    with torch.device("meta"):
        model = apply_lora(Transformer(cfg), run_cfg.lora)
    live = adapter_state_dict(model) if run_cfg.lora.rank else model.state_dict()
    state = {k: torch.empty_like(v, device="cpu") for k, v in live.items()}
    tied = cfg.tie_embeddings and "lm_head.weight" in state
    if tied:  # saved under both names, or the embedding's alone
        state["lm_head.weight"] = state["embed_tokens.weight"]
    read_part(ckpt, "model", state, "a Kiln model of its config" + (" (LoRA adapters)" if run_cfg.lora.rank else ""),
              optional=frozenset({"lm_head.weight"} if tied else ()))
    if tied:
        state.pop("lm_head.weight", None)
    return run_cfg, meta, state


def _export_adapters(p: Path, to: str | Path, dtype: str | None) -> Path:
    """The LoRA adapters of a run (its model/adapters/, else its newest checkpoint) in PEFT's format."""
    from kiln.model.hub import published_base
    from kiln.model.lora_peft import CONFIG, read_peft_adapters, save_peft, write_peft_adapters
    from kiln.state.rundir import checkpoints

    cast = DTYPES[dtype] if dtype else None
    for saved in (p / "adapters", p / "model" / "adapters"):  # a finished run's model/ keeps them
        if (saved / CONFIG).is_file() and _saved_by_auto(saved.parent):
            return _copy_peft(saved, Path(to).expanduser(), cast)
        if (saved / CONFIG).is_file():
            return save_peft(*read_peft_adapters(saved), to, cast)
    ckpt = p if (p / ".metadata").is_file() else (checkpoints(p) or [None])[-1]
    if ckpt is None:
        raise StateError(f"{p} holds no LoRA adapters: give the directory of a `kiln train` run with lora.rank > 0, "
                         "its model/ folder or one of its checkpoints")
    run_cfg = _run_config(ckpt)
    if not run_cfg.lora.rank:
        raise StateError(f"{ckpt} was trained without LoRA (lora.rank=0), so it has no adapters; export the whole "
                         "model without --adapters")
    if run_cfg.model.hf_class == "auto":  # PEFT's own adapters on the transformers model
        model = load_checkpoint_auto(ckpt, run_cfg, base_weights=False)
        name, revision = published_base(run_cfg.model.init_from)  # a Hub snapshot: named by its id and revision
        for adapter in model.hf.peft_config.values():
            adapter.base_model_name_or_path, adapter.revision = name, revision
        out = Path(to).expanduser()
        (model.hf.to(cast) if cast else model.hf).save_pretrained(str(out), safe_serialization=True)
        for f in out.glob("*.safetensors"):
            default_mode(f)
        return out
    _, _, state = _checkpoint_tensors(ckpt)
    return write_peft_adapters(state, run_cfg.model, run_cfg.lora, run_cfg.model.init_from, to, cast)


def _saved_by_auto(model_dir: Path) -> bool:
    """Whether the final model/ directory holds a transformers model (an auto run), by its model_config.json."""
    try:
        return json.loads((model_dir / "model_config.json").read_text()).get("hf_class") == "auto"
    except (OSError, ValueError, AttributeError):
        return False


def _copy_peft(saved: Path, out: Path, cast: torch.dtype | None) -> Path:
    """PEFT's adapter directory `saved` (written by PEFT itself) into `out`, its tensors cast to `cast`."""
    from safetensors.torch import load_file, save_file

    from kiln.files import atomic_write_json, replace_file
    from kiln.model.hub import published_base
    from kiln.model.lora_peft import CONFIG, WEIGHTS

    try:
        tensors = load_file(str(saved / WEIGHTS))
        config = json.loads((saved / CONFIG).read_text())
    except Exception as e:  # safetensors raises its own error type on a damaged file
        raise StateError(f"the LoRA adapters in {saved} cannot be read ({e})") from None
    name, revision = published_base(config.get("base_model_name_or_path"))  # a Hub snapshot: its id and revision
    if revision is not None:
        config = {**config, "base_model_name_or_path": name, "revision": revision}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file({k: v.to(cast or v.dtype).contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    replace_file(tmp, out / WEIGHTS)
    atomic_write_json(out / CONFIG, config, indent=2)
    return out


def _checkpoint_tokenizer(ckpt: Path, run_cfg, meta: dict, required: bool = True) -> Tokenizer | None:
    """The run's tokenizer: its final model/, data.tokenizer, or the prepared dataset the checkpoint names."""
    run_dir = ckpt.parent.parent
    want = (meta.get("fingerprints") or {}).get("tokenizer")
    places = [run_dir / "model" / "tokenizer.json"]
    if run_cfg.data.tokenizer:
        places.append(Path(run_cfg.data.tokenizer).expanduser())
    dataset = (meta.get("fingerprints") or {}).get("dataset")
    if dataset:
        places.append(Path(run_cfg.data.cache_dir).expanduser() / "datasets" / str(dataset) / "tokenizer.json")
    for place in places:
        if place.exists():
            tok = Tokenizer.load(place, run_cfg.data.eos_token, run_cfg.data.bos_token, named_in=run_cfg.data.tokenizer)
            if want is None or tok.hash == want:
                return tok
    if not required:
        return None
    raise StateError(f"the tokenizer of {ckpt} was not found (looked in {', '.join(map(str, places))}); give it "
                     "with --tokenizer PATH")
