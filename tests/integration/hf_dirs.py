"""Small transformers causal LMs in the Hugging Face layout, built locally from configs (nothing is
downloaded), with a BPE tokenizer trained on standard library source."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 320
TINY = {  # model_type: config fields of a model of a few thousand parameters, no dropout
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "phi": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gemma": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64),
    "llama": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False),
}


def tokenizer():
    from kiln.data.prepare.tokenizer import train_bpe

    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py")]
    return train_bpe(texts, VOCAB)


def write_hf_dir(out: Path, model_type: str = "gpt2", seed: int = 0, tok=None) -> Path:
    """A random `model_type` causal LM saved with save_pretrained (safetensors) and a tokenizer.json."""
    import transformers

    tok = tok or tokenizer()
    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type], bos_token_id=tok.eos_id,
                                               eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save(out / "tokenizer.json")
    return out


def write_corpus(out: Path, files: int = 8) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in sorted(p.name for p in STDLIB.glob("*.py"))[:files]:
        (out / name).write_text((STDLIB / name).read_text(errors="replace"))
    return out
