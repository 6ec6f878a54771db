"""Training speed of each family that trains only through `model.hf_class=auto` (GPT-2, Phi, OLMo, Falcon, BLOOM,
...) against the native Llama of the same size, one process.

    python benchmarks/generic_families.py                          # CPU, tiny, two families, a few steps
    python benchmarks/generic_families.py --size 124m --device cuda --batch 16 --seq 1024 --vocab 32000 --compile \
        --families all --time-limit 540 --json benchmarks/results/generic_families_124m_h100.json

First Kiln's native Llama of `--size` (the reference), then for each family of --families (`GENERIC`: a
Hugging Face model_type Kiln has no native model for) transformers' own class built locally from a config of the
same width, depth, heads, vocabulary and row length in that family's keys and layout (`generic_config`: its own
names for them, learned position tables at least a row long, its partial rotary embeddings, plain or gated MLPs of
the same parameters, multi-query attention where the released models have it; no dropout), wrapped in
`kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains) and trained by Kiln's Trainer and loader on
the same random tokens as the reference, as benchmarks/families.py trains each native family beside its generic
path (benchmarks/hf_auto.py's `run`: document masks, bf16 autocast on CUDA, per-block compile as asked, --warmup
then --steps timed steps). Prints one table: tokens/s, MFU (on a GPU of kiln.plan.gpus' table), peak memory and
each family's speed as a fraction of the native Llama's, with the parts of the native path each family runs on
(`describe_fast_path`). A family that fails to build or train gets a row with its error and the next one runs;
with --time-limit no family starts once that many seconds have passed. --json is rewritten after each family:
the speed cells of the generic rows of docs/models.md come from it (kiln.docs_models, GENERIC_RESULTS).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/generic_families.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile
import time

import torch

from benchmarks.common import device_name, free, run_info, table, write_json
from benchmarks.hf_auto import add_run_args, run

# the dense families that train only on the generic path (their rows in kiln.model.families), in its order
GENERIC = ("gemma", "gpt2", "phi", "olmo", "olmo2", "stablelm", "starcoder2", "falcon", "gpt_neox", "granite",
           "cohere", "glm4", "smollm3", "exaone4", "gpt_bigcode", "gptj", "bloom", "opt", "codegen")
GATED = {"gemma", "olmo", "olmo2", "stablelm", "granite", "cohere", "glm4", "smollm3", "exaone4"}  # gated MLPs
OWN_HEAD_DIM = {"gemma", "glm4"}  # configs whose head width is its own key (256 and 128 by default)


def generic_fields(kind: str, d_model: int, n_layers: int, n_heads: int, gated_hidden: int, vocab: int,
                   seq: int) -> dict:
    """The config fields of a `kind` model d_model wide, n_layers deep with n_heads heads (all of them keys and
    values, as the reference Llama's), a vocabulary of `vocab` and a context of `seq`, in the family's own keys.
    A gated MLP is `gated_hidden` wide (the reference's), a plain one 4 x d_model (the same parameters). What
    the family's defaults keep: Phi's, StableLM's, GPT-NeoX's and GLM-4's partial rotary embeddings, Falcon's
    and GPT-BigCode's multi-query attention, BLOOM's ALiBi, OPT's and GPT-2's learned positions (the table
    `seq` long); GPT-J and CodeGen rotate a quarter and a half of each head, as GPT-J-6B and CodeGen-350M do."""
    head = d_model // n_heads
    if kind in ("gpt2", "gpt_bigcode", "gptj", "codegen"):
        fields = dict(vocab_size=vocab, n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_positions=seq)
        if kind == "gptj":
            fields["rotary_dim"] = head // 4
        if kind == "codegen":
            fields.update(n_ctx=seq, rotary_dim=head // 2)
        return fields
    if kind == "bloom":
        return dict(vocab_size=vocab, hidden_size=d_model, n_layer=n_layers, n_head=n_heads)
    if kind == "opt":
        return dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                    ffn_dim=4 * d_model, word_embed_proj_dim=d_model, max_position_embeddings=seq)
    if kind == "falcon":
        return dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                    ffn_hidden_size=4 * d_model, max_position_embeddings=seq)
    fields = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  num_key_value_heads=n_heads, max_position_embeddings=seq,
                  intermediate_size=gated_hidden if kind in GATED else 4 * d_model)
    if kind in OWN_HEAD_DIM:
        fields["head_dim"] = head
    if kind == "gpt_neox":  # no grouped keys and values in its config
        del fields["num_key_value_heads"]
    return fields


def generic_config(kind: str, d_model: int, n_layers: int, n_heads: int, gated_hidden: int, vocab: int, seq: int):
    """transformers' config of `kind` (generic_fields) with every dropout off and the special token ids that the
    family's defaults put past the vocabulary (GPT-2's 50256, Cohere's 255001, ...) on its last id."""
    import transformers

    fields = generic_fields(kind, d_model, n_layers, n_heads, gated_hidden, vocab, seq)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # StarCoder2's defaults warn of their own token ids
    try:
        defaults = transformers.AutoConfig.for_model(kind).to_dict()
    finally:
        transformers.logging.set_verbosity(verbosity)
    for key, value in defaults.items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            fields[key] = 0.0
        if key.endswith("_token_id") and value is not None:
            ids = [min(i, vocab - 1) for i in (value if isinstance(value, list) else [value])]
            fields[key] = ids if isinstance(value, list) else ids[0]
    config = transformers.AutoConfig.for_model(kind, **fields)
    config.use_cache = False
    return config


def mfu(tokens_per_s: float, flops_per_token: float, device: torch.device) -> float | None:
    from kiln.monitor.meters import peak_flops

    peak = peak_flops(device)
    return tokens_per_s * flops_per_token / peak if peak else None


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def measure(kind: str, cfg, args, device: torch.device, data: str) -> dict:
    """The row of `kind` trained on the generic path (ValueError and the like propagate: the caller records them)."""
    import transformers

    from kiln.model.hf_auto import HFCausalLM

    m = cfg.model
    torch.manual_seed(0)
    config = generic_config(kind, m.d_model, m.n_layers, m.n_heads, m.mlp_hidden, m.vocab_size, cfg.train.seq_len)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config), m)
    row = {"params": model.param_count(), "fast_path": model.describe_fast_path(),
           "flops_per_token": model.flops_per_token(cfg.train.seq_len)}
    try:
        row.update(run("generic", model, cfg, args, device, data))
    finally:
        del model
        free()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="gpt2,bloom", help=f"Comma-separated, of {', '.join(GENERIC)}; or all.")
    ap.add_argument("--size", default="tiny", help="Kiln model size of the reference (tiny, 124m, 350m, 1b, ...).")
    add_run_args(ap)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="Seconds after which no further family starts (those finished are kept).")
    ap.add_argument("--json", default=None, help="Write the rows and the machine to this file.")
    args = ap.parse_args()
    kinds = list(GENERIC) if args.families == "all" else [k for k in args.families.split(",") if k]
    unknown = [k for k in kinds if k not in GENERIC]
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose from {', '.join(GENERIC)} (or all)")

    from kiln.config import ModelConfig, RunConfig
    from kiln.model.llama import Transformer
    from kiln.model.registry import flops_per_token

    start = time.perf_counter()
    device = torch.device(args.device)
    size = ModelConfig(size=args.size)
    cfg = RunConfig.model_validate({
        "model": {"size": args.size, "vocab_size": args.vocab or size.vocab_size or 512,
                  "max_seq_len": max(size.max_seq_len, args.seq), "tie_embeddings": False},
        "train": {"batch_size": args.batch, "seq_len": args.seq, "lr": 1e-4, "warmup_steps": 0,
                  "precision": "bf16" if device.type == "cuda" else "fp32"}})
    rows, skipped = [], []

    def save():  # after each family: a run cut short by a time limit keeps the families it finished
        write_json(args.json, {**run_info(device, packages=("transformers",)), "args": vars(args), "rows": rows})

    with tempfile.TemporaryDirectory() as data:
        torch.manual_seed(0)
        native = Transformer(cfg.model)
        ref = {"family": "llama", "params": sum(p.numel() for p in native.parameters()),
               "fast_path": "native", "flops_per_token": flops_per_token(cfg.model, args.seq),
               **run("native", native, cfg, args, device, f"{data}/llama")}
        del native
        free()
        ref.update(mfu=mfu(ref["tokens_per_s"], ref["flops_per_token"], device), over_llama=1.0)
        rows.append(ref)
        print(f"llama (native, the reference): {ref['tokens_per_s']:,.0f} tokens/s", flush=True)
        save()
        for kind in kinds:
            if args.time_limit is not None and time.perf_counter() - start > args.time_limit:
                skipped.append(kind)
                continue
            t0 = time.perf_counter()
            try:
                row = {"family": kind, **measure(kind, cfg, args, device, f"{data}/{kind}")}
                row.update(mfu=mfu(row["tokens_per_s"], row["flops_per_token"], device),
                           over_llama=row["tokens_per_s"] / ref["tokens_per_s"])
                said = f"{row['tokens_per_s']:,.0f} tokens/s, {row['over_llama']:.2f}x the native Llama"
            except Exception as e:  # one family's failure is its row; the others still run
                free()
                row = {"family": kind, "name": "generic", "error": one_line(e)}
                said = f"failed: {row['error']}"
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{kind}: {said} ({row['seconds']:.0f} s with building and compiling)", flush=True)
            save()

    print(f"{args.size}, batch {args.batch} x {args.seq} tokens, {device_name(device)}, compile={args.compile}, "
          f"ac={args.ac}, doc_mask={args.doc_mask}")
    print(table(rows, [("family", "family"), ("path", "name"), ("params", "params", ",d"),
                       ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"), ("peak GiB", "peak_gib", ".2f"),
                       ("vs native llama", "over_llama", "{:.2f}x"), ("first loss", "first_loss", ".4f"),
                       ("error", "error")]))
    for r in rows[1:]:
        if "error" not in r:
            print(f"{r['family']}: {r['fast_path']}")
    if skipped:
        print(f"not run (--time-limit {args.time_limit:.0f} s spent): {','.join(skipped)}")


if __name__ == "__main__":
    main()
