"""What an export keeps of its source directory: which files are carried, and config.json changed only where
Kiln changed the model on purpose."""

from __future__ import annotations

import json

from kiln.config import ModelConfig, RopeScaling
from kiln.model.hf import to_hf_config_dict
from kiln.state.hf_source import carry_files, source_config, source_dir, written_lengths

CFG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=256, tie_embeddings=False)


def test_only_what_is_not_the_weights_is_carried(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    names = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "model.gguf", "README.md", ".gitattributes", "tokenizer.json",
             "tokenizer_config.json", "tokenizer.model", "chat_template.jinja", "generation_config.json",
             "LICENSE", "preprocessor_config.json", "trainer_state.json", "training_args.bin", "optimizer.pt",
             "rng_state.pth"]  # the last four: a Hugging Face Trainer checkpoint's state of its own run
    for name in names:
        (src / name).write_text(name)
    (src / "original").mkdir()  # another format's folder
    assert carry_files(src, out, tokenizer=True) == sorted(["tokenizer.json", "tokenizer_config.json",
                                                            "tokenizer.model", "chat_template.jinja",
                                                            "generation_config.json", "LICENSE",
                                                            "preprocessor_config.json"])
    assert all((out / n).read_text() == n for n in ("LICENSE", "chat_template.jinja"))
    other = tmp_path / "other"
    other.mkdir()
    assert carry_files(src, other, tokenizer=False) == ["LICENSE", "preprocessor_config.json"]


def test_config_is_the_sources_but_for_dtype_and_an_extended_context(tmp_path):
    hf = {**to_hf_config_dict(CFG), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": [2, 3],
          "pad_token_id": 0, "custom_field": {"kept": True}, "transformers_version": "4.45.0"}
    hf.pop("rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = CFG.model_copy(update={"init_from": str(tmp_path), "hf_model_type": "llama"})
    assert source_dir(cfg) == tmp_path and source_dir(cfg.model_copy(update={"init_from": "gone"})) is None
    written = to_hf_config_dict(cfg, bos_token_id=5, eos_token_id=6)
    same = source_config(tmp_path, cfg, "float32", written, tokenizer=True)
    assert same == {**hf, "torch_dtype": "float32"}  # the 4.x key updated, no transformers 5 key added
    other_tok = source_config(tmp_path, cfg, None, written, tokenizer=False)
    assert (other_tok["bos_token_id"], other_tok["eos_token_id"], "pad_token_id" in other_tok) == (5, 6, False)
    bounded = cfg.model_copy(update={"max_seq_len": 64})  # a run's bound below the model's context: not exported
    assert source_config(tmp_path, bounded, None, to_hf_config_dict(bounded), tokenizer=True) == hf
    longer = cfg.model_copy(update={"max_seq_len": 512, "rope_scaling": RopeScaling(type="linear", factor=2)})
    extended = source_config(tmp_path, longer, None, to_hf_config_dict(longer), tokenizer=True)
    assert extended["max_position_embeddings"] == 512 and extended["rope_scaling"]["factor"] == 2
    context = ("max_position_embeddings", "rope_scaling", "rope_parameters")
    assert {k: v for k, v in extended.items() if k not in context} == {k: v for k, v in hf.items() if k not in context}


def test_a_config_that_does_not_describe_the_model_gets_kilns_fields(tmp_path):
    """Never an architecture that is not the model's: a source whose config.json disagrees with the model (edited
    since the run) gives way to what Kiln writes for it."""
    (tmp_path / "config.json").write_text(json.dumps({**to_hf_config_dict(CFG), "num_hidden_layers": 3}))
    cfg = CFG.model_copy(update={"init_from": str(tmp_path), "hf_model_type": "llama"})
    assert source_config(tmp_path, cfg, None, to_hf_config_dict(cfg), tokenizer=True)["num_hidden_layers"] == 2


def test_a_hub_snapshot_fetches_what_an_export_carries():
    """model.init_from=ORG/NAME downloads only the files a run needs: the chat template (chat_template.jinja, as
    transformers 5 saves it) and the license must be among them, or the export has nothing to carry."""
    from fnmatch import fnmatch

    from kiln.model.hub import FILES

    for name in ("chat_template.jinja", "LICENSE", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json", "tokenizer.json"):
        assert any(fnmatch(name, pattern) for pattern in FILES), name


def test_an_extended_context_is_the_tokenizers_limit_where_that_held_the_old_one(tmp_path):
    """8192 positions extended to 32768: a tokenizer limit of 16384 (above the old context) becomes 32768 (it stayed
    16384, warning of every longer text), one of 4096 stays; generation's max_length follows where it was 8192."""
    for limit, cap, want in ((16384, 8192, (32768, 32768)), (4096, 2048, (4096, 2048)), (8192, 20, (32768, 20))):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": limit}))
        (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": cap}))
        written_lengths(tmp_path, 32768, 8192)
        got = (json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"],
               json.loads((tmp_path / "generation_config.json").read_text())["max_length"])
        assert got == want, (limit, cap)


def test_named_chat_templates_are_carried_with_the_tokenizer(tmp_path):
    """transformers saves a tokenizer's named chat templates (tool_use, rag) in additional_chat_templates/ beside
    chat_template.jinja: an export, and the tokenizer files carried from a tokenizer directory, dropped that folder,
    and the exported tokenizer had its default template alone."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.state.hf_source import carry_tokenizer_files

    src = tmp_path / "src"
    train_bpe(["def f(x):\n    return x\n"] * 20, 280).save(tmp_path / "tokenizer.json")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.chat_template = {"default": "{{ 'chat' }}", "tool_use": "{{ 'tools' }}"}
    tok.save_pretrained(src)
    for carry in (lambda out: carry_files(src, out, tokenizer=True), lambda out: carry_tokenizer_files(src, out, 64)):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        carry(out)
        loaded = transformers.AutoTokenizer.from_pretrained(out)
        assert loaded.chat_template == {"default": "{{ 'chat' }}", "tool_use": "{{ 'tools' }}"}
    other = tmp_path / "other"
    other.mkdir()
    carry_files(src, other, tokenizer=False)  # another tokenizer is written: none of this one's files
    assert list(other.iterdir()) == []


def test_an_extended_context_keeps_the_rotary_base_transformers_5_reads(tmp_path):
    """A transformers 5 config.json holds its rotary base in rope_parameters alone (no top-level rope_theta); the
    export of a run that extended its context added a rope_scaling without it, which transformers 5 reads first,
    with the default base 10000 beside it: a Qwen3 (base 1e6) exported that way gave logits 0.1 off Kiln's."""
    import pytest

    transformers = pytest.importorskip("transformers")
    base = CFG.model_copy(update={"rope_theta": 1e6, "hf_model_type": "llama"})
    longer = base.model_copy(update={"max_seq_len": 512, "rope_scaling": RopeScaling(type="linear", factor=2)})
    hf = {k: v for k, v in to_hf_config_dict(base).items() if k not in ("rope_theta", "rope_scaling")}
    for source in (hf, {**hf, "rope_scaling": {"rope_type": "linear", "factor": 1.5}}):  # a stale scaling too
        (tmp_path / "config.json").write_text(json.dumps(source))
        cfg = longer.model_copy(update={"init_from": str(tmp_path)})
        extended = source_config(tmp_path, cfg, None, to_hf_config_dict(cfg), tokenizer=True)
        rope = transformers.LlamaConfig(**extended).rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 2.0, 1e6)
        assert ("rope_scaling" in extended) == ("rope_scaling" in source)  # no 4.x key added to a 5.x config
