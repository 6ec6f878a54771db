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


# tiny configs of the causal LMs the parity matrix covers (beside TINY's): shared fields, then each one's own
MATRIX_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=64)
MATRIX = {
    "llama": {}, "mistral": dict(sliding_window=8), "qwen2": dict(tie_word_embeddings=True), "nemotron": {},
    "gpt2": TINY["gpt2"], "phi": TINY["phi"], "phi3": dict(pad_token_id=0), "gemma": dict(head_dim=16),
    # windows shorter than the rows, scores and logits capped where they reach the cap (the native path's options)
    "gemma2": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=8, attn_logit_softcapping=1.0,
                   final_logit_softcapping=2.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=8, final_logit_softcapping=2.0), "qwen3": dict(head_dim=16), "olmo2": {},
    "stablelm": {}, "starcoder2": {}, "falcon": {}, "gpt_neox": {}, "granite": {},
    "mixtral": dict(num_local_experts=2, num_experts_per_tok=1),
    "qwen2_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3, head_dim=16,
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16,
                       use_mamba_kernels=False),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=16, expand=2),
    "cohere": {}, "olmo": {}, "glm4": dict(head_dim=16, pad_token_id=0), "smollm3": dict(pad_token_id=0),
    "exaone4": {}, "gpt_bigcode": {},
    "gptj": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "bloom": dict(n_embed=32, n_layer=2, n_head=2), "opt": dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
    "codegen": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, rotary_dim=8),
    "qwen3_moe": dict(head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32),
    "olmoe": dict(num_experts=2, num_experts_per_tok=1), "phimoe": dict(num_local_experts=2, num_experts_per_tok=1),
    "deepseek_v3": dict(n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                        n_group=1, topk_group=1),
    "jamba": dict(num_experts=1, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                  attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, use_mamba_kernels=False),
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_n_groups=1, mamba_chunk_size=16),
    "gpt_oss": dict(num_local_experts=2, num_experts_per_tok=1, head_dim=16, sliding_window=8),
}


def write_matrix_dir(out: Path, model_type: str, seed: int = 0) -> Path:
    """A random `model_type` of MATRIX, every parameter drawn (norms and biases too, so a dropped one shows),
    saved with save_pretrained and dressed (`dress`) as a published model is."""
    import transformers

    fields = {**MATRIX_COMMON, **MATRIX[model_type]}
    if model_type == "gpt2":
        fields = dict(MATRIX[model_type])
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return dress(out)


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


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def llama_tokenizer():
    """A BPE whose special tokens are Llama's (<unk> 0, <s> 1, </s> 2) and whose post-processor puts <s> first."""
    from tokenizers import processors

    from kiln.data.prepare.tokenizer import Tokenizer, train_bpe

    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py")]
    tk = train_bpe(texts, VOCAB, ["<unk>", "<s>", "</s>"]).tk
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    return Tokenizer(tk)


def dress(out: Path) -> Path:
    """Give the model directory `out` what a published model has besides its weights: a Llama-style tokenizer
    (BOS added by its post-processor) with its tokenizer_config.json (special tokens, a chat template, its
    class), special_tokens_map.json, a generation_config.json with sampling settings and two stop tokens, and
    the special token ids in config.json."""
    import json

    llama_tokenizer().save(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "model_max_length": 1000000,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "legacy": False}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [1, 2], "pad_token_id": 0, "do_sample": True, "temperature": 0.6,
        "top_p": 0.9, "max_length": 64}, indent=2))
    config = json.loads((out / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def json_changes(src: Path, out: Path) -> dict[str, dict]:
    """{file: {key: (source value, export value)}} for every JSON file of `src` whose content `out` does not
    carry unchanged (a file missing from `out`: {file: {None: "missing"}}; tokenizer.json compared whole)."""
    import json

    changes: dict[str, dict] = {}
    for f in sorted(src.glob("*.json")):
        if f.name == "model.safetensors.index.json":  # the weights' own index, written anew by every save
            continue
        if not (out / f.name).is_file():
            changes[f.name] = {None: "missing"}
            continue
        a, b = json.loads(f.read_text()), json.loads((out / f.name).read_text())
        if f.name == "tokenizer.json":
            if a != b:
                changes[f.name] = {None: "different"}
            continue
        diff = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in set(a) | set(b) if a.get(k) != b.get(k)
                or (k in a) != (k in b)}
        if diff:
            changes[f.name] = diff
    return changes
