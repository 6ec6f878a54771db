"""Each architecture option of the native model against transformers' own model: same weights, same logits."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, RopeScaling
from kiln.errors import StateError
from kiln.model.hf import (
    export_problem,
    from_hf_config_dict,
    from_hf_state_dict,
    hf_config,
    hf_model_type,
    to_hf_config_dict,
    to_hf_state_dict,
)
from kiln.model.llama import Transformer

transformers = pytest.importorskip("transformers")
# conftest.ARCHS
ARCHS = ["llama", "llama3.1", "llama-bias", "mistral", "qwen2", "nemotron", "qwen3", "qwen3-bias", "phi3"]


def kiln_of(hf) -> Transformer:
    cfg = from_hf_config_dict(hf.config.to_dict())
    model = Transformer(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg.tie_embeddings), strict=True)
    return model


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_logits_equal_transformers(arch, hf_model):
    hf = hf_model(arch)
    kiln = kiln_of(hf)
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = hf(input_ids=tokens).logits
    torch.testing.assert_close(kiln(tokens), expected, rtol=0, atol=1e-5)
    assert kiln.cfg.hf_model_type == hf.config.model_type == hf_model_type(kiln.cfg)


def test_options_reach_the_model(hf_model):
    """The parity above would pass trivially if an option were ignored on both sides: check each is live."""
    m = {arch: kiln_of(hf_model(arch)) for arch in ("mistral", "qwen2", "nemotron", "llama3.1")}
    assert m["mistral"].cfg.sliding_window == 8 and m["mistral"].cfg.head_dim == 48
    assert m["qwen2"].layers[0].self_attn.q_proj.bias is not None and m["qwen2"].layers[0].self_attn.o_proj.bias is None
    assert m["qwen2"].lm_head.weight is m["qwen2"].embed_tokens.weight
    nem = m["nemotron"]
    assert not hasattr(nem.layers[0].mlp, "gate_proj") and nem.rot_dim == 8 and nem.rope_cos.shape[-1] == 8
    assert nem.cfg.norm == "layernorm1p" and nem.layers[0].input_layernorm.bias is not None
    assert m["llama3.1"].cfg.rope_scaling.type == "llama3"
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(2))
    far = tokens.clone()
    far[0, 0] = (far[0, 0] + 1) % 96  # position 0 is outside the window of position 31 (window 8)
    with torch.no_grad():
        a, b = m["mistral"](tokens), m["mistral"](far)
    torch.testing.assert_close(a[0, 16:], b[0, 16:], rtol=0, atol=0)  # 2 layers: receptive field 15 back


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trip(arch, hf_model):
    cfg = from_hf_config_dict(hf_model(arch).config.to_dict())
    assert from_hf_config_dict(to_hf_config_dict(cfg)) == cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_of_each_architecture(arch, hf_model):
    from kiln.model.registry import param_count

    hf = hf_model(arch)
    assert param_count(kiln_of(hf).cfg) == sum(p.numel() for p in hf.parameters())


@torch.no_grad()
def test_sliding_window_with_document_mask(hf_model):
    """A document packed after another gets the logits it has alone, with the window counted inside it."""
    kiln = kiln_of(hf_model("mistral"))  # window 8
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.zeros(1, 40, dtype=torch.int32)
    doc_ids[0, 13:] = 1
    packed = kiln(tokens, doc_ids=doc_ids)[0, 13:]
    torch.testing.assert_close(packed, kiln(tokens[:, 13:])[0], rtol=1e-5, atol=1e-5)
    whole = kiln.cfg.model_copy(update={"sliding_window": None})
    unwindowed = Transformer(whole).eval()
    unwindowed.load_state_dict(kiln.state_dict())
    assert not torch.allclose(unwindowed(tokens[:, 13:])[0], packed, atol=1e-3)  # the window is in effect


@pytest.mark.parametrize("shape, why", [
    (dict(mlp="relu2"), "model.norm=rmsnorm"),
    (dict(rotary_fraction=0.5), "model.rotary_fraction=0.5"),
    (dict(sliding_window=8, rope_scaling=RopeScaling()), "model.sliding_window=8"),
])
def test_shapes_no_hf_class_holds_are_said(shape, why):
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, **shape)
    problem = export_problem(cfg)
    assert problem is not None and why in problem and "kiln export` will not be able to write it" in problem
    with pytest.raises(StateError, match="no Hugging Face class holds this model shape"):
        hf_model_type(cfg)


def test_qkv_biases_from_scratch_export_as_llama(hf_model):
    """q/k/v biases (with or without MLP biases) from scratch: Llama with a zero o_proj bias, equal logits."""
    for mlp_bias in (False, True):
        cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, attention_bias="qkv", mlp_bias=mlp_bias,
                          tie_embeddings=False)
        assert export_problem(cfg) is None and hf_model_type(cfg) == "llama"
        torch.manual_seed(0)
        kiln = Transformer(cfg).eval()
        with torch.no_grad():
            for p in kiln.parameters():
                p.copy_(torch.randn_like(p) * 0.1)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg)).eval()
        hf.load_state_dict(to_hf_state_dict(kiln.state_dict(), cfg.tie_embeddings, zero_o_bias=True))
        x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(hf(input_ids=x).logits, kiln(x), rtol=0, atol=1e-5)
