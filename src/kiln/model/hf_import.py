"""Read a local Hugging Face model directory into Kiln's native model (`model.init_from`).

    cfg = resolve_init_from(run_cfg.model)      # the ModelConfig that config.json describes
    load_init_weights(model, cfg)               # its weights into a Transformer(cfg)

A directory holds `config.json` and its weights as safetensors: one `model.safetensors`, or shards
listed in `model.safetensors.index.json`. Pickled weights (`pytorch_model.bin`, `.pt`, `.pth`) are
refused, since unpickling can run code, unless `model.allow_pickle` is true; even then they are read
with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.config import ModelConfig, RopeScaling
from kiln.errors import ConfigError, StateError
from kiln.model.hf import ARCHITECTURES, from_hf_config_dict, from_hf_state_dict, unapplied_dropout

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# fields init_from sets; a user may still choose these beside it
_FREE = {"init_from", "allow_pickle", "max_seq_len", "size", "init_std", "hf_class", "trust_remote_code"}


def _dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.init_from: {path} is not a directory; give a local Hugging Face model directory "
                          "(config.json and safetensors weights) or a Hub model id (ORG/NAME[@REVISION])")
    return p


def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = _dir(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        kiln = any((file.parent / n).is_file() for n in ("model_config.json", "config.yaml"))  # a run of Kiln's
        raise ConfigError(f"model.init_from: {file.parent} has no config.json, so it is not a Hugging Face model "
                          "directory" + ("; it is a Kiln run or its model/: export it first (kiln export RUN_DIR "
                                         "--to DIR) and give DIR" if kiln else "")) from None
    except (OSError, ValueError) as e:
        raise StateError(f"{file} cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise StateError(f"{file} is not a model config (a JSON {type(data).__name__})")
    if "model_type" not in data and not (data.get("auto_map") or {}).get("AutoConfig"):
        raise ConfigError(_no_model_type(file, data.get("architectures")))
    return data


def _no_model_type(file: Path, architectures: Any) -> str:
    """The refusal of a config.json without model_type (and without its own config code, auto_map): transformers'
    AutoConfig refuses it too, so Kiln does not guess one (its export would not load in transformers either)."""
    names = architectures if isinstance(architectures, list) else []
    kinds = sorted({k for k, cls in ARCHITECTURES.items() if cls in names})
    if len(kinds) == 1:
        add = f'add "model_type": "{kinds[0]}" to it (the type of its architectures, {", ".join(map(str, names))})'
    else:
        add = 'add the model type of its class to it ("model_type": "llama" for LlamaForCausalLM, and so on)'
    return (f"{file} has no model_type, so the architecture it describes is not known (transformers' AutoConfig "
            f"refuses such a file too): {add}, or copy the model directory again from its source")


def weight_files(path: str | Path, allow_pickle: bool = False, command: str | None = None) -> list[Path]:
    """The safetensors files of a model directory (the index's shards, in order); pickles only if allowed.
    `command` (kiln eval, kiln export): the command that reads it, whose refusal of pickles advises what that
    command takes (default: kiln train's model.init_from and model.allow_pickle)."""
    p = _dir(path)
    index = p / SAFETENSORS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise StateError(f"{index} is not a safetensors index with a weight_map ({e})") from None
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            raise StateError(f"{index} lists shards that are not in {p}: {', '.join(missing)}; copy the whole model")
        return [p / n for n in names]
    if (p / SAFETENSORS).is_file():
        return [p / SAFETENSORS]
    single = sorted(p.glob("*.safetensors"))
    if len(single) == 1:
        return single
    pickles = sorted(f for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())
    if pickles and allow_pickle:
        return pickles
    if pickles:
        then = (f"and give the new directory to {command}" if command else "and set model.init_from to the new "
                "directory; or, if you trust the file, set model.allow_pickle=true")
        raise StateError(
            f"{pickles[0]}: the weights in {p} are pickled ({', '.join(f.name for f in pickles)}), and Kiln loads "
            "safetensors only, since loading a pickle can run code. Convert them once with transformers: python -c "
            f"\"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{p}').save_pretrained("
            f"'{p}-safetensors')\" {then}")
    raise StateError(f"{p} holds no weights: expected {SAFETENSORS} or {SAFETENSORS_INDEX} with its shards")


_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "BF16": "bf16", "F32": "fp32",
                "F16": "fp16"}


def stored_dtype(path: str | Path | None) -> str | None:
    """The dtype a model directory stores its weights in (bf16, fp16 or fp32): its config.json's dtype (or
    torch_dtype), else its first safetensors file's embedding-sized tensors; None where it cannot be told."""
    if not path or not Path(path).expanduser().is_dir():
        return None
    try:
        hf = read_hf_config(path)
    except (ConfigError, StateError):
        return None
    named = hf.get("dtype") or hf.get("torch_dtype")
    if isinstance(named, str) and named in _DTYPE_NAMES:
        return _DTYPE_NAMES[named]
    try:
        from safetensors import safe_open

        file = weight_files(path)[0]
        with safe_open(str(file), framework="pt") as f:
            kinds = [f.get_slice(k).get_dtype() for k in f.keys()]
    except Exception:  # noqa: BLE001 - pickled or damaged weights: no default is told from them
        return None
    floats = [k for k in kinds if k in _DTYPE_NAMES]
    return _DTYPE_NAMES[max(set(floats), key=floats.count)] if floats else None


def read_hf_state_dict(path: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory by its Hugging Face name, on the CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path, allow_pickle):
        try:
            if file.suffix == ".safetensors":
                part = load_file(str(file))
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # safetensors and torch.load raise their own types on damaged files
            raise StateError(f"{file} cannot be read ({e}); copy it again from its source") from None
        state.update(part)
    return state


def native_architecture(path: str | Path) -> bool:
    """Whether Kiln's native model holds the architecture of the Hugging Face directory `path` (else it takes
    the auto path, kiln.model.hf_auto)."""
    try:
        from_hf_config_dict(read_hf_config(path))
    except StateError:
        return False
    return True


def import_hf(path: str | Path, allow_pickle: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, Kiln state dict) of a Hugging Face model directory."""
    cfg = from_hf_config_dict(read_hf_config(path))
    return cfg, from_hf_state_dict(read_hf_state_dict(path, allow_pickle), cfg.tie_embeddings)


def resolve_init_from(model: ModelConfig, say: Callable[[str], Any] | None = None) -> ModelConfig:
    """The ModelConfig of a run with `model.init_from`: the directory's architecture and context. ConfigError if
    the run also sets a field the directory decides, or a context that is not the model's (see `_context`).
    `say`: where a run is told what of the directory its model does not apply (its dropout)."""
    assert model.init_from is not None
    try:
        hf = read_hf_config(model.init_from)
        imported = from_hf_config_dict(hf)
    except StateError as e:
        from kiln.model.hf_causal import unbuildable

        why = unbuildable(read_hf_config(model.init_from))
        if why is not None:
            raise StateError(f"model.init_from={model.init_from}: {why}") from None
        raise StateError(f"model.init_from={model.init_from}: {e}. Set model.hf_class=auto to train it through "
                         "transformers' AutoModelForCausalLM instead (slower; see the README)") from None
    max_seq_len, scaling = _context(model, imported.max_seq_len, imported.rope_scaling)
    imported, weights_only = router_losses_of(model, imported)  # model.moe's loss weights are the run's to choose
    free = _FREE | ({"rope_scaling"} if scaling != imported.rope_scaling else set())
    free |= {"moe"} if weights_only else set()
    clash = [f"model.{k}={getattr(model, k)!r} (the model has {getattr(imported, k)!r})"
             for k in sorted(model.model_fields_set - free) if getattr(model, k) != getattr(imported, k)]
    if clash:
        raise ConfigError(f"model.init_from={model.init_from} sets the architecture from its config.json, but the "
                          f"config also sets {'; '.join(clash)}: remove those fields")
    if say is not None and (dropout := unapplied_dropout(hf)) is not None:
        say(f"warning: model.init_from={model.init_from}: {dropout}")
    keep = {k: getattr(model, k) for k in ("init_from", "allow_pickle", "trust_remote_code")}
    return imported.model_copy(update={**keep, "max_seq_len": max_seq_len, "rope_scaling": scaling})


def _context(model: ModelConfig, context: int, scaling: RopeScaling | None) -> tuple[int, RopeScaling | None]:
    """(max_seq_len, rope_scaling) of a run from a model of `context` positions and rotary `scaling`.

    The model's context is its own, and its export keeps it: train.seq_len is how long the rows it trains on are.
    model.max_seq_len beside init_from may bound this run's sequences below it (generation; the rotary tables),
    or extend the context on purpose, with the model.rope_scaling that makes the longer context (the export then
    writes both out); longer without scaling is a ConfigError."""
    fields = model.model_fields_set
    want = model.max_seq_len if "max_seq_len" in fields else context
    asked = _over(model.rope_scaling, scaling) if "rope_scaling" in fields else scaling
    new_scaling = "rope_scaling" in fields and asked != scaling
    where = f"model.init_from={model.init_from}"
    if want > context and not new_scaling:
        raise ConfigError(f"model.max_seq_len={want} is longer than the {context} positions of {where} (its "
                          "config.json max_position_embeddings), which the model was not trained for. Remove "
                          "model.max_seq_len (train.seq_len sets how long the training rows are), or extend the "
                          "context on purpose: set model.rope_scaling too (e.g. model.rope_scaling.type=linear "
                          f"model.rope_scaling.factor={-(-want // context)}); the export then writes both out")
    if new_scaling and want <= context:
        raise ConfigError(f"model.rope_scaling beside {where} extends the model's context: set model.max_seq_len "
                          f"above its {context} positions too (or remove model.rope_scaling)")
    return want, asked if new_scaling else scaling


def _over(run: RopeScaling | None, base: RopeScaling | None) -> RopeScaling | None:
    """The run's model.rope_scaling over the model's own: the fields it leaves unset (its type too) are the model's
    where the type is the same (model.rope_scaling.factor=16 on a Llama 3.1 keeps its original context and
    frequency bands; they became the defaults)."""
    if run is None or base is None or ("type" in run.model_fields_set and run.type != base.type):
        return run
    return base.model_copy(update={k: getattr(run, k) for k in run.model_fields_set - {"type"}})


def load_init_weights(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Copy the weights of `cfg.init_from` into `model` (a Transformer built from `resolve_init_from`)."""
    state = from_hf_state_dict(read_hf_state_dict(cfg.init_from, cfg.allow_pickle), cfg.tie_embeddings)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise StateError(f"the weights in {cfg.init_from} do not fit its config.json: {e}") from None


def router_losses_of(model: ModelConfig, imported: ModelConfig) -> tuple[ModelConfig, bool]:
    """(`imported` with the router-loss weights the run sets beside init_from, whether model.moe set those alone):
    moe.aux_loss_coef and moe.z_loss_coef weigh training's objective, not the architecture, so a run chooses them;
    any other moe field beside init_from is a clash that resolve_init_from names."""
    if "moe" not in model.model_fields_set or model.moe is None or imported.moe is None:
        return imported, False
    chosen = {k: getattr(model.moe, k) for k in model.moe.model_fields_set & {"aux_loss_coef", "z_loss_coef"}}
    if len(chosen) < len(model.moe.model_fields_set):
        return imported, False
    return imported.model_copy(update={"moe": imported.moe.model_copy(update=chosen)}), True
