"""kiln.model.hf_moe: a transformers mixture of experts trains on cross-entropy + router_aux_loss_coef x its
load-balancing loss, as the Hugging Face Trainer does, and a run logs that loss as aux_loss."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig, load_config
from kiln.model.hf_auto import auto_config, build_auto
from kiln.train.run import run

transformers = pytest.importorskip("transformers")

STDLIB = Path(sysconfig.get_paths()["stdlib"])

MIXTRAL = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
               router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=1)


def mixtral(root: Path, router_logits: bool = True) -> Path:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("mixtral", **MIXTRAL, output_router_logits=router_logits)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "mixtral")
    return root / "mixtral"


def test_training_loss_is_the_hf_trainers_with_the_aux_term(tmp_path):
    path = mixtral(tmp_path)
    model = build_auto(auto_config(ModelConfig(init_from=str(path), hf_class="auto")))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    z = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = z[:, :-1], z[:, 1:]
    want = reference(input_ids=x, labels=x)  # transformers shifts the labels itself
    model.train()
    ce = F.cross_entropy(model(x).flatten(0, 1), torch.cat([x[:, 1:], torch.full((2, 1), -100)], 1).flatten(),
                         ignore_index=-100)
    got = model(x, torch.cat([x[:, 1:], torch.full((2, 1), -100)], 1))
    torch.testing.assert_close(got, want.loss, atol=1e-5, rtol=1e-5)
    assert float(got - ce) == pytest.approx(0.02 * float(want.aux_loss), rel=1e-4)  # the term is there
    assert model.router_aux.take() is not None
    model.eval()  # evaluation: the cross-entropy alone, comparable with any model's
    with torch.no_grad():
        torch.testing.assert_close(model(x, y), F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    assert model.router_aux.take() is None


def test_a_model_whose_config_leaves_router_logits_off_trains_on_cross_entropy(tmp_path):
    model = build_auto(auto_config(ModelConfig(init_from=str(mixtral(tmp_path, router_logits=False)),
                                               hf_class="auto")))
    assert model.router_aux_coef is None
    x = torch.randint(0, 320, (2, 16))
    model.train()
    torch.testing.assert_close(model(x, x), F.cross_entropy(model(x).flatten(0, 1), x.flatten()))


def test_a_run_logs_aux_loss_at_every_logging_step(tmp_path):
    from kiln.data.prepare.tokenizer import train_bpe

    path = mixtral(tmp_path)
    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py")]
    train_bpe(texts, 320).save(path / "tokenizer.json")
    (tmp_path / "c").mkdir()
    for name in ("argparse.py", "textwrap.py"):
        (tmp_path / "c" / name).write_text((STDLIB / name).read_text())
    run(load_config(None, [
        f"model.init_from={path}", "model.hf_class=auto", f"data.sources=[{tmp_path / 'c'}]",
        f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=32", "train.batch_size=2", "train.max_steps=3",
        "train.eval_every=0", "train.device=cpu", "train.precision=fp32", "train.sample_tokens=0",
        f"train.run_dir={tmp_path / 'run'}", "logging.every=1", "logging.console=false", "logging.plots=false"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0 < r["aux_loss"] < 10 for r in train)  # Mixtral's is about the number of experts picked
