"""What an export keeps of the Hugging Face directory a model came from (model.init_from, or the directory
`kiln export` converts): everything but the weights.

    src = source_dir(cfg)                                   # None: from scratch, or the directory is gone
    keep_source(cfg, run_dir)                               # its files into run_dir/init_from (kept_source)
    config = source_config(src, cfg, dtype="bfloat16")      # its config.json, with what Kiln changed
    carry_files(src, out, tokenizer=True)                   # tokenizer files, generation config, ...

A published model says much besides its tensors: its tokenizer's special tokens and class, a chat
template, the stop tokens and sampling settings of generation_config.json, the special token ids of
config.json. Training changes none of that, so an export copies those files unchanged and writes
config.json as the source's, changed only where Kiln changed the model on purpose: the weights' dtype,
and a context the run extended (model.max_seq_len with model.rope_scaling). When the run's tokenizer is
not the source's (data.tokenizer or --tokenizer named another), the tokenizer files, the generation
config and the special token ids are Kiln's instead: of the run's own tokenizer, and where that came from a
Hugging Face tokenizer directory (data.tokenizer), its tokenizer files (special tokens, chat template) and stop
tokens too, as for a model trained from scratch on it (`tokenizer_dir`, `stop_ids`, `carry_tokenizer_files`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kiln.config import ModelConfig

# files of a model directory an export never copies: its weights (written anew), their indexes, the model card
# of another model, config.json (merged: source_config), and the state of the Hugging Face Trainer run that saved a
# checkpoint (its step and logs, which would tell a Trainer resuming from the export to skip as many steps)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".pkl")
NOT_CARRIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "README.md",
               "model_config.json", "adapter_config.json", "adapter_model.safetensors", "trainer_state.json"}
# the tokenizer's files (Kiln writes its own instead when the run's tokenizer is another)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json"}
# the folder where transformers saves a tokenizer's named chat templates (tool_use, rag) beside chat_template.jinja
CHAT_TEMPLATES = "additional_chat_templates"
# what the tokenizer decides in config.json and generation_config.json
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 writes the first, 4.x the second
KEPT = "init_from"  # a run directory's copy of the files of model.init_from an export keeps (all but the weights)


def source_dir(cfg: ModelConfig) -> Path | None:
    """The local directory of cfg.init_from, or None (from scratch, or no longer there)."""
    if not cfg.init_from:
        return None
    p = Path(cfg.init_from).expanduser()
    return p if (p / "config.json").is_file() else None


def keep_source(cfg: ModelConfig, run_dir: Path) -> None:
    """Copy into run_dir/KEPT what an export keeps of cfg.init_from's directory (`carry_files`, and its config.json):
    the run's export keeps them where that directory is gone (moved, deleted, a Hub snapshot cleaned from the cache:
    `kept_source`). Nothing for a model from scratch."""
    src = source_dir(cfg)
    if src is None:
        return
    out = run_dir / KEPT
    if out.resolve() == src.resolve():  # a resume whose model.init_from is gone reads this copy itself
        return
    out.mkdir(exist_ok=True)
    carry_files(src, out, tokenizer=True)
    shutil.copyfile(src / "config.json", out / "config.json")


def kept_source(cfg: ModelConfig, run_dir: Path | None) -> Path | None:
    """The copy of cfg.init_from's files its run in `run_dir` kept (`keep_source`), where the directory itself is
    gone; None where it is there (source_dir), was none, or no copy was kept."""
    if not cfg.init_from or source_dir(cfg) is not None or run_dir is None:
        return None
    return run_dir / KEPT if (run_dir / KEPT / "config.json").is_file() else None


def init_from_dirs(model_dir: Path) -> list[Path]:
    """Where the files of the model.init_from of the model saved in `model_dir` (a run's model/: its
    model_config.json) are: that directory, then its run's copy of them (`keep_source`, for when it is gone); [] for
    a model from scratch."""
    init_from = read_json(model_dir / "model_config.json").get("init_from")
    if not isinstance(init_from, str) or not init_from:
        return []
    return [Path(init_from).expanduser(), model_dir.parent / KEPT]


def same_tokenizer(src: Path, tokenizer) -> bool:
    """True when `tokenizer` (a kiln Tokenizer, or None: none given) is the one `src` ships."""
    from kiln.data.prepare.tokenizer import Tokenizer
    from kiln.errors import DataError

    if tokenizer is None:
        return True
    try:
        return Tokenizer.load(src, eos_token=None).hash == tokenizer.hash
    except DataError:  # the source has no tokenizer (data.tokenizer named one): Kiln's is written
        return False


def carry_files(src: Path, out: Path, tokenizer: bool) -> list[str]:
    """Copy the files of `src` an export keeps into `out` (the tokenizer's only if `tokenizer`); their names."""
    copied = []
    for f in sorted(src.iterdir()):
        if (not f.is_file() or f.name.startswith(".") or f.name in NOT_CARRIED or f.suffix in WEIGHT_SUFFIXES
                or (f.name in TOKENIZER_FILES and not tokenizer)):
            continue
        if not tokenizer and f.name == "generation_config.json":
            continue
        shutil.copyfile(f, out / f.name)
        copied.append(f.name)
    return copied + (copy_chat_templates(src, out) if tokenizer else [])


def copy_chat_templates(folder: Path, out: Path) -> list[str]:
    """The named chat templates of the tokenizer directory `folder` (CHAT_TEMPLATES) into `out`: [its name], or []."""
    if not (folder / CHAT_TEMPLATES).is_dir():
        return []
    shutil.copytree(folder / CHAT_TEMPLATES, out / CHAT_TEMPLATES, dirs_exist_ok=True)
    return [CHAT_TEMPLATES]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def source_config(src: Path, cfg: ModelConfig | None, dtype: str | None, written: dict[str, Any],
                  tokenizer: bool) -> dict[str, Any]:
    """config.json of an export of `cfg` from `src`: the source's, with the weights' `dtype` (a torch dtype name),
    a context the run extended (cfg.max_seq_len over the source's), and unless `tokenizer` (the source's is
    kept) the special token ids of `written` (the config Kiln would write on its own). With `cfg` (None: an
    auto-path model, whose architecture is the source's by construction), the result is checked to describe it."""
    from kiln.model.hf import from_hf_config_dict

    config = current_rope(read_json(src / "config.json"))
    if dtype is not None:
        keys = [k for k in DTYPE_KEYS if k in config] or ["torch_dtype"]
        config.update({k: dtype for k in keys})
    if not tokenizer:
        for key in SPECIAL_IDS:
            if key in written:
                config[key] = written[key]
            else:
                config.pop(key, None)
    before = config.get("max_position_embeddings")
    if isinstance(before, int) and written.get("max_position_embeddings", 0) > before:  # extended on purpose: the
        # new length and its rotary scaling (a run bounded below the model's context leaves it as it is)
        for key in ("max_position_embeddings", "rope_parameters"):
            if key in written:
                config[key] = written[key]
        config.update(_rope_scaling(config, written))
    if cfg is None:
        return config
    try:
        same = _architecture(from_hf_config_dict(config)) == _architecture(cfg, config.get("max_position_embeddings"))
    except Exception:  # a config Kiln's native model cannot read (an auto-path model): nothing to compare
        same = True
    return config if same else {**config, **written}  # never an architecture that is not the model's


def _rope_scaling(config: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    """The rope_scaling key of an extended context's export of `config`: transformers 4 reads it, with the rotary
    base beside it (top-level rope_theta), and transformers 5 reads it before rope_parameters, whole. A config
    without a top-level rope_theta (as transformers 5 saves them) gets it only where it had one, holding the base
    (else 5 would read the default base 10000); one with a rope_theta gets it as Kiln writes it."""
    scaling = written.get("rope_scaling")
    if "rope_theta" in config:
        return {"rope_scaling": scaling} if "rope_scaling" in config or scaling is not None else {}
    if "rope_scaling" not in config:
        return {}
    return {"rope_scaling": written.get("rope_parameters", scaling) if scaling is not None else None}


LEGACY_ROPE = {"phi3": ("su", "yarn")}  # older Phi-3 128K checkpoints' names of longrope


def current_rope(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a config.json) with a rotary scaling named as older checkpoints name it (Phi-3's `su` or `yarn`, which
    Kiln imports as longrope) renamed longrope, in the key it uses (`type` or `rope_type`), every other field kept:
    transformers 5 refuses `su` (it reads it as longrope without the original context it then requires)."""
    legacy = LEGACY_ROPE.get(config.get("model_type"), ())
    out = dict(config)
    for key in ("rope_scaling", "rope_parameters"):
        rope = out.get(key)
        if isinstance(rope, dict) and any(rope.get(name) in legacy for name in ("type", "rope_type")):
            out[key] = {k: "longrope" if k in ("type", "rope_type") and v in legacy else v for k, v in rope.items()}
    return out


def _architecture(cfg: ModelConfig, context: Any = None) -> dict[str, Any]:
    """The fields that make the model what it is, the derived ones (null: the default) as the values they stand for;
    a max_seq_len below `context` (a run's bound on its sequences) as that context."""
    out = cfg.model_dump(exclude={"size", "init_from", "hf_class", "trust_remote_code", "allow_pickle", "init_std",
                                  "hf_model_type"})
    if isinstance(context, int) and cfg.max_seq_len < context:
        out["max_seq_len"] = context
    return {**out, "ffn_hidden": cfg.mlp_hidden, "n_kv_heads": cfg.kv_heads, "head_size": cfg.head_dim}


def written_lengths(out: Path, max_len: int, before: int | None) -> None:
    """With a context extended on purpose, the carried generation_config.json's max_length follows it where it was
    the model's context (`before`), and tokenizer_config.json's model_max_length where it held that whole context
    but not the new one (a tokenizer's limit below the model's context would warn of every longer text)."""
    if before is None or max_len <= before:
        return
    rules = {("tokenizer_config.json", "model_max_length"): lambda v: isinstance(v, int) and before <= v < max_len,
             ("generation_config.json", "max_length"): lambda v: v == before}
    for (name, key), raise_it in rules.items():
        file = out / name
        data = read_json(file)
        if raise_it(data.get(key)):
            data[key] = max_len
            file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------- the tokenizer directory of a model trained on it


def tokenizer_dir(given: str | Path | None) -> Path | None:
    """The Hugging Face directory a tokenizer came from (data.tokenizer or `--tokenizer`: the directory, or the
    folder of a tokenizer.json beside its tokenizer_config.json); None for a tokenizer.json alone, or a path not
    there."""
    if not given:
        return None
    p = Path(given).expanduser()
    folder = p if p.is_dir() else p.parent if p.name == "tokenizer.json" else None
    return folder if folder is not None and (folder / "tokenizer_config.json").is_file() else None


def stop_ids(folder: Path, tokenizer, specials: dict[str, Any]) -> dict[str, Any]:
    """`specials` (Kiln's bos/eos ids) with the stop tokens of the tokenizer directory `folder` after Kiln's EOS, and
    its pad token's id (pad_token_id) where its tokenizer_config.json names one:
    its tokenizer_config.json's eos_token (a chat model's end of turn) and its generation_config.json's
    eos_token_id (one id or a list; without that file, config.json's, which transformers' generate then takes);
    one id stays an int, several become a list, as transformers writes them."""
    found = [specials.get("eos_token_id")]
    eos = read_json(folder / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        found.append(tokenizer.tk.token_to_id(eos))
    generation = folder / "generation_config.json"
    listed = read_json(generation if generation.is_file() else folder / "config.json").get("eos_token_id")
    found += listed if isinstance(listed, list) else [listed]
    ids = list(dict.fromkeys(i for i in found if isinstance(i, int) and 0 <= i < tokenizer.vocab_size))
    pad = read_json(folder / "tokenizer_config.json").get("pad_token")  # and its pad, which generate pads with
    pad = tokenizer.tk.token_to_id(pad.get("content") if isinstance(pad, dict) else pad) if pad else None
    return {**specials, "eos_token_id": ids[0] if len(ids) == 1 else ids or None,
            **({"pad_token_id": pad} if pad is not None else {})}


def stop_strings(folder: Path) -> list[str]:
    """The stop_strings of `folder`'s generation_config.json (one text or a list; anything else: none), as a list."""
    listed = read_json(folder / "generation_config.json").get("stop_strings")
    listed = [listed] if isinstance(listed, str) else listed if isinstance(listed, list) else []
    return [t for t in listed if isinstance(t, str) and t]


def carry_tokenizer_files(folder: Path, out: Path, max_len: int) -> list[str]:
    """The tokenizer files of `folder` (special tokens, chat template) into `out`, the model's context `max_len` as
    tokenizer_config.json's model_max_length (the directory's is another model's); their names."""
    copied = []
    for name in sorted(TOKENIZER_FILES):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
            copied.append(name)
    copied += copy_chat_templates(folder, out)
    data = read_json(out / "tokenizer_config.json")
    data["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return copied
