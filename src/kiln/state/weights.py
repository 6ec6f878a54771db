"""Final model weights: safetensors + the model config + the tokenizer, in `<run_dir>/model/`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kiln.config import ModelConfig
from kiln.data.prepare.tokenizer import Tokenizer
from kiln.errors import StateError
from kiln.files import atomic_write_json, replace_file, write_failure
from kiln.state.rundir import checkpoints, model_saved


def save_model(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer | None, out: Path,
               source_files: Callable[[Path], object] | None = None) -> Path:
    """The final model in `out`: Kiln's layout, or an auto-path model's in transformers' own (save_pretrained), which
    from_pretrained loads, then `source_files(out)` (kiln.state.export.finish_auto_export: what its source says
    besides the weights, as `kiln export` writes it) before the model config that completes `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if cfg.hf_class == "auto":
        model.save_pretrained(out, None if tokenizer is None else lambda d: tokenizer.save(Path(d) / "tokenizer.json"))
        if source_files is not None:
            source_files(out)
        atomic_write_json(out / "model_config.json", cfg.model_dump(mode="json"), indent=2)
        return out
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as embed_tokens.weight
    tmp = out / "model.safetensors.tmp"
    # one metadata key only: safetensors keeps metadata in a Rust HashMap whose order changes from one
    # call to the next, so two keys made identical models differ byte for byte (model_config.json says
    # the layout is Kiln's own). The tensors are written sorted by dtype and name: deterministic.
    save_file(state, str(tmp), metadata={"format": "pt"})
    replace_file(tmp, out / "model.safetensors")
    if tokenizer is not None:  # whole or not at all, before the model config that completes `out`
        tokenizer.save(out / "tokenizer.json.tmp")
        replace_file(out / "tokenizer.json.tmp", out / "tokenizer.json")
    atomic_write_json(out / "model_config.json", cfg.model_dump(mode="json"), indent=2)
    return out


@contextmanager
def final_model_errors(run_dir: Path) -> Iterator[None]:
    """A final model save that the disk or the file system refuses (full, read-only, a quota) as a StateError that
    says what helps: it raised the writer's own error (OSError, safetensors' SafetensorError, the tokenizer's
    Exception) with a traceback.
    The partial weights file goes, which gives its room back; the final checkpoint is complete."""
    try:
        yield
    except Exception as e:
        reason = write_failure(e)
        if reason is None:
            raise
        out = run_dir / "model"
        for tmp in out.glob("*.tmp"):
            if tmp.is_file():
                tmp.unlink()
        newest = checkpoints(run_dir)
        kept = f"the final checkpoint {newest[-1]} is complete, and " if newest else ""
        raise StateError(f"writing the final model to {out} failed: {reason}. Nothing is lost: {kept}`kiln train "
                         f"{run_dir}` writes model/ from it once the cause is gone (free space on that disk)."
                         ) from None


def _not_saved(run_dir: Path) -> StateError:
    """Why the run at `run_dir` has no model to load, and what writes one."""
    found = checkpoints(run_dir)
    if (run_dir / "model").is_dir():
        why = f"{run_dir / 'model'} is incomplete: the run's final model save did not finish"
    elif found:
        why = f"{run_dir} has no final model (model/) yet: its newest checkpoint is {found[-1].name}"
    else:
        return StateError(f"no saved model in {run_dir}: no model/ and no checkpoint. Give a run directory of a "
                          "finished `kiln train`.")
    return StateError(f"{why}. `kiln train {run_dir}` finishes the run (or writes model/ from its final checkpoint); "
                      f"`kiln export {run_dir} --to DIR` and `kiln eval {run_dir}` read its newest checkpoint.")


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Tokenizer | None]:
    """Load `<run_dir>/model` (or the model directory itself)."""
    from kiln.model.llama import Transformer

    p = Path(path).expanduser()
    if (p / "config.yaml").is_file() and not model_saved(p / "model"):  # a run whose model/ is missing or partial
        raise _not_saved(p)
    if (p / "model").is_dir():
        p = p / "model"
    weights, conf = p / "model.safetensors", p / "model_config.json"
    if not (weights.is_file() or (p / "model.safetensors.index.json").is_file()) or not conf.is_file():
        raise StateError(f"no saved model in {path}: expected {weights.name} and {conf.name}. "
                         "Give a run directory of a finished `kiln train`.")
    try:
        cfg = ModelConfig.model_validate(json.loads(conf.read_text()))
    except ValueError as e:  # bad JSON or fields (pydantic's ValidationError is a ValueError)
        raise StateError(f"{conf} is not a valid model config ({e}); `kiln train RUN_DIR` saves the model "
                         "again from the run's newest checkpoint") from None
    if cfg.hf_class == "auto":
        from kiln.model.hf_auto import load_auto

        model = load_auto(p, cfg)
        tok = Tokenizer.load(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None
        return model.to(device).eval(), tok
    model = Transformer(cfg)
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error type on a damaged header or body
        raise StateError(f"{weights} is damaged ({e}); `kiln train RUN_DIR` saves it again from the run's newest "
                         "checkpoint") from None
    if cfg.tie_embeddings and "embed_tokens.weight" in state:  # absent: load_state_dict names what is missing
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    try:
        if missing or unknown:  # another tool's names (Hugging Face's 'model.' prefix): said in a line, not a page
            raise RuntimeError(f"{len(missing)} tensor(s) missing (e.g. {', '.join(missing[:2]) or '-'}), "
                               f"{len(unknown)} unknown (e.g. {', '.join(unknown[:2]) or '-'})")
        model.load_state_dict(state)
    except RuntimeError as e:
        raise StateError(f"{weights} does not match {conf} (written over by another tool?): {e}. If it is a run's "
                         "model/, delete that folder and run `kiln train RUN_DIR`: it saves the model again from the "
                         "run's final checkpoint") from None
    tok = Tokenizer.load(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None
    return model.to(device).eval(), tok
