"""Gemma 2 and Gemma 3 on the native model against transformers' own (eager attention, fp32): same weights,
same logits; their configs both ways, older config keys, and what Kiln refuses to read."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
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
from kiln.model.registry import param_count

transformers = pytest.importorskip("transformers")
GEMMAS = ["gemma2", "gemma3"]  # conftest.ARCHS


def kiln_of(hf, **change) -> Transformer:
    cfg = from_hf_config_dict(hf.config.to_dict()).model_copy(update=change)
    model = Transformer(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg.tie_embeddings), strict=True)
    return model


def tokens(T: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", GEMMAS)
@torch.no_grad()
def test_logits_equal_transformers(arch, hf_model):
    hf = hf_model(arch)
    kiln = kiln_of(hf)
    x = tokens()
    torch.testing.assert_close(kiln(x), hf(input_ids=x).logits, rtol=0, atol=1e-5)
    cfg = kiln.cfg
    assert cfg.hf_model_type == hf_model_type(cfg) == hf.config.model_type
    assert cfg.full_attention_layers == [1] and cfg.sliding_window == 8 and cfg.attn_scale_dim == 12
    assert [b.attention_kind for b in kiln.layers] == [0, 1, 0] and cfg.logit_softcap == 3.0 and cfg.tie_embeddings
    assert (cfg.attn_softcap, cfg.qk_norm, cfg.rope_local_theta) == ((2.0, False, None) if arch == "gemma2" else
                                                                      (None, True, 100.0))
    assert param_count(cfg) == sum(p.numel() for p in hf.parameters())
    assert from_hf_config_dict(to_hf_config_dict(cfg)) == cfg


@pytest.mark.parametrize("arch, options", [
    ("gemma2", dict(attn_softcap=None, logit_softcap=None, attn_scale_dim=None, sliding_window=None,
                    full_attention_layers=None, embed_scale=False)),
    ("gemma3", dict(rope_local_theta=None, rope_scaling=None)),
])
@torch.no_grad()
def test_each_option_moves_the_logits(arch, options, hf_model):
    """The parity above would pass trivially if an option were ignored on both sides: each one is live."""
    hf = hf_model(arch)
    x = tokens()
    base = kiln_of(hf)(x)
    for name, value in options.items():
        changed = {name: value, **({"full_attention_layers": None} if name == "sliding_window" else {})}
        assert (kiln_of(hf, **changed)(x) - base).abs().max() > 1e-3, name


def test_older_and_shorter_config_files_read_the_same(hf_model):
    """A config.json of transformers 4.x (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)
    gives the ModelConfig of the same model written by transformers 5; a key left out is transformers' default."""
    new = hf_model("gemma3").config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=2)
    assert from_hf_config_dict(old) == from_hf_config_dict(new)
    bare = {k: new[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads")}
    cfg = from_hf_config_dict({**bare, "model_type": "gemma2"})
    assert (cfg.head_dim, cfg.sliding_window, cfg.full_attention_layers, cfg.attn_scale_dim) == (256, 4096, [1], None)
    assert (cfg.attn_softcap, cfg.logit_softcap, cfg.tie_embeddings, cfg.norm_eps) == (50.0, 30.0, True, 1e-6)
    cfg3 = from_hf_config_dict({**bare, "model_type": "gemma3_text", "num_hidden_layers": 7})
    assert cfg3.full_attention_layers == [5] and (cfg3.rope_theta, cfg3.rope_local_theta) == (1e6, 1e4)
    assert cfg3.max_seq_len == 131072 and cfg3.attn_softcap is None and cfg3.qk_norm


@pytest.mark.parametrize("change, why", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation=gelu"),  # exact GELU: not the tanh approximation
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4),
                           "sliding_attention": dict(rope_type="linear", rope_theta=1e4, factor=4.0)}),
     "sliding-window layers' rotary scaling"),
    (dict(rope_parameters={"full_attention": dict(rope_type="yarn", rope_theta=1e4, factor=4.0),
                           "sliding_attention": dict(rope_type="default", rope_theta=1e4)}), "rope_type=yarn"),
])
def test_what_kiln_cannot_hold_is_a_state_error(change, why, hf_model):
    hf = {**hf_model("gemma3").config.to_dict(), **change}
    with pytest.raises(StateError, match=why):
        from_hf_config_dict(hf)


@pytest.mark.parametrize("qk_norm, kind", [(False, "gemma2"), (True, "gemma3_text")])
@torch.no_grad()
def test_a_gemma_shaped_model_from_scratch_exports_as_gemma(qk_norm, kind):
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64,
                      norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=qk_norm,
                      attn_scale_dim=10, attn_softcap=None if qk_norm else 2.0, logit_softcap=3.0, sliding_window=8,
                      full_attention_layers=[2], rope_local_theta=100.0 if qk_norm else None, norm_eps=1e-6)
    assert hf_model_type(cfg) == kind
    torch.manual_seed(0)
    kiln = Transformer(cfg).eval()
    for p in kiln.parameters():
        p.copy_(torch.randn_like(p) * 0.1)
    config = hf_config(cfg)
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(to_hf_state_dict(kiln.state_dict(), cfg.tie_embeddings), strict=False)  # tied head left out
    x = tokens()
    torch.testing.assert_close(hf(input_ids=x).logits, kiln(x), rtol=0, atol=1e-5)
    for shape in (cfg, cfg.model_copy(update={"attn_scale_dim": None})):  # None: scaled by 1/sqrt(head_dim)
        assert from_hf_config_dict(to_hf_config_dict(shape)).model_copy(update={"hf_model_type": None}) == shape


@pytest.mark.parametrize("shape, why", [
    (dict(logit_softcap=30.0), "model.logit_softcap=30.0"),  # Llama's shape with a Gemma option: no class holds it
    (dict(norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, attn_softcap=5.0, qk_norm=True),
     "model.attn_softcap=5.0"),  # Gemma 3 caps no attention scores, Gemma 2 has no q/k norms
])
def test_shapes_no_gemma_holds_are_said(shape, why):
    problem = export_problem(ModelConfig(vocab_size=96, d_model=64, n_heads=4, **shape))
    assert problem is not None and why in problem


@pytest.mark.parametrize("arch", GEMMAS)
@torch.no_grad()
def test_a_packed_document_gets_the_logits_it_has_alone(arch, hf_model):
    """Windows count inside each document, on the local layers' rows and the global layers' alike."""
    kiln = kiln_of(hf_model(arch))
    x = tokens(T=40, seed=3)
    doc_ids = torch.zeros(2, 40, dtype=torch.int32)
    doc_ids[:, 13:] = 1
    packed = kiln(x, doc_ids=doc_ids)[:, 13:]
    torch.testing.assert_close(packed, kiln(x[:, 13:]), rtol=0, atol=1e-5)
    assert (packed - kiln(x)[:, 13:]).abs().max() > 1e-3  # the first document does reach it unmasked
