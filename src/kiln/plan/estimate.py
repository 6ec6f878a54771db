"""The plan of a run: memory per device, the largest micro-batch that fits, speed, time and disk.

    plan = make_plan(cfg, gpus=4, gpu=GPUS["a100"])
    plan = make_plan(cfg, gpus=1, gpu=card, here=True)  # card: this machine's own (kiln.plan.gpus.is_here)

No torch: it reads the config, the model's closed forms (kiln.model.registry), the memory model
(memory.py) and the tables of gpus.py (a mixture of experts' speed: moe_speed.py). Numbers are estimates; `basis`
fields say what each rests on. What it measures of this machine (the CPU's matrix products, for a plan on the CPU;
the host memory's pace for AdamW, for an offloaded plan on this machine's GPU: kiln.plan.host) it measures lazily,
with torch, and caches.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from kiln.config import ModelConfig, RunConfig
from kiln.errors import ConfigError, StateError
from kiln.model.registry import active_param_count, flops_per_token, param_count
from kiln.plan import experts, moe_speed
from kiln.plan.fp8 import FP8_GPUS, converted_params, converted_share
from kiln.plan.fp8 import speedup as fp8_speedup
from kiln.plan.gpus import CPU_STEP_SHARE, FULL_AC_FACTOR, GIB, Gpu, MfuEstimate, cpu_matmul_flops, estimate_mfu
from kiln.plan.host import HostPace, host_pace
from kiln.plan.memory import Layout, Lora, Memory, checkpoint_bytes, lora_params, peak_memory
from kiln.plan.offload import exposed_seconds, host_seconds, offload_memory

FRAGMENTATION = 0.05  # the caching allocator reserves a little more than the peak it hands out
CONTEXT = 1 * GIB  # CUDA context, NCCL and cuBLAS workspaces: outside PyTorch's count
CPU_SHARE = 0.8  # of the RAM, on the CPU: the rest for the OS, the loader and the checkpoint copy
# resident memory of a `kiln train` process on the CPU before its model exists: Python, torch, tokenizers, the
# loader (0.33-0.41 GiB measured at the start of CPU runs on Linux, torch 2.x); GPU runs count the CUDA context
CPU_PROCESS = int(0.4 * GIB)
MAX_BATCH = 1 << 16
CPU_MICRO_TOKENS = 1024  # kiln.train.autobatch.CPU_MICRO_TOKENS: a CPU micro-batch's tokens under batch_size auto
# LoRA's tokens/s over full training's estimate: an 8B model on an H100 trained 10,390 tokens/s with LoRA
# (benchmarks/results/cpt_8b.md) where full training is estimated at 9,315 (no weight gradients for the base, but
# the same forward, recomputation and input gradients); QLoRA dequantizes each NF4 layer in the forward pass, the
# recomputation and the backward pass: a guess until benchmarks/qlora.py has run
LORA_SPEEDUP, QLORA_FACTOR = 1.12, 0.85
DDP_FIT = 0.5  # kiln.parallel.parallelize.FIT_FRACTION: 'auto' picks ddp when 16 N fits this share of a device


@dataclass(frozen=True)
class Option:
    """One way to lay out the run, with what it costs."""

    strategy: str  # single, ddp, fsdp, fsdp+offload
    ac: str
    memory: Memory  # at the configured micro-batch
    fits: bool
    max_batch: int  # largest micro-batch that fits (0: none)
    tokens_per_s: float | None  # of the whole job, at the configured micro-batch


@dataclass
class Plan:
    cfg: RunConfig
    model: ModelConfig  # with the vocabulary resolved
    gpu: Gpu
    gpus: int
    n_params: int
    flops_per_token: float
    layout: Layout
    bf16: bool
    batch: int  # the micro-batch planned: train.batch_size, or with 'auto' the one the run would pick
    memory: Memory  # per device, at that micro-batch
    capacity: int  # bytes a device may hold (peak incl. allocator and context must stay under)
    fits: bool
    max_batch: int
    mfu: MfuEstimate | None
    tokens_per_s: float | None
    tokens_per_step: int
    seconds: float | None  # to train.max_steps
    checkpoint: int  # bytes of one checkpoint
    run_disk: int  # bytes the run directory may reach: keep_last + 1 checkpoints during a save, the model
    host_per_process: int  # CPU memory per process: offloaded state, pinned checkpoint copy, snapshots
    host_parts: list[str] = field(default_factory=list)
    host_pace: HostPace | None = None  # AdamW's in host memory, where an offloaded speed was planned (kiln.plan.host)
    lora: Lora | None = None
    accumulation: int = 1  # micro-batches per optimizer step
    options: list[Option] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def resolve_model(cfg: RunConfig, notes: list[str]) -> ModelConfig:
    """The model section with init_from read and the vocabulary size known."""
    m = cfg.model
    if m.init_from:
        from kiln.model.hf_import import resolve_init_from
        from kiln.model.hub import local_model_dir

        local = local_model_dir(m.init_from, log=notes.append, files=["config.json"])  # a Hub id: its config only
        if not Path(local).is_dir():  # the cpt-* presets' placeholder, say
            from kiln.sizes import SIZES

            raise ConfigError(f"model.init_from: {m.init_from} is not a directory, and kiln plan reads the model's "
                              "shape from its config.json: give your local Hugging Face model directory, or plan a "
                              "named shape without one: model.init_from=null model.size=8b (Llama-3-8B; sizes: "
                              f"{', '.join(SIZES)})")
        try:
            m = resolve_init_from(m.model_copy(update={"init_from": local}))
        except StateError:
            if m.hf_class != "auto":
                raise
            _refuse_generic(local)
    if m.vocab_size is None:
        vocab = _tokenizer_vocab(cfg.data.tokenizer)
        if vocab is None:
            vocab = cfg.data.vocab_size
            if cfg.data.tokenizer:
                notes.append(f"vocabulary of {cfg.data.tokenizer} not read; assumed data.vocab_size={vocab}")
        m = m.model_copy(update={"vocab_size": -(-vocab // 64) * 64})
    return m


def _refuse_generic(path: str) -> None:
    """ConfigError for a model.hf_class=auto model Kiln's native model cannot stand for (the error's first words
    told to set model.hf_class=auto); a directory that is no causal LM is said to be one."""
    from kiln.model.hf_causal import unbuildable
    from kiln.model.hf_import import read_hf_config

    hf = read_hf_config(path)
    why = unbuildable(hf)
    if why is not None:
        raise StateError(f"model.init_from={path}: {why}")
    raise ConfigError(f"kiln plan estimates Kiln's native model: model.init_from={path} (model_type "
                      f"'{hf.get('model_type')}') trains through transformers' own module (model.hf_class=auto), "
                      "which it has no estimate for. For an approximation, plan a native model of its shape without "
                      "model.init_from (model.d_model, model.n_layers, model.n_heads, model.n_kv_heads, "
                      "model.ffn_hidden, model.vocab_size, model.max_seq_len)")


def _tokenizer_vocab(path: str | None) -> int | None:
    if not path:
        return None
    p = Path(path).expanduser()
    p = p / "tokenizer.json" if p.is_dir() else p
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(p)).get_vocab_size()
    except Exception:  # noqa: BLE001 - a plan goes on with the configured size
        return None


def layout_for(cfg: RunConfig, gpus: int, n_params: int, memory: int, strategy: str | None = None,
               offload: bool | None = None, model: ModelConfig | None = None) -> Layout:
    """The layout `kiln train` picks for `gpus` processes (kiln.parallel.parallelize.choose_strategy); `model`: the
    model section resolved (resolve_model: a model.init_from's mixture of experts is in its config.json)."""
    d = cfg.dist
    if gpus <= 1:  # offload here: train.offload's optimizer in host memory (kiln.plan.offload)
        return Layout("single", offload=cfg.train.offload != "none" and not cfg.lora.rank)
    offload = d.cpu_offload if offload is None else offload
    strategy = strategy or d.strategy
    if strategy == "auto":
        strategy = "fsdp" if offload or d.sharding != "full" or 16 * n_params > DDP_FIT * memory else "ddp"
    if strategy == "ddp":
        return Layout("ddp")
    shard = gpus
    if d.sharding == "hybrid":
        replicas = d.replicas or max(1, -(-gpus // 8))
        shard = max(1, gpus // replicas)
    # dist.expert_parallel where kiln train takes it: every process, a native MoE, no hybrid sharding or offload
    ep = expert_parallel_applies(cfg, gpus, model)
    experts = d.expert_parallel if ep and d.sharding != "hybrid" and not offload else 1
    return Layout("fsdp", shard, d.sharding, offload, experts)


def expert_parallel_applies(cfg: RunConfig, gpus: int, model: ModelConfig | None = None) -> bool:
    """Whether dist.expert_parallel (above 1) spreads the experts of this run over its `gpus` processes; `model`:
    the model section resolved, else the config's."""
    m = model or cfg.model
    ep, moe = cfg.dist.expert_parallel, m.moe
    return ep > 1 and ep == gpus and moe is not None and moe.n_experts % ep == 0 and m.hf_class != "auto"


def capacity_of(gpu: Gpu, gpus: int = 1) -> int:
    """Bytes one process may use: a GPU's memory, or on the CPU its share of the RAM that all `gpus`
    processes of the machine divide between them."""
    return int(gpu.memory * CPU_SHARE) // max(1, gpus) if gpu.key == "cpu" else gpu.memory


def needs(mem: Memory, gpu: Gpu) -> int:
    """Bytes of the device a step with this peak takes: the peak plus allocator slack and the context; on the CPU the
    process, and the state an offload keeps in host memory, which there is the same memory."""
    return mem.peak + CPU_PROCESS + mem.host if gpu.key == "cpu" else int(mem.peak * (1 + FRAGMENTATION)) + CONTEXT


def even_cut(rows: int, fit: int) -> int:
    """The micro-batch `train.batch_size: auto` takes (kiln.train.autobatch.even_cut, without torch): the
    largest of at most `fit` rows that cuts `rows` into the fewest, most even pieces."""
    fit = max(1, min(fit, rows))
    return -(-rows // -(-rows // fit))


def largest_batch(fits_at) -> int:
    """The largest micro-batch b with fits_at(b) (monotone), 0 if even 1 does not fit."""
    if not fits_at(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH and fits_at(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo


def cpu_rate_for(cfg: RunConfig, n_params: int) -> tuple[float, int] | None:
    """(fp32 matrix-product FLOP/s, threads) of this machine with the threads the run would use (kiln.plan.threads),
    measured now; None where it cannot be (no torch)."""
    try:
        import torch

        from kiln.plan.threads import cpu_threads
    except ImportError:
        return None
    threads = cpu_threads(cfg.train.threads, n_params) or torch.get_num_threads()
    rate = cpu_matmul_flops(threads)
    return (rate, threads) if rate else None


def make_plan(cfg: RunConfig, gpus: int, gpu: Gpu, here: bool = False) -> Plan:
    """The plan of `cfg` on `gpus` x `gpu`; `here`: `gpu` is this machine's own card (kiln.plan.gpus.is_here), so
    an offloaded step's host memory is measured, not assumed (kiln.plan.host)."""
    notes: list[str] = []
    m = resolve_model(cfg, notes)
    t = cfg.train
    n = param_count(m)
    fpt = flops_per_token(m, t.seq_len)
    bf16 = t.precision == "bf16" or (t.precision == "auto" and gpu.key != "cpu")
    compiled = t.compile
    cap = capacity_of(gpu, gpus)
    nf4 = cfg.lora.quantize_base == "nf4"
    lora = Lora(cfg.lora.rank, tuple(cfg.lora.targets), 2 if cfg.lora.base_dtype == "bf16" else 4, nf4) \
        if cfg.lora.rank else None
    trained = lora_params(m, lora) if lora else n
    if lora:
        base = f"the blocks' linear layers in NF4, the rest in {cfg.lora.base_dtype}" if nf4 else cfg.lora.base_dtype
        notes.append(f"{'QLoRA' if nf4 else 'LoRA'} rank {lora.rank} on {', '.join(lora.targets)}: "
                     f"{trained / 1e6:.1f}M trainable parameters ({trained / n:.2%}); the frozen base in {base}; "
                     f"speed: full training's x{LORA_SPEEDUP}, as measured (benchmarks/results/cpt_8b.md)"
                     + (f", x{QLORA_FACTOR} for dequantizing the base (a guess until benchmarks/qlora.py is run)"
                        if nf4 else ""))
    lora_speed = (LORA_SPEEDUP * (QLORA_FACTOR if nf4 else 1.0)) if lora else 1.0
    layout = layout_for(cfg, gpus, trained if lora else n, gpu.memory, model=m)
    if layout.experts > 1:
        notes.append(experts.note(m, layout.experts, gpu.key))
    elif cfg.dist.expert_parallel > 1:
        notes.append(f"dist.expert_parallel={cfg.dist.expert_parallel} is not planned: kiln train refuses it (a "
                     f"config error) unless it equals the number of processes (here {gpus}), with FSDP, a native "
                     "model.moe whose experts it divides, no hybrid sharding or CPU offload; planned as FSDP alone")
    fp8 = converted_params(m) if t.fp8.enabled else 0  # kiln.plan.fp8: per block, in float8 layers
    if t.fp8.enabled and gpu.key not in FP8_GPUS:
        notes.append(f"train.fp8: {gpu.name} has no float8 tensor cores (compute capability 8.9+: H100, H200, "
                     "L40S, RTX 4090); kiln train refuses train.fp8.enabled there, and this plan is of bf16")
        fp8 = 0

    rows = t.step_rows(max(1, gpus))  # per rank and step; ConfigError where the ranks cannot share the batch

    def layered(lay: Layout) -> bool:
        """train.offload's layer-by-layer step (kiln.parallel.offload_layers): it runs each layer's forward pass
        again in the backward pass whatever train.activation_checkpointing says (full checkpointing)."""
        return lay.strategy == "single" and lay.offload and not lora and m.moe is None

    def mem(batch: int, ac: str, lay: Layout, accumulate: bool | None = None) -> Memory:
        if lay.strategy == "single" and lay.offload and not lora:  # the gradient sums are on the host
            return offload_memory(m, t.seq_len, batch, "full" if layered(lay) else ac, compiled, bf16, rows,
                                  0 if gpu.key == "cpu" else cap - CONTEXT)
        gather8 = lay.strategy == "fsdp" and t.fp8.recipe == "tensorwise" and t.fp8.all_gather
        return peak_memory(m, t.seq_len, batch, ac, compiled, bf16, lay, lora, fp8, gather8,
                           accumulate=batch < rows if accumulate is None else accumulate,
                           reduce_fp32=cfg.dist.reduce_fp32,
                           every_microbatch=cfg.dist.reduce_every_microbatch)

    def most(ac: str, lay: Layout) -> int:
        """The largest micro-batch that fits: below the step's rows its gradients are kept between micro-batches,
        from them on there is one micro-batch a step (so the search is made each way, each monotone)."""
        alone = largest_batch(lambda b: needs(mem(b, ac, lay, False), gpu) <= cap)
        return alone if alone >= rows else largest_batch(lambda b: needs(mem(b, ac, lay, True), gpu) <= cap)

    cpu_rate = cpu_rate_for(cfg, n) if gpu.key == "cpu" else None
    paces: list[HostPace] = []  # the host's, once an offloaded step's speed is planned (measured at most once)

    def speed(ac: str, lay: Layout) -> tuple[MfuEstimate | None, float | None]:
        ac = "full" if layered(lay) else ac
        if gpu.key == "cpu":  # the machine's cores, whatever the number of processes sharing them
            if not cpu_rate:
                return None, None
            share = CPU_STEP_SHARE * (FULL_AC_FACTOR if ac == "full" else 1.0)
            est = MfuEstimate(share, f"this machine's fp32 matrix products, {cpu_rate[0] / 1e9:.0f} GFLOP/s measured "
                                     f"now with {cpu_rate[1]} thread(s), x{CPU_STEP_SHARE} (the share a step "
                                     "reached in Kiln's measurements; good to a factor of two)")
            return est, share * cpu_rate[0] / fpt * lora_speed
        if gpu.peak_flops is None:
            return None, None
        # a mixture of experts: the dense MFU at its active parameters, times the measured MoE factor (moe_speed)
        est = estimate_mfu(gpu.key, active_param_count(m) if m.moe else n, ac, compiled and gpu.key != "cpu", gpus,
                           lay.offload and not layered(lay))
        if layered(lay):  # the GPU's share of the step and what AdamW on the host adds (kiln.plan.offload)
            paces[:] = paces or [host_pace(here)]
            on_gpu, adamw = rows * t.seq_len * fpt / (est.mfu * gpu.peak_flops), host_seconds(n, paces[0].bytes_per_s)
            x = on_gpu / (on_gpu + exposed_seconds(on_gpu, adamw))
            est = MfuEstimate(est.mfu * x, f"{est.basis}; x{x:.2f} for AdamW in host memory, {adamw:.1f} s a step "
                                           f"at 28 bytes a parameter beside the forward pass, {paces[0].describe()}")
        if m.moe:
            est = moe_speed.scale(est, m, batch * t.seq_len)
        if lay.experts > 1:  # kiln.plan.experts: the all-to-alls and the experts' FLOPs redone, per process
            tokens, rate = batch * t.seq_len, est.mfu * gpu.peak_flops  # a micro-batch's (the dispatch: a fixed part)
            alone = tokens * fpt / rate
            more = experts.extra_seconds(m, tokens, lay.experts, ac, 2 if bf16 else 4, gpu.key, rate)
            est = MfuEstimate(est.mfu * alone / (alone + more), f"{est.basis}; x{alone / (alone + more):.2f} for "
                                                                 "expert parallelism's all-to-alls and dispatch "
                                                                 "(kiln.plan.experts)")
        if fp8:  # kiln.plan.fp8: the converted products' share of the step, faster
            x = fp8_speedup(m, t.seq_len, est.mfu)
            est = MfuEstimate(est.mfu * x, f"{est.basis}; x{x:.2f} for float8 (kiln.plan.fp8: "
                                           f"{converted_share(m, t.seq_len):.0%} of the FLOPs in float8 layers, "
                                           "MFU counted against the bf16 peak)")
        return est, est.mfu * gpu.peak_flops * gpus / fpt * lora_speed

    max_batch = most(t.activation_checkpointing, layout)
    if t.batch_size == "auto":  # the largest micro-batch that fits, cut as the run cuts the step's rows; on the
        # CPU the fewest rows of CPU_MICRO_TOKENS tokens within that (kiln.train.autobatch.cpu_fit)
        fit_rows = min(max_batch, -(-CPU_MICRO_TOKENS // t.seq_len)) if gpu.key == "cpu" else max_batch
        batch = even_cut(rows, fit_rows)
        notes.append(f"train.batch_size=auto: planned at micro-batch {batch} x {-(-rows // batch)} accumulated "
                     f"({rows} sequences per process and step; " +
                     (f"up to {max_batch} would fit)" if max_batch else "not even 1 fits)"))
    else:
        batch = t.loader_rows(max(1, gpus))  # ConfigError where the micro-batch does not divide the step's rows
    memory = mem(batch, t.activation_checkpointing, layout)
    fits = needs(memory, gpu) <= cap
    mfu, tps = speed(t.activation_checkpointing, layout)
    tokens_per_step = rows * t.seq_len * max(1, gpus)
    seconds = t.max_steps * tokens_per_step / tps if tps else None
    ckpt = checkpoint_bytes(trained)  # with LoRA the adapters only: the base is referenced by its hash
    shard = max(1, layout.shard)
    snapshot = cfg.recovery.rollback or cfg.checkpoint.snapshot_every > 0  # kiln.train.rollback takes one
    offloaded = ("fp32 master weights, AdamW moments, gradient sums and a step's layer inputs (train.offload)"
                 if layout.strategy == "single" else "offloaded state")
    parts = {offloaded: memory.host,
             "the pinned copy async checkpoints write from": cfg.checkpoint.async_save * 12 * trained // shard,
             "the in-memory snapshot rollbacks restore (recovery.rollback)": snapshot * 12 * trained // shard}
    host = sum(parts.values())
    plan = Plan(cfg, m, gpu, gpus, n, fpt, layout, bf16, batch, memory, cap, fits, max_batch, mfu, tps, tokens_per_step,
                seconds, ckpt, (cfg.checkpoint.keep_last + 1) * ckpt + 4 * trained, int(host),
                host_parts=[k for k, v in parts.items() if v], lora=lora, accumulation=-(-rows // batch), notes=notes)

    layouts = [layout, Layout("single", offload=not layout.offload)] if gpus <= 1 and not lora else \
        [layout] if gpus <= 1 else [layout_for(cfg, gpus, n, gpu.memory, s, o, m) for s, o in
                                          (("ddp", False), ("fsdp", False), ("fsdp", True))]
    if layout.experts > 1:  # FSDP alone beside expert parallelism
        layouts.insert(1, replace(layout, experts=1))
    for lay in dict.fromkeys(layouts):
        for ac in ("full",) if layered(lay) else ("none", "selective", "full"):
            mm = mem(batch, ac, lay)
            plan.options.append(Option(_option_name(lay), ac, mm, needs(mm, gpu) <= cap, most(ac, lay),
                                       speed(ac, lay)[1]))
    plan.host_pace = paces[0] if paces else None
    if plan.host_pace and not layered(layout):  # the speed of the train.offload rows of the options table
        notes.append(f"the speed of train.offload=optimizer: the GPU's part, and AdamW in host memory at 28 bytes "
                     f"a parameter where it outlasts the forward pass beside it, {plan.host_pace.describe()}")
    _advise(plan)
    return plan


def _option_name(lay: Layout) -> str:
    return lay.strategy + ("+offload" if lay.offload else "") + \
        (f" {lay.sharding}" if lay.strategy == "fsdp" and lay.sharding != "full" else "") + \
        (f" ep={lay.experts}" if lay.experts > 1 else "")


def _advise(plan: Plan) -> None:
    """Warnings and suggestions: what does not fit, and what would."""
    cfg, t, gpu = plan.cfg, plan.cfg.train, plan.gpu
    where = f"{plan.gpus} x {gpu.key}" if plan.gpus > 1 else gpu.key
    if plan.gpus > 1 and t.offload != "none":
        plan.warnings.append(f"train.offload={t.offload} runs in one process: kiln train refuses it with "
                             f"{plan.gpus} processes (dist.cpu_offload offloads under FSDP)")
    if plan.gpus <= 1 and cfg.dist.cpu_offload:
        plan.notes.append("dist.cpu_offload applies to several processes under FSDP; one process keeps all on "
                          "the device")
    if plan.fits:
        if plan.max_batch > plan.batch * 2 and t.batch_size != "auto":
            plan.notes.append(f"micro-batch {plan.max_batch} would fit (train.batch_size={plan.batch})")
        return
    need = needs(plan.memory, gpu)
    at = f"micro-batch {plan.batch} (train.batch_size=auto)" if t.batch_size == "auto" else \
        f"train.batch_size={plan.batch}"
    plan.warnings.append(f"does not fit: a step at {at} needs about {need / GIB:.1f} GiB "
                         f"per device, {where} has {plan.capacity / GIB:.1f} GiB")
    if plan.memory.accumulated:  # FSDP reducing once a step (kiln.plan.memory.accumulation_bytes)
        plan.warnings.append(f"dist.reduce_every_microbatch=false keeps {plan.memory.accumulated / GIB:.1f} GiB of "
                             "unsharded gradients on every GPU between micro-batches; true (the default) keeps the "
                             f"sharded ones ({plan.memory.grads / GIB:.1f} GiB), for a reduce-scatter per micro-batch")
    fitting = [o for o in plan.options if o.max_batch > 0 and o.strategy != "single+offload"]  # said below
    if plan.max_batch:
        g = plan.batch * plan.accumulation
        b = plan.max_batch
        while g % b:
            b -= 1
        accum = "" if t.global_batch_tokens else f" train.grad_accum={g // b}"  # else it follows from the batch
        plan.warnings.append(f"fits with train.batch_size={b}{accum} (the same global batch)")
        same = [o for o in plan.options if o.fits and o.strategy == _option_name(plan.layout)]
        if same:  # the micro-batch as configured, with the activation checkpointing that fits it
            best = max(same, key=lambda o: (o.tokens_per_s or 0, o.max_batch))
            plan.warnings.append(f"or keep train.batch_size={plan.batch} with train.activation_checkpointing="
                                 f"{best.ac} ({best.memory.peak / GIB:.1f} GiB peak, micro-batch up to "
                                 f"{best.max_batch})")
    elif fitting:
        best = max(fitting, key=lambda o: (o.tokens_per_s or 0, o.max_batch))
        how = LAYOUT_OVERRIDES.get(best.strategy)
        how = f" ({how} train.activation_checkpointing={best.ac}{_no_offload(plan)})" if how else _no_offload(plan)
        plan.warnings.append(f"fits with {best.strategy}, activation_checkpointing={best.ac}, micro-batch up to "
                             f"{best.max_batch}{how}")
    offload = [o for o in plan.options if o.strategy == "single+offload" and o.max_batch > 0]
    if offload and not plan.layout.offload:  # one GPU, the optimizer in host memory (kiln.plan.offload)
        best = max(offload, key=lambda o: (o.tokens_per_s or 0, o.max_batch))
        plan.warnings.append(f"full training fits with train.offload=optimizer, activation_checkpointing={best.ac}, "
                             f"micro-batch up to {best.max_batch} (the optimizer in host memory: "
                             f"{best.memory.host / 1e9:.0f} GB of it); for an 8B model: the preset cpt-8b-24gb "
                             f"({_preset_plan(plan, 'cpt-8b-24gb')})")
    if not plan.max_batch and plan.lora is None:
        lora = Lora(16, ("all",), 2)
        mem = peak_memory(plan.model, t.seq_len, 1, "full", t.compile, plan.bf16, _lora_layout(plan), lora,
                          accumulate=accumulates(plan, plan.gpus), reduce_fp32=cfg.dist.reduce_fp32,
                          every_microbatch=cfg.dist.reduce_every_microbatch)
        if needs(mem, gpu) <= plan.capacity:
            plan.warnings.append("LoRA fits: lora.rank=16 lora.targets=[all] train.activation_checkpointing=full "
                                 f"train.batch_size=1{_no_offload(plan)} (continued pretraining of a frozen bf16 base)")
        else:
            _advise_qlora(plan)
    elif not plan.max_batch and not plan.lora.nf4:
        _advise_qlora(plan)
    if not plan.max_batch and not fitting and gpu.key == "cpu":  # more processes share the same RAM
        plan.warnings.append("more processes on this machine share its memory: what fits is a smaller model, "
                             "shorter sequences or fewer processes")
        return
    if not plan.max_batch and not fitting:
        for more in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if more <= plan.gpus:
                continue
            for ac in ("selective", "full"):
                lay = layout_for(plan.cfg, more, plan.n_params, gpu.memory, "fsdp", False, plan.model)
                if fit_more(plan, more, ac, lay):
                    plan.warnings.append(f"the smallest that fits: {more} x {gpu.key} with FSDP and activation_"
                                         f"checkpointing={ac} (kiln train --nproc {more} dist.strategy=fsdp"
                                         f"{_no_offload(plan)})")
                    return
        plan.warnings.append(f"no layout of up to 1024 x {gpu.key} fits this model")


def _advise_qlora(plan: Plan) -> None:
    """The QLoRA hint, where a base in NF4 fits when a bf16 one does not (kiln.plan.memory.Lora.nf4)."""
    t, lora = plan.cfg.train, plan.lora or Lora(16, ("all",), 2)
    qlora = Lora(lora.rank, lora.targets, 2, nf4=True)
    mem = peak_memory(plan.model, t.seq_len, 1, "full", t.compile, plan.bf16, _lora_layout(plan), qlora,
                      accumulate=accumulates(plan, plan.gpus), reduce_fp32=plan.cfg.dist.reduce_fp32,
                      every_microbatch=plan.cfg.dist.reduce_every_microbatch)
    if needs(mem, plan.gpu) <= plan.capacity:
        targets = "" if plan.lora else " lora.targets=[all]"  # planned on every linear layer
        plan.warnings.append(f"QLoRA fits ({mem.peak / GIB:.1f} GiB peak): lora.quantize_base=nf4 with lora.rank="
                             f"{lora.rank}{targets} train.activation_checkpointing=full train.batch_size=1"
                             f"{_no_offload(plan)} "
                             "(the base's linear layers in 4 bits; for an 8B model the preset cpt-8b-16gb: "
                             f"{_preset_plan(plan, 'cpt-8b-16gb')})")


# the settings that give a layout of the options table (kiln.parallel.parallelize.choose_strategy)
LAYOUT_OVERRIDES = {"ddp": "dist.strategy=ddp", "fsdp": "dist.strategy=fsdp",
                    "fsdp+offload": "dist.strategy=fsdp dist.cpu_offload=true"}


def _no_offload(plan: Plan) -> str:
    """The override a hint for LoRA or several processes needs when the run has train.offload, which kiln train
    refuses with either (a one-process, full-training setting)."""
    return " train.offload=none" if plan.cfg.train.offload != "none" else ""


def _lora_layout(plan: Plan) -> Layout:
    """The layout a LoRA hint is planned on: one process keeps the frozen base on its device, whether or not this
    run offloads its optimizer (train.offload, which LoRA does not take)."""
    return Layout("single") if plan.layout.strategy == "single" else plan.layout


def _preset_plan(plan: Plan, preset: str) -> str:
    """`kiln plan` of an 8B preset that runs as written: the preset's model.init_from is a placeholder, so this
    run's model directory, else the Llama-3-8B shape."""
    init = plan.cfg.model.init_from
    model = f"model.init_from={shlex.quote(init)}" if init else "model.init_from=null model.size=8b"
    return f"kiln plan {preset} {model} --gpu {plan.gpu.key}"


def accumulates(plan: Plan, gpus: int) -> bool:
    """Whether micro-batches of one row, on `gpus` processes, accumulate: the step has more rows than processes."""
    return plan.batch * plan.accumulation * plan.gpus > gpus


def fit_more(plan: Plan, gpus: int, ac: str, lay: Layout) -> bool:
    t = plan.cfg.train
    mem = peak_memory(plan.model, t.seq_len, 1, ac, t.compile, plan.bf16, lay, plan.lora,
                      accumulate=accumulates(plan, gpus), reduce_fp32=plan.cfg.dist.reduce_fp32,
                      every_microbatch=plan.cfg.dist.reduce_every_microbatch)
    return needs(mem, plan.gpu) <= plan.capacity
