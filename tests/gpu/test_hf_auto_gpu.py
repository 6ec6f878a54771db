"""The auto path on CUDA (model.hf_class=auto): a transformers Llama with Kiln's attention (flex block masks),
compiled per block under bf16 autocast, trains with the native model's loss and gradients on packed rows,
keeps each document apart, and compiles no new graph after its first steps."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.hf import hf_config, to_hf_state_dict
from kiln.model.hf_auto import HFCausalLM
from kiln.model.llama import Transformer
from kiln.parallel.compile import apply_compile, compiled_graph_count

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _pair():
    cfg = ModelConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=512)
    torch.manual_seed(0)
    native = Transformer(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(cfg, dtype="float32"))
    hf.load_state_dict(to_hf_state_dict(native.state_dict(), cfg.tie_embeddings), strict=False)
    return native.cuda(), HFCausalLM(hf, cfg).cuda()


def _docs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < 0.01).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()


def test_compiled_auto_llama_trains_as_the_native_model_on_packed_rows():
    native, auto = _pair()
    assert auto.own_attention is None and auto.own_head is None
    apply_compile(native)
    apply_compile(auto)
    g = torch.Generator().manual_seed(1)
    graphs = None
    for step in range(4):
        x, y = (torch.randint(0, 1024, (4, 512), generator=g).cuda() for _ in range(2))
        docs = _docs(4, 512, step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, got = native(x, y, docs), auto(x, y, docs)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-3)
        want.backward()
        got.backward()
        for ours, theirs in ((auto.base.model.layers[0].mlp.down_proj, native.layers[0].mlp.down_proj),
                             (auto.base.model.layers[1].self_attn.q_proj, native.layers[1].self_attn.q_proj),
                             (auto.base.lm_head, native.lm_head)):
            cos = torch.nn.functional.cosine_similarity(ours.weight.grad.flatten(), theirs.weight.grad.flatten(), 0)
            assert cos > 0.99, (step, cos)
        for p in (*native.parameters(), *auto.parameters()):
            p.grad = None
        if step == 1:
            graphs = compiled_graph_count()
    assert compiled_graph_count() == graphs  # new document layouts: no recompilation


@torch.no_grad()
def test_second_document_of_a_packed_row_on_cuda_gives_its_logits_alone():
    _, auto = _pair()
    auto.eval()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 1024, (1, 300), generator=g).cuda(), torch.randint(0, 1024, (1, 212), generator=g).cuda()
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 300 + [1] * 212])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed, alone = auto(row, doc_ids=docs), auto(b)
    torch.testing.assert_close(packed[:, 300:].float(), alone.float(), atol=3e-2, rtol=3e-2)
