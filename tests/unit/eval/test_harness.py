"""KilnLM: lm-eval's three request types on Kiln's model, batched as one at a time, offline tasks end to end."""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance

from kiln.eval.harness import KilnLM
from kiln.model.generate import generate

from .conftest import TASKS


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [("def f(x):\n    return", " x"), ("", "import os"), ("class A:  ", "pass"), ("x = 1\n" * 40, "y = 2"),
         ("for i in range(10):", " print(i)")]


def test_loglikelihood_is_the_sum_of_the_continuations_log_probabilities(tiny):
    model, tok, _, _ = tiny
    lm = KilnLM(model, tok, batch_size=3)
    got = lm.loglikelihood(requests("loglikelihood", PAIRS))
    for (ctx, cont), (score, greedy) in zip(PAIRS, got):
        c, whole = lm._encode_pair(ctx, cont) if ctx else ([tok.eos_id], tok.encode(cont))
        ids = (c + whole)[-(lm.max_length + 1):]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), -1)  # (T, V)
        n = min(len(whole), len(ids) - 1)
        target = torch.tensor(ids[-n:])
        expect = float(logp[-n:].gather(1, target[:, None]).sum())
        assert score == pytest.approx(expect, abs=1e-4)
        assert greedy == bool((logp[-n:].argmax(-1) == target).all())
    # the 40-line context is longer than the model's 64 positions: kept to its last tokens, scored all the same
    assert math.isfinite(got[3][0]) and got[3][0] < 0
    assert got == KilnLM(model, tok, batch_size=1).loglikelihood(requests("loglikelihood", PAIRS))  # batching
    assert got[0] == lm.loglikelihood(requests("loglikelihood", PAIRS[:1]))[0]


def test_rolling_loglikelihood_predicts_every_token_once(tiny):
    model, tok, _, _ = tiny
    text = "def main():\n    parser = argparse.ArgumentParser()\n" * 6  # longer than one window of 64
    ids = tok.encode(text)
    assert len(ids) > 64
    lm = KilnLM(model, tok, batch_size=4)
    (total,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    # windows of 64 predictions, the first conditioned on EOS; each token predicted once
    expect, pos, inputs = 0.0, 0, [tok.eos_id, *ids]
    while pos < len(ids):
        n = min(64, len(ids) - pos)
        window = inputs[max(0, pos + n - 64):pos + n]  # the last window keeps a full context
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([window]))[0].float(), -1)
        target = torch.tensor(ids[pos:pos + n])
        expect += float(logp[-n:].gather(1, target[:, None]).sum())
        pos += n
    assert total == pytest.approx(expect, abs=1e-3)


def test_batched_generation_matches_greedy_decoding_one_prompt_at_a_time(tiny):
    model, tok, _, _ = tiny
    prompts = ["def f(x):\n    return", "import", "class Parser(object):\n    def __init__(self"]
    lm = KilnLM(model, tok, batch_size=3)
    got = lm.generate_until(requests("generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 8}) for p in prompts]))
    for prompt, text in zip(prompts, got):
        ids = generate(model, tok.encode(prompt), 8, temperature=0, vocab_size=tok.vocab_size)
        assert text == tok.decode(ids).split("\n\n")[0]
    # a stop string cuts the text; the EOS token stops too
    (cut,) = lm.generate_until(requests("generate_until", [(prompts[0], {"until": [got[0][:2]], "max_gen_toks": 8})]))
    assert cut == ""
    # any of the model's stop tokens (generation_config's eos_token_id list) ends a generation, left out of it
    ids = generate(model, tok.encode(prompts[0]), 8, temperature=0, vocab_size=tok.vocab_size)
    k = ids.index(ids[2])
    stopped = KilnLM(model, tok, batch_size=1, stop_ids=[ids[2]])
    (text,) = stopped.generate_until(requests("generate_until", [(prompts[0], {"until": ["\n\n"], "max_gen_toks": 8})]))
    assert text == tok.decode(ids[:k]).split("\n\n")[0]
    # and at its stop strings (generation_config's stop_strings), which cut the text as `until` strings do
    stop = tok.decode(ids[3:5])
    stopped = KilnLM(model, tok, batch_size=1, stop_strings=[stop])
    (text,) = stopped.generate_until(requests("generate_until", [(prompts[0], {"until": ["\n\n"], "max_gen_toks": 8})]))
    assert stop in got[0] and text == got[0].split(stop)[0]


def test_offline_tasks_of_each_kind(tiny, manager):
    from kiln.eval.tasks import run_tasks

    model, tok, _, _ = tiny
    out = run_tasks(KilnLM(model, tok, batch_size=8), TASKS, manager=manager, limit=5)
    scores = out["scores"]
    assert set(scores) == {"tiny_mc/acc", "tiny_mc/acc_norm", "tiny_ppl/word_perplexity", "tiny_ppl/bits_per_byte",
                           "tiny_gen/exact_match"}
    assert 0 <= scores["tiny_mc/acc"] <= 1 and scores["tiny_ppl/bits_per_byte"] > 0
    assert out["n_samples"] == {"tiny_mc": 5, "tiny_ppl": 5, "tiny_gen": 5}  # the budget


def test_a_task_whose_data_the_hub_cannot_give_is_a_data_error(tiny, tmp_path, monkeypatch):
    """Offline (or HF_HUB_OFFLINE=1), a task over a Hub dataset (hellaswag) ended `kiln eval --tasks` and a run's
    evaluation with datasets' ConnectionError traceback."""
    import datasets
    import huggingface_hub

    from kiln.errors import DataError
    from kiln.eval.tasks import run_tasks, task_manager

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as without network, at once
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "hub.yaml").write_text("task: tiny_hub\ndataset_path: kiln-test/no-such-dataset\ntest_split: test\n"
                                       "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                       "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: bits_per_byte\n")
    model, tok, _, _ = tiny
    with pytest.raises(DataError, match=r"lm-eval could not load the data of tiny_hub: .*--include-path"):
        run_tasks(KilnLM(model, tok), ["tiny_hub"], manager=task_manager([tmp_path], include_defaults=False),
                  limit=1)
