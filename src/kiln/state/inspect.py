"""`kiln inspect PATH`: what a checkpoint or a run directory holds, and whether it is intact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import StateError
from kiln.state.resume import FREE, config_differences
from kiln.state.rundir import CHECKPOINTS, checkpoints, model_saved, set_aside, unfinished
from kiln.state.verify import META, read_meta, verify


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _status(path: Path, check: bool) -> str:
    if not check:
        return "not verified"
    problems = verify(path)
    if not problems:
        return "ok"
    return "DAMAGED: " + "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")


def _manifest(meta: dict[str, Any]) -> list[str]:
    """The prepared dataset the checkpoint trained on, if it is still in the cache."""
    prints = meta.get("fingerprints", {})
    data = meta.get("config", {}).get("data", {})
    cache, dataset = data.get("cache_dir"), str(prints.get("dataset"))
    if data.get("streaming") or dataset.startswith("stream-"):  # no prepared dataset, so no manifest
        return [f"data: streamed from {', '.join(data.get('sources') or ['?'])} (tokenized while training, no "
                f"prepared dataset; source fingerprint {dataset.removeprefix('stream-')}), tokenizer "
                f"{prints.get('tokenizer')}"]
    if dataset.startswith("mix-"):  # several prepared datasets: their manifests are each entry's
        return [f"data: mixture {dataset} of {len(data.get('mixture') or [])} entries (data.mixture), tokenizer "
                f"{prints.get('tokenizer')}"
                + (f", {prints['train_tokens']:,} train tokens" if prints.get("train_tokens") else "")]
    lines = [f"data: dataset {prints.get('dataset')}, tokenizer {prints.get('tokenizer')}"
             + (f", {prints['train_tokens']:,} train tokens" if prints.get("train_tokens") else "")]
    if cache and prints.get("dataset"):
        path = Path(cache).expanduser() / "datasets" / str(prints["dataset"]) / "manifest.json"
        if path.is_file():
            m = json.loads(path.read_text())
            splits = ", ".join(f"{name}: {s.get('tokens', 0):,} tokens / {s.get('documents', '?')} documents"
                               for name, s in m.get("splits", {}).items())
            lines.append(f"  manifest {path} ({m.get('dtype')}, vocab {m.get('vocab_size')}; {splits})")
        else:
            lines.append(f"  manifest not found at {path} (prepare the same data again to recreate it)")
    return lines


def describe_checkpoint(path: Path, compare: dict[str, Any] | None = None, check: bool = True,
                        show_config: bool = True, status: str | None = None) -> str:
    """`status`: the hash status found already (by describe_run), instead of checking again."""
    meta = read_meta(path)
    lines = [
        f"checkpoint {path}",
        f"step {meta['step']:,}, {meta['tokens_seen']:,} tokens seen, saved {meta['time']} ({meta['reason']}), "
        f"{meta['world_size']} process(es), kiln {meta['versions']['kiln']}, torch {meta['versions']['torch']}",
        f"validation loss: {meta['val_loss']:.4f}" if meta.get("val_loss") is not None else "validation loss: -",
        f"size: {_size(meta['bytes'])} in {len(meta['files'])} files; hashes: {status or _status(path, check)}",
        *_manifest(meta),
    ]
    if compare is not None:
        if compare.get("model", {}).get("vocab_size") is None:  # resolved from the tokenizer at run time
            compare = {**compare, "model": {**compare["model"], "vocab_size": meta["config"]["model"]["vocab_size"]}}
        diffs = config_differences(meta["config"], compare, all_keys=True)
        if diffs:
            lines.append("differences from the given config (* needs --resume force):")
            lines += [f"  {' ' if d.startswith(FREE) else '*'} {d}" for d in diffs]
        else:
            lines.append("the given config matches the saved one")
    if show_config:
        lines.append("config:")
        lines += ["  " + ln for ln in yaml.safe_dump(meta["config"], sort_keys=False).splitlines()]
    return "\n".join(lines)


def _saved_config(cfg_file: Path) -> tuple[dict[str, Any], str | None]:
    """(the run's config.yaml as a dict, None), or ({}, what is wrong with it) for a damaged or hand-edited file:
    inspecting a run shows its checkpoints whatever its config holds."""
    if not cfg_file.is_file():
        return {}, None
    try:
        saved = yaml.safe_load(cfg_file.read_text(errors="replace"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{cfg_file}:{mark.line + 1}" if mark is not None else str(cfg_file)
        return {}, f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})"
    except OSError as e:
        return {}, f"{cfg_file}: cannot be read ({e.strerror or e})"
    if saved is None:
        return {}, f"{cfg_file} is empty"
    if not isinstance(saved, dict):
        return {}, f"{cfg_file} holds a {type(saved).__name__}, not a config mapping"
    if not isinstance(saved.get("checkpoint", {}), dict):
        return {**saved, "checkpoint": {}}, f"{cfg_file}: its checkpoint section is not a mapping"
    return saved, None


def describe_run(run_dir: Path, compare: dict[str, Any] | None = None, check: bool = True) -> str:
    saved, problem = _saved_config(run_dir / "config.yaml")
    ccfg = saved.get("checkpoint", {})
    lines = [f"run {run_dir}"]
    if problem:
        lines.append(f"config: {problem}; the settings read from it show as '?' (each checkpoint's meta.json "
                     "holds the config it was saved with)")
    found = checkpoints(run_dir)
    lines.append(f"on disk ({run_dir / CHECKPOINTS}, keep_last={ccfg.get('keep_last', '?')}): "
                 f"{len(found)} checkpoint(s)" + ("" if found else " - nothing to resume from"))
    status = {p: _status(p, check) for p in found}
    readable = []
    for p in found:
        try:
            meta = read_meta(p)
        except StateError as e:  # listed as what it is: the others, and the newest readable one, still shown
            lines.append(f"  {p.name}  DAMAGED: {e}")
            continue
        readable.append(p)
        val = f"val {meta['val_loss']:.4f}" if meta.get("val_loss") is not None else "val      -"
        lines.append(f"  {p.name}  step {meta['step']:>8,}  {meta['tokens_seen']:>14,} tokens  {val}  "
                     f"{_size(meta['bytes']):>9}  {meta['reason']:<9}  {status[p]}")
    for p in set_aside(run_dir):
        lines.append(f"  {p.name}  damaged, set aside by a resume (kept for inspection)")
    for p in unfinished(run_dir):
        lines.append(f"  {p.name}  unfinished save (killed or failed while writing; never loaded, removed on resume)")
    every = ccfg.get("snapshot_every", 0)
    lines.append(f"in memory: {'a snapshot every ' + str(every) + ' steps' if every else 'off'} "
                 "(lives only inside the training process)")
    url = ccfg.get("archive_url")
    if url:
        from kiln.state.archive import Archive

        arch = Archive(url, run_dir.name)
        index = arch.index()
        names = arch.list()
        lines.append(f"archive ({arch.url}): {len(names)} checkpoint(s)")
        for n in names:
            info = index["checkpoints"].get(n, {})
            best = f"  val {info['val_loss']:.4f}" if info.get("val_loss") is not None else ""
            lines.append(f"  {n}  kept for {', '.join(info.get('kept_for', [])) or '?'}{best}")
    else:
        lines.append("archive: none (set checkpoint.archive_url)")
    model = run_dir / "model"
    lines.append(f"final model: {model}" if model_saved(model) else
                 f"final model: {model} is incomplete (its save did not finish; `kiln train {run_dir}` writes it "
                 "from the final checkpoint)" if model.is_dir() else "final model: none yet")
    if readable:
        newest = "newest checkpoint:" if readable[-1] == found[-1] else "newest readable checkpoint:"
        lines += ["", newest, describe_checkpoint(readable[-1], compare, show_config=False,
                                                  status=status[readable[-1]])]
    return "\n".join(lines)


def describe(path: str | Path, compare: dict[str, Any] | None = None, check: bool = True) -> str:
    p = Path(path).expanduser()
    if (p / META).is_file():
        return describe_checkpoint(p, compare, check)
    if (p / "config.yaml").is_file() or (p / CHECKPOINTS).is_dir():
        return describe_run(p, compare, check)
    if p.is_dir() and p.parent.name == CHECKPOINTS:
        raise StateError(f"{p} is not a complete checkpoint (no {META}): a save that never finished")
    raise StateError(f"{p} is neither a checkpoint (a directory with {META}) nor a run directory (with config.yaml)")


def describe_sample(run_dir: str | Path, n: int) -> str:
    """`kiln inspect RUN --sample N`: the text of global training sample N of a run (as a rollback names it),
    with the source file and line of each document it holds."""
    from kiln.config import load_config
    from kiln.data.build import prepare_all
    from kiln.data.format.shards import TokenStream
    from kiln.data.load.locate import sample_row
    from kiln.data.prepare.provenance import find_documents

    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise StateError(f"{run_dir} is not a run directory (no config.yaml); --sample reads a run's training data")
    cfg = load_config(run_dir / "config.yaml")
    d, t = cfg.data, cfg.train
    if n < 0:
        raise StateError(f"--sample {n}: give a sample index of 0 or more (a rollback names them)")
    if d.streaming:
        raise StateError("--sample reads prepared datasets; this run streams its data (data.streaming=true), and a "
                         "streamed sample is not kept anywhere it could be found again")
    datasets = prepare_all(d)  # the prepared datasets the run read (found in the cache by their id)
    weights = [e.weight for e in d.mixture] or [1.0]
    schedule = None
    if d.schedule is not None:
        from kiln.data.load.schedule import stages_in_samples

        saved = checkpoints(run_dir)
        world = int(read_meta(saved[-1]).get("world_size", 1)) if saved else 1  # stages count optimizer steps
        schedule = stages_in_samples(d.schedule.stages, d.schedule.unit, t.seq_len, t.step_rows(world) * world)
    streams = [TokenStream(ds.shards("train"), ds.dtype, name=f"{ds.manifest['id']}/train") for ds in datasets]
    row = sample_row(streams, t.seq_len, n, weights=weights, seed=t.seed, shuffle=d.shuffle, schedule=schedule)
    ds = datasets[row.dataset]
    entry = d.mixture[row.dataset] if d.mixture else None
    source_cfg = d if entry is None else (d.model_copy(update={"mixture": [], "sources": list(entry.sources)})
                                          if entry.sources else None)
    found = find_documents(source_cfg, "train", [doc for doc, _, _ in row.documents]) if source_cfg else {}
    tok = ds.tokenizer
    lines = [f"sample {n} of {run_dir}: a row of {t.seq_len + 1} tokens at offset {row.start:,} of the train split of "
             f"{ds.path}" + (f" (data.mixture[{row.dataset}])" if d.mixture else "")]
    for doc, first, last in row.documents:
        where = found[doc].origin if doc in found else "source unknown (a dataset given by path)" \
            if source_cfg is None else "source not found (the files changed since they were prepared)"
        lines.append(f"  tokens {first}-{last}: document {doc:,} of the split, from {where}")
    lines += ["text:", tok.decode(row.tokens.tolist())]
    return "\n".join(lines)
