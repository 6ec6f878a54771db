"""train.log: the run's progress as time-stamped lines in the run directory, whatever the console shows, each
process of the run appending its share."""

import re
from types import SimpleNamespace

from kiln.config import load_config
from kiln.events import Events
from kiln.monitor.sinks.logfile import LogFileSink

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  "


def train(path, first: int, last: int, status: str, notice: bool = False):
    """A process of the run from step `first` to `last`, a logging step every 2, an evaluation at each 4."""
    trainer = SimpleNamespace(step=first, cfg=load_config(None, ["train.max_steps=8", "logging.console=false"]))
    events = Events([LogFileSink(path)])
    events.emit("on_train_start", trainer)
    for step in range(first + 1, last + 1):
        trainer.step = step
        metrics = {"step": step, "loss": 6.0 - step / 10, "lr": 1e-3, "tokens_per_s": 1234.0, "sys/peak_rss_gib": 0.5}
        events.emit("on_step_end", trainer, metrics if step % 2 == 0 else None)
        if step % 4 == 0:
            events.emit("on_eval_end", trainer, {"step": step, "val_loss": 5.5, "val_ppl": 244.7})
        if notice and step == 3:
            events.emit("on_notice", trainer, "rollback", {"message": "step 3 went bad: rolled back to step 2"})
    events.emit("on_run_end", trainer, status)


def test_progress_evaluations_notices_and_each_start_and_end_are_lines_of_the_log(tmp_path):
    path = tmp_path / "train.log"
    train(path, 0, 5, "stopped", notice=True)
    train(path, 4, 8, "finished")  # resumed from the checkpoint of step 4
    lines = path.read_text().splitlines()
    assert all(re.match(STAMP, line) for line in lines)
    said = [line[21:] for line in lines]
    assert [s.split("  ")[0] for s in said] == [
        "start at step 0 of 8", "step 2/8 (25%)", "rollback: step 3 went bad: rolled back to step 2", "step 4/8 (50%)",
        "eval step 4: val_loss 5.5000", "end at step 5: stopped",
        "start at step 4 of 8", "step 6/8 (75%)", "step 8/8 (100%)", "eval step 8: val_loss 5.5000",
        "end at step 8: finished"]
    assert said[3].startswith("step 4/8 (50%)  loss 5.6000  lr 1.00e-03  1,234 tok/s  eta ")
    assert said[3].endswith("mem host 0.50 GiB")
