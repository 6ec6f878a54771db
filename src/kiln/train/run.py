"""`kiln train`: from a config to a trained model in a run directory, end to end."""

from __future__ import annotations

import shlex
from functools import partial
from pathlib import Path

import torch
from rich.console import Console

from kiln.config import ModelConfig, RunConfig, derive
from kiln.data.build import build_data, data_position
from kiln.data.prepare.token_bytes import token_byte_lengths
from kiln.errors import ConfigError, DataError, EmptySplit, StateError
from kiln.events import RunEnd
from kiln.model.generate import generate, start_ids
from kiln.model.hf_import import resolve_init_from
from kiln.model.lora import (
    adapter_state_dict,
    apply_lora,
    lora_flops_per_token,
    target_layers,
    trainable_count,
    trainable_summary,
    training_bytes,
)
from kiln.model.registry import active_param_count, flops_per_token, param_count
from kiln.model.stop_strings import StopStrings
from kiln.monitor.plots import PlotAtEnd
from kiln.monitor.profile import ProfileWindow
from kiln.monitor.sinks import ConsoleSink, JsonlSink, enabled_sinks
from kiln.monitor.sinks.logfile import LogFileSink
from kiln.monitor.watchers import RunWatchers
from kiln.parallel.materialize import build_model
from kiln.parallel.mesh import Mesh, check_same_config, init_mesh
from kiln.parallel.parallelize import full_model, parallelize, strategy_of
from kiln.parallel.watch import Watch, rest
from kiln.plan.memory import checkpoint_bytes
from kiln.plan.threads import apply_threads
from kiln.state import after_save
from kiln.state.callback import CheckpointEvery
from kiln.state.checkpointer import Checkpointer
from kiln.state.hf_source import keep_source
from kiln.state.lora_base import KEY as BASE_KEY
from kiln.state.lora_base import base_hash, check_base, merged_model
from kiln.state.parts import KEYS
from kiln.state.preempt import SignalGuard, StopSignals, resume_command, train_guarded
from kiln.state.resume import check_compatible, choose_checkpoint, fingerprints, run_directory
from kiln.state.rundir import (
    config_while_starting,
    hold_run_dir,
    model_saved,
    process_rank,
    unmade_if_empty,
    write_config,
)
from kiln.state.sampling import run_sampling
from kiln.state.stop_tokens import Stops, run_stops
from kiln.state.verify import read_meta
from kiln.state.weights import final_model_errors, save_model
from kiln.train.early_stop import EarlyStop
from kiln.train.events import EvalEvery
from kiln.train.optim import schedule_warning
from kiln.train.rollback import Rollback, host_room
from kiln.train.spikes import loss_bound
from kiln.train.trainer import Trainer


def kept_init_from(cfg: RunConfig, resume: str, log=print) -> tuple[RunConfig, dict[str, str]]:
    """(`cfg` with model.init_from (and a data.tokenizer that named it) replaced by the run directory's copy of its
    files (kiln.state.hf_source.KEPT: config.json, tokenizer, all but the weights) where that local directory is gone
    and a full fine-tune resumes: its checkpoints hold every weight; the fields replaced, as the run records them).
    The run records the directory given, absolute (config.yaml, its checkpoints, model/), not the copy: recorded, the
    copy became the model's base on its exported card, and a run moved elsewhere read the copy at its old place, of
    whatever run is there since; each resume reads its own run's copy. A LoRA run's checkpoints hold the adapters
    only, its frozen base none: StateError saying so. (`cfg`, {}) otherwise."""
    from kiln.model.hub import hub_id
    from kiln.state.hf_source import KEPT
    from kiln.state.rundir import checkpoints

    spec, run_dir = cfg.model.init_from, cfg.train.run_dir
    if not spec or hub_id(spec) is not None or Path(spec).expanduser().is_dir() or not run_dir or resume == "never":
        return cfg, {}
    kept, saved = Path(run_dir).expanduser() / KEPT, checkpoints(Path(run_dir).expanduser())
    if not saved or not (kept / "config.json").is_file():
        return cfg, {}  # a new run, or one that kept nothing: model.init_from's own error says the directory is gone
    if cfg.lora.rank:
        raise StateError(f"model.init_from={spec} is gone, and run {run_dir} trains LoRA adapters on it: its "
                         "checkpoints hold the adapters only, not the frozen base's weights. Put the base model back "
                         "at that path (the same files: its hash is checked), or give its new place with "
                         "model.init_from=DIR when resuming")
    log(f"model.init_from={spec} is gone: resuming from the weights in {saved[-1].parent}, with the config and "
        f"tokenizer of the run's copy {kept}")
    update = {"model.init_from": str(kept)}
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).expanduser() == Path(spec).expanduser():
        update["data.tokenizer"] = str(kept)
    given = str(Path(spec).expanduser().absolute())  # as kiln.model.hub.local_model_dir records a directory
    return derive(cfg, update), {k: given for k in update}


def with_init_from(cfg: RunConfig, log=print) -> RunConfig:
    """A copy of `cfg` whose model section is the architecture of model.init_from (a Hub id read into the local
    cache first: kiln.model.hub, and the run records the snapshot's directory)."""
    from kiln.data.prepare.tokenizer import check_own_tokenizer
    from kiln.model.hub import local_model_dir

    spec = cfg.model.init_from
    local = local_model_dir(spec, cfg.model.allow_pickle, log)
    if local != spec:
        update = {"model.init_from": local}
        if cfg.data.tokenizer == spec:  # the model's own tokenizer, by default
            update["data.tokenizer"] = local
        cfg = derive(cfg, update)
    if cfg.model.hf_class == "auto":  # any causal LM, through transformers (kiln.model.hf_auto)
        from kiln.model.hf_auto import auto_config, check_lora

        model = auto_config(cfg.model)
        if cfg.lora.rank:  # a target the model has no layer for, or PEFT refuses, is said before any data is prepared
            check_lora(model, cfg.lora)
    else:
        model = resolve_init_from(cfg.model, log)  # a warning for the directory's dropout, which it does not apply
        if cfg.lora.rank:
            target_layers(model, cfg.lora.targets)
    check_own_tokenizer(cfg.model.init_from, cfg.data.tokenizer)
    if cfg.train.seq_len > model.max_seq_len:
        extend = ("edit a copy of the model's config.json (its rope scaling and context length): model.hf_class=auto "
                  "keeps the model's context" if model.hf_class == "auto" else
                  "extend the model's context on purpose (model.max_seq_len with model.rope_scaling)")
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} is longer than the {model.max_seq_len} positions of "
                          f"{cfg.model.init_from}; shorten train.seq_len, or {extend}")
    return cfg.model_copy(update={"model": model})  # a new config; the given one is unchanged


def check_model_tokenizer(cfg: RunConfig, tok) -> None:
    """DataError unless the data was tokenized with model.init_from's own tokenizer (where it ships one: a model
    directory without tokenizer files takes data.tokenizer as its own)."""
    from kiln.data.prepare.tokenizer import Tokenizer, has_tokenizer

    if cfg.data.tokenizer and not has_tokenizer(cfg.model.init_from):
        return
    own = Tokenizer.load(cfg.model.init_from, cfg.data.eos_token, cfg.data.bos_token)
    if own.hash != tok.hash:
        raise DataError(f"the data is tokenized with tokenizer {tok.hash}, but model.init_from={cfg.model.init_from} "
                        f"was trained with tokenizer {own.hash}: its token ids would mean other text to the model. "
                        "Leave data.tokenizer unset (it then defaults to the model's) and prepare the data again")


def check_vocab(cfg: RunConfig, tok) -> None:
    """ConfigError where the model has fewer token embeddings than the tokenizer has tokens."""
    have = cfg.model.vocab_size
    if have is None or have >= tok.vocab_size:
        return
    if cfg.model.init_from:  # the size is the directory's, not the user's to raise: the tokenizer is the wrong one
        raise ConfigError(f"model.init_from={cfg.model.init_from} has vocab_size={have} (its config.json), fewer than "
                          f"the {tok.vocab_size} tokens of data.tokenizer={cfg.data.tokenizer}: ids from {have} on "
                          "would have no embedding. That tokenizer is not the model's: set data.tokenizer to the one "
                          "the model was trained with (its tokenizer.json)")
    raise ConfigError(f"model.vocab_size={have} is smaller than the tokenizer's {tok.vocab_size}; raise it or leave "
                      "it null")


def run(cfg: RunConfig, console: Console | None = None, resume: str = "auto", callbacks: list = ()) -> Path:
    """Train per `cfg`; `resume` is auto, never or force (see kiln.state.resume); `callbacks` join the run's.

    The run directory is held (a second `kiln train` on it is refused) from before its checkpoints are
    tidied until the end. SIGINT/SIGTERM outside the training loop raise `Interrupted` (start-up: clean
    exit 130/143; the final model save: finished first, a second signal aborts).
    Under torchrun every process calls this; rank 0 alone writes the console and the run files."""
    console = console or Console()
    after_save.reset()  # nothing of this run is saved yet (kiln.state.after_save)
    mesh = init_mesh(cfg.train.device, cfg.dist, console.print)  # kiln.parallel: process group, this rank's device
    watch = Watch(mesh.rank, mesh.world, cfg.dist.watchdog_s).start() if mesh.distributed else None
    try:
        if mesh.rank != 0:
            console = Console(quiet=True)
        check_same_config(cfg, mesh)  # kiln.parallel: every node started with rank 0's config
        out = _run(cfg, console, resume, callbacks, mesh)
        # every rank finished: leave the group together; a signal now (rank 0 may still save model/) is noted, not
        # fatal: a rank it killed here broke the others' wait, with a traceback, though the run was complete
        with StopSignals("as the run ends", "the run is complete", defer=True):
            mesh.close(clean=True)
        return out
    except BaseException as e:
        if watch is not None and not watch.report(e):  # kiln.parallel: one rank's error stops all, shown once
            raise SystemExit(watch.exit_code) from None  # by the rank whose failure came first
        raise
    finally:
        if watch is not None:
            watch.stop()
        mesh.close()


def check_exportable(model, say) -> None:
    """Before training from scratch: a ConfigError if model.hf_model_type names a Hugging Face class that cannot
    hold the model (that export was asked for), else a warning (`say`) if no class can: `kiln export` would fail
    at the end of the run."""
    from kiln.model.hf import export_problem

    problem = export_problem(model)
    if problem is not None and model.hf_model_type is not None:
        raise ConfigError(f"model.hf_model_type={model.hf_model_type}: {problem}")
    if problem is not None:
        say(f"warning: {problem}", markup=False, highlight=False)


def check_offload_room(cfg: RunConfig, n_params: int, device: torch.device) -> int:
    """train.offload=optimizer: a ResourceError unless the host's memory holds the offloaded training state of
    `n_params` parameters (kiln.parallel.offload.check_host_memory). Returns the bytes it needs."""
    from kiln.parallel.offload import check_host_memory
    from kiln.parallel.offload_layers import kept_bytes, wave_rows

    tcfg = cfg.train
    e = 2 if tcfg.precision == "bf16" or (tcfg.precision == "auto" and device.type == "cuda") else 4
    m = cfg.model  # the layer-by-layer step keeps each layer's input of a step's rows (not a mixture of experts)
    rows = wave_rows(tcfg.step_rows(1), int(tcfg.batch_size), tcfg.seq_len)
    kept = 0 if m.moe is not None else kept_bytes(m.n_layers, rows, tcfg.seq_len, m.d_model, e)
    return check_host_memory(n_params, e, on_cpu=device.type == "cpu", async_save=cfg.checkpoint.async_save, kept=kept)


def _run(cfg: RunConfig, console: Console, resume: str, callbacks: list, mesh: Mesh) -> Path:
    cfg.lora.require_base(cfg.model)
    if cfg.train.fp8.enabled:  # kiln.parallel.float8: a GPU with float8 tensor cores and torchao, before data work
        from kiln.parallel.float8 import check_device

        check_device(mesh.device)
    recorded: dict[str, str] = {}  # fields the run records otherwise than it reads them
    if cfg.model.init_from:  # the architecture comes from the Hugging Face directory's config.json
        cfg, recorded = kept_init_from(cfg, resume, console.print)
        cfg = with_init_from(cfg, console.print)
    else:
        check_exportable(cfg.model, console.print)
    if (unmeant := schedule_warning(cfg.train)) is not None:
        console.print(f"warning: {unmeant}", highlight=False)
    if cfg.train.offload != "none":  # said in seconds, not after the data is prepared. Without a vocabulary yet (the
        # tokenizer's, from scratch), 64, the least a run rounds to: a bound below, so only what the check once the
        # data is prepared would refuse is refused here
        check_offload_room(cfg, param_count(cfg.model, vocab_size=cfg.model.vocab_size or 64), mesh.device)
    run_dir, may_resume, made = run_directory(cfg, resume, console.print)
    cfg = derive(cfg, {"train.run_dir": str(run_dir)})
    left = f"{run_dir}, made by this start, is taken away" if made else f"nothing in {run_dir} changed"
    stops = StopSignals("during start-up", f"stopped before training; {left}. Run the same command again to go on "
                                           "(prepared data shards are kept)")
    with unmade_if_empty(made), hold_run_dir(run_dir), stops, config_while_starting(run_dir, cfg, mesh.rank == 0):
        resume_from = choose_checkpoint(run_dir, console.print, cfg.checkpoint.archive_url) if may_resume else None
        console.print(f"[bold]kiln[/] run directory: {run_dir}")
        meta = read_meta(resume_from) if resume_from is not None else None
        finished = meta is not None and meta["step"] >= cfg.train.max_steps
        if finished and (not cfg.checkpoint.save_final or model_saved(run_dir / "model")):
            if cfg.checkpoint.archive_url and mesh.rank == 0:  # what missed the archive as the run ended
                from kiln.state.archiver import archive_missed

                archive_missed(run_dir, cfg.checkpoint, console.print)
            console.print(f"this run has finished: its checkpoint {resume_from.name} reached train.max_steps="
                          f"{cfg.train.max_steps}; nothing to train. To train it further, raise train.max_steps: "
                          f"kiln train {run_dir} train.max_steps=N --resume force", highlight=False)
            return run_dir
        plain = partial(console.print, markup=False, highlight=False)
        sinks = enabled_sinks(cfg, run_dir, plain) if mesh.rank == 0 else []  # a missing extra fails here
        with RunEnd() as end:  # sinks flush and close however the run ends
            return _train(cfg, run_dir, resume_from, meta, finished, mesh, console, resume, [*sinks, *callbacks],
                          stops, end, recorded)


def _first_evaluation(trainer: Trainer, console: Console) -> dict:
    """The validation loss before training. A stream whose sources hold no validation documents (found only by
    reading them all) trains on without evaluating, as a prepared dataset without a 'val' split does."""
    try:
        return trainer.evaluate()
    except EmptySplit as e:
        trainer.val_loader = None
        console.print(f"validation: none, no run is evaluated: {e}", markup=False, highlight=False)
        return {}


def _trained_on(saved: dict) -> str | list[str] | None:
    """What a checkpoint says its run trained on: a mixture's entries' datasets, or the one dataset."""
    return saved.get("datasets") or saved.get("dataset")


def _train(cfg: RunConfig, run_dir: Path, resume_from: Path | None, meta: dict | None, finished: bool,
           mesh: Mesh, console: Console, resume: str, callbacks: list, stops: StopSignals, end: RunEnd,
           recorded: dict[str, str]) -> Path:
    """The run in `run_dir` from its data on (`_run` has set it up); `recorded`: fields that config.yaml, the
    checkpoints and model/ record otherwise than `cfg` reads them (kept_init_from)."""
    device = mesh.device
    data = build_data(cfg, device, console=console,  # prepares, opens or streams cfg.data; this rank's loaders
                      trained_on=_trained_on((meta or {}).get("fingerprints", {})))
    tok = data.tokenizer
    console.print(data.summary)
    if cfg.model.init_from:
        check_model_tokenizer(cfg, tok)
    if cfg.model.vocab_size is None:
        cfg = derive(cfg, {"model.vocab_size": -(-tok.vocab_size // 64) * 64})
    check_vocab(cfg, tok)
    record = derive(cfg, recorded) if recorded else cfg  # what the run writes down of its config
    prints = fingerprints(cfg, data)
    if cfg.lora.rank:  # the frozen base is referenced by its hash, not saved in the checkpoints
        prints[BASE_KEY] = base_hash(cfg.model.init_from, cfg.model.allow_pickle)
    if meta is not None:
        check_compatible(meta, cfg, prints, resume == "force", console.print, world=data_position()[1])
        check_base(meta.get("fingerprints", {}), prints.get(BASE_KEY), f"checkpoint {resume_from}",
                   cfg.model.init_from)

    tcfg = cfg.train
    train_loader, val_loader = data.train, data.val

    torch.manual_seed(tcfg.seed)
    # a resume takes every weight from its checkpoint, except a LoRA run's frozen base (not saved there)
    weights = cfg.model.init_from if resume_from is None or cfg.lora.rank else None
    auto_model = None
    if cfg.model.hf_class == "auto":  # any transformers causal LM (kiln.model.hf_auto): the slower path
        from kiln.model.hf_auto import build_auto
        from kiln.model.hf_packing import check_packing

        model = auto_model = build_auto(cfg.model, cfg.lora, weights=weights is not None)  # PEFT LoRA inside
        n_params, flops = model.param_count(), model.flops_per_token(tcfg.seq_len)
        memory_params = -(-training_bytes(model) // 16) if model.is_peft else n_params
        shape = f"{type(model.base).__name__} through AutoModelForCausalLM, {len(model.layers)} blocks"
        if model.is_peft:
            shape += f"; {trainable_count(model) / 1e6:.2f}M of them train (PEFT LoRA: {model.lora_where})"
        if model.split_documents and cfg.data.document_mask:  # refused unless 'split' (kiln.model.hf_packing)
            shape += f"; each document of a packed row runs as its own sequence ({check_packing(model, cfg.data)})"
        shape += f"; {model.describe_fast_path()}"
        if model.router_aux_coef is not None:
            shape += f"; loss + {model.router_aux_coef:g} x the router's load-balancing loss (aux_loss)"
    else:
        n_params, flops = param_count(cfg.model), flops_per_token(cfg.model, tcfg.seq_len)
        memory_params = n_params  # what dist.strategy=auto weighs, in fp32-trained parameters (16 bytes each)
        shape = f"{cfg.model.n_layers} layers, d={cfg.model.d_model}"
        if cfg.model.moe is not None:  # kiln.model.moe: FLOPs (MFU) count the parameters each token goes through
            m = cfg.model.moe
            shape += (f"; {m.n_experts} experts, top {m.top_k}: {active_param_count(cfg.model) / 1e6:.2f}M active; "
                      f"loss + {m.aux_loss_coef:g} x the load-balancing loss (aux_loss)")
    threads = apply_threads(tcfg.threads, device, n_params)  # CPU only
    console.print(f"model: {n_params / 1e6:.2f}M parameters ({shape}) "
                  f"on {device}" + (f" x {mesh.world} processes" if mesh.distributed else "")
                  + (f", {threads} thread(s)" if device.type == "cpu" else ""))

    def adapt(model) -> int:  # LoRA: freezes the base; only the adapters train, are optimized and saved
        nonlocal flops, memory_params
        apply_lora(model, cfg.lora)
        console.print(trainable_summary(model, cfg.lora))
        flops = lora_flops_per_token(flops, cfg.model, tcfg.seq_len, trainable_count(model))
        memory_params = -(-training_bytes(model) // 16)
        return memory_params

    if tcfg.offload != "none":  # kiln.parallel.offload: the host holds the optimizer's state; said before it is built
        from kiln.parallel.offload import describe_need

        need = check_offload_room(cfg, n_params, device)  # again, with the vocabulary of the tokenizer
        console.print(describe_need(need, device.type == "cpu"), highlight=False)
    # kiln.parallel: AC -> compile -> FSDP2 / DDP; under FSDP built on the meta device, each rank initialising its shard
    if cfg.model.hf_class == "auto":
        model = parallelize(model, cfg, mesh, memory_params, console.print)
    else:
        model = build_model(cfg, mesh, n_params, console.print, weights_from=weights, init=resume_from is None,
                            adapt=adapt if cfg.lora.rank else None)
    if weights:
        console.print(f"weights: {weights}")
    micro, auto = tcfg.batch_size, None
    if micro == "auto":  # kiln.train.autobatch: the largest that fits, from the cache or real steps
        from kiln.train.autobatch import choose_micro_batch

        micro, auto = choose_micro_batch(cfg, model, mesh, memory_params, console.print)
        console.print(f"train.batch_size=auto: micro-batch {micro} ({auto['how']}; {auto['fit']} fit)")
    rows = tcfg.step_rows(mesh.world)
    g = rows * mesh.world
    how = f"; {mesh.describe(strategy_of(model), cfg.dist)}" if mesh.distributed else ""  # kiln.parallel
    console.print(f"global batch: {g} sequences ({g * tcfg.seq_len:,} tokens) per step = {micro} per "
                  f"micro-batch x {-(-rows // micro)} accumulated x {mesh.world} data-parallel rank(s){how}")

    checkpointer = Checkpointer(run_dir, record, prints, console.print)
    guard = SignalGuard(console.print, checkpointer.control_group) if cfg.checkpoint.on_signal else None
    # kiln.monitor: readings and warnings, hang watch; first (and last) among the callbacks
    plain = partial(console.print, markup=False, highlight=False)  # a message may hold brackets ('kiln[gpu]')
    watchers = RunWatchers(cfg, run_dir, device, checkpoint_bytes(n_params), mesh.rank, plain)
    extra, callbacks = list(callbacks), [*watchers.first, EvalEvery(tcfg.eval_every)]
    if getattr(auto_model, "router_aux_coef", None) is not None:  # a mixture of experts: its aux_loss logged
        from kiln.train.router_aux import RouterAuxLog

        callbacks.append(RouterAuxLog(auto_model.router_aux))
    elif cfg.model.moe is not None and cfg.model.hf_class == "native":  # kiln.model.moe: aux_loss, router_z_loss
        from kiln.parallel.parallelize import unwrap
        from kiln.train.router_aux import RouterAuxLog

        native = unwrap(model)
        callbacks.append(RouterAuxLog(native.router_aux, native.router_z if cfg.model.moe.z_loss_coef else None))
    if cfg.data.schedule is not None:  # kiln.data: a curriculum's weights in force join each logging step's metrics
        from kiln.data.load.schedule import ScheduleLog

        callbacks.append(ScheduleLog(train_loader))
    if cfg.data.streaming:  # kiln.data: what the stream's reading skipped, as `kiln prepare` reports it
        from kiln.data.load.streaming import StreamDrops

        callbacks.append(StreamDrops(train_loader))
    if cfg.eval.tasks:  # kiln.eval: benchmark scores join each evaluation's metrics, before the sinks see them
        from kiln.eval.callback import TasksAtEval

        callbacks.append(TasksAtEval(cfg.eval, tok, plain if mesh.rank == 0 else None))
    if cfg.recovery.rollback:  # kiln.train.rollback: bad steps undone from the memory snapshots
        fits, need, have = host_room(model, 2 if cfg.checkpoint.async_save else 1, mesh.local_world)
        if tcfg.offload != "none":  # the state is the host's fp32 masters and moments, not the device's bf16 weights
            from kiln.parallel.offload import rollback_room

            fits, need = rollback_room(n_params, 2 if cfg.checkpoint.async_save else 1, have)
        if fits:
            callbacks.insert(0, Rollback(cfg.recovery, checkpointer.snapshots, cfg.checkpoint.snapshot_every,
                                         checkpointer, loss_bound(cfg.recovery, cfg.model.vocab_size)))
        else:
            console.print(f"recovery.rollback is off for this run: its snapshot of the training state beside the "
                          f"checkpoint's staging copy takes {need / 1e9:.0f} GB of host memory on this node, and "
                          f"{have / 1e9:.0f} GB are available; a non-finite loss stops the run instead",
                          highlight=False)
    if cfg.logging.console and mesh.rank == 0:  # kiln.parallel: rank 0 writes console and metrics
        callbacks.append(ConsoleSink(console))
    if cfg.logging.jsonl and mesh.rank == 0:
        callbacks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if cfg.logging.log_file and mesh.rank == 0:
        callbacks.append(LogFileSink(run_dir / LogFileSink.name))
    early = None
    if tcfg.early_stop.patience:  # after the sinks: its note follows the evaluation that decided it
        early = EarlyStop(tcfg.early_stop.patience, tcfg.early_stop.min_delta, console.print,
                          tcfg.early_stop.restore_best, tcfg.early_stop.metric, tcfg.early_stop.mode)
        callbacks.append(early)
    if cfg.logging.plots and cfg.logging.jsonl and mesh.rank == 0:
        callbacks.append(PlotAtEnd(run_dir, plain))  # its hint names the extra: pip install 'kiln[plot]'
    if cfg.profile.steps and mesh.rank == 0:
        callbacks.append(ProfileWindow(cfg.profile, run_dir, plain))
    callbacks += [*extra, CheckpointEvery(checkpointer, guard), *watchers.last]  # a checkpoint sees its eval
    trainer = Trainer(cfg, model, train_loader, val_loader, device, callbacks,
                      flops_per_token=flops, mesh=mesh, micro_batch=micro)
    end.trainer = trainer
    if tcfg.fp8.enabled:  # kiln.parallel.float8: under FSDP, the float8 weights' scales after each optimizer step
        from kiln.parallel.float8 import scale_after_step

        scale_after_step(trainer.optimizer, model)
    watchers.attach(trainer, checkpointer, plain)
    trainer.events.log = plain  # a failing sink is reported here
    if val_loader is not None:  # bytes of text per token id: validation reports bits per byte
        trainer.token_bytes = torch.from_numpy(token_byte_lengths(tok, cfg.model.vocab_size)).to(device)
    if resume_from is not None:
        # verified when chosen; a finished run's model is written from its weights alone (no optimizer, no data
        # position: the batch may be split over another number of processes now)
        meta = checkpointer.load(trainer, resume_from, check_hashes=False,
                                 keys=("model", "trainer") if finished else KEYS)
        console.print(f"resumed from {resume_from} (step {meta['step']}, {meta['tokens_seen']:,} tokens)")
    started = trainer.step
    if process_rank()[0] == 0:
        write_config(run_dir, record)  # once the start or the resume has succeeded: a failed one leaves the old
        keep_source(cfg.model, run_dir)  # what its export keeps of model.init_from, should that directory go
    if finished:  # the model save of a finished run did not complete: write it from the final checkpoint
        checkpointer.close()
        console.print(f"this run has finished (step {trainer.step}) but its model was not saved: writing it now")
        model = full_model(model, cfg, mesh) if mesh.distributed else model
        if model is not None:
            _save_final(_saved_model(trainer, model), cfg, tok, run_dir, console, record.model)
        return run_dir
    if auto is not None and mesh.rank == 0:  # after the resume: metrics.jsonl keeps the records up to its step
        trainer.notice("auto_batch", **auto)
    first = trainer.last_eval or _first_evaluation(trainer, console)  # a resumed run's, else evaluated now
    if tcfg.early_stop.patience and trainer.val_loader is None:
        console.print(f"train.early_stop.patience={tcfg.early_stop.patience} has nothing to count: this run has no "
                      "validation split, so it trains to train.max_steps", highlight=False)
    stops.during = "during training"
    stops.then = f"the last complete checkpoint is kept; resume with: {resume_command(run_dir)}"
    try:
        final = train_guarded(trainer, checkpointer, guard, run_dir, console.print)
    finally:
        watchers.close()
        rest()  # kiln.parallel watchdog: training is over
        if trainer.offload is not None:  # kiln.parallel.offload: its host thread, hooks and locked buffers
            trainer.offload.close()
    if final is None:  # preempted: the checkpoint is written, nothing else to do
        return run_dir
    if final:
        since = "at start" if not first.get("step") else f"at step {first['step']}"  # a resumed run's last
        console.print(f"validation loss: {first['val_loss']:.4f} {since} -> {final['val_loss']:.4f} "
                      f"after {trainer.step} steps" + (f" ({final['val_bpb']:.4f} bits per byte)"
                                                       if "val_bpb" in final else ""))
    if trainer.stop_reason:
        console.print(f"stopped at step {trainer.step} of {tcfg.max_steps}: {trainer.stop_reason}", highlight=False)
    # a resume that trained no step (stopped early again at once) leaves the model/ its first stop saved
    keep_model = trainer.step == started and resume_from is not None and model_saved(run_dir / "model")
    if early is not None and cfg.checkpoint.save_final and not keep_model:
        early.choose_weights(trainer, checkpointer)  # the best evaluation's, with restore_best
    dropped = getattr(train_loader, "dropped", None)  # streaming: prepare's report shows them otherwise
    if dropped:
        console.print("streaming skipped records (first epoch read): "
                      + ", ".join(f"{n} {r}" for r, n in sorted(dropped.items())), highlight=False)

    if tcfg.fp8.enabled and strategy_of(model) != "fsdp":  # kiln.parallel.float8: save and sample as bf16 runs do
        from kiln.parallel.float8 import to_plain

        to_plain(model)
    if mesh.distributed and (cfg.checkpoint.save_final or tcfg.sample_tokens):
        stops.during = "while gathering the final model"
        stops.then = (f"training is complete; `kiln train {run_dir}` writes model/ from its final checkpoint"
                      if cfg.checkpoint.save_final else "training is complete; no sample was made")
        model = full_model(model, cfg, mesh)  # kiln.parallel: every rank sends its shards; rank 0 gets the model
        if model is None:
            _saved(stops)  # this rank's part is sent: rank 0 writes model/
            return run_dir
    if keep_model:
        console.print(f"model/ is kept as it was saved: no step was trained since (step {trainer.step})",
                      highlight=False)
    elif cfg.checkpoint.save_final and not _save_final(_saved_model(trainer, model), cfg, tok, run_dir, console,
                                                       record.model):
        _saved(stops)
        return run_dir  # a signal came during the save: stop here, as it asked
    _saved(stops)
    if tcfg.sample_tokens:  # a signal cuts the sample short (and exits 0: all is written)
        stops.defer, stops.during = False, "while sampling"
        stops.then = "the sample is cut short; training and the model save are complete"
        until = Stops([], []) if tcfg.sample_ignore_eos else run_stops(cfg, tok)
        ids = generate(model, start_ids(tok, tcfg.sample_prompt, bos=tok.bos_id), tcfg.sample_tokens, seed=tcfg.seed,
                       stop_ids=until.ids, vocab_size=tok.vocab_size,
                       stop_strings=StopStrings(until.strings, tok.decode), **run_sampling(cfg))
        console.rule("sample")
        text = tcfg.sample_prompt + tok.decode(ids)
        console.print(text, markup=False, highlight=False)
        console.rule()
        trainer.events.emit("on_sample", trainer, text)
        _saved(stops)
    if model_saved(run_dir / "model"):  # what kiln generate reads
        console.print(f"{'sample again' if tcfg.sample_tokens else 'sample'} with: kiln generate "
                      f"{shlex.quote(str(run_dir))} --prompt {shlex.quote(tcfg.sample_prompt)}", markup=False,
                      highlight=False)
    return run_dir


def _saved(stops: StopSignals) -> None:
    """All is written (model/, else the final checkpoint): a signal from here on loses nothing (kiln.state.after_save).
    The run's own handler notes it and the shutdown goes on (sinks close, the run directory is let go); a second one
    ends it, with exit code 0."""
    after_save.mark_saved()
    stops.defer, stops.during = True, "after the run was saved"
    stops.then = "exiting now; nothing is lost"
    stops.deferred = "nothing is lost; finishing the shutdown" if process_rank()[0] == 0 else ""  # one line of a job


def _saved_model(trainer: Trainer, model):
    """What model/ is written from: the model, or with train.offload its fp32 master weights (kiln.parallel.offload)
    rather than the device's bf16 copies."""
    return model if trainer.offload is None else trainer.offload.host_model(trainer.cfg.model)


def _save_final(model, cfg: RunConfig, tok, run_dir: Path, console: Console, recorded: ModelConfig) -> bool:
    """Save model/ (rank 0), finishing it whatever signal comes first (a second one aborts: the final
    checkpoint is complete, and `kiln train RUN_DIR` writes model/ from it). False if a signal came. `recorded`: the
    model config model/ records (kept_init_from)."""
    if process_rank()[0] != 0:
        return True
    with StopSignals("during the final model save", f"model/ is incomplete; the final checkpoint is complete "
                     f"and `kiln train {run_dir}` writes model/ from it", defer=True,
                     deferred="finishing the model save first") as saving, final_model_errors(run_dir):
        if cfg.model.hf_class == "auto":  # save_pretrained: PEFT's adapters in model/adapters, then merged
            from kiln.state.export import finish_auto_export
            from kiln.state.hf_source import tokenizer_dir

            # with its source's chat template, special and stop tokens, as `kiln export` writes them
            out = save_model(model, recorded, tok, run_dir / "model",
                             lambda d: finish_auto_export(d, cfg.model, tok, tokenizer_dir(cfg.data.tokenizer)))
        else:
            if cfg.lora.rank:  # the adapters alone, in PEFT's format (first: a complete model/ has them)
                from kiln.model.lora_peft import peft_refusal, write_peft_adapters

                why = peft_refusal(adapter_state_dict(model), cfg.model)
                if why is None:
                    write_peft_adapters(adapter_state_dict(model), cfg.model, cfg.lora, cfg.model.init_from,
                                        run_dir / "model" / "adapters")
                else:
                    console.print(f"model/adapters is not written: {why}", highlight=False)
            # LoRA: merged onto the base as stored in init_from (as an export of a checkpoint is), not the
            # training copy, rounded to lora.base_dtype
            merged = merged_model(cfg.model, cfg.lora, adapter_state_dict(model)) if cfg.lora.rank else model
            out = save_model(merged, recorded, tok, run_dir / "model")
    console.print(f"model saved: {out}")
    after_save.mark_saved()
    if saving.received:
        console.print(f"stopped by {saving.received} after the model save; the run is complete", highlight=False)
    return saving.received is None
