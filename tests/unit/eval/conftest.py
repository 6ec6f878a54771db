"""A tiny random model with a real BPE tokenizer, its Hugging Face export, and lm-eval task YAMLs over local
JSONL files (no Hub): a multiple-choice task, a rolling-loglikelihood task and a generation task."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")


def write_tasks(root: Path, texts: list[str]) -> Path:
    """Task YAMLs and their JSONL data under root/tasks."""
    tasks = root / "tasks"
    tasks.mkdir()
    rows = [{"question": f"def f{i}(x):\n    return", "choices": [" x", " None", " self.x", " 1"], "answer": i % 4}
            for i in range(12)]
    (tasks / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tasks / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "mc.yaml").write_text(
        "task: tiny_mc\n" + data.format(tasks / "mc.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "ppl.yaml").write_text(
        "task: tiny_ppl\n" + data.format(tasks / "docs.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n")
    (tasks / "gen.yaml").write_text(
        "task: tiny_gen\n" + data.format(tasks / "mc.jsonl") + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: ' x'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
        "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n")
    return tasks


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model, tokenizer, export directory, task directory)."""
    from kiln.config import ModelConfig
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.llama import Transformer
    from kiln.state.export import export_hf

    root = tmp_path_factory.mktemp("lm_eval")
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()[:40000]
    tok = train_bpe(text.split("\n\n"), 320, ["<|endoftext|>"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the initialisation, so scores differ between choices
            p.copy_(torch.randn_like(p) * 0.1)
    export_hf(model, cfg, tok, root / "export")
    return model, tok, root / "export", write_tasks(root, text.split("\n\n")[:6])


@pytest.fixture(scope="session")
def manager(tiny):
    from kiln.eval.tasks import task_manager

    return task_manager([tiny[3]], include_defaults=False)
