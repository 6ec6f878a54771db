"""`kiln plan`'s output: the plan as rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.plan.estimate import CONTEXT, CPU_PROCESS, FRAGMENTATION, Plan, needs
from kiln.plan.fp8 import FP8_GPUS
from kiln.plan.gpus import GIB
from kiln.plan.offload import offload_rows


def gib(n: float) -> str:
    """GiB with the digits a small model needs: 35.7, 2.32, 0.0123 (0 is 0.0)."""
    v = n / GIB
    return f"{v:.1f}" if v >= 10 or v == 0 else f"{v:.3g}"


def flops(n: float) -> str:
    """FLOPs with a unit that keeps three digits: 48.25 GFLOP, 1.57 MFLOP."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _where(plan: Plan) -> str:
    g = plan.gpu
    if g.key == "cpu":
        return f"the CPU ({g.memory / GIB:.0f} GiB RAM)"
    peak = f", {g.peak_flops / 1e12:.0f} TFLOP/s bf16" if g.peak_flops else ""
    return f"{plan.gpus} x {g.key} ({g.name}, {g.memory / GIB:.1f} GiB{peak})"


def _layout(plan: Plan) -> str:
    lay = plan.layout
    if lay.strategy == "single":
        return "one process" + (", the optimizer in host memory (train.offload)" if lay.offload else "")
    if lay.strategy == "ddp":
        return f"DDP over {plan.gpus} processes"
    how = {"full": "full sharding", "grad_op": "grad_op sharding", "hybrid": "hybrid sharding"}[lay.sharding]
    return f"FSDP, {how} over {lay.shard} processes" + (", CPU offload" if lay.offload else "") + \
        (f", the experts spread over them (dist.expert_parallel={lay.experts})" if lay.experts > 1 else "")


def render(plan: Plan, console: Console) -> None:
    t, m, mem = plan.cfg.train, plan.model, plan.memory
    precision = "bf16 autocast" if plan.bf16 else "fp32"
    if t.fp8.enabled and plan.gpu.key in FP8_GPUS:  # kiln.plan.fp8
        precision += f" with float8 linear layers ({t.fp8.recipe})"
    console.print(f"[bold]kiln plan[/] on {_where(plan)}", highlight=False)
    n = plan.n_params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"
    console.print(f"model: {size} parameters ({m.n_layers} layers, d={m.d_model}, "
                  f"vocab {m.vocab_size}); {flops(plan.flops_per_token)} per token at sequence "
                  f"{t.seq_len}", highlight=False)
    console.print(f"run: {_layout(plan)}, {precision}, compile {'on' if t.compile else 'off'}, activation "
                  f"checkpointing {t.activation_checkpointing}; micro-batch {plan.batch} x accumulation "
                  f"{plan.accumulation} x {plan.gpus} = {plan.tokens_per_step:,} tokens a step", highlight=False)

    table = Table(title=f"memory per device at micro-batch {plan.batch}", title_justify="left")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    shard = f" (1/{plan.layout.shard})" if plan.layout.shard > 1 else ""
    where = " on the CPU" if plan.layout.offload else ""
    base = f"NF4 + {plan.cfg.lora.base_dtype}" if plan.lora and plan.lora.nf4 else plan.cfg.lora.base_dtype
    kind = f"{base} base, fp32 adapters" if plan.lora else "fp32"
    trained = " of the adapters" if plan.lora else ""
    rows = [(f"weights, {kind}" + shard + where, mem.weights or mem.host * 4 // 16),
            (f"gradients{trained}, fp32" + shard + where, mem.grads or mem.host * 4 // 16),
            (f"AdamW moments{trained}, fp32" + shard + where, mem.optimizer or mem.host * 8 // 16),
            ("compute copies of the weights", mem.compute_weights),
            (f"activations (AC {t.activation_checkpointing})", mem.activations),
            ("loss buffers", mem.loss)]
    if mem.accumulated:  # kiln.plan.memory.accumulation_bytes
        dtype = "fp32" if plan.cfg.dist.reduce_fp32 or not plan.bf16 else "bf16"
        rows.insert(2, (f"gradients kept between micro-batches, unsharded, {dtype} (FSDP)", mem.accumulated))
    if plan.layout.offload and plan.layout.strategy == "single":  # train.offload (kiln.plan.offload)
        rows = offload_rows(mem, t.activation_checkpointing, "bf16" if plan.bf16 else "fp32")
    for what, n in rows:
        table.add_row(what, gib(n))
    when = {"recompute": "start of the backward pass, a block recomputed",  # loss: kiln.plan.offload.head_bytes
            "loss": "the loss's backward, the output layer's fp32 gradient"}.get(mem.phase,
                                                                                 f"end of the {mem.phase} pass")
    table.add_row(f"peak ({when})", gib(mem.peak), style="bold")
    if plan.gpu.key != "cpu":
        extra = f"+{FRAGMENTATION:.0%} allocator, +{CONTEXT / GIB:.0f} GiB context"
    elif mem.host:
        extra = f"+{CPU_PROCESS / GIB:.1f} GiB the process, +{mem.host / GIB:.1f} GiB the offloaded state (same RAM)"
    else:
        extra = f"+{CPU_PROCESS / GIB:.1f} GiB the process (Python, torch, the loader)"
    table.add_row(extra, gib(needs(mem, plan.gpu)))
    share = "" if plan.gpus <= 1 else f" / {plan.gpus} processes"
    table.add_row("available" + (f" (80% of RAM{share})" if plan.gpu.key == "cpu" else ""), gib(plan.capacity))
    console.print(table)
    fit = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    console.print(f"{fit}; largest micro-batch that fits: {plan.max_batch or 'none'}")
    if plan.tokens_per_s and plan.gpu.key == "cpu":
        console.print(f"speed: about {plan.tokens_per_s:,.0f} tokens/s ({plan.mfu.basis}); train.max_steps="
                      f"{t.max_steps:,} take about {duration(plan.seconds)}", highlight=False)
    elif plan.tokens_per_s:
        console.print(f"speed: about {plan.tokens_per_s:,.0f} tokens/s ({plan.mfu.mfu:.1%} MFU: {plan.mfu.basis}); "
                      f"train.max_steps={t.max_steps:,} take about {duration(plan.seconds)}", highlight=False)
    else:
        console.print("speed: no estimate (this machine's matrix-product rate could not be measured); run a few "
                      "steps and read tokens_per_s")
    console.print(f"disk: {gb(plan.checkpoint)} per checkpoint; the run directory reaches about "
                  f"{gb(plan.run_disk)} (checkpoint.keep_last={plan.cfg.checkpoint.keep_last}, one more while a "
                  "save is written, and the final model)", highlight=False)
    if plan.host_per_process:
        node = min(plan.gpus, 8)  # the processes of one node share its memory (8 GPUs a node at most)
        console.print(f"host memory: {gb(plan.host_per_process)} per process ({', '.join(plan.host_parts)})"
                      + (f"; {gb(plan.host_per_process * node)} for {node} processes on a node" if node > 1 else ""),
                      highlight=False)

    opts = Table(title=f"options at micro-batch {plan.batch}", title_justify="left")
    for col, just in (("layout", "left"), ("AC", "left"), ("peak GiB", "right"), ("fits", "left"),
                      ("largest micro-batch", "right"), ("tokens/s", "right")):
        opts.add_column(col, justify=just)
    for o in plan.options:
        current = o.ac == t.activation_checkpointing and o.memory == mem
        opts.add_row(o.strategy, o.ac, gib(o.memory.peak), "yes" if o.fits else "no", str(o.max_batch or "-"),
                     f"{o.tokens_per_s:,.0f}" if o.tokens_per_s else "-", style="bold" if current else None)
    console.print(opts)
    for note in plan.notes:
        console.print(f"note: {escape(note)}", highlight=False)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
