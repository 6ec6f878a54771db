"""The BOS a prompt to `kiln generate` starts with: the one the model's documents started with."""

from __future__ import annotations

import json

from tokenizers import processors

from kiln.data.prepare.tokenizer import train_bpe
from kiln.model.generate import start_ids
from kiln.state.prompt_bos import prompt_bos


def test_a_prompt_starts_with_the_bos_the_documents_started_with(tmp_path):
    """A run from a Llama or Gemma directory puts the BOS its tokenizer puts first before every document
    (data.bos_token=tokenizer, the default with model.init_from); kiln generate, of the run or of its export, and
    the sample at the end of the run fed the prompt without it, a context the model never trained on (and not
    what transformers' tokenizer gives it)."""
    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 280, ["<|endoftext|>", "<s>"])
    tok.tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf, run = tmp_path / "hf", tmp_path / "run"
    for d in (hf, run / "model"):
        d.mkdir(parents=True)
        tok.save(d / "tokenizer.json")
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert prompt_bos(hf, tok) == 1  # as AutoTokenizer puts it first
    for bos, want in (("tokenizer", 1), ("<s>", 1), ("null", None)):
        (run / "config.yaml").write_text(f"data:\n  tokenizer: {hf}\n  bos_token: {bos}\n")
        assert prompt_bos(run, tok) == prompt_bos(run / "model", tok) == want
    assert start_ids(tok, "def", bos=1) == [1, *tok.encode("def")]
    assert start_ids(tok, "def", bos=None) == tok.encode("def") and start_ids(tok, "", bos=1) == [tok.eos_id]
