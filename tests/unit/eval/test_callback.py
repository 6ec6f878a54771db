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


def test_tasks_whose_data_fails_at_an_evaluation_are_skipped_and_training_goes_on(tiny, tmp_path):
    """A task's data file gone after the run started (as the Hub out of reach later on): that evaluation keeps its
    loss without the scores, warns once with what failed and what to do, and records a notice each time; it
    stopped the run."""
    import torch

    from kiln.eval.callback import TasksAtEval
    from kiln.events import Callback
    from kiln.model.llama import Transformer
    from kiln.train.trainer import Trainer

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text('{"text": "def f(x):\\n    return x\\n"}\n')
    (tasks / "ppl.yaml").write_text(
        "task: gone_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(tasks / "docs.jsonl")
        + "\ntest_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n")
    cfg = load_config(None, ["model.size=tiny", "model.vocab_size=320", "train.seq_len=32", "train.device=cpu",
                             "eval.tasks=[gone_ppl]", f"eval.include_path=[{tasks}]", "eval.every=1"])
    said, notices = [], []

    class Notices(Callback):
        def on_notice(self, trainer, kind, info):
            notices.append((kind, info))

    callback = TasksAtEval(cfg.eval, tiny[1], said.append)
    trainer = Trainer(cfg, Transformer(cfg.model), None, None, torch.device("cpu"), [callback, Notices()])
    (tasks / "docs.jsonl").unlink()
    for step in (10, 20):
        trainer.step, metrics = step, {"step": step, "val_loss": 5.0}
        trainer.events.emit("on_eval_end", trainer, metrics)
        assert metrics == {"step": step, "val_loss": 5.0} and trainer.model.training
    assert len(said) == 1 and "gone_ppl" in said[0] and "step 10" in said[0] and "kiln eval" in said[0]
    assert [(kind, info["step"], info["condition"]) for kind, info in notices] == [("warning", 10, "eval_tasks"),
                                                                                   ("warning", 20, "eval_tasks")]
