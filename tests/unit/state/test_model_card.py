"""The model card of an export: its metadata and what it says of the run, read from the run's own files."""

from __future__ import annotations

import json

import yaml

from kiln.config import RunConfig
from kiln.state.model_card import model_card
from kiln.state.verify import FORMAT


def _run(tmp_path, init_from: str | None, lora_rank: int = 0, **lora):
    run = tmp_path / "run"
    run.mkdir()
    cfg = RunConfig.model_validate({"model": {"init_from": init_from} if init_from else {},
                                    "data": {"sources": ["corpus/"]}, "lora": {"rank": lora_rank, **lora},
                                    "train": {"max_steps": 20}})
    (run / "config.yaml").write_text(cfg.to_yaml())
    recs = [{"event": "start", "step": 0}, {"event": "train", "step": 10, "loss": 3.25, "tokens": 1280},
            {"event": "eval", "step": 10, "val_loss": 3.5},
            {"event": "train", "step": 20, "loss": 2.75, "tokens": 2560},
            "damaged line"]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in recs))
    return run


def test_card_of_a_cpt_run_from_a_hub_cache_snapshot(tmp_path):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    run = _run(tmp_path, str(snapshot))
    card = model_card(run, "me/llama-cpt")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "meta-llama/Llama-3.1-8B" and meta["library_name"] == "transformers"
    for row in ("| steps | 20 of 20 |", "| tokens | 2,560 |", "| final training loss | 2.7500 |",
                "| final validation loss | 3.5000 (step 10) |", "| data | `corpus/` |"):
        assert row in card
    assert "continued pretraining of" in card and "\n```yaml\nmodel:\n" in card


def test_card_of_a_checkpoint_counts_up_to_its_step_and_of_adapters_says_peft(tmp_path):
    run = _run(tmp_path, "meta-llama/Llama-3.2-1B", lora_rank=8)
    ckpt = run / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    cfg = RunConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    (ckpt / "meta.json").write_text(json.dumps({"format": FORMAT, "step": 10, "config": cfg.model_dump(mode="json")}))
    card = model_card(ckpt, adapters=True)
    meta = yaml.safe_load(card.split("---")[1])
    assert (meta["base_model"], meta["library_name"], "lora" in meta["tags"]) == ("meta-llama/Llama-3.2-1B", "peft",
                                                                                  True)
    assert "| steps | 10 of 20 |" in card and "| tokens | 1,280 |" in card
    assert "| final training loss | 3.2500 |" in card
    assert "peft.PeftModel.from_pretrained" in card


def test_card_of_a_qlora_run_says_the_base_was_quantized(tmp_path):
    run = _run(tmp_path, "meta-llama/Llama-3.1-8B", lora_rank=16, quantize_base="nf4")
    merged, adapters = model_card(run), model_card(run, adapters=True)
    assert {"lora", "qlora"} <= set(yaml.safe_load(merged.split("---")[1])["tags"])
    assert "QLoRA adapters merged into the NF4-dequantized `meta-llama/Llama-3.1-8B`" in merged
    assert "bnb_4bit_quant_type" in adapters and "peft.PeftModel.from_pretrained" in adapters
