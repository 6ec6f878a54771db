"""A QLoRA base built a block at a time: read from the Hugging Face files tensor by tensor and quantized as it
arrives (tied embeddings too), or drawn from per-parameter seeds; a base that does not fit is a StateError."""

from __future__ import annotations

import pytest
import torch

from kiln.config import RunConfig
from kiln.errors import StateError
from kiln.model.hf_import import import_hf
from kiln.model.quant import is_nf4, round_trip
from kiln.parallel.nf4_base import nf4_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")


def hf_dir(path, tie: bool):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def run_cfg(model_cfg, **lora) -> RunConfig:
    return RunConfig(model=model_cfg, lora={"rank": 4, "quantize_base": "nf4", **lora}, train={"seq_len": 32})


@pytest.mark.parametrize("tie", [False, True])
def test_the_base_is_read_and_quantized_block_by_block(tmp_path, tie):
    model_cfg, stored = import_hf(hf_dir(tmp_path / "base", tie))
    model = nf4_model(run_cfg(model_cfg), "cpu", weights_from=str(tmp_path / "base"))
    params = dict(model.named_parameters())
    assert sum(is_nf4(p) for p in params.values()) == 2 * 7  # q, k, v, o, gate, up, down of both blocks
    for name, p in params.items():
        assert not p.requires_grad
        if is_nf4(p):
            torch.testing.assert_close(p.get_original_weight(), round_trip(stored[name], torch.bfloat16),
                                       rtol=0, atol=0)
        else:  # embeddings, norms, lm_head: as stored, in lora.base_dtype
            assert p.dtype == torch.bfloat16 and torch.equal(p, stored[name]), name
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    x = torch.randint(0, 96, (1, 16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(x).float(), hf(input_ids=x).logits
    assert 0 < ((ours - theirs).norm() / theirs.norm()) < 0.2  # the same model, up to NF4's rounding


def test_a_random_base_is_drawn_per_parameter_from_the_seed():
    from kiln.config import ModelConfig

    mcfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                       max_seq_len=64)
    a, b = nf4_model(run_cfg(mcfg), "cpu", seed=1), nf4_model(run_cfg(mcfg), "cpu", seed=1)
    c = nf4_model(run_cfg(mcfg), "cpu", seed=2)
    w = "layers.1.mlp.down_proj.weight"
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert torch.equal(sa[w].get_original_weight(), sb[w].get_original_weight())
    assert torch.equal(sa["embed_tokens.weight"], sb["embed_tokens.weight"])
    assert not torch.equal(sa["embed_tokens.weight"], sc["embed_tokens.weight"])
    assert torch.equal(sa["norm.weight"], torch.ones(64, dtype=torch.bfloat16))


def test_a_base_that_does_not_fit_its_config_is_a_state_error(tmp_path):
    model_cfg, _ = import_hf(hf_dir(tmp_path / "base", False))
    wider = model_cfg.model_copy(update={"ffn_hidden": 192})
    with pytest.raises(StateError, match="gate_proj.weight has shape"):
        nf4_model(run_cfg(wider), "cpu", weights_from=str(tmp_path / "base"))


def test_a_base_fsdp_cannot_split_evenly_is_a_config_error_before_sharding():
    from kiln.config import ModelConfig
    from kiln.errors import ConfigError
    from kiln.model.lora import apply_lora, trainable_count
    from kiln.model.quant import unshardable
    from kiln.parallel.materialize import build_model
    from kiln.parallel.mesh import Mesh

    narrow = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
    wide = narrow.model_copy(update={"d_model": 256, "ffn_hidden": 512})
    assert not unshardable(nf4_model(run_cfg(wide), "cpu"), 2)  # 256 rows, 4 scale blocks: halves evenly
    assert len(unshardable(nf4_model(run_cfg(narrow), "cpu"), 2)) == 14  # 64 weights' blocks: one scale factor
    cfg = run_cfg(narrow).model_copy(update={"dist": run_cfg(narrow).dist.model_copy(update={"strategy": "fsdp"})})

    def adapt(model):
        apply_lora(model, cfg.lora)
        return trainable_count(model)

    with pytest.raises(ConfigError, match=r"under FSDP over 2 processes: layers\.0\.self_attn\.q_proj\.weight.*"
                                          r"dist\.strategy=ddp"):
        build_model(cfg, Mesh(world=2), 0, lambda _: None, adapt=adapt)
