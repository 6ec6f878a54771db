"""kiln.model.hf_packing: on the auto path a model with recurrent layers (a tiny Nemotron-H, Mamba2 + attention,
built from its config on the CPU) gives the second document of a packed row the logits of that document alone:
each document runs as its own sequence, since transformers' PyTorch scan takes no document boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.model.hf_auto import auto_config, build_auto
from kiln.model.hf_packing import merge_documents, split_documents

transformers = pytest.importorskip("transformers")

NEMOTRON_H = dict(vocab_size=64, hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp"],
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, ssm_state_size=8,
                  mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=8, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=1, pad_token_id=0)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)


def auto_model(root: Path, kind: str, fields: dict):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **fields)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / kind)
    return build_auto(auto_config(ModelConfig(init_from=str(root / kind), hf_class="auto")))


def test_split_then_merge_puts_every_position_back():
    tokens = torch.arange(2 * 12).view(2, 12)
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])  # a row's last document goes on in the next
    rows, seg, pos = split_documents(tokens, docs)
    assert rows.shape == (4, 12)  # four documents, the longest 12 tokens
    assert rows[1, :4].tolist() == [5, 6, 7, 8] and rows[3].tolist() == list(range(12, 24))
    logits = rows[..., None].float() * torch.ones(3)  # a "model" whose logits show the token at each position
    assert torch.equal(merge_documents(logits, seg, pos)[..., 0], tokens.float())


def test_second_document_of_a_packed_row_equals_it_alone_through_mamba_layers(tmp_path):
    model = auto_model(tmp_path, "nemotron_h", NEMOTRON_H).eval()
    assert "NemotronHMamba2Mixer" in model.recurrent and model.split_documents
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(2, 64, (1, 10), generator=g), torch.randint(2, 64, (1, 6), generator=g)
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 10 + [1] * 6])
    with torch.no_grad():
        packed = model(row, doc_ids=docs)
        torch.testing.assert_close(packed[:, 10:], model(b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, :10], model(a), atol=1e-5, rtol=1e-5)
        assert (model(row)[:, 10:] - model(b)).abs().max() > 1e-2  # one sequence: the state carries over
    targets = torch.cat([row[:, 1:], torch.full((1, 1), -100)], 1)
    model.train()
    loss = model(row, targets, docs)
    loss.backward()  # gradients flow through the split rows
    want = F.cross_entropy(packed.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_an_attention_model_keeps_its_packed_rows(tmp_path):
    model = auto_model(tmp_path, "llama", LLAMA)
    assert model.recurrent == [] and not model.split_documents  # position_ids keep its documents apart


def test_a_model_that_cannot_keep_documents_apart_is_refused_unless_split_is_chosen(tmp_path):
    from kiln.config import DataConfig
    from kiln.errors import ConfigError
    from kiln.model.hf_packing import check_packing

    model = auto_model(tmp_path, "nemotron_h", NEMOTRON_H)
    with pytest.raises(ConfigError, match=r"NemotronHForCausalLM cannot keep the documents .*Mamba2Mixer.*"
                                          r"data.document_mask=split"):
        check_packing(model, DataConfig(document_mask=True))
    assert "Mamba2Mixer" in check_packing(model, DataConfig(document_mask="split"))


def test_a_model_whose_masks_ignore_the_positions_keeps_its_rows_packed_by_a_document_mask(monkeypatch):
    """transformers 5.17's Falcon builds its mask without the position ids (as the patch below calls it): each
    document ran as a row of its own, padded to the longest (at 16 x 1024 tokens, 4 documents a row: 0.03x the
    native speed in 10x the memory). Given Kiln's (B, 1, T, T) document mask as its attention mask, the rows stay
    packed and each document still gets the logits it has alone."""
    from transformers.models.falcon import modeling_falcon

    from kiln.model.hf_auto import HFCausalLM

    build_mask = modeling_falcon.create_causal_mask
    monkeypatch.setattr(modeling_falcon, "create_causal_mask",
                        lambda *a, position_ids=None, **kw: build_mask(*a, **kw))
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       ffn_hidden_size=64, max_position_embeddings=64, use_cache=False)
    model = HFCausalLM(transformers.FalconForCausalLM(config), ModelConfig(d_model=32, n_layers=2, n_heads=2,
                                                                           vocab_size=64, max_seq_len=64))
    assert model.own_attention is not None  # no AttentionInterface: Falcon keeps its own
    assert not model.split_documents and model.document_masks
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(2, 64, (1, 9), generator=g), torch.randint(2, 64, (1, 7), generator=g)
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 9 + [1] * 7])
    model.eval()
    with torch.no_grad():
        packed = model(row, doc_ids=docs)
        torch.testing.assert_close(packed, torch.cat([model(a), model(b)], 1), atol=1e-5, rtol=1e-5)
        assert (model(row)[:, 9:] - model(b)).abs().max() > 1e-2  # without documents the second sees the first
