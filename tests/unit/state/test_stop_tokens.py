"""Sampling stops at every stop token of the model: its EOS, and the eos_token_id list of a Hugging Face directory's
generation_config.json (Llama 3's <|eot_id|> beside <|end_of_text|>), and at its stop_strings; `kiln generate --stop`
adds tokens, --ignore-eos drops the model's."""

import json
from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig, load_config
from kiln.data.prepare.tokenizer import Tokenizer, train_bpe
from kiln.errors import ConfigError
from kiln.model.generate import generate
from kiln.model.llama import Transformer
from kiln.state.hf_source import keep_source
from kiln.state.stop_tokens import model_stops, named_stops, run_stops, saved_model_stops
from kiln.state.weights import save_model

EOT = "<|eot_id|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(["def f(x):\n    return x * 2\n", "class A:\n    pass\n"] * 30, 300,
                     specials=["<|endoftext|>", EOT])


@pytest.fixture(scope="module")
def eot_model(tok) -> Transformer:
    """A model whose most likely next token is always <|eot_id|>: the layers add nothing to the embedding (all
    ones), and the head's only non-zero row is <|eot_id|>'s."""
    model = Transformer(ModelConfig(size="tiny", vocab_size=320, tie_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name == "embed_tokens.weight" else 0.0)
        model.norm.weight.fill_(1.0)
        model.lm_head.weight[tok.tk.token_to_id(EOT)] = 1.0
    return model


def hf_dir(path, tok, eos_token_id, **generation) -> str:
    """A Hugging Face tokenizer directory whose generation_config.json lists `eos_token_id` and `generation` (None and
    nothing: no such file)."""
    path.mkdir()
    tok.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    if eos_token_id is not None or generation:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id, **generation}))
    return str(path)


def test_sampling_stops_at_a_second_stop_token_only_where_the_model_lists_it(tmp_path, tok, eot_model):
    eos, eot = tok.eos_id, tok.tk.token_to_id(EOT)
    listed = model_stops(tok, [hf_dir(tmp_path / "llama3", tok, [eos, eot])]).ids
    assert listed == [eos, eot]
    assert generate(eot_model, [5, 6], 6, temperature=0, stop_ids=listed) == [eot]
    single = model_stops(tok, [hf_dir(tmp_path / "one", tok, eos)]).ids  # one int, as most models write it
    assert single == [eos]
    assert generate(eot_model, [5, 6], 6, temperature=0, stop_ids=single) == [eot] * 6
    assert model_stops(tok, [tmp_path / "absent", None]).ids == [eos]  # from scratch: its EOS alone
    other = train_bpe(["completely different text\n"] * 30, 280, specials=["<|endoftext|>", EOT])
    assert model_stops(other, [tmp_path / "llama3"]).ids == [other.eos_id]  # another tokenizer's ids are not its


def test_kiln_generate_stops_at_the_stop_tokens_of_the_model_and_at_stop(tmp_path, tok, eot_model, capsys):
    from kiln.cli.model import generate as kiln_generate

    eos, eot = tok.eos_id, tok.tk.token_to_id(EOT)
    source = hf_dir(tmp_path / "source", tok, [eos, eot])
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    save_model(eot_model, eot_model.cfg.model_copy(update={"init_from": source}), tok, run / "model")
    save_model(eot_model, eot_model.cfg, tok, scratch / "model")
    assert saved_model_stops(run, tok).ids == [eos, eot] and saved_model_stops(scratch, tok).ids == [eos]
    (Path(source) / "config.json").write_text("{}")  # a model directory
    keep_source(ModelConfig(init_from=source), run)  # as kiln train does at its start
    Path(source).rename(tmp_path / "moved")  # the run's copy of its files still says where sampling stops
    assert saved_model_stops(run, tok).ids == [eos, eot]
    Path(tmp_path / "moved").rename(source)

    def sample(path, stop=(), ignore_eos=False) -> str:
        kiln_generate(str(path), "def", 5, 0.0, 0, 0, list(stop), ignore_eos, threads=torch.get_num_threads(),
                      top_p=None, repetition_penalty=None)
        return capsys.readouterr().out

    assert sample(run) == f"def{EOT}\n"
    assert sample(scratch) == f"def{EOT * 5}\n"
    assert sample(scratch, stop=[EOT]) == f"def{EOT}\n"
    assert sample(run, ignore_eos=True) == f"def{EOT * 5}\n"
    assert sample(scratch, stop=["<|im_end|>"]) == f"def{EOT * 5}\n"  # no token of it: a text, never sampled here


def test_stop_names_a_token_a_text_of_one_token_or_any_other_text(tok):
    assert named_stops(tok, [EOT, "\n", EOT, "return x", "return x"]) == (
        [tok.tk.token_to_id(EOT), *tok.encode("\n")], ["return x"])
    with pytest.raises(ConfigError, match="--stop '': give the text"):
        named_stops(tok, [""])


def test_kiln_generate_stops_at_a_text_of_several_tokens(tmp_path, tok, capsys, repeating_model):
    """--stop refused a text the tokenizer encodes as several tokens ("is not a token of the model's tokenizer"):
    now sampling ends at the token that completes it, as at a stop string, with --ignore-eos too."""
    from kiln.cli.model import generate as kiln_generate

    ret = tok.encode(" return")
    assert len(ret) == 1 and len(tok.encode("rn ret")) > 1
    model = repeating_model(ret[0])  # every step's most likely token is " return"
    save_model(model, model.cfg, tok, tmp_path / "run" / "model")
    for ignore_eos in (False, True):
        kiln_generate(str(tmp_path / "run"), "def", 6, 0.0, 0, 0, ["rn ret"], ignore_eos,
                      threads=torch.get_num_threads(),
                      top_p=None, repetition_penalty=None)
        assert capsys.readouterr().out == "def return return\n"  # across two tokens, the second kept whole


def test_kiln_generate_on_an_export_stops_at_its_generation_configs_stop_tokens(tmp_path, tok, eot_model, capsys):
    from kiln.cli.model import generate as kiln_generate
    from kiln.state.export import export_hf

    out = export_hf(eot_model, eot_model.cfg, tok, tmp_path / "export")
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == tok.eos_id
    kiln_generate(str(out), "def", 4, 0.0, 0, 0, [], False, threads=torch.get_num_threads(),
                      top_p=None, repetition_penalty=None)
    assert capsys.readouterr().out == f"def{EOT * 4}\n"  # the export's one stop token is not <|eot_id|>
    config["eos_token_id"] = [tok.eos_id, tok.tk.token_to_id(EOT)]  # as Llama 3's lists both
    (out / "generation_config.json").write_text(json.dumps(config))
    kiln_generate(str(out), "def", 4, 0.0, 0, 0, [], False, threads=torch.get_num_threads(),
                      top_p=None, repetition_penalty=None)
    assert capsys.readouterr().out == f"def{EOT}\n"


def test_sampling_and_exports_keep_the_stop_strings_of_the_generation_config(tmp_path, tok, eot_model, capsys):
    from transformers import GenerationConfig

    from kiln.cli.model import generate as kiln_generate
    from kiln.state.export import export_from, export_hf

    twice = EOT * 2  # a stop string of two tokens
    source = hf_dir(tmp_path / "source", tok, tok.eos_id, stop_strings=[twice, "never here"])
    # a model from scratch on that tokenizer directory: the export writes its own generation_config.json
    rebuilt = export_hf(eot_model, eot_model.cfg, tok, tmp_path / "rebuilt", tokenizer_source=Path(source))
    tuned = eot_model.cfg.model_copy(update={"init_from": str(rebuilt)})  # a model trained from that export
    run = tmp_path / "run"
    save_model(eot_model, tuned, tok, run / "model")
    carried = export_hf(eot_model, tuned, tok, tmp_path / "carried")  # its source's generation_config.json kept
    again = export_from(carried, tmp_path / "again")  # `kiln export` of an export
    for out in (rebuilt, carried, again):
        assert GenerationConfig.from_pretrained(out).stop_strings == [twice, "never here"]

    def sample(path, ignore_eos=False) -> str:
        kiln_generate(str(path), "def", 5, 0.0, 0, 0, [], ignore_eos, threads=torch.get_num_threads(),
                      top_p=None, repetition_penalty=None)
        return capsys.readouterr().out

    for path in (run, carried):
        assert sample(path) == f"def{twice}\n"  # the stop string kept, as transformers' generate keeps it
    assert sample(run, ignore_eos=True) == f"def{EOT * 5}\n"
    cfg = load_config(None, [f"model.init_from={rebuilt}", "model.size=null"])  # the sample at the end of a run
    assert run_stops(cfg, tok).strings == [twice, "never here"]


def test_a_model_without_a_generation_config_stops_at_the_eos_ids_of_its_config(tmp_path, tok, eot_model):
    """Without generation_config.json, transformers' generate takes config.json's eos_token_id (a list in Llama 3.1's):
    Kiln's sampling stopped at the tokenizer's EOS alone, running past <|eot_id|>; a generation_config.json still
    wins over config.json, as in transformers."""
    eos, eot = tok.eos_id, tok.tk.token_to_id(EOT)
    folder = Path(hf_dir(tmp_path / "model", tok, None))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [eos, eot]}))
    listed = model_stops(tok, [folder]).ids
    assert listed == [eos, eot]
    assert generate(eot_model, [5, 6], 6, temperature=0, stop_ids=listed) == [eot]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert model_stops(tok, [folder]).ids == [eos]
