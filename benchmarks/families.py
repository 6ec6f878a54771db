"""Training speed of each native model family against the same model through `model.hf_class=auto`, one process.

    python benchmarks/families.py                                  # CPU, tiny, a few steps
    python benchmarks/families.py --size 124m --device cuda --batch 16 --seq 1024 --compile \
        --families qwen3,phi3 --json benchmarks/results/families_h100.json

For each family (a Hugging Face model_type Kiln holds natively: llama, qwen3, phi3, ...) it builds Kiln's
`Transformer` of `--size` in that family's layout (`LAYOUTS`, `layout`: Mistral a sliding window of half the row;
Qwen2 q/k/v biases; Qwen3 q/k norms; Phi-3 fused qkv_proj and gate_up_proj; Nemotron LayerNorm1p, a squared-ReLU
MLP and rotary embeddings on half of each head; Gemma 2 and 3 soft-caps, sandwich norms, local and global layers;
Mixtral, Qwen2-MoE and Qwen3-MoE experts routed as the released models route them, sized by `experts`) and
transformers' own class of the same shape with the same weights (mapped by kiln.model.hf), wraps the latter
in `kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains), and trains both through Kiln's Trainer
and loader on the same random tokens, as benchmarks/hf_auto.py does for Llama (its `run`: document masks,
bf16 autocast on CUDA, per-block compile as asked, --warmup then --steps timed steps). Prints one table, the
auto path's speed as a fraction of the native one's per family, and writes it to --json: the speed cells of
docs/models.md (kiln/model/families.py) come from it. The first losses of the two paths agree (the same function
of the same weights) as a check; a mixture of experts trains on its load-balancing loss on both paths (the losses
and speeds include it).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/families.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile
import time

import torch

from benchmarks.common import device_name, free, run_info, table, write_json
from benchmarks.hf_auto import add_run_args, run

# each family's layout on top of a named size: the ModelConfig fields that make it that family (`layout` adds those
# that depend on the size or the row)
LAYOUTS = {
    "llama": {},
    "mistral": {},  # a sliding window on every layer (layout)
    "qwen2": {"attention_bias": "qkv"},
    "qwen3": {"qk_norm": True},
    "phi3": {"fused_projections": True},
    # LayerNorm with its scale stored minus one, a squared-ReLU MLP (no gate: 4 d_model wide, as Nemotron-4 and
    # Minitron are, which holds the dense MLP's parameters), rotary embeddings on half of each head
    "nemotron": {"norm": "layernorm1p", "mlp": "relu2", "rotary_fraction": 0.5},
    # Gemma's options at their released values: caps, the query scale of the head width; local layers with a window
    # of half the row (Gemma 2: every second layer global, Gemma 3: every sixth, and q/k norms)
    "gemma2": {"norm": "rmsnorm1p", "mlp": "geglu", "sandwich_norm": True, "embed_scale": True, "attn_softcap": 50.0,
               "logit_softcap": 30.0},
    "gemma3_text": {"norm": "rmsnorm1p", "mlp": "geglu", "sandwich_norm": True, "embed_scale": True, "qk_norm": True,
                    "rope_local_theta": 10000.0},
    "mixtral": {},
    "qwen2_moe": {"attention_bias": "qkv"},
    "qwen3_moe": {"qk_norm": True},
}
GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6}
WINDOWED = ("mistral",)  # a sliding window of half the row on every layer (Mistral 7B v0.1: 4096 tokens)


def experts(kind: str, hidden: int) -> dict | None:
    """`kind`'s mixture of experts (model.moe) in place of a dense MLP `hidden` wide, None for a dense family: the
    released models' routing (experts, top-k, renormalised or not, shared expert, load-balancing weight) at a width
    meant to keep a 124m model on one 80 GB GPU at batch 16 x 1024 (Mixtral 531M parameters, Qwen2-MoE 361M,
    Qwen3-MoE 304M). Mixtral (8x7B): 8 experts of the dense MLP's width, top 2, renormalised, router_aux_loss_coef
    0.02. Qwen2-MoE (Qwen1.5-MoE-A2.7B): 16 experts of a quarter of it, top 4 as they are (norm_topk_prob false) and
    a gated shared expert of the full width (its 4 experts' worth), 0.001. Qwen3-MoE (Qwen3-30B-A3B): 32 experts of
    an eighth, top 8, renormalised, no shared expert, 0.001. Each token's routed experts are the dense MLP's width
    together (Mixtral: twice it)."""
    if kind == "mixtral":
        return {"n_experts": 8, "top_k": 2, "expert_hidden": hidden, "norm_topk": True, "aux_loss_coef": 0.02}
    if kind == "qwen2_moe":
        return {"n_experts": 16, "top_k": 4, "expert_hidden": max(1, hidden // 4), "norm_topk": False,
                "shared_expert_hidden": hidden, "aux_loss_coef": 0.001}
    if kind == "qwen3_moe":
        return {"n_experts": 32, "top_k": 8, "expert_hidden": max(1, hidden // 8), "norm_topk": True,
                "aux_loss_coef": 0.001}
    return None


def layout(kind: str, size, seq: int) -> dict:
    """The fields of `kind` on `size` (a ModelConfig) for rows of `seq` tokens."""
    fields = dict(LAYOUTS[kind])
    if kind in WINDOWED:
        fields["sliding_window"] = max(1, seq // 2)
    if kind == "nemotron":
        fields["ffn_hidden"] = 4 * size.d_model
    moe = experts(kind, size.mlp_hidden)
    if moe is not None:
        fields["moe"] = moe
    if kind in GLOBAL_EVERY:
        every = GLOBAL_EVERY[kind]
        fields.update(attn_scale_dim=size.head_dim, sliding_window=max(1, seq // 2),
                      full_attention_layers=[i for i in range(size.n_layers) if (i + 1) % every == 0] or None)
    return fields


def family_models(kind: str, cfg):
    """(Kiln's model, transformers' model of the same weights) of `cfg.model` in the layout of `kind`. A mixture of
    experts trains on its load-balancing loss on both: Kiln's always (model.moe.aux_loss_coef), transformers' with
    output_router_logits on, as its config.json must say for `model.hf_class=auto` (and the HF Trainer) to train it."""
    import transformers

    from kiln.model.hf import hf_config, to_hf_state_dict
    from kiln.model.hf_experts import stack_experts
    from kiln.model.llama import Transformer

    torch.manual_seed(0)
    native = Transformer(cfg.model)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model, dtype="float32"))
    # transformers holds each layer's experts stacked in memory, as Kiln does (its checkpoints: one per expert)
    hf.load_state_dict(stack_experts(to_hf_state_dict(native.state_dict(), tie_embeddings=False)), strict=True)
    hf.config.use_cache = False
    if cfg.model.moe is not None:
        hf.config.output_router_logits = True
    return native, hf


def aux_loss(model) -> float | None:
    """The mean load-balancing loss (unscaled) of the training steps `model` ran, None without a mixture of
    experts: it trained on aux_loss_coef times it (router_aux_loss_coef on the auto path)."""
    aux = getattr(model, "router_aux", None)
    mean = aux.take() if aux is not None else None
    return None if mean is None else mean.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama,qwen3,phi3", help=f"Comma-separated, of {', '.join(LAYOUTS)}.")
    ap.add_argument("--size", default="tiny", help="Kiln model size (tiny, 124m, 350m, 1b, ...).")
    add_run_args(ap)
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
        start = time.perf_counter()
        native, hf = family_models(kind, cfg)
        params = sum(p.numel() for p in native.parameters())
        with tempfile.TemporaryDirectory() as data:
            mine = {**run("native", native, cfg, args, device, f"{data}/native"), "aux_loss": aux_loss(native)}
            del native
            free()
            hf = HFCausalLM(hf, cfg.model)
            auto = {**run("auto", hf, cfg, args, device, f"{data}/auto"), "aux_loss": aux_loss(hf)}
            del hf
            free()
        for r in (mine, auto):
            rows.append({"family": kind, **r, "params": params,
                         "auto_over_native": auto["tokens_per_s"] / mine["tokens_per_s"]})
        seconds = time.perf_counter() - start
        print(f"{kind}: native {mine['tokens_per_s']:,.0f} tokens/s, auto {auto['tokens_per_s']:,.0f}; first losses "
              f"{mine['first_loss']:.6f} and {auto['first_loss']:.6f} ({seconds:.0f} s with building and compiling)",
              flush=True)
        # after each family: a run cut short by a time limit keeps the families it finished
        write_json(args.json, {**run_info(device, packages=("transformers",)), "args": vars(args), "rows": rows})

    print(f"{args.size}, batch {args.batch} x {args.seq} tokens, {device_name(device)}, compile={args.compile}, "
          f"ac={args.ac}, doc_mask={args.doc_mask}")
    print(table(rows, [("family", "family"), ("path", "name"), ("params", "params", ",d"),
                       ("tokens/s", "tokens_per_s", ",.0f"),
                       ("peak GiB", "peak_gib", ".2f"), ("first loss", "first_loss", ".4f"),
                       ("aux loss", "aux_loss", ".4f")]))
    for kind in kinds:
        ratio = next(r["auto_over_native"] for r in rows if r["family"] == kind)
        print(f"{kind}: auto / native {ratio:.2f}x")


if __name__ == "__main__":
    main()
