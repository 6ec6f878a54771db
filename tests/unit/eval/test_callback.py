"""eval.tasks in a training run: the tasks run at its evaluations and their scores reach metrics.jsonl."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError


def corpus(directory: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / n).read_text() for n in ("argparse.py", "textwrap.py"))
    directory.mkdir()
    for i in range(40):
        (directory / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    return directory


@pytest.mark.slow
def test_task_scores_join_the_evaluations(tiny, tmp_path):
    from kiln.train.run import run

    tasks = tiny[3]
    cfg = load_config(None, [
        "model.size=tiny", "train.seq_len=32", "train.max_steps=4", "train.warmup_steps=1", "train.eval_every=2",
        "train.eval_batches=1", "train.sample_tokens=0", "train.device=cpu", "train.precision=fp32",
        "train.batch_size=4", "checkpoint.every=0", "logging.console=false", "logging.plots=false",
        f"data.sources=[{corpus(tmp_path / 'corpus')}]", "data.val_fraction=0.1", "data.vocab_size=300",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / 'run'}",
        "eval.tasks=[tiny_mc, tiny_ppl]", f"eval.include_path=[{tasks}]", "eval.limit=3", "eval.every=2"])
    run(cfg)
    evals = [r for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if (r := json.loads(line))["event"] == "eval"]
    # evaluations at steps 0, 2 and 4; the tasks at every second one (step 2), and at the last
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert "tiny_mc/acc" not in evals[0]
    for r in evals[1:]:
        assert 0 <= r["tiny_mc/acc"] <= 1 and r["tiny_ppl/bits_per_byte"] > 0 and "val_loss" in r


def test_a_misspelt_task_stops_the_run_before_it_trains(tiny):
    from kiln.eval.callback import TasksAtEval

    cfg = load_config(None, ["eval.tasks=[tiny_mq]", f"eval.include_path=[{tiny[3]}]"]).eval
    with pytest.raises(ConfigError, match="did you mean tiny_mc"):
        TasksAtEval(cfg, tiny[1])
