"""`kiln prepare` and `kiln inspect`: data made ready to train on, and what a run or dataset holds."""

from __future__ import annotations

import signal

import typer

from kiln.cli.app import app, console, err_console


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
    cfg = load_config(config, overrides)
    data = cfg.data
    from kiln.data.prepare.tokenizer import check_own_tokenizer

    check_own_tokenizer(cfg.model.init_from, data.tokenizer)
    try:
        if data.mixture:  # each entry with sources is prepared, with the first entry's tokenizer
            from kiln.data.build import prepare_all

            for ds in prepare_all(data, console):
                print(ds.path)
            return
        from kiln.data.prepare.pipeline import prepare as run_prepare

        print(run_prepare(data, console).path)
    except KeyboardInterrupt as e:  # it said what it kept; the exit status says which signal (SIGTERM: 143)
        raise typer.Exit(128 + int(getattr(e, "signum", None) or signal.SIGINT)) from None


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
