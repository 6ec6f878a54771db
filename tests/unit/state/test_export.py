"""Export in the Hugging Face layout: transformers loads it silently, with Kiln's logits; import then
export is bit for bit; pickled weights are refused unless allowed."""

from __future__ import annotations

import json
import logging
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.config import ModelConfig, RopeScaling
from kiln.data.prepare.tokenizer import Tokenizer, train_bpe
from kiln.errors import StateError
from kiln.model.hf import ARCHITECTURES
from kiln.model.hf_import import import_hf, read_hf_state_dict, weight_files
from kiln.model.llama import Transformer
from kiln.state.export import export_from, export_hf, write_tokenizer
from kiln.state.weights import save_model

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
ARCHS = {
    "llama": dict(tie_embeddings=False),
    "llama3.1": dict(rope_theta=500000.0, rope_scaling=RopeScaling(original_max_position_embeddings=16)),
    "mistral": dict(sliding_window=8, head_size=48, tie_embeddings=False),
    "qwen2": dict(attention_bias="qkv", rope_theta=1e6, hf_model_type="qwen2"),
    "qkv": dict(attention_bias="qkv", mlp_bias=True),  # from scratch: Llama, with a zero o_proj bias
    "nemotron": dict(mlp="relu2", norm="layernorm1p", rotary_fraction=0.5, attention_bias="all", tie_embeddings=False),
    "qwen3": dict(qk_norm=True, head_size=32),  # from scratch: q/k norms are Qwen3's
    "phi3": dict(fused_projections=True, sliding_window=8, rope_scaling=RopeScaling(
        type="longrope", original_max_position_embeddings=32, factor=2.0, attention_factor=1.1,
        short_factor=[1.0] * 8, long_factor=[1.5] * 8)),  # Phi-3's layout and longrope
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()[:40000]
    return train_bpe(text.split("\n\n"), 320, ["<|endoftext|>", "<|startoftext|>"])


def random_model(arch: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**BASE, **ARCHS[arch])).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so a dropped or misnamed one shows
            p.copy_(torch.randn_like(p) * 0.1)
    return model


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def load_quietly(path: Path):
    """AutoModelForCausalLM and AutoTokenizer of `path`, with every warning they log or raise."""
    handler, logger = Captured(), logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            tok = transformers.AutoTokenizer.from_pretrained(path)
    finally:
        logger.removeHandler(handler)
    # a ResourceWarning is the garbage collector's, about objects of earlier tests that it happened to free here
    return hf, tok, handler.lines + [str(w.message) for w in caught if w.category is not ResourceWarning]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_loads_export_with_equal_logits(arch, tokenizer, tmp_path):
    model = random_model(arch)
    export_hf(model, model.cfg, tokenizer, tmp_path)
    hf, tok, messages = load_quietly(tmp_path)
    assert messages == [], messages
    kind = {"llama3.1": "llama", "qkv": "llama"}.get(arch, arch)
    assert hf.config.model_type == kind and type(hf).__name__ == ARCHITECTURES[kind]
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), rtol=0, atol=1e-5)
    text = "def parse_args(self, args=None):"
    assert tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tokenizer.eos_id == hf.config.eos_token_id
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_id


def test_sharded_bf16_export_and_import_are_bit_for_bit(tokenizer, tmp_path):
    model = random_model("nemotron")
    export_hf(model, model.cfg, tokenizer, tmp_path / "a", dtype="bf16", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    files = weight_files(tmp_path / "a")
    assert len(files) > 2 and not (tmp_path / "a" / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in files}
    first = read_hf_state_dict(tmp_path / "a")
    assert all(t.dtype == torch.bfloat16 for t in first.values())
    assert set(first) == set(index["weight_map"])
    hf, _, messages = load_quietly(tmp_path / "a")
    assert messages == [] and json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "bfloat16"
    export_from(tmp_path / "a", tmp_path / "b")  # import, then export again: same tensors, same names
    again = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert again.keys() == first.keys()
    for k in first:
        assert torch.equal(again[k].view(torch.int16), first[k].view(torch.int16)), k


def test_import_of_transformers_save_pretrained_round_trips(tokenizer, tmp_path):
    """A directory transformers itself wrote (tied Qwen2): imported, exported, the same tensors bit for bit."""
    model = random_model("qwen2")
    export_hf(model, model.cfg, tokenizer, tmp_path / "kiln")
    hf, _, _ = load_quietly(tmp_path / "kiln")
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg == model.cfg.model_copy(update={"hf_model_type": "qwen2"})
    export_from(tmp_path / "hf", tmp_path / "out", tokenizer=tmp_path / "kiln")
    original = read_hf_state_dict(tmp_path / "hf")
    exported = read_hf_state_dict(tmp_path / "out")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_export_from_a_run_model_directory_via_cli(tokenizer, tmp_path):
    from typer.testing import CliRunner

    from kiln.cli import app

    model = random_model("llama")
    save_model(model, model.cfg, tokenizer, tmp_path / "run" / "model")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--to", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf, _, messages = load_quietly(tmp_path / "hf")
    assert messages == []
    tokens = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), rtol=0, atol=1e-5)


def test_pickled_weights_are_refused_unless_allowed(tokenizer, tmp_path):
    model = random_model("llama")
    export_hf(model, model.cfg, tokenizer, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(StateError, match="pytorch_model.bin.*safetensors only.*save_pretrained.*allow_pickle=true"):
        import_hf(tmp_path)
    _, loaded = import_hf(tmp_path, allow_pickle=True)
    assert torch.equal(loaded["embed_tokens.weight"], model.embed_tokens.weight)


def test_export_to_an_existing_file_or_into_the_runs_own_model_is_refused_with_the_reason(tokenizer, tmp_path):
    model = random_model("llama")
    save_model(model, model.cfg, tokenizer, tmp_path / "run" / "model")
    (tmp_path / "out").write_text("notes")
    with pytest.raises(StateError, match="--to .*out: a file of that name exists"):
        export_from(tmp_path / "run", tmp_path / "out")
    assert (tmp_path / "out").read_text() == "notes"
    with pytest.raises(StateError, match="writing the export to .*out/hf failed: Not a directory"):  # a traceback
        export_from(tmp_path / "run", tmp_path / "out" / "hf")  # before (as a full or read-only disk's errors)
    # the run's own model/ (or its checkpoints): written over with Hugging Face names, `kiln generate` of the run
    # failed with a KeyError and the run's model was lost
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    before = (tmp_path / "run" / "model" / "model.safetensors").read_bytes()
    for inside in ("model", "checkpoints/step_00000001/hf"):
        with pytest.raises(StateError, match=f"--to .*{inside} is inside .*run/{inside.split('/')[0]}, which"):
            export_from(tmp_path / "run", tmp_path / "run" / inside)
    assert (tmp_path / "run" / "model" / "model.safetensors").read_bytes() == before
    assert (export_from(tmp_path / "run", tmp_path / "run" / "hf") / "config.json").is_file()  # beside them: fine


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tokenizer, tmp_path):
    """The issue's case: a 4096-row model given a tokenizer of ~300 entries; and one with ids past the embedding."""
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    small = train_bpe(text.split("\n\n"), 300, ["<|endoftext|>"])
    small.save(tmp_path / "small.json")
    torch.manual_seed(0)
    big = Transformer(ModelConfig(**{**BASE, "vocab_size": 4096}))
    save_model(big, big.cfg, None, tmp_path / "big")  # no tokenizer of its own: the sizes decide
    with pytest.raises(StateError, match="300 tokens for a model that embeds 4096"):
        export_from(tmp_path / "big", tmp_path / "out", tokenizer=tmp_path / "small.json")
    model = random_model("llama")  # 320 rows, trained with `tokenizer`
    save_model(model, model.cfg, tokenizer, tmp_path / "run" / "model")
    with pytest.raises(StateError, match="other ids than the tokenizer the model was trained with"):
        export_from(tmp_path / "run", tmp_path / "out", tokenizer=tmp_path / "small.json")
    wide = train_bpe(text.split("\n\n"), 400, ["<|endoftext|>"])
    wide.save(tmp_path / "wide.json")
    with pytest.raises(StateError, match="ids up to 399, but the model embeds only 320"):
        export_from(tmp_path / "run", tmp_path / "out", tokenizer=tmp_path / "wide.json")
    with pytest.raises(StateError, match=r"--tokenizer .*missing\.json does not exist"):  # not 'set data.tokenizer'
        export_from(tmp_path / "run", tmp_path / "out", tokenizer=tmp_path / "missing.json")
    assert not (tmp_path / "out").exists()
    tokenizer.save(tmp_path / "own.json")  # its own tokenizer, given explicitly: accepted
    export_from(tmp_path / "run", tmp_path / "out", tokenizer=tmp_path / "own.json")
    assert Tokenizer.load(tmp_path / "out").hash == tokenizer.hash


def test_a_qkv_bias_model_from_scratch_ships_the_tokenizer_kiln_trained(tokenizer, tmp_path):
    """transformers loads a Qwen2 directory's tokenizer as Qwen2Tokenizer, rebuilt with Qwen2's pre-tokenizer
    (3,510 tokens against Kiln's 3,350 on one file): a q/k/v-bias model trained here exports as a class whose
    tokenizer is the tokenizer.json written, and a file counts the same tokens both ways."""
    model = random_model("qkv")
    export_hf(model, model.cfg, tokenizer, tmp_path)
    _, tok, _ = load_quietly(tmp_path)
    text = Path(sysconfig.get_paths()["stdlib"], "csv.py").read_text()
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(tokenizer.encode(text))
    assert tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)


def chat_tokenizer(tokenizer: Tokenizer, root: Path) -> tuple[Path, int]:
    """A chat model's tokenizer directory made from `tokenizer` (an end-of-turn token, a chat template, two stop
    tokens, 8,192 positions); its path and the end of turn's id."""
    from tokenizers import Tokenizer as HFTokenizer

    tk = HFTokenizer.from_str(tokenizer.to_str())  # a copy, with a chat model's end of turn
    tk.add_special_tokens(["<|eot|>", "<|pad|>"])
    folder = root / "chat-tokenizer"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    eot = tk.token_to_id("<|eot|>")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot|>{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eot|>", "pad_token": "<|pad|>",
        "model_max_length": 8192,
        "chat_template": template}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, 0], "temperature": 0.6}))
    return folder, eot


def assert_chat_tokenizer_kept(out: Path, eot: int, context: int) -> None:
    hf, tok, _ = load_quietly(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi<|eot|>"
    assert (tok.eos_token, tok.model_max_length, hf.config.max_position_embeddings) == ("<|eot|>", context, context)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == hf.config.eos_token_id == [0, eot]  # the documents' EOS first
    assert "temperature" not in json.loads((out / "generation_config.json").read_text())  # another model's setting
    pad = tok.convert_tokens_to_ids("<|pad|>")  # the tokenizer's pad, in both configs (transformers reads them)
    assert (tok.pad_token, gen.pad_token_id, hf.config.pad_token_id) == ("<|pad|>", pad, pad)


def run_on(folder: Path, run: Path, model, run_tok: Tokenizer) -> Path:
    """`run`, a finished run of `model` with data.tokenizer=`folder`."""
    import yaml

    save_model(model, model.cfg, run_tok, run / "model")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(folder)}}))
    return run


def test_a_model_from_scratch_on_a_hugging_face_tokenizer_keeps_its_chat_template_and_stop_tokens(tokenizer,
                                                                                                  tmp_path):
    """data.tokenizer names a chat model's tokenizer directory: the export of a model trained from scratch on it
    keeps the template and every stop token beside the EOS its documents ended with, and advertises the new
    model's context, not 8,192."""
    folder, eot = chat_tokenizer(tokenizer, tmp_path)
    run_tok = Tokenizer.load(folder)  # as `kiln train data.tokenizer=DIR` loads it: <|endoftext|> ends documents
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": 336, "tie_embeddings": False})).eval()
    out = export_from(run_on(folder, tmp_path / "run", model, run_tok), tmp_path / "out")
    assert_chat_tokenizer_kept(out, eot, 64)


def test_an_auto_model_trained_on_another_hugging_face_tokenizer_keeps_that_tokenizer(tokenizer, tmp_path):
    """model.hf_class=auto from model.init_from=DIR (a Llama with Kiln's tokenizer files) with data.tokenizer naming
    another tokenizer directory: the export ships the tokenizer the run used, its chat template and stop tokens,
    not Kiln's minimal files nor the source's."""
    from kiln.model.hf_auto import auto_config, build_auto

    src = tmp_path / "base"
    config = transformers.LlamaConfig(vocab_size=336, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=48,
                                      eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    write_tokenizer(tokenizer, src, 48)  # the source's own tokenizer, without the chat template
    folder, eot = chat_tokenizer(tokenizer, tmp_path)
    model = build_auto(auto_config(ModelConfig(init_from=str(src), hf_class="auto")))
    out = export_from(run_on(folder, tmp_path / "run", model, Tokenizer.load(folder)), tmp_path / "out")
    assert_chat_tokenizer_kept(out, eot, 48)


@pytest.mark.parametrize("bos_token", [None, "tokenizer"])
def test_the_exported_tokenizer_puts_a_bos_first_only_if_the_model_trained_with_one(tokenizer, tmp_path, bos_token):
    """data.tokenizer names a directory whose tokenizer puts <s> before a text (Llama's post-processor). From
    scratch with data.bos_token=null the model never sees <s>, and AutoTokenizer of its export gives none;
    with data.bos_token=tokenizer it trained with <s> first, and the export keeps it."""
    import yaml
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing
    from typer.testing import CliRunner

    from kiln.cli import app

    tk = HFTokenizer.from_str(tokenizer.to_str())
    tk.add_special_tokens(["<s>"])
    bos = tk.token_to_id("<s>")
    tk.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    folder = tmp_path / "llama-like"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "add_bos_token": True}))
    run_tok = Tokenizer.load(folder, bos_token=bos_token)  # as the run loaded it
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": 336})).eval()
    run = run_on(folder, tmp_path / "run", model, run_tok)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(folder), "bos_token": bos_token}}))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(run), "--to", str(out)])
    assert result.exit_code == 0, result.output
    _, tok, _ = load_quietly(out)
    text = "def f(x):\n    return x"
    first = [bos] if bos_token else []
    assert tok(text)["input_ids"] == first + run_tok.encode(text)  # the model's inputs as in training
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is bool(bos_token)
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == (bos if bos_token else None)
    said = "note: the exported tokenizer puts no <s> before a text, as the model trained without a BOS"
    assert (said in " ".join(result.output.split())) is not bool(bos_token)  # the line of `kiln export`


def test_a_run_without_its_models_bos_exports_the_models_tokenizer_without_it(tokenizer, tmp_path):
    """model.init_from=DIR whose tokenizer puts <s> before a text, trained with data.bos_token=null: the export
    carries DIR's tokenizer files (its chat template) with <s> taken out, as the documents had none, and says so
    (it put <s> first, which the run never did)."""
    import yaml
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from kiln.state.export import ExportNote

    tk = HFTokenizer.from_str(tokenizer.to_str())
    tk.add_special_tokens(["<s>"])
    bos = tk.token_to_id("<s>")
    tk.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    src = tmp_path / "src"
    torch.manual_seed(0)
    base = Transformer(ModelConfig(**{**BASE, "vocab_size": 336})).eval()
    export_hf(base, base.cfg, Tokenizer(tk), src)
    template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<s>", "add_bos_token": True,
                                                           "chat_template": template}))
    model = Transformer(base.cfg.model_copy(update={"init_from": str(src)}))
    model.load_state_dict(base.state_dict())
    run_tok = Tokenizer.load(src, bos_token=None)  # as the run loaded it
    run = run_on(src, tmp_path / "run", model, run_tok)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(src), "bos_token": None}}))
    with pytest.warns(ExportNote, match="puts no <s> before a text"):
        out = export_from(run, tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("def f(x)")["input_ids"] == run_tok.encode("def f(x)")
    assert tok.chat_template == template and tok.bos_token == "<s>"
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_a_run_whose_init_from_directory_is_gone_exports_what_that_directory_said(tokenizer, tmp_path):
    """model.init_from=DIR (a chat model: its template, stop tokens, sampling settings), then DIR moved away (a Hub
    snapshot cleaned from the cache): the export of the run's model/ or of a checkpoint lost all that, with a
    warning, for Kiln's own tokenizer files. The run keeps a copy of DIR's files (run_dir/init_from) at its start."""
    import shutil

    import yaml

    from kiln.state.hf_source import keep_source

    folder, eot = chat_tokenizer(tokenizer, tmp_path)
    src = tmp_path / "src"
    torch.manual_seed(0)
    base = Transformer(ModelConfig(**{**BASE, "vocab_size": 336, "tie_embeddings": False})).eval()
    export_hf(base, base.cfg, Tokenizer.load(folder), src)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(folder / name, src / name)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    model = Transformer(base.cfg.model_copy(update={"init_from": str(src), "max_seq_len": 8192}))
    model.load_state_dict(base.state_dict())
    run = tmp_path / "run"
    save_model(model, model.cfg, Tokenizer.load(src), run / "model")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(src)},
                                                     "model": {"init_from": str(src)}}))
    keep_source(model.cfg, run)  # as kiln train does at its start
    shutil.rmtree(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is missing: no warning that the directory is gone
        out = export_from(run, tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi<|eot|>"
    context = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert (tok.eos_token, tok.model_max_length, context) == ("<|eot|>", 8192, 8192)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["temperature"]) == ([eot, 0], 0.6)  # DIR's stop tokens and sampling, unchanged


def test_peft_adapters_of_a_run_whose_base_is_gone_get_its_tokenizer_files_from_the_runs_copy(tokenizer, tmp_path):
    """kiln export --adapters puts the base's tokenizer files beside the adapters (its chat template, stop tokens);
    with the base moved away since the run, the adapters came without them."""
    import shutil

    import yaml

    from kiln.state.export import _base_tokenizer
    from kiln.state.hf_source import keep_source

    folder, _ = chat_tokenizer(tokenizer, tmp_path)
    (folder / "config.json").write_text("{}")  # a model directory (its weights play no part here)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(folder), "bos_token": "tokenizer"},
                                                     "model": {"init_from": str(folder)}}))
    keep_source(ModelConfig(init_from=str(folder)), run)  # as kiln train does at its start
    shutil.move(folder, tmp_path / "moved")
    (tmp_path / "out").mkdir()
    _base_tokenizer(run, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "<|eot|>"
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_an_export_leaves_nothing_that_loads(tokenizer, tmp_path, monkeypatch, sig):
    """SIGTERM or SIGHUP (a closed terminal) while the weights are written (timed here by sending it from inside the
    write): the process ended at once, leaving a model.safetensors.tmp the size of the model (and after SIGTERM's
    fix, SIGHUP still did), beside the config.json by which a loader takes the directory for a model; now an
    interrupt that carries its signal (the exit status: 128 + it), the files removed."""
    import os
    import signal

    import safetensors.torch

    from kiln.data.prepare.bpe import Interrupted

    signum = getattr(signal, sig)
    model = random_model("llama")
    save_model(model, model.cfg, tokenizer, tmp_path / "run" / "model")
    real = safetensors.torch.save_file

    def signalled(tensors, path, metadata=None):
        real(tensors, path, metadata)  # the file is there, as when the signal comes midway
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(safetensors.torch, "save_file", signalled)
    before = signal.getsignal(signum)  # the default, or kiln's process-wide one after an in-process `kiln`
    with pytest.raises(Interrupted) as stopped:
        export_from(tmp_path / "run", tmp_path / "out")
    assert stopped.value.signum == signum
    assert not (tmp_path / "out").exists()  # config.json, written before the weights, too; the folder it made
    assert signal.getsignal(signum) is before  # given back


@torch.no_grad()
def test_a_phi3_whose_config_names_its_longrope_su_exports_one_transformers_loads(tokenizer, tmp_path):
    """Older Phi-3 128K checkpoints name their longrope `su` (rope_scaling.type), which transformers 5 refuses: Kiln
    imports it as longrope, and its export names it longrope, the factors kept, with the logits of Kiln's import on
    either side of the original context (32)."""
    model = random_model("phi3")
    export_hf(model, model.cfg, tokenizer, tmp_path / "su")
    config = json.loads((tmp_path / "su" / "config.json").read_text())
    config.pop("rope_parameters")
    factors = {k: config["rope_scaling"][k] for k in ("short_factor", "long_factor")}
    config["rope_scaling"] = {"type": "su", **factors}
    (tmp_path / "su" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match="original_max_position_embeddings"):  # what the source does in transformers
        transformers.AutoConfig.from_pretrained(tmp_path / "su")
    cfg, state = import_hf(tmp_path / "su")
    assert cfg.rope_scaling.type == "longrope" and cfg.rope_scaling.long_factor == factors["long_factor"]
    kiln = Transformer(cfg).eval()
    kiln.load_state_dict(state)
    export_from(tmp_path / "su", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"] == {"type": "longrope",
                                                                                          **factors}
    hf, _, _ = load_quietly(tmp_path / "out")
    for T in (12, 40):
        x = torch.randint(0, 320, (1, T), generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(hf(input_ids=x).logits, kiln(x), rtol=0, atol=1e-4)
