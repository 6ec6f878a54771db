"""Qwen3 (q/k RMSNorm per head, a head_dim of its own) and Phi-3 (qkv_proj and gate_up_proj kept fused) on the
native model: what makes each reaches the model, an export is transformers' own class with the same logits,
packed documents stay apart, the blocks compile whole, Qwen3's sliding window and Phi-3's longrope are
transformers', and what Kiln lacks is refused with the key that asks it."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.model.hf import (
    ARCHITECTURES,
    from_hf_config_dict,
    hf_config,
    hf_model_type,
    to_hf_state_dict,
    zero_o_bias,
)
from kiln.model.llama import RMSNorm, Transformer

from .conftest import ARCHS as HF_ARCHS
from .test_hf_archs import kiln_of

transformers = pytest.importorskip("transformers")
FAMILIES = ["qwen3", "phi3"]
BOTH = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_size=32, ffn_hidden=128,
                   max_seq_len=64, qk_norm=True, fused_projections=True, attention_bias="qkv")


def test_what_makes_each_family_reaches_the_model(hf_model):
    hf = hf_model("qwen3")
    qwen = kiln_of(hf)
    attn = qwen.layers[0].self_attn
    assert qwen.cfg.head_dim == 32 != qwen.cfg.d_model // qwen.cfg.n_heads  # Qwen3's head_dim, not d / heads
    assert isinstance(attn.q_norm, RMSNorm) and attn.q_norm.weight.shape == (32,) and attn.q_proj.bias is None
    x = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = qwen(x)
        attn.k_norm.weight.mul_(2.0)  # the norm is live: its scale changes the logits
        assert (qwen(x) - before).abs().max() > 1e-3

    phi = kiln_of(hf_model("phi3"))
    attn, mlp = phi.layers[0].self_attn, phi.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == 64 + 2 * 32
    assert hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.out_features == 256
    assert phi.cfg.sliding_window == 8 and phi.rot_dim == 8 and not isinstance(attn.q_norm, RMSNorm)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_export_is_transformers_class_with_the_same_logits(family, hf_model):
    """Changed after import, the model written back as its family loads in transformers' class, key for key."""
    kiln = kiln_of(hf_model(family))
    for p in kiln.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    cfg = kiln.cfg
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg)).eval()
    assert type(hf).__name__ == ARCHITECTURES[family]
    hf.load_state_dict(to_hf_state_dict(kiln.state_dict(), tie_embeddings=False), strict=True)
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(input_ids=x).logits, kiln(x), rtol=0, atol=1e-5)


def test_a_model_from_scratch_exports_as_the_family_that_holds_it():
    qwen = BOTH.model_copy(update={"fused_projections": False})
    assert hf_model_type(qwen) == "qwen3" and zero_o_bias(qwen)  # q/k/v biases: Qwen3's on all four, o's zero
    assert hf_model_type(ModelConfig(vocab_size=96, d_model=64, n_heads=4, fused_projections=True)) == "phi3"
    with pytest.raises(StateError, match="model.qk_norm=True"):  # no class has both
        hf_model_type(BOTH)
    qwen = qwen.model_copy(update={"attention_bias": "all"})
    assert from_hf_config_dict(hf_config(qwen).to_dict()) == qwen.model_copy(update={"hf_model_type": "qwen3"})


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_packed_document_gives_the_logits_it_gives_alone(family, hf_model):
    kiln = kiln_of(hf_model(family))  # phi3: a window of 8, counted inside the document
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.zeros(1, 40, dtype=torch.int32)
    doc_ids[0, 13:] = 1
    packed = kiln(tokens, doc_ids=doc_ids)[0, 13:]
    torch.testing.assert_close(packed, kiln(tokens[:, 13:])[0], rtol=0, atol=1e-5)
    assert (packed - kiln(tokens)[0, 13:]).abs().max() > 1e-3  # without doc_ids the first document is seen


def test_every_parameter_is_initialised_and_meta_init_matches_eager():
    torch.manual_seed(5)
    eager = Transformer(BOTH)
    with torch.device("meta"):
        meta = Transformer(BOTH)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    assert {id(p) for p, _ in meta.init_order()} == {id(p) for p in meta.parameters()}
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    norm = eager.layers[1].self_attn.k_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))


def test_a_block_compiles_to_one_graph_with_the_same_numbers():
    """fullgraph: q/k norms, the fused split and the doc mask trace without a break (the GPU compiles the same)."""
    from kiln.model import masks

    torch.manual_seed(0)
    model = Transformer(BOTH)
    block = model.layers[0]
    x = torch.randn(2, 24, 64)
    cos, sin = model._rope(24)
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    mask = masks.doc_mask(docs, x.device)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin, mask), block(x, cos, sin, mask), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_qwen3_with_a_window_on_every_layer_keeps_it_both_ways():
    """use_sliding_window with max_window_layers=0 (every layer windowed): imported with its window, the logits are
    transformers', and the export writes the same window on every layer back."""
    fields = dict(HF_ARCHS["qwen3"])
    fields.pop("model_type")
    config = transformers.AutoConfig.for_model("qwen3", **fields, use_sliding_window=True, sliding_window=8,
                                               max_window_layers=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    kiln = kiln_of(hf)
    assert kiln.cfg.sliding_window == 8
    x = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(kiln(x), hf(input_ids=x).logits, rtol=0, atol=1e-5)
    back = hf_config(kiln.cfg)
    assert back.sliding_window == 8 and set(back.layer_types) == {"sliding_attention"}
    full = {**hf.config.to_dict(), "max_window_layers": 2, "layer_types": None}  # the window on no layer: none
    assert from_hf_config_dict(full).sliding_window is None


@torch.no_grad()
def test_phi3_longrope_takes_the_short_factors_up_to_its_original_context_and_the_long_ones_beyond(tmp_path):
    """Phi-3 128K / Phi-3.5 / Phi-4-mini: transformers' logits on either side of original_max_position_embeddings
    (16 here, of 64), the attention factor included; exported, the same longrope comes back."""
    fields = dict(HF_ARCHS["phi3"])
    fields.pop("model_type")
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, short_factor=[1.0, 1.1, 1.5, 2.0],
                long_factor=[1.0, 2.0, 4.0, 8.0])
    config = transformers.AutoConfig.for_model("phi3", **{**fields, "rope_parameters": rope,
                                                          "original_max_position_embeddings": 16})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    kiln = kiln_of(hf)
    s = kiln.cfg.rope_scaling
    assert s.type == "longrope" and s.attention_factor == pytest.approx((1 + math.log(4) / math.log(16)) ** 0.5)
    for T in (12, 40):  # short factors; long ones (T > 16)
        x = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(kiln(x), hf(input_ids=x).logits, rtol=0, atol=1e-5)
    assert from_hf_config_dict(hf_config(kiln.cfg).to_dict()).rope_scaling == s
    with pytest.raises(StateError, match="LlamaForCausalLM cannot hold this model: .*model.rope_scaling.type=longrope"):
        hf_model_type(kiln.cfg.model_copy(update={"fused_projections": False, "hf_model_type": "llama"}))


@pytest.mark.parametrize("family, change, said", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "sliding window on some layers"),
    ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                        original_max_position_embeddings=16)), "rope_parameters.rope_type=yarn"),
])
def test_what_kiln_lacks_is_refused_with_the_key_that_asks_it(family, change, said, tmp_path):
    from kiln.model.hf_import import resolve_init_from

    fields = dict(HF_ARCHS[family])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **{**fields, **change})
    config.save_pretrained(tmp_path)
    with pytest.raises(StateError, match=f"{said}.*model.hf_class=auto"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path)))
