"""`kiln inspect`: a checkpoint's facts and hash status; a run directory's tiers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.config import derive
from kiln.state.checkpointer import Checkpointer
from kiln.state.inspect import describe

from .conftest import run_steps

PRINTS = {"config": "c0", "dataset": "d0", "tokenizer": "t0", "train_tokens": 123}


def test_inspect_run_and_checkpoint(trainer_factory, tmp_path):
    t = trainer_factory(archive_url=str(tmp_path / "arch"), keep_last=2)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    for _ in range(3):
        run_steps(t, 2)
        t.last_eval = {"step": t.step, "val_loss": 10.0 - t.step}
        ck.save(t)
    ck.close()
    run_dir = t.cfg.train.run_dir
    (tmp_path / "run" / "config.yaml").write_text(t.cfg.to_yaml())
    damaged = tmp_path / "run" / "checkpoints" / "step_00000004" / "state.json"
    damaged.write_text(damaged.read_text().replace('"step": 4', '"step": 5'))

    out = describe(run_dir)
    assert "2 checkpoint(s)" in out and "step_00000002" not in out.split("archive")[0]
    assert "step_00000006" in out and "DAMAGED" in out and "state.json" in out
    assert "archive (" in out and "kept for best" in out
    newest = tmp_path / "run" / "checkpoints" / "step_00000006" / "meta.json"
    kept = newest.read_text()
    newest.write_text("{cut")  # the newest one's meta.json damaged: `kiln inspect RUN` was that error alone
    out = describe(run_dir)
    assert "step_00000006  DAMAGED: " in out and "unreadable or corrupted" in out
    assert "newest readable checkpoint:\ncheckpoint " in out and "step_00000004\nstep 4," in out
    newest.write_text(kept)

    changed = derive(t.cfg, {"train.lr": 0.5, "logging.every": 3})
    one = describe(tmp_path / "run" / "checkpoints" / "step_00000006", changed.model_dump(mode="json"))
    assert "step 6, 192 tokens seen" in one and "hashes: ok" in one and "123 train tokens" in one
    assert "* train.lr: 0.002 -> 0.5" in one and "  logging.every: 10 -> 3" in one


def test_inspect_cli_error_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 2 and "neither a checkpoint" in done.stderr and "Traceback" not in done.stderr


def test_inspect_streaming_run_has_no_manifest_and_one_hash_status(trainer_factory, tmp_path):
    t = trainer_factory()
    cfg = derive(t.cfg, {"data.streaming": True})
    prints = {"config": "c0", "dataset": "stream-5eed5eed", "tokenizer": "t0", "train_tokens": None}
    ck = Checkpointer(cfg.train.run_dir, cfg, prints, print)
    run_steps(t, 2)
    ck.save(t)
    ck.close()
    (tmp_path / "run" / "config.yaml").write_text(cfg.to_yaml())

    out = describe(tmp_path / "run")
    assert "manifest" not in out and "streamed from @stdlib" in out and "5eed5eed" in out
    assert "step_00000002" in out and "hashes: ok" in out and "not verified" not in out
    unchecked = describe(tmp_path / "run", check=False)
    assert "hashes: not verified" in unchecked and " ok" not in unchecked


def test_inspect_of_a_run_whose_config_yaml_is_broken_still_lists_its_checkpoints(trainer_factory, tmp_path):
    t = trainer_factory()
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    run_steps(t, 2)
    ck.save(t)
    ck.close()
    cfg_file = tmp_path / "run" / "config.yaml"
    for text, problem in [("train:\n  lr: [0.1\n", "config.yaml:3: not valid YAML"),
                          ("- a\n- b\n", "holds a list, not a config mapping"), ("", "config.yaml is empty"),
                          ("checkpoint: 3\n", "its checkpoint section is not a mapping")]:
        cfg_file.write_text(text)
        out = describe(tmp_path / "run")
        assert problem in out and "1 checkpoint(s)" in out and "step_00000002" in out, out
    cfg_file.write_text("train:\n  lr: [0.1\n")
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tmp_path / "run")], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0 and "Traceback" not in done.stderr and "not valid YAML" in done.stdout


def test_inspect_sample_prints_the_text_of_a_sample_and_where_its_documents_come_from(tmp_path):
    """A rollback names samples by their global index; `kiln inspect RUN --sample N` finds their text and the
    file and line of each document, checked here against the rows the training loader itself reads (with a
    validation split, duplicates removed and a bad record skipped, all of which the count must follow)."""
    import json
    import random

    import torch

    from kiln.config import load_config
    from kiln.data.build import build_data
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.state.inspect import describe_sample

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(3):
        lines = [json.dumps({"text": f"file {f} record {i}: " + " ".join(rng.choices(words, k=rng.randint(2, 12)))})
                 for i in range(40)]
        lines[5] = lines[4]  # a duplicate, removed
        lines[7] = '{"text": 7}'  # a bad record, skipped
        (corpus / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    train_bpe([(corpus / "part0.jsonl").read_text()], 300).save(tmp_path / "tok.json")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, [f"data.sources=[{corpus}]", f"data.tokenizer={tmp_path / 'tok.json'}",
                             f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2", "data.dedup=true",
                             "data.on_bad_record=skip", "train.seq_len=16", "train.batch_size=4", "train.seed=3",
                             "model.size=tiny", f"train.run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    data = build_data(cfg, torch.device("cpu"), rank=0, world=1)
    batches = [next(data.train) for _ in range(3)]
    data.train.close()
    tok = data.tokenizer
    for n in (0, 5, 11):
        tokens, targets, _ = batches[n // 4]
        row = tokens[n % 4].tolist() + [int(targets[n % 4, -1])]
        out = describe_sample(run_dir, n)
        head, text = out.split("\ntext:\n", 1)
        assert text == tok.decode(row), n
        listed = [line for line in head.splitlines() if line.startswith("  tokens ")]
        assert listed, out
        for line in listed:  # "  tokens 3-9: document 17 of the split, from /path/part1.jsonl:12"
            span, origin = line.split(", from ")
            first, last = map(int, span.split()[1].rstrip(":").split("-"))
            path, lineno = origin.rsplit(":", 1)
            record = json.loads(Path(path).read_text().splitlines()[int(lineno) - 1])["text"]
            piece = tok.decode(row[first:last + 1]).replace("<|endoftext|>", "")
            assert piece and piece in record, (n, line, piece, record)
