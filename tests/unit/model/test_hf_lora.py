"""kiln.model.hf_lora: lora.targets found among a transformers model's own layers, fused ones included; a target
that matches no layer is a ConfigError, said before any data is prepared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.config import LoraConfig, ModelConfig, load_config
from kiln.errors import ConfigError
from kiln.model.hf_auto import auto_config, build_auto
from kiln.train.run import with_init_from

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=48, bos_token_id=1, eos_token_id=1)
TINY = {"phi3": dict(BASE, pad_token_id=0), "phi": BASE, "nemotron": BASE,
        "nemotron_h": dict(BASE, hybrid_override_pattern="M*", head_dim=16, mamba_num_heads=2, mamba_head_dim=16,
                           ssm_state_size=8, n_groups=1, chunk_size=8),
        "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=48, bos_token_id=1, eos_token_id=1)}


def hf_dir(root: Path, kind: str) -> Path:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **TINY[kind])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / kind)
    return root / kind


def adapted(model) -> set[str]:
    """The layers (path inside a block) that carry a trainable adapter."""
    out = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts = name.split(".lora_")[0].split(".")
            block = next(i for i, part in enumerate(parts) if part.isdigit())  # ...layers.N.<path>
            out.add(".".join(parts[block + 1:]))
    return out


def lora(kind: str, root: Path, targets: list[str]):
    cfg = auto_config(ModelConfig(init_from=str(hf_dir(root, kind)), hf_class="auto"))
    return build_auto(cfg, LoraConfig(rank=4, alpha=8, targets=targets, base_dtype="fp32"))


@pytest.mark.parametrize("kind,targets,layers,where", [
    ("phi3", ["q", "k", "v", "o"], {"self_attn.qkv_proj", "self_attn.o_proj"},
     "q, k, v on self_attn.qkv_proj; o on self_attn.o_proj"),
    ("phi3", ["q", "v"], {"self_attn.qkv_proj"}, "q, v on self_attn.qkv_proj (fused: k is adapted too)"),
    ("phi3", ["gate", "up", "down"], {"mlp.gate_up_proj", "mlp.down_proj"},
     "gate, up on mlp.gate_up_proj; down on mlp.down_proj"),
    ("phi", ["q", "k", "v", "o"], {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense"},
     None),
    ("gpt2", ["q", "k", "v", "o"], {"attn.c_attn", "attn.c_proj"}, "q, k, v on attn.c_attn; o on attn.c_proj"),
    ("gpt2", ["up", "down"], {"mlp.c_fc", "mlp.c_proj"}, "up on mlp.c_fc; down on mlp.c_proj"),
])
def test_targets_map_onto_the_models_own_and_fused_layers(tmp_path, kind, targets, layers, where):
    model = lora(kind, tmp_path, targets)
    assert adapted(model) == layers
    if where is not None:
        assert model.lora_where == where
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = model(x)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)  # the adapters now change what the layers compute
        after = model(x)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("kind,targets,missing", [("nemotron", ["q", "gate"], "gate matches no layer"),
                                                  ("phi", ["gate", "up", "down"], "gate matches no layer"),
                                                  ("gpt2", ["q", "gate", "o"], "gate matches no layer")])
def test_a_target_no_layer_computes_is_refused(tmp_path, kind, targets, missing):
    with pytest.raises(ConfigError, match=f"lora.targets: {missing} of .*linear layers of its blocks: .*"
                                          "lora.targets=\\[all\\]"):
        lora(kind, tmp_path, targets)


@pytest.mark.parametrize("hf_class", ["auto", "native"])
def test_the_refusal_comes_before_any_data_is_prepared(tmp_path, hf_class):
    path = hf_dir(tmp_path, "nemotron")
    (path / "tokenizer.json").write_text("{}")  # never read: the config is refused first
    cfg = load_config(None, [f"model.init_from={path}", f"model.hf_class={hf_class}", "lora.rank=4",
                             "lora.targets=[q,gate]", "train.seq_len=32"])
    with pytest.raises(ConfigError, match="gate"):
        with_init_from(cfg)


def test_targets_peft_refuses_are_refused_by_kiln_train_before_any_data_is_prepared(tmp_path, monkeypatch):
    """lora.targets=[all] on Nemotron-H: PEFT's refusal of a Mamba layer's out_proj came once the data was prepared
    (build_auto); the same adapters are now put on the architecture on the meta device as the run starts."""
    import io

    from peft.tuners import tuners_utils
    from rich.console import Console

    from kiln.train import run as run_module

    if not hasattr(tuners_utils, "_check_lora_target_modules_mamba"):
        pytest.skip("this peft adapts a Mamba layer's out_proj")

    def prepared(*a, **k):
        raise AssertionError("the data was prepared before lora.targets were checked")

    from kiln.data.prepare.tokenizer import train_bpe

    monkeypatch.setattr(run_module, "build_data", prepared)
    path = hf_dir(tmp_path, "nemotron_h")
    train_bpe(["def f(x):\n    return x\n"] * 20, 260).save(path / "tokenizer.json")
    cfg = load_config(None, [f"model.init_from={path}", "model.hf_class=auto",
                             "lora.rank=4", "lora.targets=[all]", "train.seq_len=32", "train.device=cpu",
                             "data.sources=[nowhere]", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"lora.targets=\[all\]: PEFT cannot adapt"):
        run_module.run(cfg, console=Console(file=io.StringIO()))
    assert not (tmp_path / "run").exists()


def test_targets_peft_refuses_on_a_mamba_model_are_a_config_error(tmp_path):
    """PEFT refuses LoRA on a Mamba layer's out_proj: lora.targets=[all] on Nemotron-H ended in PEFT's ValueError,
    with a traceback, after the data was prepared."""
    from peft.tuners import tuners_utils

    if not hasattr(tuners_utils, "_check_lora_target_modules_mamba"):
        pytest.skip("this peft adapts a Mamba layer's out_proj")
    path = hf_dir(tmp_path, "nemotron_h")
    cfg = auto_config(ModelConfig(init_from=str(path), hf_class="auto"))
    with pytest.raises(ConfigError, match=r"lora.targets=\[all\]: PEFT cannot adapt .*out_proj.*name the targets"):
        build_auto(cfg, LoraConfig(rank=2, targets=["all"]))
    assert build_auto(cfg, LoraConfig(rank=2, targets=["q", "v"])).lora_where


def test_saving_the_merged_model_of_a_bf16_base_gives_no_deprecation_warning(tmp_path):
    """The merge onto the base as stored (read again: the training copy is bf16) printed transformers' FutureWarning
    for the is_gradient_checkpointing PEFT asks for at the end of every such run; the adapting itself hid it."""
    import warnings

    cfg = auto_config(ModelConfig(init_from=str(hf_dir(tmp_path, "nemotron")), hf_class="auto"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = build_auto(cfg, LoraConfig(rank=4, alpha=8, targets=["q", "v"], base_dtype="bf16"))
        model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
