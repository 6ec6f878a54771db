"""Training speed of each native model family against the same model through `model.hf_class=auto`, one process.

    python benchmarks/families.py                                  # CPU, tiny, a few steps
    python benchmarks/families.py --size 124m --device cuda --batch 16 --seq 1024 --compile \
        --families qwen3,phi3 --json benchmarks/results/families_h100.json

For each family (a Hugging Face model_type Kiln holds natively: llama, qwen3, phi3, ...) it builds Kiln's
`Transformer` of `--size` in that family's layout (Qwen3: q/k norms; Phi-3: fused qkv_proj and gate_up_proj)
and transformers' own class of the same shape with the same weights (mapped by kiln.model.hf), wraps the latter
in `kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains), and trains both through Kiln's Trainer
and loader on the same random tokens, as benchmarks/hf_auto.py does for Llama (its `run`: document masks,
bf16 autocast on CUDA, per-block compile as asked, --warmup then --steps timed steps). Prints one table, the
auto path's speed as a fraction of the native one's per family, and writes it to --json: the speed cells of
docs/models.md (kiln/model/families.py) come from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/families.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile

import torch

from benchmarks.common import device_name, free, run_info, table, write_json
from benchmarks.hf_auto import run

# each family's layout on top of a named size: the ModelConfig fields that make it that family
LAYOUTS = {
    "llama": {},
    "qwen3": {"qk_norm": True},
    "phi3": {"fused_projections": True},
    # Gemma's options at their released values: caps, the query scale of the head width; local layers with a window
    # of half the row (Gemma 2: every second layer global, Gemma 3: every sixth, and q/k norms)
    "gemma2": {"norm": "rmsnorm1p", "mlp": "geglu", "sandwich_norm": True, "embed_scale": True, "attn_softcap": 50.0,
               "logit_softcap": 30.0},
    "gemma3_text": {"norm": "rmsnorm1p", "mlp": "geglu", "sandwich_norm": True, "embed_scale": True, "qk_norm": True,
                    "rope_local_theta": 10000.0},
}
GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6}


def layout(kind: str, size, seq: int) -> dict:
    """The fields of `kind` on `size` (a ModelConfig) for rows of `seq` tokens."""
    if kind not in GLOBAL_EVERY:
        return LAYOUTS[kind]
    every = GLOBAL_EVERY[kind]
    return {**LAYOUTS[kind], "attn_scale_dim": size.head_dim, "sliding_window": max(1, seq // 2),
            "full_attention_layers": [i for i in range(size.n_layers) if (i + 1) % every == 0] or None}


def family_models(kind: str, cfg):
    """(Kiln's model, transformers' model of the same weights) of `cfg.model` in the layout of `kind`."""
    import transformers

    from kiln.model.hf import hf_config, to_hf_state_dict
    from kiln.model.llama import Transformer

    torch.manual_seed(0)
    native = Transformer(cfg.model)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model, dtype="float32"))
    hf.load_state_dict(to_hf_state_dict(native.state_dict(), tie_embeddings=False), strict=True)
    hf.config.use_cache = False
    return native, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama,qwen3,phi3", help=f"Comma-separated, of {', '.join(LAYOUTS)}.")
    ap.add_argument("--size", default="tiny", help="Kiln model size (tiny, 124m, 350m, 1b, ...).")
    ap.add_argument("--device", default="cpu", help="cpu or cuda.")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="Timed steps.")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed steps first (compilation included).")
    ap.add_argument("--vocab", type=int, default=None, help="Vocabulary (default: the size's, else 512).")
    ap.add_argument("--compile", action="store_true", help="Per-block torch.compile on both (kiln.parallel.compile).")
    ap.add_argument("--ac", default="none", choices=["none", "selective", "full"], help="Activation checkpointing.")
    ap.add_argument("--no-doc-mask", dest="doc_mask", action="store_false", help="One sequence per row.")
    ap.add_argument("--json", default=None, help="Write the rows and the machine to this file.")
    args = ap.parse_args()
    kinds = [k for k in args.families.split(",") if k]
    unknown = [k for k in kinds if k not in LAYOUTS]
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose from {', '.join(LAYOUTS)}")

    from kiln.config import ModelConfig, RunConfig
    from kiln.model.hf_auto import HFCausalLM

    device = torch.device(args.device)
    size = ModelConfig(size=args.size)
    rows = []
    for kind in kinds:
        cfg = RunConfig.model_validate({
            "model": {"size": args.size, "vocab_size": args.vocab or size.vocab_size or 512,
                      "max_seq_len": max(size.max_seq_len, args.seq), "tie_embeddings": False,
                      "hf_model_type": kind, **layout(kind, size, args.seq)},
            "train": {"batch_size": args.batch, "seq_len": args.seq, "lr": 1e-4, "warmup_steps": 0,
                      "precision": "bf16" if device.type == "cuda" else "fp32"}})
        native, hf = family_models(kind, cfg)
        with tempfile.TemporaryDirectory() as data:
            mine = run("native", native, cfg, args, device, f"{data}/native")
            del native
            free()
            auto = run("auto", HFCausalLM(hf, cfg.model), cfg, args, device, f"{data}/auto")
            del hf
            free()
        for r in (mine, auto):
            rows.append({"family": kind, **r, "auto_over_native": auto["tokens_per_s"] / mine["tokens_per_s"]})

    print(f"{args.size}, batch {args.batch} x {args.seq} tokens, {device_name(device)}, compile={args.compile}, "
          f"ac={args.ac}, doc_mask={args.doc_mask}")
    print(table(rows, [("family", "family"), ("path", "name"), ("tokens/s", "tokens_per_s", ",.0f"),
                       ("peak GiB", "peak_gib", ".2f"), ("first loss", "first_loss", ".4f")]))
    for kind in kinds:
        ratio = next(r["auto_over_native"] for r in rows if r["family"] == kind)
        print(f"{kind}: auto / native {ratio:.2f}x")
    write_json(args.json, {**run_info(device, packages=("transformers",)), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
