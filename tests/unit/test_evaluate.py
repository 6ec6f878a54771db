"""`kiln eval` on source files: the data options (--format, --field, --text-unit) choose how the sources are read,
and a device that is not there is a clear error."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig
from kiln.data.prepare.tokenizer import train_bpe
from kiln.errors import ConfigError
from kiln.evaluate import evaluate
from kiln.model.llama import Transformer
from kiln.state.weights import save_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model/ folder of the tiny model with a BPE tokenizer of 300 tokens trained on stdlib source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = train_bpe([(stdlib / "textwrap.py").read_text()], 300)
    cfg = ModelConfig(size="tiny", vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    return save_model(Transformer(cfg), cfg, tok, tmp_path_factory.mktemp("eval") / "model")


def write_jsonl(path: Path, field: str) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = (stdlib / "shlex.py").read_text().splitlines()
    with path.open("w") as f:
        for i in range(0, len(lines), 20):
            f.write(json.dumps({field: "\n".join(lines[i:i + 20]), "id": i}) + "\n")
    return path


def test_field_and_format_read_the_named_field_of_json_records(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "held-out.txt", "body")  # JSON lines under a .txt suffix
    as_text = evaluate(model_dir, [str(data)], seq_len=16, batch_size=2, device="cpu")
    as_json = evaluate(model_dir, [str(data)], seq_len=16, batch_size=2, device="cpu", format="jsonl", field="body")
    raw = data.read_text()
    assert as_text["bytes"] > as_json["bytes"]  # read as text, the JSON syntax is text too
    bodies = "".join(json.loads(line)["body"] for line in raw.splitlines())
    assert as_json["bytes"] <= len(bodies.encode())  # only the field's text is evaluated


def test_text_unit_changes_how_a_text_file_is_split_into_documents(model_dir, tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (tmp_path / "a.txt").write_text((stdlib / "shlex.py").read_text())
    whole = evaluate(model_dir, [str(tmp_path / "a.txt")], seq_len=16, batch_size=2, device="cpu")
    lines = evaluate(model_dir, [str(tmp_path / "a.txt")], seq_len=16, batch_size=2, device="cpu", text_unit="line")
    assert lines["tokens"] != whole["tokens"]  # one EOS per line against one per file


def test_an_unknown_format_is_a_config_error(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "x.jsonl", "text")
    with pytest.raises(ConfigError, match="format"):
        evaluate(model_dir, [str(data)], seq_len=16, device="cpu", format="xml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "x.jsonl", "text")
    with pytest.raises(ConfigError, match="--device cuda"):
        evaluate(model_dir, [str(data)], seq_len=16, device="cuda")



def test_a_hugging_face_directory_is_evaluated_on_documents_that_start_as_its_tokenizer_starts_a_text(tmp_path):
    """kiln eval of an export of a Gemma or Llama run (or of the model itself) read each document without the BOS
    the model trained on before every document and AutoTokenizer puts first: the loss of another input than the
    run's own evaluation reads."""
    from safetensors.torch import save_file
    from tokenizers import processors

    from kiln.evaluate import load_target, open_eval_data
    from kiln.model.hf import to_hf_config_dict, to_hf_state_dict

    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 280, ["<|endoftext|>", "<s>"])
    tok.tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    state = to_hf_state_dict(Transformer(cfg).state_dict(), cfg.tie_embeddings)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    tok.save(tmp_path / "tokenizer.json")
    target = load_target(tmp_path)
    assert target.kind == "hf" and target.tokenizer.bos_id == 1
    (tmp_path / "a.txt").write_text("def g(y):\n    return y\n" * 4)
    ds, _ = open_eval_data([str(tmp_path / "a.txt")], target.tokenizer, None, tmp_path / "cache", None, 8)
    assert ds.manifest["report"]["special_tokens"].startswith("<s> before")


def test_a_run_is_evaluated_with_the_eos_its_tokenizer_directory_names(tmp_path):
    """A run from a model whose EOS has none of the usual names (DeepSeek's <｜end▁of▁sentence｜>, which
    data.eos_token=auto finds in its tokenizer directory's tokenizer_config.json) trained with that EOS after every
    document, but kiln eval of the run (or of a checkpoint) read its model/tokenizer.json, away from that directory,
    without one: 'the tokenizer has no end-of-text token'."""
    import yaml

    from kiln.data.prepare.tokenizer import Tokenizer
    from kiln.evaluate import load_target
    from kiln.state.export import _as_trained, _checkpoint_tokenizer
    from kiln.state.hf_source import tokenizer_dir

    eos = "<｜end▁of▁sentence｜>"
    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 280, [eos])
    folder = tmp_path / "base"
    folder.mkdir()
    tok.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    run = tmp_path / "run"
    save_model(Transformer(cfg), cfg, tok, run / "model")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(folder)}}))
    assert tokenizer_dir(folder) == folder
    assert load_target(run).tokenizer.eos_id == 0
    run_cfg = load_target(run).run_cfg
    assert _checkpoint_tokenizer(run / "checkpoints" / "step_00000001", run_cfg, {}).eos_id == 0
    saved = Tokenizer.load(run / "model" / "tokenizer.json")  # what kiln export of the run reads, then its EOS
    assert saved.eos_id is None and _as_trained(saved, {"tokenizer": str(folder)})[0].eos_id == 0
