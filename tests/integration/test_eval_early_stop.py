"""Watching a run, end to end on the CPU: early stopping ends a tiny run whose validation loss stalls (final
checkpoint, model, the reason on the console and in metrics.jsonl, stopped again at once when resumed);
validation reports bits per byte; `kiln eval` of the run, its checkpoint and its Hugging Face export
reproduces the trainer's own validation loss; bits per byte of two tokenizers count the same bytes;
plots.png and `kiln runs` describe the run."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kiln.cli import app
from kiln.config import load_config
from kiln.errors import StateError
from kiln.evaluate import evaluate
from kiln.monitor.runs import list_runs
from kiln.state.rundir import checkpoints
from kiln.state.verify import read_meta
from kiln.train.run import run

from .conftest import stdlib_corpus, tiny_cpu_run

pytestmark = pytest.mark.slow

B, T, EVAL_BATCHES = 4, 32, 2  # T and EVAL_BATCHES: tiny_cpu_run's train.seq_len and train.eval_batches


def base_args(corpus: Path, cache: Path, run_dir: Path, vocab: int = 512) -> list[str]:
    return tiny_cpu_run(cache, corpus, 30, 2, "train.warmup_steps=0", "train.eval_every=2", "checkpoint.keep_last=1",
                        "logging.console=true", "logging.plots=true", f"train.run_dir={run_dir}", batch_size=B,
                        vocab_size=vocab)


def records(run_dir: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def train(args: list[str]) -> tuple[Path, str]:
    out = io.StringIO()
    run_dir = run(load_config(None, args), Console(file=out, width=300))
    return run_dir, out.getvalue()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run whose validation loss cannot improve by min_delta=0.5 at lr 1e-6: stops after 2 evaluations."""
    root = tmp_path_factory.mktemp("watch")
    corpus, cache = root / "corpus", root / "cache"
    corpus.mkdir()
    stdlib_corpus(corpus, 100)
    args = base_args(corpus, cache, root / "run") + ["train.lr=1e-6", "train.early_stop.patience=2",
                                                      "train.early_stop.min_delta=0.5"]
    run_dir, console = train(args)
    return {"run": run_dir, "console": console, "corpus": corpus, "cache": cache, "root": root}


def test_early_stop_ends_the_run_with_a_checkpoint_a_model_and_the_reason(stopped):
    run_dir, console = stopped["run"], stopped["console"]
    assert "stopping early at step 4" in console and "patience=2" in console
    (event,) = records(run_dir, "early_stop")
    # each evaluation is a little lower (lr 1e-6), never by min_delta: the last is the lowest, the best named
    assert event["step"] == 4 and event["best_step"] == 4
    assert max(r["step"] for r in records(run_dir, "train")) == 4
    (ckpt,) = checkpoints(run_dir)
    meta = read_meta(ckpt)
    assert meta["step"] == 4 and meta["reason"] == "final" and meta["stop_reason"].startswith("early stop:")
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert [r.status for r in list_runs(run_dir.parent)] == ["stopped"]
    # train.early_stop.restore_best (on by default): model/ takes the best evaluation's weights (here the last's:
    # tests/unit/train/test_early_stop.py restores an earlier one), and says which
    (note,) = records(run_dir, "model_step")
    assert note["step"] == 4 and "model/ takes the weights of the last step, 4, the best" in console


def test_resuming_a_run_that_stopped_early_stops_again_at_once(stopped):
    run_dir = stopped["run"]
    before = len(records(run_dir, "train"))
    _, console = train([f"train.run_dir={run_dir}", *base_args(stopped["corpus"], stopped["cache"], run_dir),
                        "train.lr=1e-6", "train.early_stop.patience=2", "train.early_stop.min_delta=0.5"])
    assert "stopping early at step 4 (again" in console
    assert "model/ is kept as it was saved: no step was trained since" in console  # the best weights stay there
    assert len(records(run_dir, "train")) == before and read_meta(checkpoints(run_dir)[-1])["step"] == 4


def test_validation_reports_bits_per_byte_and_the_run_draws_its_plots(stopped):
    run_dir = stopped["run"]
    evals = records(run_dir, "eval")
    assert evals and all(0.5 < r["val_bpb"] < 10 and r["tokens"] == r["step"] * B * T for r in evals)
    assert "val_bpb" in stopped["console"]
    from PIL import Image

    with Image.open(run_dir / "plots.png") as im:
        assert im.format == "PNG" and im.size[1] > 500
    panels = json.loads((run_dir / "plots.json").read_text())["panels"]
    # loss, lr, grad norm, tokens/s, the process's memory, data wait; vs steps (a fixed 128 tokens a step)
    assert [p["metric"] for p in panels] == ["loss", "learning rate", "gradient norm", "tokens/s", "memory",
                                             "data wait"]


def dataset_dir(cache: Path, run_dir: Path) -> Path:
    return cache / "datasets" / read_meta(checkpoints(run_dir)[-1])["fingerprints"]["dataset"]


def test_kiln_eval_reproduces_the_trainers_validation_loss(stopped, tmp_path):
    run_dir = stopped["run"]
    last = records(run_dir, "eval")[-1]
    data = dataset_dir(stopped["cache"], run_dir)
    same = dict(split="val", max_tokens=EVAL_BATCHES * B * T, batch_size=B, seq_len=T, device="cpu")
    for target in (run_dir, checkpoints(run_dir)[-1]):
        got = evaluate(target, [str(data)], **same)
        assert got["tokens"] == EVAL_BATCHES * B * T and got["document_mask"] is True
        assert got["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
        assert got["bits_per_byte"] == pytest.approx(last["val_bpb"], rel=1e-5)
        assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--data", str(data), "--split", "val", "--max-tokens",
                                   str(EVAL_BATCHES * B * T), "--out", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    assert "bits per byte" in res.output
    assert json.loads((tmp_path / "e.json").read_text())["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--data", str(data)])  # default out: in the run directory
    assert res.exit_code == 0 and json.loads((run_dir / "eval.json").read_text())["split"] == "val"


def test_kiln_eval_of_a_hugging_face_directory(stopped, tmp_path):
    """The run exported to the Hugging Face layout: the same loss through hf_import, and transformers' own
    model agrees on a row of one document."""
    import torch
    from transformers import AutoModelForCausalLM

    run_dir = stopped["run"]
    hf = tmp_path / "hf"
    assert CliRunner().invoke(app, ["export", str(run_dir), "--to", str(hf)]).exit_code == 0
    data = dataset_dir(stopped["cache"], run_dir)
    ours = evaluate(run_dir, [str(data)], split="val", max_tokens=256, batch_size=B, seq_len=T, device="cpu")
    theirs = evaluate(hf, [str(data)], split="val", max_tokens=256, batch_size=B, seq_len=T, device="cpu",
                      seed=ours["seed"])
    assert theirs["kind"] == "hf" and theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5)
    assert (hf.parent / "hf.eval.json").exists() is False  # evaluate() alone writes nothing
    mine = evaluate(hf, [str(data)], split="val", seq_len=T, batch_size=1, max_tokens=T, device="cpu",
                    document_mask=False, seed=7)
    from kiln.data.format.dataset import open_dataset
    from kiln.data.format.shards import TokenStream
    from kiln.data.load.loader import PackedRows

    ds = open_dataset(data)
    name = f"{ds.manifest['id']}/val"  # the stream name seeds the row order, as in training
    rows = PackedRows([TokenStream(ds.shards("val"), ds.dtype, name=name)], T, 1, seed=7, document_mask=False)
    x, y, _ = rows.next_batch()  # the row kiln eval read
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x).logits[0].float(), y[0])
    assert mine["tokens"] == T and mine["loss"] == pytest.approx(float(ref), rel=1e-4)
    bare = tmp_path / "no-tokenizer"  # weights and config only: the error says what kiln eval needs
    bare.mkdir()
    for f in [hf / "config.json", *hf.glob("*.safetensors*")]:
        shutil.copy(f, bare / f.name)
    with pytest.raises(StateError, match="kiln eval needs the model's own tokenizer") as e:
        evaluate(bare, [str(data)], device="cpu")
    assert "data.tokenizer" not in str(e.value)  # a setting kiln eval does not read


def test_bits_per_byte_of_two_tokenizers_count_the_same_text(stopped, tmp_path):
    other, _ = train(base_args(stopped["corpus"], tmp_path / "cache", tmp_path / "other", vocab=1024)
                     + ["train.max_steps=2"])
    files = sorted(str(p) for p in stopped["corpus"].glob("00*.txt"))
    a = evaluate(stopped["run"], files, device="cpu")
    b = evaluate(other, files, device="cpu")
    assert a["tokenizer"] != b["tokenizer"] and b["tokens"] < a["tokens"]  # the larger vocabulary: fewer tokens
    size = sum(Path(f).stat().st_size for f in files)
    # every token is predicted but the first and the last partial row (< seq_len tokens) of the stream
    for r in (a, b):
        assert size - (T + 1) * r["bytes_per_token"] * 1.5 < r["bytes"] <= size
        assert 1 < r["bits_per_byte"] < 12
