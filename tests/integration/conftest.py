"""Shared by the end-to-end tests: a small corpus of Python standard library source, the overrides of a tiny
run on the CPU, the losses a run logged, and a random Llama in the Hugging Face layout to start from."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from ..conftest import kiln_here  # noqa: F401 - the end-to-end tests' in-process kiln


def stdlib_corpus(directory: Path, documents: int, modules: int = 40) -> Path:
    """Write `documents` text files of 2 kB each, cut from the first `modules` stdlib modules, into `directory`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:modules])
    for i in range(documents):
        (directory / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    return directory


def losses(run_dir: Path, event: str = "train") -> dict[int, float]:
    """{step: loss} of each training step (event "train") or evaluation ("eval": val_loss) in metrics.jsonl."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "loss" if event == "train" else "val_loss"
    return {r["step"]: r[key] for r in recs if r["event"] == event}


def tiny_cpu_run(cache: Path, corpus: Path, steps: int, every: int, *extra: str, batch_size: int | None = None,
                 vocab_size: int = 512) -> list[str]:
    """`kiln train` overrides of a short run of the tiny model on the CPU over `corpus`: a checkpoint every
    `every` steps, every step logged to metrics.jsonl, no console and no plots; `batch_size` (None: the default) and
    `vocab_size` as given, then the overrides `extra` (a later override of a key wins)."""
    return ["model.size=tiny", "train.seq_len=32", f"train.max_steps={steps}", "train.warmup_steps=2",
            "train.eval_every=0", "train.eval_batches=2", "train.sample_tokens=0", "train.device=cpu",
            "train.precision=fp32", f"checkpoint.every={every}", "logging.every=1", "logging.console=false",
            "logging.plots=false",  # 1-2 s of matplotlib at each run's end; test_eval_early_stop draws them
            f"data.sources=[{corpus}]", "data.val_fraction=0.1", f"data.vocab_size={vocab_size}",
            f"data.cache_dir={cache}", *([f"train.batch_size={batch_size}"] if batch_size is not None else []),
            *extra]


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    """A directory with `model/`, a random 2-layer Llama saved by transformers with a BPE tokenizer.json of 512
    tokens, and `corpus/`, seven stdlib modules; runs that share its `cache/` prepare the corpus once."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kiln.data.prepare.tokenizer import train_bpe

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("hf")
    texts = [(stdlib / n).read_text() for n in ("argparse.py", "textwrap.py", "difflib.py")]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    train_bpe(texts, 512).save(root / "model" / "tokenizer.json")
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("argparse.py", "textwrap.py", "difflib.py", "csv.py", "shlex.py", "string.py", "heapq.py"):
        (corpus / name).write_text((stdlib / name).read_text())
    return root
