"""The tokens Kiln's sampling stops at (`kiln generate`, the sample at the end of a run), as transformers' generate
stops on every id of generation_config.eos_token_id.

A model trained from scratch stops at its EOS. A model from a Hugging Face directory (model.init_from, a Kiln
export, or a run trained on a tokenizer directory: data.tokenizer=DIR) has more: its generation_config.json's
eos_token_id (one id or a list; without that file, config.json's, as transformers reads it) and its
tokenizer_config.json's eos_token, read as an export reads them (kiln.state.hf_source.stop_ids): Llama 3 stops at
<|end_of_text|> and at <|eot_id|>, the end of a chat turn; Qwen's chat models at <|endoftext|> and <|im_end|>. The
same directories' generation_config.json may list stop_strings, texts that end sampling even where they span several
tokens (kiln.model.stop_strings).

    stops = model_stops(tok, [model_dir, source_dir(cfg.model), tokenizer_dir(cfg.data.tokenizer)])
    stops = run_stops(cfg, tok)                         # the sample at the end of a run
    stops = saved_model_stops("runs/X", tok)            # what `kiln generate runs/X` stops at
    stops.ids, stops.strings                            # token ids; generation_config.json's stop_strings, as text
    ids, texts = named_stops(tok, ["<|im_end|>", "\\n\\nUser:"])  # `kiln generate --stop`: tokens, and texts
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from kiln.errors import ConfigError


class Stops(NamedTuple):
    """Where a model's sampling ends: at any of `ids`, and once the text ends with any of `strings`."""

    ids: list[int]
    strings: list[str]


def model_stops(tok, folders: Iterable[Path | None], ids: Iterable[int] = ()) -> Stops:
    """`ids`, `tok`'s EOS, then the stop tokens of each Hugging Face directory of `folders` (None: none) that ships
    this very tokenizer (another tokenizer's ids would name other tokens), each id once, in that order; and the
    stop_strings of those directories' generation_config.json, each text once."""
    from kiln.state.hf_source import stop_ids, stop_strings

    own = _own_folders(tok, folders)
    found = [*ids, tok.eos_id]
    for folder in own:
        listed = stop_ids(folder, tok, {})["eos_token_id"]
        found += listed if isinstance(listed, list) else [listed]
    return Stops(list(dict.fromkeys(i for i in found if isinstance(i, int))),
                 list(dict.fromkeys(t for folder in own for t in stop_strings(folder))))


def _own_folders(tok, folders: Iterable[Path | None]) -> list[Path]:
    """The directories of `folders` (None: none) that are there and ship this very tokenizer, each once."""
    from kiln.state.hf_source import same_tokenizer

    found = dict.fromkeys(Path(f).expanduser().resolve() for f in folders if f is not None)
    return [f for f in found if f.is_dir() and same_tokenizer(f, tok)]


def run_stops(cfg, tok) -> Stops:
    """The stops of the model a run (RunConfig `cfg`, its tokenizer `tok`) trains: its EOS, and those of its
    model.init_from and data.tokenizer directories (the sample at the end of a run, lm-eval tasks during it)."""
    from kiln.state.hf_source import source_dir, tokenizer_dir

    return model_stops(tok, [source_dir(cfg.model), tokenizer_dir(cfg.data.tokenizer)])


def saved_model_stops(path: str | Path, tok) -> Stops:
    """The stops of the model `kiln generate PATH` samples from: a run directory or its model/ folder (with its
    model.init_from and data.tokenizer directories, where they are still there, and its data.eos_token), or a
    Hugging Face model directory (a Kiln export)."""
    from kiln.state.hf_source import init_from_dirs, tokenizer_dir

    p = Path(path).expanduser()
    model_dir = p / "model" if (p / "model" / "model_config.json").is_file() else p
    folders = [model_dir, *init_from_dirs(model_dir)]  # its model.init_from, or the run's copy of its files
    ids = []
    run_cfg = _run_config(model_dir.parent if model_dir.name == "model" else model_dir)
    if run_cfg is not None:
        folders.append(tokenizer_dir(run_cfg.data.tokenizer))
        eos = run_cfg.data.eos_token
        if eos not in ("auto", None) and tok.tk.token_to_id(eos) is not None:  # the run's own document end
            ids.append(tok.tk.token_to_id(eos))
    return model_stops(tok, folders, ids)


def named_stops(tok, names: Iterable[str]) -> tuple[list[int], list[str]]:
    """`kiln generate --stop`'s texts as (stop token ids, stop strings): a token of the vocabulary as the tokenizer
    writes it (<|eot_id|>, </s>) or a text it encodes as one token ("\\n") is a stop token; any other text ends
    sampling as a stop string does (kiln.model.stop_strings: at the token that completes it, kept in the text).
    ConfigError for an empty one."""
    ids, texts = [], []
    for name in names:
        if not name:
            raise ConfigError("--stop '': give the text (or token) to stop at")
        found = tok.tk.token_to_id(name)
        if found is None:
            encoded = tok.encode(name)
            found = encoded[0] if len(encoded) == 1 else None
        if found is None:
            texts.append(name)
        else:
            ids.append(found)
    return list(dict.fromkeys(ids)), list(dict.fromkeys(texts))


def _run_config(run_dir: Path):
    """The run's validated config, or None (no run directory, or a config this version cannot read)."""
    from kiln.config import load_config
    from kiln.errors import KilnError

    file = run_dir / "config.yaml"
    if not file.is_file():
        return None
    try:
        return load_config(file)
    except KilnError:  # the model still samples, stopping at its tokenizer's stop tokens
        return None
