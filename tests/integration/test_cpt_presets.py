"""The continued-pretraining presets train every architecture their header names: cpt-8b-1gpu (LoRA),
cpt-8b-16gb (QLoRA), cpt-8b-4gpu (full, FSDP) and cpt-8b-24gb (full, the optimizer in host memory) on a tiny
random Llama, Mistral, Qwen2 and Nemotron, on the CPU (the presets' GPU settings overridden: device, precision,
compile, row length; their LoRA, quantization, sharding and offload kept)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.config import load_config, resolve_config_path
from kiln.train.run import run

from .conftest import losses
from .hf_dirs import tokenizer, write_corpus

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
NAMED = {"Llama": ("llama", {}), "Mistral": ("mistral", {"sliding_window": None}),
         "Qwen2": ("qwen2", {}), "Nemotron": ("nemotron", {"partial_rotary_factor": 0.5})}
CPU = ["train.device=cpu", "train.precision=fp32", "train.compile=false", "train.seq_len=32", "train.batch_size=2",
       "train.grad_accum=1", "train.max_steps=2", "train.warmup_steps=1", "train.eval_every=0",
       "train.sample_tokens=0", "logging.every=1", "logging.console=false", "logging.plots=false"]


@pytest.mark.parametrize("preset", ["cpt-8b-1gpu", "cpt-8b-16gb", "cpt-8b-4gpu", "cpt-8b-24gb"])
def test_the_header_names_these_architectures(preset):
    header = resolve_config_path(preset).read_text().splitlines()[0]
    assert set(re.findall(r"(Llama|Mistral|Qwen2|Nemotron)-", header)) == set(NAMED)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("presets")
    tok = tokenizer()
    for name, (kind, extra) in NAMED.items():
        config = transformers.AutoConfig.for_model(kind, **BASE, **extra, bos_token_id=tok.eos_id,
                                                   eos_token_id=tok.eos_id)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tok.save(root / name / "tokenizer.json")
    write_corpus(root / "corpus", 3)
    return root


@pytest.mark.parametrize("name", sorted(NAMED))
@pytest.mark.parametrize("preset", ["cpt-8b-1gpu", "cpt-8b-16gb", "cpt-8b-4gpu", "cpt-8b-24gb"])
def test_cpt_preset_trains_each_architecture_it_names(root, tmp_path, preset, name):
    cfg = load_config(preset, [f"model.init_from={root / name}", f"data.sources=[{root / 'corpus'}]",
                               f"data.cache_dir={root / 'cache'}", f"train.run_dir={tmp_path / 'run'}", *CPU])
    run_dir = run(cfg)
    assert sorted(losses(run_dir)) == [1, 2]
    if preset in ("cpt-8b-1gpu", "cpt-8b-16gb"):
        assert cfg.lora.rank > 0 and (run_dir / "model" / "adapters" / "adapter_model.safetensors").is_file()
    if preset == "cpt-8b-24gb":
        assert cfg.train.offload == "optimizer" and cfg.lora.rank == 0
