"""Sampling: argument checks, greedy at temperature 0, and never an id the tokenizer does not have."""

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.generate import generate, start_ids
from kiln.model.llama import Transformer

TOKENS, PADDED = 300, 320  # the tokenizer's vocabulary, and the model's rounded up to a multiple of 64


@pytest.fixture(scope="module")
def padded_model() -> Transformer:
    """A model whose padding rows (ids 300..319) would win every step: the real rows give logit 0."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=PADDED, tie_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight[:TOKENS] = 0
        model.lm_head.weight[TOKENS:] = torch.randn(PADDED - TOKENS, model.cfg.d_model) * 100
    return model


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (1.0, 5), (0.8, 50)])
def test_ids_beyond_the_tokenizer_are_never_sampled(padded_model, temperature, top_k):
    unmasked = generate(padded_model, [1, 2, 3], 16, temperature, top_k, seed=0)
    assert max(unmasked) >= TOKENS  # the padding rows do win without the tokenizer's size
    out = generate(padded_model, [1, 2, 3], 16, temperature, top_k, seed=0, vocab_size=TOKENS)
    assert len(out) == 16 and max(out) < TOKENS


def test_temperature_zero_is_greedy_whatever_the_seed(padded_model):
    a = generate(padded_model, [5, 6], 8, temperature=0, seed=1, vocab_size=TOKENS)
    b = generate(padded_model, [5, 6], 8, temperature=0, seed=2, vocab_size=TOKENS)
    assert a == b


def test_a_vanishing_temperature_is_greedy():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=PADDED)).eval()
    greedy = generate(model, [5, 6], 8, temperature=0)
    assert generate(model, [5, 6], 8, temperature=1e-40, seed=3) == greedy


@pytest.mark.parametrize("kwargs,message", [({"temperature": -0.5}, "temperature must be 0"),
                                            ({"temperature": float("nan")}, "temperature must be 0"),
                                            ({"top_k": -1}, "top_k must be 0 or more")])
def test_bad_sampling_arguments_are_refused(padded_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(padded_model, [1], 4, **kwargs)


def test_an_empty_prompt_starts_from_eos_or_bos():
    from kiln.data.prepare.tokenizer import Tokenizer, train_bpe

    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 280)
    assert start_ids(tok, "def") == tok.encode("def") != []
    assert start_ids(tok, "") == [tok.eos_id]
    bare = Tokenizer(tok.tk, eos_token=None)
    with pytest.raises(ValueError, match="the tokenizer has none"):
        start_ids(bare, "")


def test_top_p_keeps_the_most_likely_tokens_and_a_repetition_penalty_turns_greedy_away(repeating_model):
    """A model that always favours token 7: a small top_p samples it alone; a strong repetition penalty (as
    generation_config.json's repetition_penalty) makes greedy decoding leave it once it is in the text."""
    model = repeating_model(7)  # its logits: 64 for token 7, 0 for the 319 others; at temperature 11, 7 has p ~ 1/2
    assert generate(model, [1], 8, temperature=11.0, top_k=None, top_p=0.4, seed=0) == [7] * 8
    assert generate(model, [1], 8, temperature=11.0, top_k=None, seed=0) != [7] * 8  # without: others too
    with torch.no_grad():
        model.lm_head.weight[9] = 0.5  # the runner-up: logit 32
    assert generate(model, [1], 3, temperature=0) == [7, 7, 7]
    assert generate(model, [1], 3, temperature=0, repetition_penalty=3.0) == [7, 9, 7]  # 64/3 < 32, 32/3 < 64/3
    with pytest.raises(ValueError, match="top_p must be above 0"):
        generate(model, [1], 2, top_p=0)
