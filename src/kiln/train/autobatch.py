"""`train.batch_size: auto`: the largest micro-batch that fits, found before training and cached.

On CUDA, `search_cuda` runs real training steps of the run's model (already compiled, checkpointed
and sharded as configured) on random tokens at train.seq_len: forward, backward and an AdamW step of a
throwaway optimizer with a learning rate of zero (its moments take their memory, the weights do not
change); a micro-batch smaller than the step's rows is tried as two of them a step, accumulated as the
trainer accumulates them (the gradients kept between micro-batches: 30 GiB a GPU at 8B under FSDP).
It doubles the micro-batch until a step runs out of memory, or its peak reserved memory
leaves less than recovery.auto_batch_margin of the device free, or it reaches the rows a rank trains
on per step, then bisects between the last size that fitted and the first that did not. The random
generators are put back afterwards, so the run is the one it would have been with that batch size.
In a run of several processes every rank tries the same sizes (the ranks are symmetric, so they run
out of memory together) and they agree on the smallest answer.

On the CPU the largest micro-batch that fits is not the fastest: its memory is, and the whole step's rows in
one micro-batch took 3.5 times the memory of 8 rows of 32 tokens for no speed measured. A step's matrix products
run at the CPU's rate from a few hundred rows on (tokens/s was flat from 256 to 2048 tokens a micro-batch for
0.1M-4M parameter models on 2 cores), and accumulating more micro-batches costs the CPU nothing, so `cpu_fit`
takes the fewest rows holding CPU_MICRO_TOKENS tokens, within `cpu_budget`: the available memory (less the
margin, the weights, gradients and AdamW moments) over an estimate of one sequence's activations.

The micro-batch then becomes ceil(rows / ceil(rows / fit)), the even cut of the step's rows into the
fewest micro-batches of at most `fit`. The result is kept in `auto_batch.json` under data.cache_dir,
keyed by what decides it (model shape, sequence length, rows a rank trains per step, precision, compile,
activation checkpointing, the device and its memory (the GPU's, or the machine's RAM), world size, strategy), so a
restart does not search again, and a machine with other memory does.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kiln.config import RunConfig
from kiln.files import atomic_write_json
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import drop_unreduced_grads, grad_sync
from kiln.state.rng import rng_state, set_rng_state
from kiln.train.optim import build_optimizer

CACHE_FILE = "auto_batch.json"
CPU_MICRO_TOKENS = 1024  # tokens of a CPU micro-batch: its matrix products run at the CPU's rate (module doc)


def setting(cfg: RunConfig, device: torch.device, world: int) -> dict:
    """What decides the micro-batch that fits: the cache key's content."""
    t, d = cfg.train, cfg.dist
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev = f"{props.name} {props.total_memory >> 20} MiB"
    else:
        dev = f"{device.type} {total_memory() >> 20} MiB"
    return {"model": cfg.model.model_dump(mode="json", exclude={"init_from", "allow_pickle", "trust_remote_code"}),
            "seq_len": t.seq_len, "rows": t.step_rows(world), "precision": t.precision,
            "compile": [t.compile, t.compile_scope],
            "activation_checkpointing": t.activation_checkpointing, "document_mask": cfg.data.document_mask,
            "device": dev, "world": world, "dist": [d.strategy, d.sharding, d.cpu_offload],
            "lora": [cfg.lora.rank, sorted(cfg.lora.targets)], "margin": cfg.recovery.auto_batch_margin,
            "optim_fused": cfg.optim.fused, **({"fp8": t.fp8.model_dump(mode="json")} if t.fp8.enabled else {})}


def cache_key(found: dict) -> str:
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def even_cut(rows: int, fit: int) -> int:
    """The largest micro-batch of at most `fit` rows that cuts `rows` into the fewest, most even pieces."""
    fit = max(1, min(fit, rows))
    pieces = -(-rows // fit)
    return -(-rows // pieces)


def available_memory() -> int:
    """Bytes of host memory available to this process (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory() -> int:
    """Bytes of this machine's RAM."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def row_activation_bytes(cfg: RunConfig) -> int:
    """Estimated bytes of saved activations of one sequence in fp32 (half of it in bf16), with a 1.5x slack."""
    m, t = cfg.model, cfg.train
    kv = m.kv_heads * m.head_dim
    # per token per block: norms, q/k/v, attention output, residuals, the MLP's gate/up/act/product,
    # plus the T x T attention weights per head of the CPU's math attention
    per_token = 6 * m.d_model + 2 * kv + 4 * m.mlp_hidden + 2 * m.n_heads * t.seq_len
    blocks = m.n_layers if t.activation_checkpointing == "none" else 1
    keep = m.n_layers * m.d_model  # the block inputs a checkpointed run keeps
    width = 2 if t.precision == "bf16" else 4
    return int(1.5 * width * t.seq_len * (per_token * blocks + keep + 2 * m.d_model))


def cpu_budget(cfg: RunConfig, n_params: int, local_world: int = 1, log: Callable[[str], None] = print) -> int:
    """The micro-batch a memory budget allows on the CPU (at least 1; a warning when not even 1 fits)."""
    free = available_memory() / max(1, local_world) * (1 - cfg.recovery.auto_batch_margin)
    state = 16 * n_params  # fp32 weights, gradients and two AdamW moments
    row = row_activation_bytes(cfg)
    if free < state + row:
        log(f"warning: auto batch: this process has about {free / 1e9:.1f} GB of memory to use (available memory"
            f"{f' shared by {local_world} processes' if local_world > 1 else ''}, less recovery.auto_batch_margin="
            f"{cfg.recovery.auto_batch_margin}), less than the weights, gradients and AdamW state ({state / 1e9:.1f}"
            f" GB) and one sequence's activations ({row / 1e9:.2f} GB) need: trying a micro-batch of 1, which may "
            "run out of memory; free memory, use fewer processes, a smaller model or a shorter train.seq_len")
    return max(1, int((free - state) // row))


def cpu_fit(cfg: RunConfig, n_params: int, local_world: int = 1, log: Callable[[str], None] = print
            ) -> tuple[int, str]:
    """The micro-batch for the CPU: the fewest rows holding CPU_MICRO_TOKENS tokens, at most what the memory
    budget allows; and how it was chosen."""
    budget = cpu_budget(cfg, n_params, local_world, log)
    want = max(1, -(-CPU_MICRO_TOKENS // cfg.train.seq_len))
    if want <= budget:
        return want, f"{CPU_MICRO_TOKENS} tokens a micro-batch on the CPU; memory allows {budget}"
    return budget, "memory budget"


class _Try:
    """One trial micro-batch size: two real training steps; the peak memory they reserved, or None (OOM)."""

    def __init__(self, cfg: RunConfig, model: nn.Module, device: torch.device):
        self.cfg, self.model, self.device = cfg, model, device
        self.optimizer = build_optimizer(model, cfg.optim, 0.0, device)  # lr 0: the weights stay as they are
        use_bf16 = cfg.train.precision in ("bf16", "auto") and device.type == "cuda"
        self.dtype = torch.bfloat16 if use_bf16 else None
        self.vocab = cfg.model.vocab_size or 256

    def __call__(self, b: int, accumulate: bool = False) -> int | None:
        """`accumulate`: the run will take more than one micro-batch a step, so each trial step takes two, the
        first with its gradient sync off as the trainer's: the gradients kept between them (under FSDP each
        parameter's whole unsharded gradient, 4 bytes a parameter, with dist.reduce_every_microbatch off; its
        sharded gradients with it on) are there when the second one runs."""
        T, dev = self.cfg.train.seq_len, self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        ok = False
        try:
            for _ in range(2):  # the second step runs with the optimizer's moments allocated
                for sync in (False, True) if accumulate else (True,):
                    x = torch.randint(0, self.vocab, (b, T + 1), device=dev)
                    docs = torch.zeros((b, T), dtype=torch.int32, device=dev) if self.cfg.data.document_mask else None
                    with grad_sync(self.model, sync=sync, every_microbatch=self.cfg.dist.reduce_every_microbatch):
                        with torch.autocast(dev.type, dtype=self.dtype, enabled=self.dtype is not None):
                            loss = self.model(x[:, :-1], x[:, 1:], docs)
                        loss.backward()
                    del loss
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            ok = True
        except torch.OutOfMemoryError:
            pass
        drop_unreduced_grads(self.model)  # a trial cut short: FSDP's unreduced gradients would reach the run
        self.optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_reserved(dev)
        torch.cuda.empty_cache()
        return peak if ok else None

    def close(self) -> None:
        self.optimizer.state.clear()
        self.optimizer = None
        torch.cuda.empty_cache()


def _agree(fits: bool, mesh: Mesh) -> bool:
    """True when it fitted on every rank."""
    if not mesh.distributed:
        return fits
    flag = torch.tensor([1 if fits else 0], device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def search_cuda(cfg: RunConfig, model: nn.Module, mesh: Mesh, rows: int, log: Callable[[str], None]) -> int:
    """The largest micro-batch (at most `rows`) whose training steps fit with the margin to spare."""
    device = mesh.device
    limit = (1 - cfg.recovery.auto_batch_margin) * torch.cuda.get_device_properties(device).total_memory
    trial = _Try(cfg, model, device)
    rng = rng_state()
    good, bad, b = 0, rows + 1, 1
    try:
        while b < bad:  # doubling, then bisection between the last fit and the first miss
            peak = trial(b, accumulate=b < rows)
            fits = _agree(peak is not None and peak <= limit, mesh)
            log(f"auto batch: micro-batch {b}: " + (f"fits ({peak / 2**30:.1f} GiB reserved)" if fits else
                                                    "does not fit" if peak is None else
                                                    f"{peak / 2**30:.1f} GiB reserved, over the margin"))
            if fits:
                good = b
            else:
                bad = b
            b = min(2 * b, rows) if bad > rows else (good + bad) // 2
            if b <= good:
                break
    finally:
        trial.close()
        set_rng_state(rng)
    return good


def choose_micro_batch(cfg: RunConfig, model: nn.Module, mesh: Mesh, n_params: int,
                       log: Callable[[str], None]) -> tuple[int, dict]:
    """The micro-batch for train.batch_size auto, from the cache or found now; and a record of how."""
    from kiln.errors import ResourceError

    rows = cfg.train.step_rows(mesh.world)
    found = setting(cfg, mesh.device, mesh.world)
    key = cache_key(found)
    path = Path(cfg.data.cache_dir).expanduser() / CACHE_FILE
    cached = read_cache(path).get(key) if cfg.recovery.auto_batch_cache else None
    if cached is not None:
        fit, how = int(cached["fit"]), "cached"
    elif mesh.device.type == "cuda":
        fit, how = search_cuda(cfg, model, mesh, rows, log), "searched"
        if fit < 1:
            raise ResourceError(f"train.batch_size=auto: not even one sequence of {cfg.train.seq_len} tokens fits a "
                                f"training step on {mesh.device} with recovery.auto_batch_margin="
                                f"{cfg.recovery.auto_batch_margin} to spare; set train.activation_checkpointing, a "
                                "shorter train.seq_len, more devices (dist.strategy=fsdp) or a smaller margin")
    else:
        fit, how = cpu_fit(cfg, n_params, mesh.local_world, log)
    if mesh.distributed:  # every rank must cut its rows alike (FSDP's collectives run per micro-batch)
        t = torch.tensor([fit], device=mesh.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        fit = int(t.item())
    if cached is None and cfg.recovery.auto_batch_cache and mesh.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {**read_cache(path), key: {"fit": fit, "how": how, "setting": found}}, indent=1)
        except OSError as e:
            log(f"auto batch: could not write the cache {path} ({e.strerror}); the next start searches again")
    micro = even_cut(rows, fit)
    return micro, {"micro_batch": micro, "fit": fit, "how": how, "rows_per_step": rows,
                   "accumulation": -(-rows // micro), "cache": str(path)}
