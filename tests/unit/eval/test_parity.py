"""Parity with lm-eval's own Hugging Face backend (`hf` on the exported directory): the same log-likelihoods,
greedy flags, generations and task scores."""

from __future__ import annotations

import pytest

from kiln.eval.harness import KilnLM

from .conftest import TASKS
from .test_harness import PAIRS, requests

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_lm(tiny):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny[2]), batch_size=4, device="cpu", dtype="float32")


def test_requests_score_as_the_hf_backend_scores_them(tiny, hf_lm):
    model, tok, _, _ = tiny
    lm = KilnLM(model, tok, batch_size=4)
    ours, theirs = (m.loglikelihood(requests("loglikelihood", PAIRS)) for m in (lm, hf_lm))
    for (a, ga), (b, gb) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    docs = [("def main():\n    parser = argparse.ArgumentParser()\n" * 6,), ("x = 1",)]
    ours, theirs = (m.loglikelihood_rolling(requests("loglikelihood_rolling", docs)) for m in (lm, hf_lm))
    assert ours == pytest.approx(theirs, abs=1e-3)
    gen = [("def f(x):\n    return", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}),
           ("import", {"until": ["\n"], "max_gen_toks": 5, "do_sample": False})]
    assert lm.generate_until(requests("generate_until", gen)) == hf_lm.generate_until(requests("generate_until", gen))


@pytest.mark.slow
def test_task_scores_equal_the_hf_backends(tiny, manager, hf_lm):
    from kiln.eval.tasks import run_tasks

    model, tok, _, _ = tiny
    ours = run_tasks(KilnLM(model, tok, batch_size=4), TASKS, manager=manager)["scores"]
    theirs = run_tasks(hf_lm, TASKS, manager=manager)["scores"]
    assert ours.keys() == theirs.keys()
    for key in ours:  # accuracies exactly; perplexities to float precision
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert ours["tiny_mc/acc"] == theirs["tiny_mc/acc"]


def test_an_architecture_the_native_model_does_not_import_runs_through_transformers(tiny, manager, tmp_path):
    """A GPT-2 directory: `kiln eval --tasks` runs it as model.hf_class=auto trains it, and scores as `hf` does."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    from kiln.eval.score import score_target
    from kiln.eval.tasks import run_tasks

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    tiny[1].save(tmp_path / "gpt2" / "tokenizer.json")
    ours = score_target(tmp_path / "gpt2", ["tiny_mc", "tiny_ppl"], include_path=[tiny[3]], device="cpu")
    assert ours["kind"] == "hf"
    theirs = run_tasks(HFLM(pretrained=str(tmp_path / "gpt2"), batch_size=4, device="cpu", dtype="float32"),
                       ["tiny_mc", "tiny_ppl"], manager=manager)["scores"]
    assert {k: v for k, v in ours["scores"].items() if not k.endswith("_stderr")} == pytest.approx(theirs, rel=1e-5)
