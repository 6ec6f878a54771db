"""Mixtral, Qwen2-MoE and Qwen3-MoE between transformers and Kiln's native model: tiny random models built locally,
fp32: import, export, the training loss with its load-balancing term, greedy generation, packed documents."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, MoEConfig
from kiln.errors import StateError
from kiln.model.generate import generate
from kiln.model.hf import from_hf_config_dict, hf_model_type, to_hf_config_dict
from kiln.model.hf_experts import expert_slot, stack_experts, unstack_experts
from kiln.model.hf_import import import_hf
from kiln.model.llama import Transformer
from kiln.state.export import export_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, router_aux_loss_coef=0.02,
             output_router_logits=True)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                     decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, norm_topk_prob=True, head_dim=16),
}


def _hf_model(kind: str, tmp_path):
    torch.manual_seed(0)
    model = getattr(transformers, {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                   "qwen3_moe": "Qwen3MoeForCausalLM"}[kind])(FAMILIES[kind]())
    with torch.no_grad():  # transformers starts routers at zero (every expert alike): give them a real choice
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "norm.weight")) or p.abs().sum() == 0:
                p.normal_(0.0, 0.3 if "gate" in name else 0.02).add_(1.0 if "norm" in name else 0.0)
    model.config._attn_implementation = "sdpa"
    path = tmp_path / kind
    model.save_pretrained(path)
    return model.eval(), path


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_import_export_and_training_loss_match_transformers(kind, tmp_path):
    hf, path = _hf_model(kind, tmp_path)
    cfg, state = import_hf(path)
    assert cfg.moe is not None and hf_model_type(cfg) == kind
    kiln = Transformer(cfg.model_copy(update={"max_seq_len": 64}))
    kiln.load_state_dict(state, strict=True)
    kiln.eval()
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=x).logits
        torch.testing.assert_close(kiln(x), want, rtol=0, atol=1e-5)
    # the training objective: cross-entropy + router_aux_loss_coef x transformers' load-balancing loss
    hf.train(), kiln.train()
    y = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    out = hf(input_ids=x, labels=x)
    torch.testing.assert_close(kiln(x, y), out.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(kiln.router_aux.take(), out.aux_loss.float(), rtol=0, atol=1e-6)
    # export: transformers loads Kiln's directory and gives the same logits
    back = export_hf(kiln, cfg, None, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, want, rtol=0, atol=1e-5)
    if kind == "qwen3_moe":  # greedy generation picks the same tokens
        kiln.eval()
        ids = generate(kiln, [5, 17, 3], 6, temperature=0.0)
        hf_ids = hf.generate(torch.tensor([[5, 17, 3]]), max_new_tokens=6, do_sample=False).tolist()[0]
        assert ids[-6:] == hf_ids[-6:]


def test_config_round_trip_and_refusals():
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, qk_norm=True,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, norm_topk=False, dense_layers=[0]))
    assert hf_model_type(cfg) == "qwen3_moe"  # from scratch: the first family that holds it
    again = from_hf_config_dict(to_hf_config_dict(cfg))
    assert again.moe == cfg.moe and again.qk_norm
    shared = cfg.model_copy(update={"qk_norm": False, "attention_bias": "qkv",
                                    "moe": cfg.moe.model_copy(update={"shared_expert_hidden": 24})})
    assert hf_model_type(shared) == "qwen2_moe"
    with pytest.raises(StateError, match="MixtralForCausalLM cannot hold this model: .*qk_norm"):
        hf_model_type(cfg.model_copy(update={"hf_model_type": "mixtral"}))
    with pytest.raises(StateError, match="LlamaForCausalLM cannot hold this model: model.moe"):
        hf_model_type(cfg.model_copy(update={"hf_model_type": "llama"}))
    jitter = to_hf_config_dict(cfg.model_copy(update={"qk_norm": False, "moe": MoEConfig(n_experts=4)})) | {
        "router_jitter_noise": 0.1}
    with pytest.raises(StateError, match="router_jitter_noise=0.1"):
        from_hf_config_dict(jitter)


def test_expert_keys_both_ways():
    assert expert_slot("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", 7, "up")
    assert expert_slot("layers.0.mlp.experts.2.down_proj.weight") == ("layers.0.mlp.experts.down_proj", 2, "down")
    assert expert_slot("layers.0.mlp.shared_expert.down_proj.weight") is None
    g = torch.Generator().manual_seed(0)
    stacked = {"layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 4, generator=g),
               "layers.0.mlp.experts.down_proj": torch.randn(3, 4, 4, generator=g),
               "layers.0.mlp.gate.weight": torch.randn(3, 4, generator=g)}
    for mixtral in (False, True):
        per_expert = unstack_experts(stacked, mixtral)
        assert len(per_expert) == 3 * 3 + 1
        assert ("layers.0.block_sparse_moe.experts.1.w1.weight" in per_expert) == mixtral
        back = stack_experts(per_expert)
        assert back.keys() == stacked.keys() and all(torch.equal(back[k], stacked[k]) for k in stacked)


PUBLISHED = {  # config.json fields of released models (shapes only), and their published total / active sizes
    "Qwen3-30B-A3B": (dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False), 30.5e9, 3.3e9),
    "Mixtral-8x7B": (dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                          num_experts_per_tok=2, tie_word_embeddings=False), 46.7e9, 12.9e9),
    "Qwen1.5-MoE-A2.7B": (dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                               num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                               norm_topk_prob=False, tie_word_embeddings=False), 14.3e9, 2.7e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_released_shapes_count_their_published_total_and_active_parameters(name):
    """What MFU counts (the active parameters) and what memory counts (all of them), for the released models."""
    from kiln.model.registry import active_param_count, param_count

    fields, total, active = PUBLISHED[name]
    cfg = from_hf_config_dict(fields)
    assert param_count(cfg) == pytest.approx(total, rel=0.01)
    assert active_param_count(cfg) == pytest.approx(active, rel=0.02)
