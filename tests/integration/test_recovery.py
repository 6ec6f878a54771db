"""Recovery in whole runs through the CLI: a stream whose sources differ in difficulty is trained through by the
default rollback, and a forced resume at a rate that diverges is rolled back from its first steps."""

import json
import sysconfig
from pathlib import Path

import pytest

from .conftest import kiln_here, losses

pytestmark = pytest.mark.slow




def two_sources(directory: Path) -> Path:
    """Repetitive records (a_easy.jsonl, read first), then Python source cut in records (b_code.jsonl)."""
    directory.mkdir()
    with open(directory / "a_easy.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": "the cat sat on the mat. " * 20}) + "\n")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:30])
    with open(directory / "b_code.jsonl", "w") as f:
        for i in range(0, 400_000, 2000):
            f.write(json.dumps({"text": text[i:i + 2000]}) + "\n")
    return directory


def events(run_dir: Path, kind: str) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["event"] == kind]


def test_a_stream_that_moves_to_harder_data_trains_through_with_the_default_rollback(tmp_path):
    corpus = two_sources(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    common = ["model.size=tiny", "train.seq_len=64", "train.batch_size=8", f"data.sources=[{corpus}]",
              "data.streaming=true", "data.shuffle=false", "data.vocab_size=512", f"data.cache_dir={tmp_path / 'c'}",
              "logging.every=5", f"train.run_dir={run_dir}", "train.sample_tokens=0", "logging.plots=false",
              "train.eval_every=0", "train.device=cpu", "train.precision=fp32"]
    # both runs in this process through kiln.cli.main (kiln_here): a new interpreter for each cost seconds of imports
    r = kiln_here("train", *common, "train.max_steps=130")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not events(run_dir, "rollback")
    [shift] = events(run_dir, "data_shift")
    train = losses(run_dir)
    before = [v for s, v in train.items() if s < shift["step"]]
    after = [v for s, v in train.items() if s > shift["step"] + 5]
    assert shift["step"] > 50 and min(after) > 10 * before[-1]  # the code is much harder than the records
    assert "taken as a change in the data" in r.stdout

    # the same run trained on at a rate that diverges: rolled back from its first steps after the resume (which
    # has no batch of its own to compare with yet), until the run stops and asks for a lower rate
    r = kiln_here("train", *common, "train.max_steps=160", "train.lr=1.0", "train.warmup_steps=0", "--resume", "force")
    assert r.returncode == 2 and "lower train.lr" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    bad = events(run_dir, "rollback")
    assert len(bad) == 4 and all(b["to_step"] == 130 for b in bad)
    assert all("divergence" in b["reason"] or "max_loss" in b["reason"] for b in bad)
