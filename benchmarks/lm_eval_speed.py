"""lm-evaluation-harness on Kiln's adapter against lm-eval's own Hugging Face backend: same model, same tasks.

    python benchmarks/lm_eval_speed.py                                   # CPU, tiny, fp32
    python benchmarks/lm_eval_speed.py --size 124m --device cuda --examples 500 --json out.json

Builds Kiln's `Transformer` of `--size` with random weights and a byte-level BPE trained on the Python
standard library, exports it in the Hugging Face layout (kiln export), and writes two tasks over local
JSONL files: a four-way multiple choice (loglikelihood: the next line of a standard library file among
four) and a perplexity task (loglikelihood_rolling over whole files). Runs them through
`kiln.eval.harness.KilnLM` on the native model and through `lm_eval.models.huggingface.HFLM` (`--model
hf`) on the export, with the same batch size, device and dtype, and prints the seconds of each, Kiln's
speed-up, and whether the scores agree (exactly for accuracies; to 1e-4 relative for perplexities, in
fp32). Writes the numbers as JSON with --json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/lm_eval_speed.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import random
import sysconfig
import tempfile

import torch

from benchmarks.common import device, free, run_info, table, timed, write_json

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""


def write_tasks(root: Path, examples: int, docs: int, seed: int = 0) -> list[str]:
    """Task YAMLs and their JSONL data under `root`: bench_mc (next line among four) and bench_ppl."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    rng = random.Random(seed)
    lines = [ln.rstrip() for f in files[:60] for ln in f.read_text(errors="replace").splitlines() if len(ln) > 24]
    rows = []
    for _ in range(examples):
        j = rng.randrange(len(lines) - 1)
        wrong = rng.sample(lines, 3)
        choices = [lines[j + 1], *wrong]
        rng.shuffle(choices)
        answer = choices.index(lines[j + 1])
        rows.append({"context": lines[j], "choices": ["\n" + c for c in choices], "answer": answer})
    (root / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    texts = [f.read_text(errors="replace")[:6000] for f in files[60:60 + docs]]
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    (root / "mc.yaml").write_text(TASK.format(name="bench_mc", data=root / "mc.jsonl") +
                                  "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
                                  "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
                                  "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
                                  "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")
    (root / "ppl.yaml").write_text(TASK.format(name="bench_ppl", data=root / "docs.jsonl") +
                                   "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                                   "metric_list:\n  - {metric: word_perplexity, aggregation: weighted_perplexity, "
                                   "higher_is_better: false}\n  - {metric: bits_per_byte, aggregation: "
                                   "bits_per_byte, higher_is_better: false}\n")
    return ["bench_mc", "bench_ppl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", help="Kiln model size (tiny, 124m, 350m, 1b, ...).")
    ap.add_argument("--device", default="cpu", help="cpu or cuda.")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA, else fp32.")
    ap.add_argument("--batch", type=int, default=16, help="Requests per forward pass, both backends.")
    ap.add_argument("--examples", type=int, default=64, help="Multiple-choice questions (four requests each).")
    ap.add_argument("--docs", type=int, default=8, help="Documents of the perplexity task.")
    ap.add_argument("--seq", type=int, default=512, help="The model's context (max_seq_len).")
    ap.add_argument("--vocab", type=int, default=2048, help="Vocabulary of the BPE trained here.")
    ap.add_argument("--json", default=None, help="Write the numbers here.")
    args = ap.parse_args()

    from lm_eval.models.huggingface import HFLM

    from kiln.config import ModelConfig
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.eval.harness import KilnLM
    from kiln.eval.tasks import run_tasks, task_manager
    from kiln.model.llama import Transformer
    from kiln.state.export import export_hf

    dev = device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if dev.type == "cuda" else "fp32")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:40]]
    tok = train_bpe(texts, args.vocab, ["<|endoftext|>"])
    torch.manual_seed(0)
    size = ModelConfig(size=args.size)
    cfg = size.model_copy(update={"vocab_size": -(-tok.vocab_size // 64) * 64, "max_seq_len": args.seq})
    model = Transformer(cfg).eval()
    with tempfile.TemporaryDirectory(prefix="kiln-lm-eval-") as tmp:
        root = Path(tmp)
        export_hf(model, cfg, tok, root / "export", dtype="bf16" if dtype == "bf16" else "fp32")
        names = write_tasks(root, args.examples, args.docs)
        manager = task_manager([root], include_defaults=False)
        model = model.to(dev, torch.bfloat16 if dtype == "bf16" else torch.float32)
        backends = {"kiln": lambda: KilnLM(model, tok, batch_size=args.batch),
                    "hf": lambda: HFLM(pretrained=str(root / "export"), batch_size=args.batch, device=str(dev),
                                       dtype="bfloat16" if dtype == "bf16" else "float32", max_length=args.seq)}
        rows, scores = [], {}
        for name, make in backends.items():
            lm = make()
            run_tasks(lm, names, manager=manager, limit=4)  # warm-up: allocator, kernels, task building
            seconds, out = timed(lambda lm=lm: run_tasks(lm, names, manager=manager), dev)
            scores[name] = out["scores"]
            requests = args.examples * 4 + args.docs
            rows.append({"backend": name, "seconds": seconds, "requests_per_s": requests / seconds,
                         **{k: v for k, v in out["scores"].items()}})
            del lm
            free()
    keys = sorted(scores["kiln"])
    agree = {k: (scores["kiln"][k] == scores["hf"][k] if k.endswith(("acc", "acc_norm"))
                 else abs(scores["kiln"][k] - scores["hf"][k]) <= 1e-4 * abs(scores["hf"][k])) for k in keys}
    print(f"{args.size}, {dtype} on {dev}: {args.examples} questions x 4 choices, {args.docs} documents, "
          f"batch {args.batch}, context {args.seq}")
    print(table(rows, [("backend", "backend"), ("seconds", "seconds", ".2f"), ("requests/s", "requests_per_s", ".1f"),
                       *((k, k, ".4f") for k in keys)]))
    speedup = rows[1]["seconds"] / rows[0]["seconds"]
    print(f"kiln / hf: {speedup:.2f}x faster; scores agree: "
          + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in agree.items()))
    write_json(args.json, {**run_info(dev, ["lm_eval", "transformers"], size=args.size, dtype=dtype,
                                      batch=args.batch, examples=args.examples, docs=args.docs, seq=args.seq),
                           "rows": rows, "speedup": speedup, "agree": agree})
    if dtype == "fp32" and not all(agree.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
