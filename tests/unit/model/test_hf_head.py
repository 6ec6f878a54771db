"""kiln.model.hf_head: the auto path's loss on the hidden states, against the native model's and the full logits'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.model.hf import hf_config, to_hf_state_dict
from kiln.model.hf_auto import HFCausalLM
from kiln.model.llama import Transformer

transformers = pytest.importorskip("transformers")


def native_and_auto(tie: bool = False):
    """Kiln's Transformer and transformers' LlamaForCausalLM with its weights, behind HFCausalLM."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=32,
                      tie_embeddings=tie)
    torch.manual_seed(0)
    native = Transformer(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(cfg, dtype="float32"))
    hf.load_state_dict(to_hf_state_dict(native.state_dict(), tie), strict=False)
    if tie:
        hf.tie_weights()
    return native, HFCausalLM(hf, cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_loss_and_gradients_equal_the_native_models(tie):
    native, auto = native_and_auto(tie)
    assert auto.own_head is None and auto.own_attention is None  # the chunked loss, Kiln's attention
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 24), generator=g), torch.randint(0, 64, (2, 24), generator=g)
    y[1, :5] = -100
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 9 + [2] * 12])
    want, got = native(x, y, docs), auto(x, y, docs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want.backward()
    got.backward()
    torch.testing.assert_close(auto.base.lm_head.weight.grad, native.lm_head.weight.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(auto.base.model.layers[0].self_attn.q_proj.weight.grad,
                               native.layers[0].self_attn.q_proj.weight.grad, atol=1e-6, rtol=1e-4)


def test_the_loss_never_computes_the_whole_batchs_logits():
    _, auto = native_and_auto()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    logits = auto(x)  # the model's own logits, for generation and evaluation
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def refuse(*args):
        raise AssertionError("the output layer ran on the batch")

    auto.base.lm_head.forward = refuse
    torch.testing.assert_close(auto(x, y), want)  # its weight alone went into the chunked loss


def test_a_head_that_is_not_a_plain_linear_layer_keeps_the_full_logits():
    _, auto = native_and_auto()
    auto.base.config.logit_scale = 0.25  # as Cohere sets it: logits are not the head's output
    from kiln.model.hf_head import plain_head

    assert "logit_scale=0.25" in plain_head(auto.base)
    auto.base.lm_head.bias = torch.nn.Parameter(torch.zeros(64))
    auto.base.config.logit_scale = None
    assert plain_head(auto.base) == "its output layer has a bias"
