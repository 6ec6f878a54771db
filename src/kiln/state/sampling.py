"""The sampling settings of `kiln generate`: each option the user gives, else the model's own, else Kiln's.

The model's own are those of its Hugging Face generation_config.json (temperature, top_p, top_k, do_sample,
repetition_penalty, max_new_tokens), the file transformers' generate reads: in a Hugging Face model directory (a
`kiln export`), else in the directory of the run's model.init_from. Its `do_sample: false` is greedy decoding
(temperature 0); `do_sample: true` samples with transformers' defaults (temperature 1, top_k 50) for the settings the
file leaves out; a file that names settings without do_sample samples with them, Kiln's defaults for the rest.
A file that names none (Kiln's own exports of a model trained from scratch) leaves Kiln's defaults.

    s = sampling_settings("runs/X", temperature=None, top_k=None, top_p=None, repetition_penalty=None,
                          max_new_tokens=None)
    s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.max_new_tokens, s.source
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from kiln.errors import ConfigError

KILN_DEFAULTS = {"temperature": 0.8, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "max_new_tokens": 100}
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}  # transformers'
SETTINGS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")


class Sampling(NamedTuple):
    """How `kiln generate` samples; `source`: the generation_config.json any of it came from (None: none)."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    max_new_tokens: int
    source: Path | None


def sampling_settings(path: str | Path, **given: Any) -> Sampling:
    """The settings to sample the model at `path` (a run directory, its model/ folder or a Hugging Face model
    directory) with: `given` (temperature, top_k, top_p, repetition_penalty, max_new_tokens: None where not given)
    over its generation_config.json's (model_settings) over Kiln's defaults."""
    found, source = model_settings(path, given={k for k, v in given.items() if v is not None})
    chosen = {**KILN_DEFAULTS, **found, **{k: v for k, v in given.items() if v is not None}}
    return Sampling(**{k: chosen[k] for k in SETTINGS}, source=source if found else None)


def run_sampling(cfg) -> dict[str, Any]:
    """The temperature, top_k, top_p and repetition_penalty of the sample at the end of a run (RunConfig `cfg`), as
    `kiln generate RUN_DIR` samples it: its model.init_from's generation_config.json over Kiln's defaults (its
    length stays train.sample_tokens). A setting there that transformers would refuse leaves Kiln's: the run has
    trained by then, and `kiln generate` says what is wrong with the file."""
    from kiln.state.hf_source import source_dir

    src = source_dir(cfg.model)
    try:
        found = model_settings(src)[0] if src is not None else {}
    except ConfigError:
        found = {}
    chosen = {**KILN_DEFAULTS, **found}
    return {k: chosen[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty")}


def model_settings(path: str | Path, given: set[str] = frozenset()) -> tuple[dict[str, Any], Path | None]:
    """The sampling settings the model at `path` ships (a dict of SETTINGS, empty where its generation_config.json
    names none), and that file (None: there is none). ConfigError for a setting it names with a value transformers
    would refuse, unless the user gives that setting (one of `given`)."""
    file = _generation_config(Path(path).expanduser())
    if file is None:
        return {}, None
    from kiln.state.hf_source import read_json

    data = read_json(file)
    named = {k: data[k] for k in SETTINGS if data.get(k) is not None and k not in given}
    for key, value in named.items():
        problem = _problem(key, value)
        if problem:
            raise ConfigError(f"{file}: {key} {value!r} {problem}; correct it there, or give --{key.replace('_', '-')}")
    sample = data.get("do_sample")
    if sample is False:  # greedy, whatever else it names
        return {**named, "temperature": 0.0}, file
    if sample is True:
        return {**SAMPLING_DEFAULTS, **named}, file
    return named, file


def _generation_config(p: Path) -> Path | None:
    """The generation_config.json of the model at `p`: its own, else that of its model.init_from directory (or of
    its run's copy of that directory's files)."""
    from kiln.state.hf_source import init_from_dirs

    model_dir = p / "model" if (p / "model" / "model_config.json").is_file() else p
    folders = [model_dir, *init_from_dirs(model_dir)]
    return next((f / "generation_config.json" for f in folders if (f / "generation_config.json").is_file()), None)


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for the setting `key`, or None."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in ("top_k", "max_new_tokens"):
        low = 0 if key == "top_k" else 1
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= low else \
            f"is not a whole number of {low} or more"
    if key == "top_p":
        return None if number and 0 < value <= 1 else "is not above 0 and at most 1"
    if key == "temperature":
        return None if number and value >= 0 else "is not 0 or more"
    return None if number and value > 0 else "is not above 0"  # repetition_penalty
