"""The BOS a prompt to `kiln generate` starts with: the one the model's documents started with in training.

    ids = start_ids(tok, prompt, bos=prompt_bos(path, tok))

A run puts `data.bos_token` before every document (with model.init_from, by default, the BOS the model's own
tokenizer puts first: Llama's <s>, Gemma's <bos>), and a model continues a text best from the context it trained
on. A Hugging Face directory (an export, a model of the Hub) starts a text as its tokenizer's post-processor does,
as AutoTokenizer does (an export of a run that put no BOS first puts none).
"""

from __future__ import annotations

from pathlib import Path

from kiln.data.prepare.tokenizer import Tokenizer, post_processor_bos


def prompt_bos(path: str | Path, tok: Tokenizer) -> int | None:
    """The id to put before a prompt to the model in `path` (a run, its model/ or a Hugging Face directory) encoded
    with `tok`; None where its documents started with none, or where `path` says nothing of it."""
    from kiln.state.rundir import CONFIG, run_config

    p = Path(path).expanduser()
    run_dir = p.parent if p.name == "model" and (p.parent / CONFIG).is_file() else p
    if (run_dir / CONFIG).is_file():
        bos = run_config(run_dir).data.bos_token
        return None if bos is None else Tokenizer(tok.tk, eos_token=None, bos_token=bos).bos_id
    return post_processor_bos(tok.tk) if (p / "config.json").is_file() else None
