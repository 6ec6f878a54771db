"""`kiln generate`, `kiln export` and `kiln eval`: what is done with a trained model."""

from __future__ import annotations

import typer

from kiln.cli.app import app, console, err_console
from kiln.errors import ConfigError


@app.command()
def generate(
    run_dir: str = typer.Argument(..., help="Run directory of a finished `kiln train` (or its model/ folder), or a "
                                            "Hugging Face model directory (a `kiln export`)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", "-n", min=1, help="Tokens to generate "
                                              "(default: the model's, else 100)."),
    temperature: float | None = typer.Option(None, "--temperature", "-t", min=0.0,
                                             help="Sampling temperature: higher is more varied; 0 is greedy (always "
                                                  "the most likely token). Default: the model's, else 0.8."),
    top_k: int | None = typer.Option(None, "--top-k", min=0, help="Sample among the k most likely tokens (0: all; "
                                     "default: the model's, else 50)."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Seed for reproducible samples."),
    stop: list[str] = typer.Option([], "--stop", help="Also stop at this token (its text, e.g. <|im_end|>) or "
                                   "text (e.g. 'Question:', however many tokens it takes: sampling ends at the "
                                   "token that completes it, kept in the text); repeatable. The model's stop tokens "
                                   "always count: its EOS and the eos_token_id of its Hugging Face "
                                   "generation_config.json."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the model's stop tokens (nor its "
                                    "stop strings): sample all --max-new-tokens, or up to a --stop."),
    threads: int | None = typer.Option(None, "--threads", min=1,
                                          help="CPU threads of PyTorch (on the CPU only); default: 1 for a model "
                                               "under 20M parameters (one token at a time is too little to "
                                               "split), else PyTorch's."),
    top_p: float | None = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Sample among the most likely "
                                       "tokens whose probabilities add up to p (1: all; default: the model's, "
                                       "else 1)."),
    repetition_penalty: float | None = typer.Option(None, "--repetition-penalty", min=0.0, help="Above 1: the "
                                                    "tokens already in the text are less likely (default: the "
                                                    "model's, else 1: none)."),
) -> None:
    """Sample text from a trained model, up to its first stop token (its EOS, and those its Hugging Face
    generation_config.json lists, and --stop tokens), the token that completes one of that file's stop_strings or
    a --stop text (kept in the text, as transformers keeps it), or --max-new-tokens.

    The sampling settings you leave out are the model's own, as transformers' generate reads them: those of its
    generation_config.json (a Hugging Face model directory's, else that of the run's model.init_from directory;
    do_sample false there is greedy), else Kiln's (temperature 0.8, top-k 50, 100 tokens).

    Example: kiln generate runs/20261126-101500 --prompt "def main(" -n 64 --seed 0
    """
    for name, value in (("--temperature", temperature), ("--top-p", top_p), ("--repetition-penalty",
                                                                              repetition_penalty)):
        if value is not None and not value >= 0:  # NaN, which the range check of typer before 0.17 lets through
            raise ConfigError(f"{name} {value}: give 0 or a positive number")
    if top_p == 0 or repetition_penalty == 0:
        raise ConfigError(f"{'--top-p' if top_p == 0 else '--repetition-penalty'} 0 leaves no token to sample: "
                          "give a number above 0")
    import torch

    from kiln.model.generate import generate as sample
    from kiln.model.generate import start_ids
    from kiln.model.stop_strings import StopStrings
    from kiln.plan.threads import apply_threads
    from kiln.state.prompt_bos import prompt_bos
    from kiln.state.sampling import sampling_settings
    from kiln.state.stop_tokens import Stops, named_stops, saved_model_stops
    from kiln.state.weights import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if _hf_directory(run_dir):
        from kiln.evaluate import load_target

        target = load_target(run_dir, command="kiln generate")
        model, tok = target.model.to(device).eval(), target.tokenizer
    else:
        model, tok = load_model(run_dir, device)
    if tok is None:
        raise ConfigError(f"{run_dir} holds no tokenizer.json; cannot encode the prompt")
    apply_threads(threads, device, sum(p.numel() for p in model.parameters()), sampling=True)
    try:
        ids = start_ids(tok, prompt, bos=prompt_bos(run_dir, tok))
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}; give a prompt") from None
    settings = sampling_settings(run_dir, temperature=temperature, top_k=top_k, top_p=top_p,
                                 repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens)
    if settings.source is not None:
        err_console.print(f"sampling: temperature {settings.temperature:g}, top-k {settings.top_k}, top-p "
                          f"{settings.top_p:g}, repetition penalty {settings.repetition_penalty:g}, at most "
                          f"{settings.max_new_tokens} tokens (options given, else {settings.source})",
                          style="dim", markup=False, highlight=False)
    stop_ids, stop_texts = named_stops(tok, stop)
    saved = Stops([], []) if ignore_eos else saved_model_stops(run_dir, tok)
    stops, texts = stop_ids + saved.ids, StopStrings(stop_texts + saved.strings, tok.decode)
    try:
        out = sample(model, ids, settings.max_new_tokens, settings.temperature, settings.top_k or None, seed, stops,
                     vocab_size=tok.vocab_size, stop_strings=texts, top_p=settings.top_p,
                     repetition_penalty=settings.repetition_penalty)
    except ValueError as e:
        raise ConfigError(f"kiln generate {run_dir}: {e}") from None
    except KeyboardInterrupt as e:  # Ctrl-C: the text sampled so far is printed, then the exit status of the signal
        print(prompt + tok.decode(getattr(e, "sampled", [])), flush=True)
        raise
    print(prompt + tok.decode(out))


def _hf_directory(path: str) -> bool:
    """Whether `path` is a Hugging Face model directory (config.json, no Kiln model_config.json or run)."""
    from pathlib import Path

    p = Path(path).expanduser()
    return (p / "config.json").is_file() and not any((p / n).exists() for n in ("model_config.json", "model",
                                                                                 "config.yaml", "meta.json"))


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

    from kiln.state.export import ExportNote, ExportWarning, export_from

    if private and not push_to_hub:
        raise ConfigError("--private applies to --push-to-hub: give the repository to create as OWNER/NAME")
    if push_to_hub:
        from kiln.state.hub import check_repo

        check_repo(push_to_hub)  # before the export's work
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        try:
            out = export_from(source, to, dtype, tokenizer, adapters=adapters, repo=push_to_hub)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP: what is left, and the exit status of the signal
            import signal

            from kiln.data.prepare.bpe import signal_name

            err_console.print(f"export stopped ({signal_name(e)}): {to} is incomplete, not to be loaded (its partial "
                              f"weights and its config.json were removed); {source} is untouched. Export again",
                              highlight=False)
            raise typer.Exit(128 + int(getattr(e, "signum", None) or signal.SIGINT)) from None
    for w in caught:  # Kiln's own as a plain warning line; the libraries' as Python shows them
        if issubclass(w.category, ExportWarning):
            kind = "note" if issubclass(w.category, ExportNote) else "warning"
            err_console.print(f"{kind}: {w.message}", markup=False, highlight=False)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(out)
    if push_to_hub:
        from kiln.state.hub import push_to_hub as push

        print(f"pushed to {push(out, push_to_hub, private=private)}")


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
