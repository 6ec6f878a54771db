"""Gemma's layers in the native model: the norm's order of operations, the embedding scale's rounding,
initialisation (eager, meta then materialised), rotary tables past the context, the parameter and FLOP counts,
and training through compiled blocks. FSDP over two processes: tests/unit/parallel/test_parallelize.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.model.gemma import RMSNorm1P, embed_scale
from kiln.model.llama import Transformer

GEMMA = dict(vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64,
             norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=True, attn_scale_dim=10,
             attn_softcap=2.0, logit_softcap=3.0, sliding_window=8, full_attention_layers=[1], rope_local_theta=100.0)


def gemma(**change) -> ModelConfig:
    return ModelConfig(**{**GEMMA, **change})


def test_rmsnorm1p_scales_in_fp32_then_casts():
    norm = RMSNorm1P(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.5)
    x = torch.randn(3, 64).to(torch.bfloat16)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)).to(torch.bfloat16)
    assert torch.equal(norm(x), want)
    llama_order = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * (1 + norm.weight)
    assert not torch.equal(norm(x), llama_order.to(torch.bfloat16))  # the order is what the test sees


def test_embedding_scale_is_rounded_to_the_compute_dtype():
    assert embed_scale(3072, torch.bfloat16) == 55.5  # sqrt(3072) = 55.43, as Gemma's checkpoints were trained
    assert embed_scale(3072, torch.float32) == float(torch.tensor(3072 ** 0.5))
    model = Transformer(gemma(n_layers=1, full_attention_layers=None)).eval()
    x = torch.randint(0, 96, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = []
        handle = model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        model(x)
        handle.remove()
    want = model.embed_tokens(x).to(torch.bfloat16) * 8.0  # sqrt(64) is exact
    assert seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], want)


def test_initialisation_norms_at_zero_every_parameter_listed_once_and_meta_agrees():
    torch.manual_seed(3)
    eager = Transformer(gemma())
    order = eager.init_order()
    assert sorted(id(p) for p, _ in order) == sorted({id(p) for p in eager.parameters()})
    norms = [m.weight for m in eager.modules() if isinstance(m, RMSNorm1P)]
    assert len(norms) == 3 * 6 + 1 and all(torch.count_nonzero(w) == 0 for w in norms)  # 4 + q/k per block, final
    with torch.device("meta"):
        meta = Transformer(gemma())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for name, table in eager.named_buffers():
        assert torch.equal(table, dict(meta.named_buffers())[name]), name
    assert {"rope_local_cos", "rope_local_sin"} <= dict(eager.named_buffers()).keys()
    assert "rope_local_cos" not in dict(Transformer(gemma(rope_local_theta=None)).named_buffers())


@torch.no_grad()
def test_rows_longer_than_the_context_extend_both_rotary_tables():
    torch.manual_seed(0)
    short = Transformer(gemma(max_seq_len=16)).eval()
    long = Transformer(gemma(max_seq_len=64)).eval()
    long.load_state_dict(short.state_dict())
    x = torch.randint(0, 96, (1, 24))
    torch.testing.assert_close(short(x), long(x), rtol=0, atol=1e-6)


def test_the_loss_is_cross_entropy_of_the_capped_logits():
    torch.manual_seed(0)
    model = Transformer(gemma())
    x, t = torch.randint(0, 96, (2, 20)), torch.randint(0, 96, (2, 20))
    logits = model(x)
    assert logits.abs().max() < 3.0
    torch.testing.assert_close(model(x, t), F.cross_entropy(logits.flatten(0, 1), t.flatten()), rtol=1e-6, atol=1e-6)


def test_param_count_and_flops_count_the_extra_norms_and_the_windows():
    from kiln.model.registry import flops_per_token, param_count

    cfg = gemma()
    assert param_count(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())
    q, T = cfg.n_heads * cfg.head_dim, 64
    windowed = 2 * 8 - 8 * 8 / T  # keys per query of a window of 8, doubled as the causal T / 2 is to T
    n = param_count(cfg)  # tied embeddings: the output projection counts once
    assert flops_per_token(cfg, T) == pytest.approx(6 * n + 12 * q * (2 * windowed + T))
    assert flops_per_token(cfg, 8) == pytest.approx(6 * n + 12 * q * 3 * 8)  # a window as long as the row: none


@pytest.mark.slow
def test_compiled_blocks_train_as_eager():
    """Each block compiles whole (fullgraph: the capped attention, q/k norms and both kinds of layer)."""
    from kiln.parallel.compile import apply_compile, restore_loss_kernel

    torch.manual_seed(0)
    eager = Transformer(gemma(n_layers=2))
    compiled = Transformer(gemma(n_layers=2))
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, loss=False)
    x, t = torch.randint(0, 96, (2, 24)), torch.randint(0, 96, (2, 24))
    doc_ids = torch.zeros(2, 24, dtype=torch.int32)
    doc_ids[0, 9:] = 1
    try:
        for model in (eager, compiled):
            model(x, t, doc_ids).backward()
    finally:
        restore_loss_kernel()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
