"""kiln.model.lora_experts: LoRA on a mixture of experts: per-expert adapters on the stacked projections (grouped
products), ordinary ones on attention, the shared expert and dense layers; merging, as the model and as the export
from the base directory does it; PEFT export refused with the reason."""

from __future__ import annotations

import pytest
import torch

from kiln.config import LoraConfig, ModelConfig, MoEConfig
from kiln.errors import StateError
from kiln.model.llama import Transformer
from kiln.model.lora import LoraLinear, adapter_state_dict, apply_lora, merge_lora, merge_state_dict
from kiln.model.lora_experts import LoraGroupedExperts
from kiln.model.lora_peft import write_peft_adapters

SHAPE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=48)
CFG = ModelConfig(**SHAPE, attention_bias="qkv", hf_model_type="qwen2_moe",
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, shared_expert_hidden=24, dense_layers=[1]))
FAMILIES = {"qwen2_moe": CFG,
            "mixtral": ModelConfig(**SHAPE, hf_model_type="mixtral", moe=MoEConfig(n_experts=4, expert_hidden=16)),
            "qwen3_moe": ModelConfig(**SHAPE, hf_model_type="qwen3_moe", qk_norm=True,
                                     moe=MoEConfig(n_experts=4, expert_hidden=16, norm_topk=False))}
LORA = LoraConfig(rank=4, alpha=8, targets=["all"], base_dtype="fp32")


def _adapted(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = apply_lora(Transformer(cfg), LORA)
    with torch.no_grad():  # B starts at zero (a no-op): give every adapter a value so that merging shows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_every_projection_gets_its_adapter_and_only_adapters_train():
    model = _adapted()
    moe_block, dense = model.layers[0].mlp, model.layers[1].mlp
    assert isinstance(moe_block.experts, LoraGroupedExperts)
    assert moe_block.experts.gate_adapter.lora_A.weight.shape == (4, 4, 32)  # (E, r, d)
    assert moe_block.experts.down_adapter.lora_B.weight.shape == (4, 32, 4)  # (E, d, r)
    assert isinstance(moe_block.shared_expert.up_proj, LoraLinear) and isinstance(dense.gate_proj, LoraLinear)
    assert isinstance(model.layers[0].self_attn.q_proj, LoraLinear)
    assert not moe_block.experts.gate_up_proj.requires_grad and not moe_block.gate.weight.requires_grad
    keys = adapter_state_dict(model)
    assert "layers.0.mlp.experts.up_adapter.lora_A.weight" in keys and "layers.0.mlp.experts.gate_up_proj" not in keys
    x = torch.randint(0, 64, (2, 12))
    model.train()
    model(x, x).backward()
    assert moe_block.experts.down_adapter.lora_A.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_merged_weights_give_the_adapted_models_logits(tmp_path, kind):
    cfg = FAMILIES[kind]
    model = _adapted(cfg).eval()
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        merged = merge_lora(model)
        torch.testing.assert_close(merged(x), want, rtol=0, atol=1e-5)
        plain = Transformer(cfg)
        plain.load_state_dict(merge_state_dict(model.state_dict(), LORA))
        torch.testing.assert_close(plain.eval()(x), want, rtol=0, atol=1e-5)
    # the export's merge: the adapters onto the base as its Hugging Face directory stores it
    from kiln.state.export import export_hf
    from kiln.state.lora_base import merged_model

    torch.manual_seed(0)
    base = Transformer(cfg)
    with torch.no_grad():
        assert not torch.allclose(base.eval()(x), want, atol=1e-3)  # the adapters change the logits
    path = export_hf(base, cfg, None, tmp_path / "base")
    exported = Transformer(cfg)  # merged_model's own has its weights only (no rope tables): the export's state
    from_base = merged_model(cfg.model_copy(update={"init_from": str(path)}), LORA, adapter_state_dict(model))
    exported.load_state_dict(from_base.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(x), want, rtol=0, atol=1e-5)
    with pytest.raises(StateError, match="no PEFT form"):
        write_peft_adapters(adapter_state_dict(model), cfg, LORA, str(path), tmp_path / "peft")
