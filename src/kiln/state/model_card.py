"""The model card (README.md) of an export: what a reader of the Hub page needs to know of how it was made.

    write_model_card(source, out)      # kiln export SOURCE --to OUT writes OUT/README.md

Read from the run the export came from: the base model (model.init_from, and the license its card names), the
data (its sources), the steps and tokens trained (up to the exported checkpoint's step), the last training and
validation losses, and the run's whole Kiln config. An export of a Hugging Face directory (no run) says what it
was made from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

import kiln


def _run_of(source: Path) -> tuple[Path | None, int | None, dict | None]:
    """(run directory, the step exported (None: the run's last), the run config) of an export's source."""
    from kiln.state.verify import read_meta

    if (source / ".metadata").is_file():  # a checkpoint: its run is two levels up, its config in its meta.json
        try:
            meta = read_meta(source)
        except Exception:  # a damaged meta.json: the card says less, the export itself has checked the weights
            meta = {}
        return source.parent.parent, meta.get("step"), meta.get("config")
    for run in (source, source.parent):  # a run directory, or its model/
        if (run / "config.yaml").is_file():
            try:
                config = yaml.safe_load((run / "config.yaml").read_text())
            except (OSError, yaml.YAMLError):
                config = None
            return run, None, config if isinstance(config, dict) else None
    return None, None, None


def _training(run: Path, step: int | None) -> dict[str, Any]:
    """The last train record's step, tokens and loss, and the last validation loss, up to `step`."""
    out: dict[str, Any] = {}
    try:
        lines = (run / "metrics.jsonl").read_text(errors="replace").splitlines()  # a damaged byte: its line
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        if step is not None and rec["step"] > step:  # after the exported checkpoint
            continue
        if rec.get("event") == "train" and isinstance(rec.get("loss"), int | float):
            out.update(step=rec["step"], tokens=rec.get("tokens"), loss=rec["loss"])
        elif rec.get("event") == "eval" and isinstance(rec.get("val_loss"), int | float):
            out.update(val_loss=rec["val_loss"], val_step=rec["step"])
    return out


def _hub_id(init_from: str | None) -> str | None:
    """init_from as a Hub model id (owner/name, as the card's base_model metadata takes it): a Hub id itself, or
    a snapshot of huggingface_hub's cache (.../models--OWNER--NAME/snapshots/REVISION); None for another path."""
    if not init_from:
        return None
    path = Path(init_from).expanduser()
    for part in path.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    if path.exists():
        return None
    name = init_from.removeprefix("hf://").split("@")[0].strip("/")
    return name if name.count("/") == 1 else None


LICENSE_KEYS = ("license", "license_name", "license_link")


def _license(init_from: str | None) -> dict[str, Any]:
    """The license metadata of the base's own card (model.init_from's README.md front matter: license, and for
    license: other its name and link), which a model trained from it is under too; {} where there is none."""
    if not init_from:
        return {}
    try:
        text = (Path(init_from).expanduser() / "README.md").read_text()
        front = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else None
    except (OSError, IndexError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return {k: front[k] for k in LICENSE_KEYS if isinstance(front, dict) and front.get(k)}


def model_card(source: str | Path, repo: str | None = None, adapters: bool = False) -> str:
    """The README.md text of an export of `source` (as `kiln export` takes it), to be published as `repo`;
    `adapters`: the export is a LoRA run's adapters alone (PEFT's format)."""
    source = Path(source).expanduser()
    run, step, config = _run_of(source)
    model = (config or {}).get("model") or {}
    data = (config or {}).get("data") or {}
    lora = (config or {}).get("lora") or {}
    init_from = model.get("init_from")
    base = _hub_id(init_from)
    qlora = bool(lora.get("rank")) and lora.get("quantize_base") == "nf4"  # adapters trained on an NF4 base
    tags = ["kiln", "text-generation"] + (["lora"] if lora.get("rank") else []) + (["qlora"] if qlora else [])
    front = {"library_name": "peft" if adapters else "transformers", "pipeline_tag": "text-generation", "tags": tags}
    if base:
        front["base_model"] = base
    front.update(_license(init_from))
    title = repo or (run.name if run is not None else source.name)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    if config is None:
        lines += [f"Converted to the Hugging Face layout by Kiln {kiln.__version__} from `{source.name}`.", ""]
        return "\n".join(lines)
    how = ("QLoRA adapters merged into the NF4-dequantized " if qlora else "LoRA adapters merged into "
           if lora.get("rank") else "continued pretraining of " if init_from else "")
    what = f"`{init_from}`" if init_from else "a model trained from scratch"
    lines += [f"Trained with Kiln {kiln.__version__}: {how}{what}.", ""]
    if adapters:
        lines[-2] = (f"LoRA adapters (PEFT's format) trained with Kiln {kiln.__version__} on `{init_from}`: load them "
                     "onto that base with `peft.PeftModel.from_pretrained(base, this_directory)`.")
        if qlora:
            lines[-2] = (f"QLoRA adapters (PEFT's format) trained with Kiln {kiln.__version__} on `{init_from}` with "
                         "its linear layers in 4-bit NF4: load them onto that base quantized by bitsandbytes "
                         "(`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\")`), or as stored, "
                         "with `peft.PeftModel.from_pretrained(base, this_directory)`.")
    done = _training(run, step) if run is not None else {}
    sources = data.get("mixture") or data.get("sources") or []
    rows = [("base model", f"`{init_from}`" if init_from else "none (trained from scratch)"),
            ("data", ", ".join(f"`{s}`" if isinstance(s, str) else f"`{json.dumps(s)}`" for s in sources) or "-"),
            ("steps", f"{done.get('step', step)}" + (f" of {config.get('train', {}).get('max_steps')}"
                                                     if config.get("train", {}).get("max_steps") else "")),
            ("tokens", f"{done['tokens']:,}" if isinstance(done.get("tokens"), int) else "-"),
            ("final training loss", f"{done['loss']:.4f}" if "loss" in done else "-"),
            ("final validation loss", f"{done['val_loss']:.4f} (step {done['val_step']})" if "val_loss" in done
             else "- (none ran)")]
    lines += ["| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows], ""]
    lines += ["## Kiln config", "", "The run's whole resolved config (`kiln train` with this file reproduces it):", "",
              "```yaml", yaml.safe_dump(config, sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def write_model_card(source: str | Path, out: str | Path, repo: str | None = None, adapters: bool = False) -> Path:
    """out/README.md: the card of a trained model, or a converted Hugging Face directory's own card (the same
    model: its license and description still hold)."""
    source, path = Path(source).expanduser(), Path(out).expanduser() / "README.md"
    own = source / "README.md"
    if _run_of(source)[2] is None and own.is_file() and own.resolve() != path.resolve():
        path.write_bytes(own.read_bytes())
    else:
        path.write_text(model_card(source, repo, adapters))
    return path
