"""`kiln train`: from a config to a trained model in a run directory, end to end."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from kiln.config import RunConfig
from kiln.data.build import build_data, data_position
from kiln.dist.mesh import Mesh, agree_run_dir, init_mesh
from kiln.dist.parallelize import full_model, parallelize
from kiln.dist.watch import EXIT_CODE, Watch
from kiln.errors import ConfigError, ResourceError
from kiln.model.generate import generate
from kiln.model.llama import Transformer
from kiln.model.registry import flops_per_token, param_count
from kiln.monitor.sinks import ConsoleSink, JsonlSink
from kiln.state.callback import CheckpointEvery
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import SignalGuard, train_guarded
from kiln.state.resume import check_compatible, fingerprints, resume_target
from kiln.state.verify import read_meta
from kiln.state.weights import save_model
from kiln.train.events import EvalEvery
from kiln.train.trainer import Trainer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device: '{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ResourceError(f"train.device={name} but CUDA is not available here; use train.device=cpu")
    return dev


def run(cfg: RunConfig, console: Console | None = None, resume: str = "auto", callbacks: list = ()) -> Path:
    """Train per `cfg`; `resume` is auto, never or force (see kiln.state.resume); `callbacks` join the run's.
    Under torchrun every process calls this; rank 0 alone writes the console and the run files."""
    console = console or Console()
    mesh = init_mesh(cfg.train.device, cfg.dist, console.print)  # kiln.dist: process group, this rank's device
    watch = Watch(mesh.rank, mesh.world, cfg.dist.watchdog_s).start() if mesh.distributed else None
    try:
        if mesh.rank != 0:
            console = Console(quiet=True)
        cfg.train.run_dir = agree_run_dir(cfg.train.run_dir, resume, mesh)
        return _run(cfg, console, resume, callbacks, mesh)
    except BaseException as e:
        if watch is not None:  # kiln.dist: one rank's error stops all, shown once by that rank
            other = watch.failure()
            if other is not None and not other.startswith(f"rank {mesh.rank}:"):
                watch.stopping(other)  # a consequence of that failure, which its rank reports
                raise SystemExit(EXIT_CODE) from None
            watch.record_failure(e)
        raise
    finally:
        if watch is not None:
            watch.stop()
        mesh.close()


def _run(cfg: RunConfig, console: Console, resume: str, callbacks: list, mesh: Mesh) -> Path:
    device = mesh.device
    run_dir, resume_from = resume_target(cfg, resume, console.print)
    console.print(f"[bold]kiln[/] run directory: {run_dir}")

    data = build_data(cfg, device, console=console)  # prepares, opens or streams cfg.data; this rank's loaders
    tok = data.tokenizer
    console.print(data.summary)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = -(-tok.vocab_size // 64) * 64
    elif cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tok.vocab_size}; raise it or leave it null")
    prints = fingerprints(cfg, data)
    if resume_from is not None:
        check_compatible(read_meta(resume_from), cfg, prints, resume == "force", console.print,
                         world=data_position()[1])
    if mesh.rank == 0:  # kiln.dist
        (run_dir / "config.yaml").write_text(cfg.to_yaml())

    tcfg = cfg.train
    train_loader, val_loader = data.train, data.val

    torch.manual_seed(tcfg.seed)
    model = Transformer(cfg.model)  # on the CPU: parallelize moves it (or this rank's shard) to the device
    n_params = param_count(cfg.model)
    console.print(f"model: {n_params / 1e6:.2f}M parameters ({cfg.model.n_layers} layers, d={cfg.model.d_model}) "
                  f"on {device}" + (f" x {mesh.world} processes" if mesh.distributed else ""))
    model = parallelize(model, cfg, mesh, n_params, console.print)  # kiln.dist: AC -> compile -> FSDP2 / DDP
    g = tcfg.batch_size * tcfg.grad_accum * mesh.world
    console.print(f"global batch: {g} sequences ({g * tcfg.seq_len:,} tokens) per step = {tcfg.batch_size} per "
                  f"micro-batch x {tcfg.grad_accum} accumulated x {mesh.world} data-parallel rank(s)")

    checkpointer = Checkpointer(run_dir, cfg, prints, console.print)
    guard = SignalGuard(console.print, checkpointer.control_group) if cfg.checkpoint.on_signal else None
    extra, callbacks = list(callbacks), [EvalEvery(tcfg.eval_every)]
    if cfg.logging.console and mesh.rank == 0:  # kiln.dist: rank 0 writes console and metrics
        callbacks.append(ConsoleSink(console))
    if cfg.logging.jsonl and mesh.rank == 0:
        callbacks.append(JsonlSink(run_dir / "metrics.jsonl"))
    callbacks += [*extra, CheckpointEvery(checkpointer, guard)]  # last: a checkpoint sees its step's eval
    trainer = Trainer(cfg, model, train_loader, val_loader, device, callbacks,
                      flops_per_token=flops_per_token(cfg.model, tcfg.seq_len), mesh=mesh)
    if resume_from is not None:
        meta = checkpointer.load(trainer, resume_from, check_hashes=False)  # verified when chosen
        console.print(f"resumed from {resume_from} (step {meta['step']}, {meta['tokens_seen']:,} tokens)")
        first = trainer.last_eval or trainer.evaluate()
    else:
        first = trainer.evaluate()
    final = train_guarded(trainer, checkpointer, guard, run_dir, console.print)
    if final is None:  # preempted: the checkpoint is written, nothing else to do
        return run_dir
    if final:
        console.print(f"validation loss: {first['val_loss']:.4f} at start -> {final['val_loss']:.4f} "
                      f"after {trainer.step} steps")
    dropped = getattr(train_loader, "dropped", None)  # streaming: prepare's report shows them otherwise
    if dropped:
        console.print("streaming skipped records (first epoch read): "
                      + ", ".join(f"{n} {r}" for r, n in sorted(dropped.items())), highlight=False)

    if mesh.distributed and (cfg.checkpoint.save_final or tcfg.sample_tokens):
        model = full_model(model, cfg, mesh)  # kiln.dist: every rank sends its shards; rank 0 gets the model
        if model is None:
            return run_dir
    if cfg.checkpoint.save_final:
        out = save_model(model, cfg.model, tok, run_dir / "model")
        console.print(f"model saved: {out}")
    if tcfg.sample_tokens:
        ids = generate(model, tok.encode(tcfg.sample_prompt), tcfg.sample_tokens, seed=tcfg.seed)
        console.rule("sample")
        console.print(tcfg.sample_prompt + tok.decode(ids), markup=False, highlight=False)
        console.rule()
    console.print(f"sample again with: kiln generate {run_dir} --prompt 'def '")
    return run_dir
