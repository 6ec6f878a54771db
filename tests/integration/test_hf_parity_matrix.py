"""The parity matrix: the families of causal LM Kiln trains, natively (the model_types of
kiln.model.hf.ARCHITECTURES: Llama, Mistral, Qwen2, Qwen3, Phi-3, Nemotron, ...) or through transformers
(`model.hf_class=auto`: dense, mixture-of-experts, Mamba and hybrid models; see hf_dirs.MATRIX), each as a tiny
random model in fp32 on the CPU. Imported, Kiln's logits are transformers', and two documents packed in a row
give the logits each gives alone; trained a step and exported, transformers' logits and greedy generation are
Kiln's (within 1e-5), and every JSON file of the source directory survives the export unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig, load_config
from kiln.model.generate import generate
from kiln.model.hf import ARCHITECTURES
from kiln.state.export import export_from
from kiln.state.weights import load_model
from kiln.train.run import run

from .hf_dirs import MATRIX, VOCAB, json_changes, write_corpus, write_matrix_dir

transformers = pytest.importorskip("transformers")
NATIVE = tuple(ARCHITECTURES)  # what `kiln train model.init_from=DIR` builds as Kiln's own model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("matrix")
    write_corpus(root / "corpus", 2)
    return root


def imported(src: Path, native: bool):
    """Kiln's model of `src` as `kiln train` builds it."""
    if native:
        from kiln.model.hf_import import load_init_weights, resolve_init_from
        from kiln.model.llama import Transformer

        cfg = resolve_init_from(ModelConfig(init_from=str(src)))
        model = Transformer(cfg)
        load_init_weights(model, cfg)
        return model.eval()
    from kiln.model.hf_auto import auto_config, build_auto

    return build_auto(auto_config(ModelConfig(init_from=str(src), hf_class="auto"))).eval()


def greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids` by n tokens, without the exported generation_config (its sampling
    settings and stop tokens, which Kiln's greedy decoding does not read: merged in, they would stop the text or
    keep a stop token out of it)."""
    hf.generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, bos_token_id=None,
                                                         pad_token_id=0)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n)
    return out[0, len(ids):].tolist()


def apart(model, x: torch.Tensor) -> None:
    """Two documents packed in one row (doc_ids) give the logits each gives alone; without doc_ids the second
    sees the first."""
    a, b = x[:1, :10], x[1:, :14]
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 10 + [1] * 14])
    packed = model(row, doc_ids=docs)
    torch.testing.assert_close(packed[:, :10], model(a), rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 10:], model(b), rtol=0, atol=1e-5)
    assert not torch.allclose(model(row)[:, 10:], model(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", list(MATRIX))
def test_parity(root, kind, tmp_path):
    native = kind in NATIVE
    src = write_matrix_dir(tmp_path / "src", kind)
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    source = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        model = imported(src, native)
        torch.testing.assert_close(model(x), source(input_ids=x).logits, rtol=0, atol=1e-5)
        apart(model, x)

    run_dir = run(load_config(None, [
        f"model.init_from={src}", *([] if native else ["model.hf_class=auto", "data.document_mask=split"]),
        f"data.sources=[{root / 'corpus'}]",
        f"data.cache_dir={root / 'cache'}", "data.workers=1", "data.val_fraction=0", "train.seq_len=32",
        "train.batch_size=2", "train.max_steps=1", "train.warmup_steps=0", "train.lr=1e-2", "train.device=cpu",
        "train.precision=fp32", "train.sample_tokens=0", f"train.run_dir={tmp_path / 'run'}", "checkpoint.every=0",
        "logging.console=false", "logging.plots=false", "train.compile=false"]))
    out = export_from(run_dir, tmp_path / "out")
    model, _ = load_model(run_dir)
    assert (type(model).__name__ == "Transformer") == native  # the run took the path the matrix names
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(x)
        assert (ours - source(input_ids=x).logits).abs().max() > 1e-4  # the step changed the model
        torch.testing.assert_close(hf(input_ids=x).logits, ours, rtol=0, atol=1e-5)
    prompt = x[0, :8].tolist()
    assert greedy(hf, prompt, 8) == generate(model, prompt, 8, temperature=0, top_k=None)
    assert json_changes(src, out) == {}
