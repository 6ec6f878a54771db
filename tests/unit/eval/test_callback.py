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


def write_split_tasks(root: Path, rank: int, docs: list[str]) -> Path:
    """This rank's copy of three tasks: `split_load`, whose data file the run later loses on rank 1 only (a file
    one node cannot read: it fails before any forward), `split_end`, whose results rank 1 alone cannot score (it
    fails after every forward), and `both_ok`."""
    tasks = root / f"tasks{rank}"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    (tasks / "lost.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    (tasks / "rank.py").write_text(
        f"def scored(doc, results):\n    if {rank} == 1:\n        raise ValueError('cannot score on this node')\n"
        "    return {'acc': 1.0}\n")
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    ppl = ("output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
           "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n")
    (tasks / "load.yaml").write_text("task: split_load\n" + data.format(tasks / "lost.jsonl") + ppl)
    (tasks / "ok.yaml").write_text("task: both_ok\n" + data.format(tasks / "docs.jsonl") + ppl)
    (tasks / "end.yaml").write_text(
        "task: split_end\n" + data.format(tasks / "docs.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: 'def'\ndoc_to_choice: [' f', ' g']\ndoc_to_target: 0\nprocess_results: !function rank.scored\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    return tasks


def _split_failure(rank: int, port: int, root: str, fsdp: bool) -> None:
    import os

    import torch
    import torch.distributed as dist

    from kiln.data.prepare.tokenizer import Tokenizer
    from kiln.eval.callback import TasksAtEval
    from kiln.events import Callback
    from kiln.model.registry import param_count
    from kiln.parallel.materialize import build_model
    from kiln.parallel.mesh import init_mesh
    from kiln.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    base = Path(root)
    tasks = write_split_tasks(base, rank, [(base / "docs.txt").read_text()[i * 300:(i + 1) * 300] for i in range(3)])
    cfg = load_config(None, ["model.size=tiny", "model.vocab_size=320", "train.seq_len=32", "train.device=cpu",
                             "dist.timeout_s=60", f"dist.strategy={'fsdp' if fsdp else 'ddp'}", "eval.limit=2",
                             "eval.tasks=[split_load, split_end, both_ok]", f"eval.include_path=[{tasks}]"])
    mesh = init_mesh("cpu", cfg.dist, log=lambda m: None)
    try:
        torch.manual_seed(0)
        model = build_model(cfg, mesh, param_count(cfg.model), log=lambda m: None)
        said, notices = [], []

        class Notices(Callback):
            def on_notice(self, trainer, kind, info):
                notices.append(info)

        callback = TasksAtEval(cfg.eval, Tokenizer.load(base / "tokenizer.json"), said.append if rank == 0 else None)
        trainer = Trainer(cfg, model, None, None, mesh.device, [callback, Notices()], mesh=mesh)
        if rank == 1:
            (tasks / "lost.jsonl").unlink()
        trainer.step, metrics = 10, {"step": 10, "val_loss": 5.0}
        trainer.events.emit("on_eval_end", trainer, metrics)
        total = torch.ones(1)
        dist.all_reduce(total)  # still in step: the next collective of each rank meets the other's
        found = {"metrics": sorted(metrics), "said": said, "total": total.item(),
                 "notices": [n.get("tasks") for n in notices], "message": notices[0]["message"] if notices else ""}
        (base / f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        mesh.close(clean=True)


@pytest.mark.slow  # two processes of a real gloo group, each importing lm-eval
def test_tasks_that_fail_on_one_rank_are_skipped_on_every_rank_which_stay_in_step(tiny, tmp_path):
    """A task that failed on rank 1 only was skipped there while rank 0 ran it: on a sharded model (FSDP) every
    forward is a collective, which rank 1 never answered (a hang) or answered with its next training step's. Now
    the ranks agree: a task that fails on one (at its data, before any forward, or at its results, after them
    all) is skipped on both, said with the rank it failed on, and the other tasks score on both."""
    import shutil
    import socket
    import sysconfig

    import torch.multiprocessing as mp

    shutil.copy(tiny[2] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "docs.txt").write_text(Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_split_failure, args=(port, str(tmp_path), True), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in got:
        assert rank["metrics"] == ["both_ok/bits_per_byte", "step", "val_loss"]  # rank 0's scores, on both
        assert rank["notices"] == [["split_load", "split_end"]] and rank["total"] == 2.0
        assert "split_load: " in rank["message"] and "lost.jsonl" in rank["message"]
        assert "split_end: ValueError: cannot score on this node (on rank 1 of 2)" in rank["message"]
    assert got[0]["message"] == got[1]["message"] and got[1]["said"] == []  # rank 0 speaks: once, then scores
    assert [s.split(":")[0] for s in got[0]["said"]] == ["warning", "tasks step 10"]
