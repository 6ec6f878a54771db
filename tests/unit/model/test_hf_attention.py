"""kiln.model.hf_attention: the native model's attention inside transformers models (model.hf_class=auto), and
the models that keep their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model import masks
from kiln.model.hf_attention import MASK_KEY, NotPlain
from kiln.model.hf_auto import auto_config, build_auto
from kiln.model.hf_packing import doc_positions

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=48)


def auto_model(root: Path, kind: str, **fields):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **{**COMMON, **fields})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / kind)
    return build_auto(auto_config(ModelConfig(init_from=str(root / kind), hf_class="auto")))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_second_document_of_a_packed_row_gives_its_logits_alone(tmp_path, kind):
    model = auto_model(tmp_path, kind).eval()
    assert model.own_attention is None and model.base.config._attn_implementation == "kiln"
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 64, (1, 9), generator=g), torch.randint(0, 64, (1, 11), generator=g)
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 9 + [1] * 11])
    with torch.no_grad():
        packed = model(row, doc_ids=docs)
        torch.testing.assert_close(packed[:, 9:], model(b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, :9], model(a), atol=1e-5, rtol=1e-5)
        assert (model(row)[:, 9:] - model(b)).abs().max() > 1e-3  # without doc_ids: one sequence
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()  # its own attention
        torch.testing.assert_close(model(row), ref(input_ids=row).logits, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "out")  # the attention is the run's choice, not written for other programs
    assert "kiln" not in json.loads((tmp_path / "out" / "config.json").read_text()).values()


def test_a_sliding_window_joins_the_document_mask(tmp_path):
    model = auto_model(tmp_path, "mistral", sliding_window=4).eval()
    assert model.own_attention is None and model.window == 4
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mistral").eval()
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 64, (1, 9), generator=g), torch.randint(0, 64, (1, 11), generator=g)
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 9 + [1] * 11])
    with torch.no_grad():
        alone = model(b)
        torch.testing.assert_close(alone, ref(input_ids=b).logits, atol=1e-5, rtol=1e-5)  # its window of 4
        ref.config.sliding_window = None
        assert (alone - ref(input_ids=b).logits).abs().max() > 1e-3  # control: the window matters here
        packed = model(row, doc_ids=docs)
        torch.testing.assert_close(packed[:, 9:], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, :9], model(a), atol=1e-5, rtol=1e-5)


def test_soft_capped_scores_and_logits_with_local_layers_run_as_the_model_runs_them(tmp_path):
    model = auto_model(tmp_path, "gemma2", sliding_window=4, attn_logit_softcapping=0.5,
                       final_logit_softcapping=0.5)  # local layers of 4 tokens; caps low enough to change every score
    assert model.own_attention is None and model.own_head is None and (model.window, model.logit_cap) == (4, 0.5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gemma2")
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 64, (1, 8), generator=g), torch.randint(0, 64, (1, 6), generator=g)
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 8 + [1] * 6])
    targets = torch.randint(0, 64, (1, 14), generator=g)
    with torch.no_grad():
        logits = ref(input_ids=row).logits
        torch.testing.assert_close(model(row), logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(row, doc_ids=docs)[:, 8:], model(b), atol=1e-5, rtol=1e-5)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model(row, targets), want, atol=1e-5, rtol=1e-5)  # the chunked loss, capped


def test_a_layer_that_keeps_the_keywords_is_refused_not_run_without_its_mask(tmp_path):
    model = auto_model(tmp_path, "nemotron", partial_rotary_factor=0.5)  # NemotronAttention passes no **kwargs on
    assert "does not hand the model's keywords on" in model.own_attention
    assert model.base.config._attn_implementation != "kiln"
    llama = auto_model(tmp_path, "llama")
    with pytest.raises(NotPlain, match="does not hand"):  # Kiln's function never runs without its mask argument
        llama.hf(input_ids=torch.randint(0, 64, (1, 5)))


def test_a_model_whose_attention_transformers_cannot_switch_says_it_keeps_its_own(tmp_path):
    torch.manual_seed(0)  # FalconAttention has no AttentionInterface: the switch only warns
    config = transformers.AutoConfig.for_model("falcon", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, max_position_embeddings=48)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "falcon")
    model = build_auto(auto_config(ModelConfig(init_from=str(tmp_path / "falcon"), hf_class="auto")))
    assert "cannot change its attention" in model.own_attention
    assert model.describe_fast_path().startswith("attention: the model's own")


@pytest.mark.slow
def test_a_llama_decoder_layer_compiles_in_one_graph(tmp_path):
    model = auto_model(tmp_path, "llama")
    h = torch.randn(2, 12, 32, requires_grad=True)
    docs = torch.tensor([[0] * 5 + [1] * 7] * 2)
    pos = doc_positions(docs)
    cos_sin = model.decoder.rotary_emb(h, pos)
    for mask in (None, masks.dense_mask(docs, h.device)):
        explained = torch._dynamo.explain(model.layers[0])(h, attention_mask=None, position_embeddings=cos_sin,
                                                            position_ids=pos, use_cache=False, **{MASK_KEY: mask})
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
