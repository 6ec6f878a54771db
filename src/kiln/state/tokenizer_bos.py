"""An exported tokenizer that puts no BOS before a text, for a model trained without one.

A model trained from scratch on a Hugging Face tokenizer (data.tokenizer=DIR) has no BOS before its documents
unless data.bos_token asks for one, even where that tokenizer's post-processor puts one first (Llama's <s>).
Its export then ships the tokenizer with that BOS taken out of the post-processor of tokenizer.json (which
transformers 5 follows) and `add_bos_token: false` in tokenizer_config.json (which transformers 4's Llama
tokenizers rebuild their post-processor from), so AutoTokenizer gives the model the inputs it trained on.

    bos, gone = drop_bos(out)   # '<s>', True: taken out; None: the tokenizer put no BOS first
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.state.hf_source import read_json


def drop_bos(out: Path) -> tuple[str | None, bool]:
    """Take the BOS out of the tokenizer files in `out` (tokenizer.json's post-processor, tokenizer_config.json's
    add_bos_token): (the BOS token they put first, or None where they put none; whether it is out now: False for a
    post-processor of another kind than Hugging Face's templates, left as it was)."""
    from tokenizers import Tokenizer as HFTokenizer

    from kiln.data.prepare.tokenizer import post_processor_bos

    dropped, gone = None, True
    file = out / "tokenizer.json"
    if file.is_file():
        tk = HFTokenizer.from_file(str(file))
        bos = post_processor_bos(tk)
        if bos is not None:
            dropped, data = tk.id_to_token(bos), json.loads(tk.to_str())
            data["post_processor"] = _without(data.get("post_processor"), bos)
            edited = HFTokenizer.from_str(json.dumps(data))
            gone = post_processor_bos(edited) is None
            if gone:
                edited.save(str(file))
    config_file = out / "tokenizer_config.json"
    config = read_json(config_file)
    if config.get("add_bos_token"):
        config["add_bos_token"] = False
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        bos = config.get("bos_token")
        dropped = dropped or (bos.get("content") if isinstance(bos, dict) else bos) or "BOS"
    return dropped, gone


def _without(proc: dict[str, Any] | None, bos: int) -> dict[str, Any] | None:
    """A tokenizer.json post-processor with the special token of id `bos` taken out of its templates."""
    if not isinstance(proc, dict):
        return proc
    if proc.get("type") == "Sequence":
        return {**proc, "processors": [_without(p, bos) for p in proc.get("processors", [])]}
    if proc.get("type") != "TemplateProcessing":
        return proc  # BERT's and RoBERTa's put a CLS first: no causal LM's BOS
    specials = proc.get("special_tokens", {})
    gone = {key for key, s in specials.items() if s.get("ids") == [bos]}
    templates = {k: [p for p in proc.get(k, []) if p.get("SpecialToken", {}).get("id") not in gone]
                 for k in ("single", "pair")}
    used = {p["SpecialToken"]["id"] for t in templates.values() for p in t if "SpecialToken" in p}
    return {**proc, **templates, "special_tokens": {k: v for k, v in specials.items() if k in used}}

