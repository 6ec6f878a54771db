"""Plots of runs from their metrics.jsonl: `kiln plot RUN [RUN ...]`, and plots.png at the end of every run.

    fig, panels = draw([read_metrics(run) for run in runs])
    write_plots(runs, "compare.png")          # compare.png, compare.html and compare.json (the panels)

One row per metric (training and validation loss, learning rate, gradient norm, tokens/s, and MFU,
peak memory (the GPU's, and the process's on the host) and data wait where a run logged them), each y axis
labelled with its unit (fractions as percents), plotted against optimizer steps, with a tokens scale on top
when every run trains the same tokens a step, or beside it a column against tokens seen when they differ;
several runs share each panel, one colour per run, named in one legend above the panels. Noisy per-step
series (loss, gradient norm, tokens/s, data wait) are drawn faint as logged, with a moving average over them.
The run's events (rollbacks, early stops, warnings, automatic batch choices, out-of-memory retries) are dotted
vertical lines on the loss panels, each labelled with its kind. The HTML page is self-contained: the same figure
embedded as a PNG, and a table of each run's last values. The JSON sidecar lists the panels (metric and x axis
of each), the runs and their events. matplotlib is an extra (`pip install 'kiln[plot]'`), imported only here and
only when drawing, with the Agg backend (no display).
"""

from __future__ import annotations

import base64
import html
import json
import warnings
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, StateError
from kiln.events import Callback
from kiln.files import atomic_write


@dataclass(frozen=True)
class Panel:
    """One metric's panel: its name (in the JSON sidecar), the y axis label with its unit, the series it draws
    ((event, key, kind): kind "train", "val" or "host"; a key "a|b" takes a where a run logged it, else b), the y
    scale, the factor that turns a fraction into a percent, and whether per-step values are smoothed."""

    metric: str
    ylabel: str
    keys: tuple[tuple[str, str, str], ...]
    scale: str = "linear"
    factor: float = 1.0
    smooth: bool = False
    named: bool = False  # its series are told apart by a legend of their own, beside the panel (benchmark metrics)


PANELS: list[Panel] = [
    Panel("loss", "loss (nats per token)", (("train", "loss", "train"), ("eval", "val_loss", "val")), smooth=True),
    Panel("learning rate", "learning rate", (("train", "lr", "train"),)),
    Panel("gradient norm", "gradient norm (before clipping)", (("train", "grad_norm", "train"),), "log", smooth=True),
    Panel("tokens/s", "tokens/s (whole job)", (("train", "tokens_per_s", "train"),), smooth=True),
    Panel("MFU", "MFU (% of peak FLOP/s)", (("train", "mfu", "train"),), factor=100),
    Panel("memory", "peak memory (GiB)", (("train", "peak_mem_gib", "train"),
                                          ("train", "sys/peak_rss_gib|sys/rss_gib", "host"))),
    Panel("data wait", "data wait (% of time)", (("train", "data_wait", "train"),), factor=100, smooth=True),
]
STYLES = {"train": {}, "val": dict(marker="o", markersize=3, linestyle="--"), "host": dict(linestyle=":")}
SMOOTH_FROM = 50  # points: a shorter series is drawn as it is (its moving average would be over one or two)


# the notices of metrics.jsonl marked on the loss panels, and the colour of each
MARKED = {"rollback": "tab:red", "oom_stop": "tab:red", "early_stop": "tab:purple", "oom": "tab:orange",
          "warning": "tab:olive", "data_shift": "tab:cyan", "auto_batch": "tab:gray"}


@dataclass
class RunMetrics:
    name: str
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # the MARKED notices, in order

    def event_x(self, rec: dict[str, Any], x: str) -> float | None:
        """Where an event goes on an axis of `x` ('step' or 'tokens': those seen at its step, where known)."""
        if x == "step":
            return rec.get("step")
        seen = [r["tokens"] for r in self.train if r.get("step") == rec.get("step") and "tokens" in r]
        return seen[0] if seen else None

    def series(self, event: str, key: str, x: str) -> tuple[list[float], list[float]]:
        """(x values, y values) of `key` in the `event` records, x being 'step' or 'tokens'; `key` "a|b": a's
        values where the run logged it, else b's."""
        if "|" in key:
            for k in key.split("|"):
                found = self.series(event, k, x)
                if found[0]:
                    return found
            return [], []
        records = self.train if event == "train" else self.eval
        pts = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
        if event == "eval" and x == "tokens" and not pts:  # older eval records: tokens from the train records
            steps = {r["step"]: r["tokens"] for r in self.train if "tokens" in r}
            pts = [(steps[r["step"]], r[key]) for r in records if r.get(key) is not None and r["step"] in steps]
        return [p[0] for p in pts], [p[1] for p in pts]


def read_metrics(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """The train and eval records of a run directory's metrics.jsonl (the last record of each step wins)."""
    path = Path(run_dir).expanduser()
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise StateError(f"{file} does not exist; give a run directory of `kiln train` (with logging.jsonl on)")
    by_step: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    events = []
    for line in file.read_text(errors="replace").splitlines():  # a damaged byte costs its line
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(rec, dict) and rec.get("event") in by_step and isinstance(rec.get("step"), int):
            by_step[rec["event"]][rec["step"]] = rec
        elif isinstance(rec, dict) and rec.get("event") in MARKED and isinstance(rec.get("step"), int):
            events.append(rec)
    if name is None:  # the run's directory; a file of another name (a copy: old.jsonl) is named itself
        name = path.name if path.is_dir() else path.resolve().parent.name if path.name == "metrics.jsonl" else path.name
    return RunMetrics(name,
                      [by_step["train"][s] for s in sorted(by_step["train"])],
                      [by_step["eval"][s] for s in sorted(by_step["eval"])], events)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'kiln[plot]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def panels_of(runs: list[RunMetrics]) -> list[Panel]:
    """The panels some run has data for, in PANELS order, then a panel per benchmark task of eval.tasks (its
    scores, TASK/METRIC in the eval records, standard errors left out)."""
    fixed = [p for p in PANELS if any(r.series(ev, key, "step")[0] for r in runs for ev, key, _ in p.keys)]
    tasks: dict[str, list[str]] = {}
    for r in runs:
        for rec in r.eval:
            for key, value in rec.items():
                task, sep, metric = key.partition("/")
                if sep and task != "sys" and not metric.endswith("_stderr") and isinstance(value, int | float) \
                        and key not in tasks.setdefault(task, []):
                    tasks[task].append(key)
    return fixed + [Panel(f"{task} (benchmark)", "score", tuple(("eval", k, "val") for k in keys), named=True)
                    for task, keys in tasks.items()]


def tokens_per_step(runs: list[RunMetrics]) -> float | None:
    """The tokens of a step when every run trains the same fixed number a step (then a tokens axis would repeat the
    steps' one), else None."""
    ratios = {round(r["tokens"] / r["step"], 6) for run in runs for r in run.train
              if r.get("step") and isinstance(r.get("tokens"), int | float)}
    return ratios.pop() if len(ratios) == 1 else None


def smoothed(ys: list[float], log: bool = False) -> list[float]:
    """An exponential moving average over about a 25th of the series (debiased at its start, as TensorBoard's;
    in log space for a log axis)."""
    import math

    alpha = 2 / (max(1, len(ys) // 25) + 1)
    out, avg, weight = [], 0.0, 0.0
    for y in ys:
        v = math.log(y) if log else y
        avg, weight = (1 - alpha) * avg + alpha * v, (1 - alpha) * weight + alpha
        out.append(math.exp(avg / weight) if log else avg / weight)
    return out


@contextmanager
def _quiet_glyphs():
    """A run named in a script the font lacks (CJK, emoji) is drawn with boxes, without a warning per glyph."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Glyph .* missing from", UserWarning)
        yield


def _axes_style(ax, panel: Panel, log: bool) -> None:
    from matplotlib import ticker

    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.5, 1, 2, 5: a tick every step
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        return
    if panel.metric == "tokens/s":
        ax.yaxis.set_major_formatter(ticker.EngFormatter(sep=""))  # 12k, 1.5M
    if panel.metric in ("learning rate", "tokens/s", "MFU", "memory", "data wait"):  # amounts: from zero, room above
        ax.set_ylim(0, max(ax.get_ylim()[1] * 1.1, 1e-9))


def draw(runs: list[RunMetrics]):
    """A matplotlib figure (rows: metrics; columns: against steps, and against tokens when runs train different
    numbers of tokens a step, else a tokens scale on top of each panel) and its panel list."""
    plt = _pyplot()
    from matplotlib import ticker
    from matplotlib.lines import Line2D

    panels = panels_of(runs)
    if not panels:
        raise StateError(f"no metrics to plot in {', '.join(r.name for r in runs)}: their metrics.jsonl has no "
                         "train or eval records yet")
    per_step = tokens_per_step(runs)
    xs_of = ("step",) if per_step else ("step", "tokens")
    # against steps alone, the panels fill two columns; against steps and tokens, a row each
    cols = 2 if per_step and len(panels) > 1 else len(xs_of)
    nrows = -(-len(panels) * len(xs_of) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 2.9 * nrows + 0.7), squeeze=False)
    cells = iter(ax for line in axes for ax in line)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    listed, kinds, raw = [], set(), False
    for row, panel in enumerate(panels):
        log = panel.scale == "log" and all(y > 0 for r in runs for ev, k, _ in panel.keys
                                           for y in r.series(ev, k, "step")[1])
        for x in xs_of:
            ax = next(cells)
            for i, run in enumerate(runs):
                for j, (event, key, kind) in enumerate(panel.keys):
                    xs, ys = run.series(event, key, x)
                    if not xs:
                        continue
                    ys = [y * panel.factor for y in ys]
                    kinds.add(kind)
                    style = dict(STYLES[kind], color=colors[i % len(colors)], linewidth=1.3)
                    if panel.named:  # one marker a metric, named in the panel's own legend
                        style.update(marker="osD^v<>"[j % 7], label=key.partition("/")[2] if len(runs) == 1
                                     else f"{run.name}: {key.partition('/')[2]}")
                    if len(xs) == 1:  # a line through one point draws nothing: a run logged once is a dot
                        style.setdefault("marker", "o")
                    if panel.smooth and kind == "train" and len(xs) >= SMOOTH_FROM:
                        ax.plot(xs, ys, color=style["color"], linewidth=0.8, alpha=0.25)  # the values as logged
                        ys, raw = smoothed(ys, log), True
                    ax.plot(xs, ys, **style)
            if panel.named:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
            if panel.metric == "loss":
                _mark_events(ax, runs, x)
            ax.set_title(f"{panel.metric} vs {x}", fontsize=10)
            ax.set_xlabel("tokens" if x == "tokens" else "step")
            _axes_style(ax, panel, log)
            if x == "tokens":
                ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
            elif per_step and row < cols:  # a tokens scale on top of the first row: every run's is the same
                top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
                top.set_xlabel(f"tokens ({per_step:,.0f} a step)", fontsize=8)
                top.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
            listed.append({"metric": panel.metric, "x": x, "keys": [k for _, k, _ in panel.keys]})
    # one legend for the figure, above the panels, off the curves: the runs' colours and what each style is
    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2, label=r.name) for i, r in enumerate(runs)]
    names = {"train": "train", "val": "validation", "host": "host memory (process)"}
    handles += [Line2D([], [], color="0.3", label=names[k], **STYLES[k]) for k in names if k in kinds]
    if raw:
        handles.append(Line2D([], [], color="0.3", alpha=0.3, linewidth=0.8, label="as logged (faint; bold: moving "
                              "average)"))
    for ax in cells:  # an odd number of panels leaves a cell
        ax.set_visible(False)
    top = 1 - 0.65 / fig.get_figheight()
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 3 * cols), fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    with _quiet_glyphs():
        fig.tight_layout(rect=(0, 0, 1, top))
    return fig, listed


def _mark_events(ax, runs: list[RunMetrics], x: str) -> None:
    """A dotted vertical line at each run's events, labelled with the kind (gid 'event:<kind>')."""
    for run in runs:
        for rec in run.events:
            at = run.event_x(rec, x)
            if at is None:
                continue
            kind = rec["event"]
            ax.axvline(at, color=MARKED[kind], linestyle=":", linewidth=1, gid=f"event:{kind}")
            ax.text(at, 1.0, f" {kind.replace('_', ' ')}", transform=ax.get_xaxis_transform(), rotation=90,
                    va="top", ha="left", fontsize=7, color=MARKED[kind])


def _summary_rows(runs: list[RunMetrics]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for r in runs:
        last = r.train[-1] if r.train else {}
        vals = [e["val_loss"] for e in r.eval if e.get("val_loss") is not None]
        bpb = [e["val_bpb"] for e in r.eval if e.get("val_bpb") is not None]
        rows.append((r.name, str(last.get("step", "-")), f"{last['loss']:.4f}" if "loss" in last else "-",
                     f"{min(vals):.4f}" if vals else "-", f"{min(bpb):.4f}" if bpb else "-"))
    return rows


def write_plots(run_dirs: list[str | Path], out: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Draw the runs into `out` (a .png), with `out`.html and `out`.json beside it. Returns the three paths."""
    runs = [read_metrics(d, n) for d, n in zip(run_dirs, names or [None] * len(run_dirs))]
    seen: dict[str, int] = {}
    for r in runs:  # two runs of the same name (runs/a/x, runs/b/x) are told apart
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"
    fig, panels = draw(runs)
    png = Path(out).expanduser()
    if png.suffix.lower() != ".png":
        png = png.with_name(png.name + ".png")
    tmp = png.with_name(png.name + ".tmp")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        with _quiet_glyphs():
            fig.savefig(tmp, dpi=90, format="png")
        tmp.replace(png)
    except OSError as e:  # a full or read-only disk: said, without a traceback, and no partial file left
        with suppress(OSError):
            tmp.unlink()
        raise StateError(f"cannot write the plots to {png}: {e.strerror or e}. Free space there, or give another "
                         "file (kiln plot --out)") from None
    finally:
        _pyplot().close(fig)
    data = base64.b64encode(png.read_bytes()).decode()
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in _summary_rows(runs))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>kiln plots: {html.escape(png.stem)}</title>"
            "<style>body{font-family:sans-serif;margin:1em}td,th{padding:2px 10px;text-align:right}"
            "img{max-width:100%}</style></head><body>"
            f"<h1>{html.escape(', '.join(r.name for r in runs))}</h1><table><tr><th>run</th><th>last step</th>"
            f"<th>last loss</th><th>best val loss</th><th>best val bpb</th></tr>{rows}</table>"
            f"<img alt='training curves' src='data:image/png;base64,{data}'></body></html>")
    page_path, side = png.with_suffix(".html"), png.with_suffix(".json")
    events = [{"run": r.name, "event": e["event"], "step": e["step"]} for r in runs for e in r.events]
    try:
        atomic_write(page_path, page)
        atomic_write(side, json.dumps({"runs": [r.name for r in runs], "panels": panels, "events": events},
                                      indent=1) + "\n")
    except OSError as e:
        raise StateError(f"cannot write the plots' page beside {png}: {e.strerror or e}. Free space there, or give "
                         "another file (kiln plot --out)") from None
    return {"png": png, "html": page_path, "json": side}


class PlotAtEnd(Callback):
    """A callback (rank 0) that writes <run_dir>/plots.png (and .html, .json) when training ends, or when a
    signal stops the run (after its checkpoint). A missing matplotlib, or any failure to draw, is one line on
    the console: plots never fail a run."""

    def __init__(self, run_dir: Path, log=print):
        self.run_dir, self.log = Path(run_dir), log
        self.drawn = False

    def on_run_end(self, trainer, status: str) -> None:
        if status == "stopped" and not self.drawn:  # a failed run ends as soon as it can: no plots
            self.on_train_end(trainer, {})

    def on_train_end(self, trainer, metrics) -> None:
        self.drawn = True
        try:
            out = write_plots([self.run_dir], self.run_dir / "plots.png")
        except ConfigError:
            self.log("plots.png skipped: matplotlib is not installed (pip install 'kiln[plot]')")
        except Exception as e:  # noqa: BLE001 - a plot is a convenience; the run's results are saved
            self.log(f"plots.png skipped: {type(e).__name__}: {e}")
        else:
            self.log(f"plots: {out['png']}")
