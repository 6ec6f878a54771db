"""Gemma 2 and 3 on CUDA: soft-capped attention as flex attention's score modifier (with the block masks of
packed documents and sliding windows) against the eager attention the CPU runs, a Gemma-shaped model on the
GPU against itself on the CPU, transformers' Gemma 2 in bf16, and compiled blocks (with selective activation
checkpointing) at Gemma's head width (256) training in bf16."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.model.masks import attend, block_mask, dense_mask
from kiln.parallel.ac import apply_ac
from kiln.parallel.compile import apply_compile, restore_loss_kernel

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GEMMA = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512, max_seq_len=512,
             norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, attn_scale_dim=64, attn_softcap=5.0,
             logit_softcap=10.0, sliding_window=64, full_attention_layers=[1, 3], init_std=0.1)


def _doc_ids(B: int, T: int) -> torch.Tensor:
    ids = torch.zeros(B, T, dtype=torch.int32)
    ids[0, T // 3:] = 1
    ids[1, T // 5:] = 1
    ids[1, T // 2:] = 2
    return ids


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("with_docs", [True, False], ids=["docs", "no-docs"])
@pytest.mark.parametrize("hd", [64, 256])
def test_capped_flex_attention_matches_eager(window, with_docs, hd):
    T, H, KV, cap, scale = 256, 4, 2, 2.0, 0.2  # scaled so that the cap bites
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, T, hd, generator=g).to(CUDA, torch.bfloat16).requires_grad_() for h in (H, KV, KV))
    dy = torch.randn(2, H, T, hd, generator=g).to(CUDA, torch.bfloat16)
    ids = _doc_ids(2, T) if with_docs else None
    out = attend(q, k, v, block_mask(ids, CUDA, window, T), scale=scale, cap=cap)
    ref = attend(q, k, v, dense_mask(ids, CUDA, window, T), scale=scale, cap=cap)  # eager: the CPU's code
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
    uncapped = attend(q, k, v, block_mask(ids, CUDA, window, T), scale=scale)
    assert (out - uncapped).abs().max() > 5e-2  # control: the cap changes the result


@pytest.mark.parametrize("qk_norm", [False, True], ids=["gemma2", "gemma3"])
@torch.no_grad()
def test_model_on_the_gpu_gives_the_cpus_logits(qk_norm):
    cfg = ModelConfig(**GEMMA, qk_norm=qk_norm, rope_local_theta=100.0 if qk_norm else None)
    torch.manual_seed(0)
    cpu = Transformer(cfg).eval()
    gpu = Transformer(cfg).to(CUDA).eval()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(1))
    ids = _doc_ids(2, 200)
    for doc_ids in (None, ids):  # no mask but the causal one the cap needs; packed documents
        want = cpu(x, doc_ids=doc_ids)
        got = gpu(x.to(CUDA), doc_ids=None if doc_ids is None else doc_ids.to(CUDA)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_bf16_logits_follow_transformers_gemma2_in_bf16():
    """Under bf16 autocast Kiln keeps fp32 weights and a bf16 residual stream; transformers' bf16 model rounds its
    weights too: close, not equal (the embedding scale rounds to bf16 on both sides)."""
    transformers = pytest.importorskip("transformers")
    from kiln.model.hf import from_hf_config_dict, from_hf_state_dict

    config = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=64, query_pre_attn_scalar=64,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    cfg = from_hf_config_dict(hf.config.to_dict())
    kiln = Transformer(cfg).eval()
    kiln.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg.tie_embeddings))
    kiln.to(CUDA)
    hf.to(CUDA, torch.bfloat16)
    x = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = kiln(x).float()
    theirs = hf(input_ids=x).logits.float()
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_compiled_checkpointed_blocks_at_head_width_256_train_in_bf16_as_eager():
    cfg = ModelConfig(**{**GEMMA, "d_model": 512, "n_heads": 2, "n_kv_heads": 1, "head_size": 256}, qk_norm=True,
                      rope_local_theta=100.0)
    torch.manual_seed(0)
    eager = Transformer(cfg).to(CUDA)
    compiled = Transformer(cfg).to(CUDA)
    compiled.load_state_dict(eager.state_dict())
    apply_ac(compiled, "selective")
    apply_compile(compiled)
    x, t = (torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(s)).to(CUDA) for s in (1, 2))
    ids = _doc_ids(2, 256).to(CUDA)
    losses = []
    try:
        for model in (eager, compiled):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, t, ids)
            loss.backward()
            losses.append(loss.item())
    finally:
        restore_loss_kernel()
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.isfinite(b.grad).all(), name
        torch.testing.assert_close(b.grad, a.grad, rtol=0.1, atol=0.1 * float(a.grad.abs().max()) + 1e-6, msg=name)
