"""`kiln plot` and plots.png: valid PNG images with a panel per metric a run logged, against steps and against
tokens, several runs overlaid; without matplotlib a ConfigError naming the extra (and a note at a run's end)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from kiln.errors import ConfigError
from kiln.monitor.plots import PlotAtEnd, draw, read_metrics, write_plots

pytest.importorskip("matplotlib")


def fake_run(path, steps=20, gpu=False, tokens_per_step=256):
    path.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        rec = {"event": "train", "time": 1000.0 + s, "step": s, "loss": 5 * math.exp(-s / 10), "lr": 1e-3,
               "grad_norm": 1.0 / s, "tokens": s * tokens_per_step, "tokens_per_s": 1000.0 + s, "data_wait": 0.01}
        if gpu:
            rec |= {"mfu": 0.4, "peak_mem_gib": 12.5}
        lines.append(rec)
        if s % 5 == 0:
            lines.append({"event": "eval", "time": 1000.0 + s, "step": s, "tokens": s * tokens_per_step,
                          "val_loss": 5.2 * math.exp(-s / 10), "val_bpb": 1.2})
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (path / "metrics.jsonl").write_text(text + '{"event": "train", "step": 99, "lo')  # a line cut by a kill
    return path


def read_png(path):
    from matplotlib import image
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG"
    return image.imread(path)


def test_one_run_gets_a_panel_per_metric_against_steps_with_a_tokens_scale(tmp_path):
    run = fake_run(tmp_path / "a")
    paths = write_plots([run], run / "plots.png")
    pixels = read_png(paths["png"])
    assert pixels.ndim == 3 and pixels.shape[0] > 500 and pixels.shape[1] > 500
    panels = json.loads(paths["json"].read_text())["panels"]
    # loss, lr, grad norm, tokens/s, data wait (no MFU or memory in this run's records), against steps only: its
    # tokens are 256 a step, a tokens column would repeat the steps' one
    assert [p["metric"] for p in panels] == ["loss", "learning rate", "gradient norm", "tokens/s", "data wait"]
    assert {p["x"] for p in panels} == {"step"}
    page = paths["html"].read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page and ">a<" in page


def test_several_runs_share_the_panels_and_gpu_metrics_add_panels(tmp_path, recwarn):
    runs = [fake_run(tmp_path / "cpu"), fake_run(tmp_path / "gpu 运行 🔥", gpu=True, tokens_per_step=512)]
    fig, panels = draw([read_metrics(r) for r in runs])
    # 256 and 512 tokens a step: a column against tokens compares them; MFU and peak memory join
    assert len(panels) == 14 and len([ax for ax in fig.axes if ax.get_visible()]) >= 14
    loss_vs_tokens = fig.axes[1]
    assert len(loss_vs_tokens.get_lines()) == 4  # train and val of each run
    assert max(loss_vs_tokens.get_lines()[2].get_xdata()) == 20 * 512  # the tokens axis is each run's own
    paths = write_plots(runs, tmp_path / "out" / "compare")
    assert paths["png"].name == "compare.png" and read_png(paths["png"]).shape[0] > 1000
    assert json.loads(paths["json"].read_text())["runs"] == ["cpu", "gpu 运行 🔥"]
    assert not [w for w in recwarn if "Glyph" in str(w.message)]  # a name the font cannot draw is no warning


def test_the_last_record_of_a_step_wins_and_eval_tokens_come_from_train_records(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    recs = [{"event": "train", "step": 1, "loss": 9.0, "tokens": 64}, {"event": "train", "step": 1, "loss": 4.0,
            "tokens": 64}, {"event": "eval", "step": 1, "val_loss": 4.5}]  # a replayed step; an older eval record
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = read_metrics(run)
    assert m.series("train", "loss", "step") == ([1], [4.0])
    assert m.series("eval", "val_loss", "tokens") == ([64], [4.5])


def test_a_metrics_file_given_itself_is_named_for_its_run_or_itself(tmp_path, monkeypatch):
    """`kiln plot metrics.jsonl` inside the run, or a copy of other name, was named '' (the parent of a relative
    path), or for the folder it was copied into: 'no metrics to plot in : ...'."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": 4.0}) + "\n")
    (run / "old.jsonl").write_text((run / "metrics.jsonl").read_text())
    monkeypatch.chdir(run)
    assert read_metrics("metrics.jsonl").name == "r" and read_metrics("old.jsonl").name == "old.jsonl"


def test_without_matplotlib_a_config_error_names_the_extra(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "a")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'kiln\[plot\]'"):
        write_plots([run], run / "plots.png")
    notes = []
    PlotAtEnd(run, notes.append).on_train_end(None, {})
    assert notes == ["plots.png skipped: matplotlib is not installed (pip install 'kiln[plot]')"]
    assert not (run / "plots.png").exists()


def test_a_run_stopped_by_a_signal_draws_its_plots_and_a_failed_one_none(tmp_path):
    stopped, failed = fake_run(tmp_path / "stopped"), fake_run(tmp_path / "failed")
    notes = []
    PlotAtEnd(stopped, notes.append).on_run_end(None, "stopped")
    PlotAtEnd(failed, notes.append).on_run_end(None, "failed")
    assert notes == [f"plots: {stopped / 'plots.png'}"]
    assert read_png(stopped / "plots.png").ndim == 3 and not (failed / "plots.png").exists()


def test_a_run_logged_once_is_drawn_as_a_dot(tmp_path):
    """A line through one point draws nothing: a short run's one train record would leave its panels empty."""
    run = fake_run(tmp_path / "a", steps=1)
    fig, _ = draw([read_metrics(run)])
    lines = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
    assert lines and all(line.get_marker() not in (None, "None", "") for line in lines)


def test_the_panels_read_at_a_glance(tmp_path):
    """Units on every y axis, a log axis labelled at 0.5 / 1 / 2 ..., MFU and data wait in percent, a moving
    average over noisy per-step values, one legend above the panels (none over the curves), and a memory panel on
    the CPU from the process's peak resident memory."""
    run = tmp_path / "cpu"
    run.mkdir()
    recs = []
    for s in range(1, 201):
        recs.append({"event": "train", "step": s, "tokens": 64 * s, "loss": 4 + math.sin(s) / 2, "lr": 1e-3,
                     "grad_norm": 1.5 + math.sin(s), "tokens_per_s": 900.0 + 300 * math.sin(s / 3), "mfu": 0.31,
                     "data_wait": 0.02, "sys/peak_rss_gib": 0.42})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig, panels = draw([read_metrics(run)])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}
    assert set(axes) == {f"{p} vs step" for p in ("loss", "learning rate", "gradient norm", "tokens/s", "MFU",
                                                  "memory", "data wait")}
    units = {t: ax.get_ylabel() for t, ax in axes.items()}
    assert "nats" in units["loss vs step"] and "%" in units["MFU vs step"] and "GiB" in units["memory vs step"]
    assert "%" in units["data wait vs step"] and all(units.values())
    fig.canvas.draw()
    grad = axes["gradient norm vs step"]
    labels = [t.get_text() for t in grad.get_yticklabels() if t.get_text()]
    assert grad.get_yscale() == "log" and len(labels) >= 3 and all("^" not in x for x in labels)  # 0.5, 1, 2
    assert max(axes["MFU vs step"].get_lines()[-1].get_ydata()) == pytest.approx(31.0)  # a percent
    assert axes["memory vs step"].get_lines()[-1].get_ydata()[0] == pytest.approx(0.42)
    loss = axes["loss vs step"].get_lines()
    assert len(loss) == 2 and loss[0].get_alpha() < 0.5  # as logged, faint; and its moving average
    assert max(loss[1].get_ydata()) - min(loss[1].get_ydata()) < max(loss[0].get_ydata()) - min(loss[0].get_ydata())
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)  # one legend, off the curves
    assert axes["loss vs step"].get_ylim()[0] > 0 and axes["tokens/s vs step"].get_ylim()[0] == 0


def test_benchmark_scores_get_a_panel_per_task(tmp_path):
    run = fake_run(tmp_path / "a")
    with (run / "metrics.jsonl").open("a") as f:
        for step, acc in ((10, 0.25), (20, 0.31)):
            f.write(json.dumps({"event": "eval", "step": step, "tokens": step * 256, "val_loss": 3.0,
                                "hellaswag/acc": acc, "hellaswag/acc_norm": acc + 0.01, "hellaswag/acc_stderr": 0.01,
                                "arc_easy/acc": acc / 2}) + "\n")
    panels = json.loads(write_plots([run], run / "plots.png")["json"].read_text())["panels"]
    assert [p["metric"] for p in panels if p["x"] == "step"][-2:] == ["hellaswag (benchmark)", "arc_easy (benchmark)"]


def test_events_are_marked_on_the_loss_panels(tmp_path):
    run = fake_run(tmp_path / "r", tokens_per_step=100)
    with (run / "metrics.jsonl").open("a") as f:  # after the cut line, as a resumed process appends
        f.write("\n" + "".join(json.dumps(r) + "\n" for r in [
            {"event": "auto_batch", "time": 1.0, "step": 0, "batch_size": 8},
            {"event": "rollback", "time": 2.0, "step": 6, "bad_step": 8, "to_step": 6},
            {"event": "warning", "time": 3.0, "step": 12, "condition": "data_wait"},
            {"event": "early_stop", "time": 4.0, "step": 20, "reason": "no improvement"},
            {"event": "start", "time": 0.5, "step": 0}]))  # not an event to mark
    # beside a run of 200 tokens a step the loss has a panel against tokens too (alone, a tokens scale on top)
    fig, panels = draw([read_metrics(run), read_metrics(fake_run(tmp_path / "other", tokens_per_step=200))])
    loss_step, loss_tokens = fig.axes[0], fig.axes[1]
    assert loss_tokens.get_title() == "loss vs tokens"
    marks = sorted((line.get_gid(), line.get_xdata()[0]) for line in loss_step.lines if line.get_gid())
    assert marks == [("event:auto_batch", 0), ("event:early_stop", 20), ("event:rollback", 6),
                     ("event:warning", 12)]
    on_tokens = sorted((line.get_gid(), line.get_xdata()[0]) for line in loss_tokens.lines if line.get_gid())
    assert on_tokens == [("event:early_stop", 2000), ("event:rollback", 600), ("event:warning", 1200)]  # step 0
    assert {t.get_text().strip() for t in loss_step.texts} == {"auto batch", "rollback", "warning", "early stop"}
    assert not any(line.get_gid() for ax in fig.axes[2:] for line in ax.lines)  # the loss panels only
    out = write_plots([run], tmp_path / "p.png")
    assert [e["event"] for e in json.loads(out["json"].read_text())["events"]] == \
        ["auto_batch", "rollback", "warning", "early_stop"]


def test_plots_that_cannot_be_written_are_a_state_error(tmp_path):
    """`kiln plot --out` under a file, as on a full or read-only disk: an OSError traceback before."""
    from kiln.errors import StateError

    run = fake_run(tmp_path / "run", steps=3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateError, match=r"cannot write the plots to .*file/p\.png: .*give another file"):
        write_plots([run], tmp_path / "file" / "p.png")
