"""The `kiln` command."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from kiln import __version__
from kiln.errors import ConfigError, KilnError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Kiln: raw text to a trained causal language model.")
# soft_wrap: lines are never broken by rich (it wraps at 80 columns when the output is not a terminal), so a
# path or file:line in a message stays whole and can be copied
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"kiln {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    _state["debug"] = debug
    if ctx.invoked_subcommand != "train":  # it loads torch first: it gives the signals back as it starts training
        from kiln.start_signals import started

        started()


@app.command(context_settings={"allow_extra_args": False})
def train(
    config: str | None = typer.Argument(None, help="YAML config file, preset name (see configs/), or a run "
                                                     "directory to resume; omit for the built-in quickstart."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.lr=3e-4."),
    resume: str = typer.Option("auto", "--resume", help="auto: continue from the newest good checkpoint of "
                               "train.run_dir if it has one; never: start fresh (in a new directory if that one "
                               "has checkpoints); force: continue even though the config or data changed."),
    help_config: bool = typer.Option(False, "--help-config", help="List every config key with its doc and exit."),
    nproc: int = typer.Option(1, "--nproc", help="Start torchrun with this many processes on this machine (one "
                              "per GPU); see dist.* in --help-config for DDP / FSDP."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="With --nproc: torchrun restarts the job this many "
                                     "times after a process dies; each start resumes from the newest checkpoint."),
) -> None:
    """Train a model, or resume one.

    With no arguments, trains a small model on this Python's standard library source on the CPU
    in a few minutes and prints a sample.

    Example: kiln train gpu-124m train.max_steps=2000 model.n_layers=8

    Resume: `kiln train RUN_DIR` continues the run in RUN_DIR from its newest checkpoint whose
    hashes verify (damaged ones are skipped, with a message), with the config in RUN_DIR/config.yaml.
    `kiln train CONFIG train.run_dir=RUN_DIR` does the same with CONFIG, which must match the saved
    config; add `--resume force` to accept deliberate changes (e.g. train.max_steps=4000 train.lr=1e-4).
    A run stopped by SIGTERM or Ctrl-C writes a checkpoint first; Ctrl-C twice aborts at once.
    """
    from kiln.config import derive, describe_fields, load_config

    if help_config:
        print(describe_fields())
        return
    overrides = list(overrides or [])
    if config is not None and "=" in config:  # only overrides were given
        overrides.insert(0, config)
        config = None
    if resume not in ("auto", "never", "force"):
        raise ConfigError(f"--resume {resume!r}: use auto, never or force")
    try:
        if config is not None and Path(config).expanduser().is_dir():  # a run directory: resume it
            run_dir = Path(config).expanduser()
            if not (run_dir / "config.yaml").is_file():
                from kiln.state.rundir import started_by

                command = started_by(run_dir)
                if command:  # a start killed before it wrote config.yaml (kiln.train.run writes it at once now)
                    raise ConfigError(f"{run_dir} has no config.yaml: the run started there with `{command}` was "
                                      "stopped before it wrote one, so there is nothing to resume. Run that command "
                                      "again")
                raise ConfigError(f"{run_dir} is a directory without config.yaml, so not a run directory; give a "
                                  "config file, or the directory of an earlier `kiln train`")
            cfg = load_config(run_dir / "config.yaml", overrides)
            if not any(o.strip().startswith("train.run_dir=") for o in overrides):
                cfg = derive(cfg, {"train.run_dir": str(run_dir)})
        else:
            cfg = load_config(config, overrides)
    except KilnError:
        if _rank() is not None and _env_number("LOCAL_RANK", 0) > 0:
            # kiln.parallel: every process of a node reads the same config and fails alike: its first one says so
            from kiln.parallel.launch.torchrun import wait_for_first_rank
            from kiln.start_signals import started

            started()  # torchrun's SIGTERM ends this wait, as it should, without a word
            wait_for_first_rank()
            raise typer.Exit(2) from None
        raise
    from kiln.start_signals import started

    if nproc != 1 or max_restarts:  # kiln.parallel: torchrun runs this same command in nproc processes
        from kiln.parallel.launch.local import relaunch

        started()  # signals are the launcher's from here on: it passes them to torchrun
        # the config was checked here first: an error in it is shown once, not by every process of every restart
        raise typer.Exit(relaunch(nproc, max_restarts=max_restarts, cfg=cfg))
    from kiln.state.preempt import Interrupted
    from kiln.train.run import run

    started()  # torch is loaded: signals are the run's from here on (kiln.train.run)
    try:
        run(cfg, console, resume=resume)
    except Interrupted as e:  # SIGINT/SIGTERM outside the training loop: what happened and what to do
        if _state["debug"]:
            raise
        err_console.print(str(e), highlight=False)
        raise typer.Exit(e.exit_code) from None


@app.command()
def prepare(
    config: str | None = typer.Argument(None, help="YAML config file or preset name (its data: section is "
                                                     "used); omit for the quickstart's data."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. "
                                                               "data.sources=[corpus/*.jsonl.zst]."),
    verify: str | None = typer.Option(None, "--verify", help="Check every shard hash of the prepared dataset "
                                                               "in this directory instead; exits 1 on a mismatch."),
) -> None:
    """Tokenize data.sources into verified, content-addressed token shards.

    Reads the sources (files, directories, globs, URLs; txt, jsonl, json, parquet, csv, tsv,
    saved HF datasets; .gz/.zst), validates every record, drops duplicates, tokenizes in
    parallel and writes <data.cache_dir>/datasets/<id>/, then prints a report. The id hashes
    the inputs, the tokenizer and the settings: the same inputs reuse the dataset, any change
    makes a new one. An interrupted prepare, run again, keeps the shards it had finished.

    Example: kiln prepare my.yaml data.sources=[data/*.jsonl.zst] data.on_bad_record=skip
    """
    from kiln.config import load_config

    if verify is not None:
        from kiln.data.format.dataset import open_dataset

        ds = open_dataset(verify)
        problems = ds.verify()
        shards = sum(len(s["shards"]) for s in ds.manifest["splits"].values())
        if problems:
            for p in problems:
                err_console.print(f"[bold red]bad:[/] {p}", highlight=False)
            err_console.print(f"{len(problems)} problem(s) in {ds.path}; remove that directory, then run the same "
                              "`kiln prepare` again", highlight=False)
            raise typer.Exit(1)
        console.print(f"ok: {ds.path}: {shards} shard(s) and the tokenizer match the manifest", highlight=False)
        return
    overrides = list(overrides or [])
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    data = load_config(config, overrides).data
    if data.mixture:  # each entry with sources is prepared, with the first entry's tokenizer
        from kiln.data.build import prepare_all

        for ds in prepare_all(data, console):
            print(ds.path)
        return
    from kiln.data.prepare.pipeline import prepare as run_prepare

    print(run_prepare(data, console).path)


@app.command()
def generate(
    run_dir: str = typer.Argument(..., help="Run directory of a finished `kiln train` (or its model/ folder)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue."),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", min=0.0,
                                      help="Sampling temperature: higher is more varied; 0 is greedy (always the "
                                           "most likely token)."),
    top_k: int = typer.Option(50, "--top-k", min=0, help="Sample among the k most likely tokens (0: all)."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Seed for reproducible samples."),
    threads: int | None = typer.Option(None, "--threads", min=1,
                                          help="CPU threads of PyTorch (on the CPU only); default: 1 for a model "
                                               "under 20M parameters (one token at a time is too little to "
                                               "split), else PyTorch's."),
) -> None:
    """Sample text from a trained model.

    Example: kiln generate runs/20261126-101500 --prompt "def main(" -n 64 --seed 0
    """
    import torch

    from kiln.errors import ConfigError
    from kiln.model.generate import generate as sample
    from kiln.model.generate import start_ids
    from kiln.state.weights import load_model
    from kiln.train.threads import apply_threads

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(run_dir, device)
    if tok is None:
        raise ConfigError(f"{run_dir} holds no tokenizer.json; cannot encode the prompt")
    apply_threads(threads, device, sum(p.numel() for p in model.parameters()), sampling=True)
    try:
        ids = start_ids(tok, prompt)
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}; give a prompt") from None
    try:
        out = sample(model, ids, max_new_tokens, temperature, top_k or None, seed, vocab_size=tok.vocab_size)
    except ValueError as e:
        raise ConfigError(f"kiln generate {run_dir}: {e}") from None
    print(prompt + tok.decode(out))


@app.command()
def export(
    source: str = typer.Argument(..., help="A run directory, its model/ folder, a checkpoint directory "
                                           "(checkpoints/step_...) or a Hugging Face model directory."),
    to: str = typer.Option(..., "--to", help="Directory to write the Hugging Face model into."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: the dtype of the "
                                     "model.init_from it was trained from, else as saved)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Tokenizer to ship with it (default: the "
                                                                      "run's)."),
    adapters: bool = typer.Option(False, "--adapters", help="A LoRA run's adapters alone, in PEFT's format "
                                  "(adapter_model.safetensors, adapter_config.json), instead of the merged model."),
    push_to_hub: str | None = typer.Option(None, "--push-to-hub", metavar="OWNER/NAME", help="Then upload it to "
                                           "this Hugging Face Hub model repository (created if missing), with its "
                                           "model card; the token is huggingface_hub's (HF_TOKEN)."),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repository private."),
) -> None:
    """Write a model in the Hugging Face layout (safetensors, config.json, tokenizer files) that
    AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load. A LoRA run writes its
    merged weights, or with --adapters the adapters that peft.PeftModel.from_pretrained loads onto the base.

    Example: kiln export runs/20261126-101500 --to exports/my-model --dtype bf16 --push-to-hub me/my-model
    """
    import warnings

    from kiln.state.export import ExportWarning, export_from

    if private and not push_to_hub:
        raise ConfigError("--private applies to --push-to-hub: give the repository to create as OWNER/NAME")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        out = export_from(source, to, dtype, tokenizer, adapters=adapters, repo=push_to_hub)
    for w in caught:  # Kiln's own as a plain warning line; the libraries' as Python shows them
        if issubclass(w.category, ExportWarning):
            err_console.print(f"warning: {w.message}", markup=False, highlight=False)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(out)
    if push_to_hub:
        from kiln.state.hub import push_to_hub as push

        print(f"pushed to {push(out, push_to_hub, private=private)}")


@app.command()
def inspect(
    path: str = typer.Argument(..., help="A checkpoint directory (runs/X/checkpoints/step_...) or a run directory."),
    config: str | None = typer.Option(None, "--config", "-c", help="Config file or preset to compare the "
                                         "saved config with; KEY=VALUE overrides may follow PATH."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides of --config."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Re-hash every file (slow for big models)."),
    sample: int | None = typer.Option(None, "--sample", min=0, help="Print the text of the run's training sample "
                                      "N (a global index, as a rollback names it) and the source file and line of "
                                      "each document in it."),
) -> None:
    """Show a checkpoint (step, tokens, config, data manifest, sizes, hash status) or the
    checkpoints of a run directory in each tier (memory, disk, archive).

    Example: kiln inspect runs/20261126-101500 --config gpu-124m train.lr=1e-4
    """
    from kiln.config import load_config
    from kiln.state.inspect import describe, describe_sample

    if sample is not None:
        print(describe_sample(path, sample))
        return

    compare = None
    if config is not None or overrides:
        compare = load_config(config, list(overrides or [])).model_dump(mode="json")
    print(describe(path, compare, check=verify))


@app.command("eval")
def eval_(
    target: str = typer.Argument(..., help="A run directory (its model/, else its newest checkpoint), a model/ "
                                           "folder, a checkpoint directory or a Hugging Face model directory."),
    data: list[str] | None = typer.Option(None, "--data", "-d", help="Source files, directories or globs (any "
                                          "format `kiln prepare` reads; repeat the option for more), or one "
                                          "prepared dataset directory made with the model's tokenizer."),
    tasks: str | None = typer.Option(None, "--tasks", help="Instead of --data: lm-evaluation-harness tasks, "
                                     "comma-separated (hellaswag,arc_easy); needs the lm-eval extra."),
    include_path: list[str] | None = typer.Option(None, "--include-path", help="With --tasks: a directory of "
                                                  "task YAML files (yours, or a local copy of lm-eval's)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="With --tasks: at most this many examples "
                                     "per task (default: all)."),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", min=0, help="With --tasks: examples shown "
                                           "before each question (default: each task's own)."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="With --tasks: processes (one per GPU) that share the "
                              "requests, each with the whole model (torchrun on this machine)."),
    more: list[str] | None = typer.Argument(None, help="More sources (a glob the shell expanded after --data)."),
    split: str | None = typer.Option(None, "--split", help="Split of a prepared dataset (default: val if it "
                                     "has one, else train)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="Evaluate at most this many tokens "
                                          "(default: all)."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Rows per batch (default: the run's "
                                          "train.batch_size, else 8)."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Tokens per row (default: the run's "
                                       "train.seq_len, else up to 1024); with --tasks the longest input "
                                       "(default: the model's context)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda or cuda:N."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Seed of the row order (default: the run's "
                                    "train.seed, as its validation reads them; else 0)."),
    out: str | None = typer.Option(None, "--out", "-o", help="JSON file to write (default: RUN/eval.json, "
                                   "RUN/eval-step_N.json for a checkpoint, DIR.eval.json for a Hugging Face model)."),
    fmt: str | None = typer.Option(None, "--format", help="Format of the sources (as data.format; default: the "
                                   "run's, else by suffix)."),
    field: str | None = typer.Option(None, "--field", help="JSON field or column holding the text (as data.field)."),
    text_unit: str | None = typer.Option(None, "--text-unit", help="Text files: a document per file, line or "
                                         "paragraph (as data.text_unit)."),
) -> None:
    """Loss, perplexity and bits per byte of a model on any data (--data), or its scores on
    lm-evaluation-harness benchmarks (--tasks), printed and written as JSON.

    Bits per byte do not depend on the tokenizer, so models with different tokenizers compare on
    the same text. Documents are packed and masked as in training.

    Examples: kiln eval runs/20261126-101500 --data held-out/*.jsonl --max-tokens 1000000;
    kiln eval runs/20261126-101500 --tasks hellaswag,arc_easy --limit 500
    """
    from rich.table import Table

    from kiln.evaluate import evaluate, write_result

    if (data is None) == (tasks is None):
        raise ConfigError("kiln eval: give --data (loss and bits per byte on text) or --tasks (lm-eval benchmarks)")
    if nproc > 1:
        if tasks is None:
            raise ConfigError("kiln eval --nproc shares lm-eval tasks between processes: give --tasks")
        from kiln.parallel.launch.local import relaunch

        raise typer.Exit(relaunch(nproc, command="eval"))
    if tasks is not None:
        from kiln.eval.score import score_target

        names = [t.strip() for t in tasks.split(",") if t.strip()]
        result = score_target(target, names, include_path=include_path or (), limit=limit, num_fewshot=num_fewshot,
                              batch_size=batch_size or 16, device=device, max_length=seq_len)
        if result["rank"] != 0:  # under --nproc: rank 0 writes and prints
            return
        path = write_result(result, out)
        table = Table(title=f"kiln eval {result['target']}", title_justify="left")
        for name in ("task", "metric", "value", "examples"):
            table.add_column(name, justify="left" if name in ("task", "metric") else "right")
        for key, value in result["scores"].items():
            task, metric = key.split("/", 1)
            if not metric.endswith("_stderr"):
                table.add_row(task, metric, f"{value:.4f}", str(result["n_samples"].get(task, "")))
        console.print(table)
        console.print(f"written to {path}", highlight=False)
        return

    result = evaluate(target, [*(data or []), *(more or [])], split=split, max_tokens=max_tokens, batch_size=batch_size,
                      seq_len=seq_len, device=device, seed=seed, format=fmt, field=field, text_unit=text_unit)
    path = write_result(result, out)
    table = Table(title=f"kiln eval {result['target']}", title_justify="left")
    for name in ("loss", "perplexity", "bits per byte", "tokens", "bytes"):
        table.add_column(name, justify="right")
    bpb = result["bits_per_byte"]
    table.add_row(f"{result['loss']:.4f}", f"{result['perplexity']:.3f}", f"{bpb:.4f}" if bpb is not None else "-",
                  f"{result['tokens']:,}", f"{result['bytes']:,}")
    console.print(table)
    console.print(f"data: {', '.join(result['data'])} ({result['split']} split, seq_len {result['seq_len']}, "
                  f"document mask {'on' if result['document_mask'] else 'off'}); written to {path}", highlight=False)


@app.command()
def plot(
    runs: list[str] = typer.Argument(..., help="Run directories (or their metrics.jsonl files) to draw together."),
    out: str | None = typer.Option(None, "--out", "-o", help="PNG file to write; an .html page and a .json list "
                                   "of the panels go beside it (default: RUN/plots.png for one run, "
                                   "plots-compare.png here for several)."),
) -> None:
    """Plot training and validation loss, learning rate, gradient norm, tokens/s, MFU, memory and data
    wait against steps and tokens, several runs overlaid.

    Example: kiln plot runs/20261126-101500 runs/20261126-120000 --out compare.png
    """
    from kiln.monitor.plots import write_plots

    if out is None:
        first = Path(runs[0]).expanduser()
        out = str((first if first.is_dir() else first.parent) / "plots.png") if len(runs) == 1 else "plots-compare.png"
    paths = write_plots(runs, out)
    console.print(f"wrote {paths['png']} and {paths['html']}", highlight=False)


@app.command()
def sweep(
    config: str | None = typer.Argument(None, help="YAML config file or preset name each trial trains with."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides for every trial."),
    space: str = typer.Option(..., "--space", help="YAML search space: params (config keys and their domains), "
                              "search (grid, random, tpe), metric, mode, asha."),
    trials: int = typer.Option(4, "--trials", min=1, help="Trials to sample (with grid params: times the grid)."),
    out: str = typer.Option("sweeps/sweep", "--out", "-o", help="Directory of the sweep: trials/, results.csv, "
                            "best.yaml."),
    search: str | None = typer.Option(None, "--search", help="grid, random or tpe (default: the space's)."),
    address: str | None = typer.Option(None, "--address", help="An existing Ray cluster (auto, or ray://HOST:10001); "
                                       "default: Ray on this machine."),
    cpus: float = typer.Option(1, "--cpus-per-trial", min=0, help="CPUs each trial takes."),
    gpus: float = typer.Option(0, "--gpus-per-trial", min=0, help="GPUs each trial takes (0.5: two share one)."),
    concurrent: int | None = typer.Option(None, "--concurrent", min=1, help="At most this many trials at once."),
) -> None:
    """Hyperparameter search on Ray Tune: each trial is a `kiln train` run in OUT/trials/<id>; ASHA stops
    poor trials early; the results table and the best config are written to OUT.

    Example: kiln sweep my.yaml --space space.yaml --trials 8 --gpus-per-trial 1
    """
    from rich.table import Table

    from kiln.sweep.tune import sweep as run_sweep

    result = run_sweep(config, space, trials, out, list(overrides or []), search=search, address=address,
                       cpus_per_trial=cpus, gpus_per_trial=gpus, concurrent=concurrent,
                       log=lambda m: console.print(m, highlight=False))
    rows = result["rows"]
    table = Table(title=f"kiln sweep {out}", title_justify="left")
    for name in rows[0]:
        if name != "run_dir":
            table.add_column(name, justify="left" if name in ("trial", "status") else "right")
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in r.items() if k != "run_dir"])
    console.print(table)
    console.print(f"best: trial {result['best']['trial']} ({result['best']['run_dir']}); its config: "
                  f"{result['best_config']}; every trial: {result['results']}", highlight=False)


@app.command("runs")
def runs_(
    directory: str = typer.Argument("runs", help="Directory holding run directories (default: runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per run) instead of a table."),
) -> None:
    """List the runs under a directory: name, status (running, finished, stopped, failed, killed), steps,
    tokens, best validation loss, last checkpoint and wall time.

    Example: kiln runs runs/
    """
    import json

    from kiln.monitor.runs import list_runs, runs_table

    found = list_runs(directory)
    if as_json:
        print(json.dumps([r.as_dict() for r in found], indent=1))
        return
    if not found:
        console.print(f"no runs in {directory}", highlight=False)
        return
    # a file or a pipe gets the whole table, however wide (rich fits it to 80 columns there, cutting its cells)
    out = console if console.is_terminal else Console(width=1000, soft_wrap=True)  # fits its widest cell
    out.print(runs_table(found, f"runs in {directory}"))
    for r in found:
        if r.note and r.status not in ("running", "finished"):
            console.print(f"{r.name}: {r.status} ({r.note})", highlight=False)


@app.command()
def plan(
    config: str | None = typer.Argument(None, help="YAML config file or preset name; omit for the quickstart."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. train.batch_size=16."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Processes (one per GPU) the run would use."),
    gpu: str | None = typer.Option(None, "--gpu", help="The card: h100, h200, a100, a100-40, l40s, rtx4090, "
                                   "rtx3090, a10g or cpu (default: this machine's GPU; else h100 when "
                                   "train.device asks for CUDA, the CPU otherwise)."),
) -> None:
    """Estimate, before anything runs: parameters, memory per device (weights, gradients, optimizer
    state, activations), the largest micro-batch that fits, tokens/s and the time to
    train.max_steps, and the disk a checkpoint needs. Warns when the run will not fit.

    Example: kiln plan gpu-1b --gpu rtx4090   |   kiln plan gpu-1b model.size=8b --gpus 4 --gpu a100
    """
    from kiln.config import load_config
    from kiln.plan import make_plan
    from kiln.plan.gpus import local_device
    from kiln.plan.report import render

    overrides = list(overrides or [])
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    cfg = load_config(config, overrides)
    device, note = local_device(gpu, cfg.train.device)
    result = make_plan(cfg, gpus, device)
    if note:
        result.notes.insert(0, note)
    render(result, console)


# --------------------------------------------------------------------------- launch (kiln.parallel.launch)

launch_app = typer.Typer(no_args_is_help=True, help="Write a launch file that runs `kiln train` on a cluster: a "
                         "Kubeflow PyTorchJob (k8s), an sbatch script (slurm) or a SageMaker training job "
                         "(sagemaker); or run it on a Ray cluster (ray).")
app.add_typer(launch_app, name="launch")


@launch_app.command("k8s")
def launch_k8s(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    nodes: int = typer.Option(1, "--nodes", help="Worker pods (one per node)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs (training processes) per pod."),
    image: str = typer.Option(..., "--image", help="Container image with kiln installed."),
    out: str | None = typer.Option(None, "--out", "-o", help="Manifest file to write (default NAME.yaml)."),
    name: str | None = typer.Option(None, "--name", help="Job name (default kiln-<config name>)."),
    claim: str = typer.Option("kiln-shared", "--volume-claim", help="ReadWriteMany PVC for runs and the cache."),
    shm_gib: int | None = typer.Option(None, "--shm-gib", help="/dev/shm size (default 4 GiB per GPU, 8 at least)."),
) -> None:
    """Write a Kubeflow PyTorchJob manifest (elastic, c10d rendezvous) for `kiln train CONFIG`.

    Example: kiln launch k8s gpu-1b --nodes 2 --gpus-per-node 8 --image ghcr.io/me/kiln:latest
    """
    from kiln.parallel.launch import k8s

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    text = k8s.manifest(config, list(overrides or []), nodes, gpus_per_node, image, name=name, claim=claim,
                        shm_gib=shm_gib)
    from kiln.parallel.launch.common import job_name, write_files

    path = Path(out or f"{job_name(config, name)}.yaml")
    write_files({path: text})
    console.print(f"wrote {path}; submit with: kubectl apply -f {shlex.quote(str(path))}", highlight=False)


@launch_app.command("slurm")
def launch_slurm(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes to run on."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs (training processes) per node."),
    out: str | None = typer.Option(None, "--out", "-o", help="Script to write (default NAME.sbatch); the "
                                      "resolved config goes beside it as NAME.config.yaml."),
    name: str | None = typer.Option(None, "--name", help="Job name (default kiln-<config name>)."),
    run_dir: str | None = typer.Option(None, "--run-dir", help="Run directory on shared storage "
                                          "(default runs/NAME here)."),
    time_limit: str | None = typer.Option(None, "--time", help="Slurm time limit, e.g. 2-00:00:00."),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition."),
) -> None:
    """Write an sbatch script that starts torchrun on every node (c10d rendezvous on the first).

    Example: kiln launch slurm gpu-1b --nodes 2 --gpus-per-node 8 --time 1-00:00:00
    """
    import yaml

    from kiln.parallel.launch import slurm
    from kiln.parallel.launch.common import job_name, write_files

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    script_path = Path(out or f"{job_name(config, name)}.sbatch")
    config_path = script_path.with_name(script_path.name.rsplit(".", 1)[0] + ".config.yaml")
    text, cfg_yaml = slurm.script(config, list(overrides or []), nodes, gpus_per_node, config_path, name=name,
                                  run_dir=run_dir, time_limit=time_limit, partition=partition)
    write_files({config_path: cfg_yaml, script_path: text})
    note = slurm.make_log_dir(yaml.safe_load(cfg_yaml)["train"]["run_dir"])  # as the script resolved it
    console.print(f"wrote {script_path} and {config_path}; submit with: sbatch {shlex.quote(str(script_path))}"
                  + (f"\n{note}" if note else ""), highlight=False)


@launch_app.command("sagemaker")
def launch_sagemaker(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    instance_type: str = typer.Option(..., "--instance-type", help="e.g. ml.p5.48xlarge."),
    instance_count: int = typer.Option(1, "--instance-count", help="Instances (nodes)."),
    image: str = typer.Option(..., "--image", help="ECR URI of an image with kiln installed."),
    role: str = typer.Option(..., "--role", help="IAM role ARN the job runs as."),
    output: str = typer.Option(..., "--output", help="S3 prefix for the job's config, output and checkpoints."),
    checkpoint_s3: str | None = typer.Option(None, "--checkpoint-s3", help="S3 prefix SageMaker syncs the run "
                                             "directory to (default OUTPUT/JOB/checkpoints)."),
    spot: bool = typer.Option(False, "--spot", help="Managed spot training: resumes from its checkpoints."),
    max_run: int = typer.Option(86400, "--max-run", help="Seconds of training at most."),
    max_wait: int | None = typer.Option(None, "--max-wait", help="With --spot: seconds of waiting plus training "
                                        "(default twice --max-run)."),
    gpus_per_instance: int | None = typer.Option(None, "--gpus-per-instance", help="Default: the instance type's."),
    inputs: list[str] | None = typer.Option(None, "--input", help="A data channel NAME=s3://..., at "
                                            "/opt/ml/input/data/NAME in the job (repeat for more)."),
    name: str | None = typer.Option(None, "--name", help="Job name prefix (default kiln-<config name>)."),
    out: str | None = typer.Option(None, "--out", "-o", help="JSON file to write (default JOB.json); the config "
                                   "goes beside it as JOB.config.yaml."),
    submit: bool = typer.Option(False, "--submit", help="Upload the config and create the job (boto3)."),
    region: str | None = typer.Option(None, "--region", help="AWS region for --submit (default: your AWS config)."),
) -> None:
    """Write (and with --submit, create) a SageMaker training job: torchrun on every instance, the run directory
    synced to S3 for spot recovery, metrics parsed from Kiln's log lines.

    Example: kiln launch sagemaker gpu-1b --instance-type ml.p5.48xlarge --instance-count 2 --spot --image
    123456789012.dkr.ecr.us-east-1.amazonaws.com/kiln:latest --role arn:aws:iam::123456789012:role/sm
    --output s3://my-bucket/kiln
    """
    import json

    from kiln.parallel.launch import sagemaker
    from kiln.parallel.launch.common import write_files

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    request, cfg_yaml = sagemaker.training_job(
        config, list(overrides or []), instance_type=instance_type, instance_count=instance_count, image=image,
        role=role, output_s3=output, checkpoint_s3=checkpoint_s3, spot=spot, max_run_s=max_run, max_wait_s=max_wait,
        name=name, gpus_per_instance=gpus_per_instance, inputs=list(inputs or []))
    path = Path(out or f"{request['TrainingJobName']}.json")
    config_path = path.with_name(path.name.rsplit(".", 1)[0] + ".config.yaml")
    write_files({path: json.dumps(request, indent=1) + "\n", config_path: cfg_yaml})
    console.print(f"wrote {path} (the CreateTrainingJob request) and {config_path}", highlight=False)
    if submit:
        arn = sagemaker.submit(request, cfg_yaml, region)
        console.print(f"created {arn}", highlight=False)
    else:
        console.print(f"submit: kiln launch sagemaker ... --submit, or upload {config_path} as config.yaml under "
                      f"{request['InputDataConfig'][0]['DataSource']['S3DataSource']['S3Uri']} and run aws "
                      f"sagemaker create-training-job --cli-input-json file://{path}", highlight=False)


@launch_app.command("ray")
def launch_ray(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    workers: int = typer.Option(..., "--workers", help="Training processes (Ray Train workers)."),
    gpus_per_worker: float = typer.Option(0, "--gpus-per-worker", help="GPUs per worker (0: CPU workers, gloo)."),
    cpus_per_worker: float = typer.Option(1, "--cpus-per-worker", help="CPUs per worker."),
    address: str | None = typer.Option(None, "--address", help="An existing Ray cluster (auto, or ray://HOST:10001); "
                                       "default: Ray on this machine."),
    max_failures: int = typer.Option(0, "--max-failures", help="Times Ray restarts the workers after a failure "
                                     "(they resume from the newest checkpoint)."),
    resume: str = typer.Option("auto", "--resume", help="auto, never or force (as kiln train)."),
) -> None:
    """Run `kiln train` on a Ray cluster through Ray Train's TorchTrainer: the process group from Ray, the
    same run and exact resume as under torchrun; the run directory must be on storage every node sees.

    Example: kiln launch ray gpu-1b --workers 16 --gpus-per-worker 1 --address auto train.run_dir=/shared/runs/a
    """
    from kiln.train.on_ray import launch

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    run_dir = launch(config, list(overrides or []), workers, gpus_per_worker=gpus_per_worker,
                     cpus_per_worker=cpus_per_worker, address=address, max_failures=max_failures, resume=resume,
                     log=lambda m: console.print(m, highlight=False))
    console.print(f"run directory: {run_dir}", highlight=False)


def _env_number(name: str, default: int) -> int:
    """An integer environment variable of torchrun's; one that is not a number reads as `default` here (where
    an error is being shown: kiln.parallel.mesh says what is wrong with it when the run starts)."""
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def _rank() -> int | None:
    """This process's rank in a job of several (torchrun's RANK), None in a one-process run."""
    if _env_number("WORLD_SIZE", 1) <= 1:
        return None
    return _env_number("RANK", 0)


def main() -> None:
    from kiln.start_signals import stop_while_starting
    from kiln.streams import keep_writing

    stop_while_starting()  # a signal while the libraries load says so (kiln.start_signals)
    keep_writing()  # a closed pipe (`| tee` under Ctrl-C) or terminal drops the output, not the run
    try:
        app()
    except KilnError as e:
        if _state["debug"]:
            raise
        rank = _rank()
        where = f"error (rank {rank}): " if rank is not None else "error: "  # kiln.parallel: which process failed
        err_console.print(Text.assemble((where, "bold red"), str(e)), highlight=False)
        if rank is not None:  # torchrun's summary of the failed job names this error (kiln.parallel.launch.torchrun)
            from kiln.parallel.launch.torchrun import record_error

            record_error(where + str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
