"""Stop strings end sampling where transformers' StopStringCriteria ends it: at the token that completes one, across
tokens, with an overhang, inside one token, or begun in the prompt; never for one wholly in the prompt."""

import pytest
import torch

from kiln.data.prepare.tokenizer import train_bpe
from kiln.model.generate import generate
from kiln.model.stop_strings import StopStrings

TEXT = "xstop and stopper\n\nUser: hi <|im_end|> then def return aaa\n"


@pytest.fixture(scope="module")
def tok():
    return train_bpe([TEXT] * 40 + ["def f(x):\n    return x * 2\n"] * 30, 300,
                     specials=["<|endoftext|>", "<|im_end|>"])


@pytest.mark.parametrize("stop", ["stop", "\n\nUser:", "User:", "<|im_end|>", "> the", "aa", "xst", "ret"])
def test_where_sampling_stops_is_where_transformers_stops(tok, stop):
    from transformers import PreTrainedTokenizerFast
    from transformers.generation.stopping_criteria import StopStringCriteria

    ids = tok.encode(TEXT)
    theirs = StopStringCriteria(PreTrainedTokenizerFast(tokenizer_object=tok.tk), [stop])
    ours = StopStrings([stop], tok.decode)
    expected = [bool(theirs(torch.tensor([ids[:n]]), None)[0]) for n in range(1, len(ids) + 1)]
    assert [ours.ends(ids[:n]) for n in range(1, len(ids) + 1)] == expected
    assert any(expected)  # each stop string is in the text: its completing token is found


def test_sampling_ends_with_the_token_that_completes_a_stop_string_and_keeps_it(tok, repeating_model):
    ret = tok.encode(" return")
    assert len(ret) == 1
    model = repeating_model(ret[0])  # every step's most likely token is " return"
    prompt = tok.encode("def\n")

    def sample(*stops: str) -> str:
        return tok.decode(generate(model, prompt, 6, temperature=0, stop_strings=StopStrings(stops, tok.decode)))

    assert sample() == " return" * 6
    assert sample("rn ret") == " return return"  # across two tokens, the second kept whole (its "urn" too)
    assert sample("\n ret") == " return"  # begun in the prompt
    assert sample("def") == " return" * 6  # in the prompt alone: no stop
    assert sample("nowhere", "turn return return") == " return" * 3
