"""Every script in benchmarks/ runs: a smoke run of each on the CPU, of a few seconds, through its real code path
(both sides where it compares Kiln with a baseline) to its table, so a benchmark that no longer runs fails the
suite; and each starts both ways a user runs it, `python benchmarks/X.py` and `python -m benchmarks.X` (from
the repository root), with --help.

One fresh interpreter imports torch and transformers (the bulk of every start) once, then forks a child per
start, two at a time; each child sets sys.argv, sys.path[0] and the working directory as the interpreter
would (the script's folder, or the current folder for -m) and runs the script as __main__ the way `python`
does (runpy). A script named like a module imported before the fork would shadow it in a real script start
without the fork showing it, so the test fails on such a name first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPERS = {"__init__", "common", "hf_worker", "synthetic"}  # modules of the package that are not benchmarks
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in HELPERS)

# a `kiln train` of a few steps on the CPU; its data is prepared once into {cache}, a folder the scripts share
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=32", "train.batch_size=2",
        "train.device=cpu", "data.max_bytes=150000", "data.vocab_size=384", "data.cache_dir={cache}",
        "logging.every=1"]

# each script's smoke run: its arguments ({tmp}: a fresh folder, also the working directory; {cache}: the shared
# data cache) and a pattern its output matches only when the run went through to its table with numbers
SMOKE = {
    "attention": (["--device", "cpu", "--shapes", "2x4/2", "--seq", "64", "--medians", "16", "--iters", "1"],
                  r"4/2 +16 +[\d.]+ +cuda only +cuda only +\d"),
    "checkpoint": (["--size", "tiny", "--device", "cpu", "--dir", "{tmp}/ck", "--threads", "1",
                    "--json", "{tmp}/out.json"], r"speed-up over torch.save: \d"),
    "cpt_8b": (["--size", "tiny", "--device", "cpu", "--steps", "3", "--data-bytes", "150000"],
               r"peft\+hf-trainer +[1-9]"),
    "cross_entropy": (["--device", "cpu", "--chunks", "64x1000", "--losses", "128x32x1000", "--torch", "eager",
                       "--iters", "2", "--warmup", "1", "--json", "{tmp}/out.json"],
                      r"triton unavailable: the device is cpu[\s\S]*chunk +64x1000 bfloat16 +torch \(eager\) +\d"
                      r"[\s\S]*linear_cross_entropy fwd\+bwd +128x32 V1000 +torch \(eager\) +\d"),
    "doc_mask": (["--size", "tiny", "--seq-len", "64", "--batch-size", "2", "--steps", "1", "--median-doc", "16",
                  "--vocab", "512"],
                 r"ratio masked / causal: \d"),
    "fsdp_8b": (["--size", "tiny", "--device", "cpu", "--nproc", "1", "--steps", "4", "--warmup", "1", "--seq", "32",
                 "--batch", "2", "--accum", "2",
                 "--no-append", "--run-root", "{tmp}", "--cache-dir", "{tmp}/cache", "--set", "data.max_bytes=150000",
                 "--json", "{tmp}/out.json"], r"Kiln / HF Trainer: \*\*\d"),
    # the two paths' first losses agree (the load-balancing term of Qwen2-MoE's on both: 0.001 x about 4)
    "families": (["--families", "qwen3,phi3,gemma2,nemotron,qwen2_moe", "--batch", "2", "--seq", "32", "--steps", "1",
                  "--warmup", "1", "--json", "{tmp}/out.json"],
                 r"nemotron: native .*; first losses (\d\.\d{4})\d* and \1\d* [\s\S]*"
                 r"qwen2_moe: native .*; first losses (\d\.\d{4})\d* and \2\d* [\s\S]*"
                 r"qwen3: auto / native \d.*\nphi3: auto / native \d.*\ngemma2: auto / native \d.*\n"
                 r"nemotron: auto / native \d.*\nqwen2_moe: auto / native \d"),
    # two generic-only families (learned positions; ALiBi on its own attention) beside the native Llama
    "generic_families": (["--families", "gpt2,bloom", "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1",
                          "--json", "{tmp}/out.json"],
                         r"gpt2: [1-9][\d,]* tokens/s, \d[\s\S]*bloom: [1-9][\d,]* tokens/s, \d[\s\S]*"
                         r"llama +native +[1-9][\s\S]*bloom +generic +[1-9]"),
    "fp8": (["--size", "tiny", "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "1", "--compile", "0",
             "--vocab", "512", "--device", "cpu", "--json", "{tmp}/out.json"], r"bf16 +tiny +32 +2 +[1-9][\d,]* +"),
    "fp8_quality": (["--config", "quickstart", "--gpus", "cpu", "--sides", "fp32,bf16", "--steps", "4", "--seq", "32",
                     "--batch", "2", "--warmup", "1", "--eval-every", "2", "--vocab", "300", "--sources",
                     str(Path(json.__file__).parent / "*.py"), "--cache", "{tmp}/cache", "--out", "{tmp}/q",
                     "--runs", "{tmp}/runs",
                     "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.compile=false",
                     "data.val_fraction=0.2", "train.eval_batches=1", "logging.every=1"],
                    r"final validation loss, bf16 against fp32: [+-]\d"),
    "host_adamw": (["--params", "300000", "--steps", "1", "--device", "cpu"],
                   r"bit-identical across variants: True[\s\S]*kiln offload step, in its thread +\d"),
    "hf_auto": (["--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1", "--before"], r"auto / native: \d"),
    "lm_eval_speed": (["--examples", "4", "--docs", "2", "--batch", "4", "--seq", "128", "--vocab", "512"],
                      r"kiln / hf: \d[\d.]*x faster; scores agree: bench_mc/acc yes"),
    "loader": (["--tokens", "100000", "--seconds", "0.1", "--min-rate", "0", "--seq-len", "64", "--batch-size", "2",
                "--out", "{tmp}/out.json"], r"ratio kiln \(doc ids\) / nanoGPT: \d"),
    "moe": (["--shape", "tiny", "--device", "cpu", "--nproc", "1", "--steps", "3", "--warmup", "1", "--seq", "32",
             "--no-append", "--cache-dir", "{tmp}/cache", "--data-bytes", "150000", "--json", "{tmp}/out.json"],
            r"\| Kiln \(native MoE\) \| [1-9][\s\S]*Kiln / HF Trainer: \*\*\d"),
    "nemotron_h": (["--shape", "tiny", "--device", "cpu", "--nproc", "1", "--steps", "2", "--warmup", "1", "--seq",
                    "32", "--no-append", "--cache-dir", "{tmp}/cache", "--set", "data.max_bytes=150000", "--json",
                    "{tmp}/out.json"],
                   r"Kiln native / HF Trainer: \*\*\d[\s\S]*Kiln native / Kiln hf_class=auto: \*\*\d"),
    "offload_8b": (["--shape", "tiny", "--device", "cpu", "--steps", "2", "--data-bytes", "150000", "--timeline",
                    "--json", "{tmp}/out.json"],
                   r"timeline adamw started [\d.]+ None[\s\S]*kiln cpt-8b-24gb \(train.offload\) +[1-9]"),
    "plan_check": (["--presets", "quickstart", "--steps", "4", *(x for o in TINY for x in ("--set", o)),
                    "--out", "{tmp}/plan.md", "--json", "{tmp}/out.json"], r"\| quickstart \| 2 \| none \| \d"),
    "prepare_memory": (["--gb", "0.0005", "--workers", "1", "--vocab", "300", "--dir", "{tmp}"], r"peak RSS ratio \d"),
    "qlora": (["--size", "tiny", "--device", "cpu", "--steps", "3", "--data-bytes", "150000"],
              r"kiln \(NF4, torchao\) +[1-9]"),
    "real_run": (["--config", "quickstart", "--out", "{tmp}/run", "--cache", "{tmp}/cache", "--max-bytes", "100000",
                  "--steps", "2", "--vocab", "384", *TINY[:6], "train.eval_batches=2"],
                 r'"tokens_per_s_median": [1-9]'),
    "scaling": (["--config", "quickstart", "--runs", "1:auto", "--steps", "4",
                 *(x for o in TINY for x in ("--set", o)), "--json", "{tmp}/out.json"], r"1 x auto +[1-9]"),
    "threads": (["--models", "32x1", "--threads", "1", "--rounds", "1", "--steps", "1", "--seq", "32", "--batch", "2",
                 "--gen-tokens", "2"], r"1 thread\(s\): train step +\d"),
    "throughput": (["--runs", "tiny:2", "--seq", "32", "--warmup", "1", "--steps", "1", "--no-default",
                    "--variant", "compile=0", "--variant", "compile=0,docs=2,name=kiln-docs", "--hf-trainer",
                    "--json", "{tmp}/out.json"], r"(?s)kiln-docs +tiny +32 +2 +[1-9].*hf-trainer +tiny +32 +2 +[1-9]"),
    "tokenize_speed": (["--corpus", "{tmp}/corpus", "--workers", "1", "--vocab", "300", "--out", "{tmp}/out.json"],
                       r"token streams identical: True"),
    "trace_summary": (["{tmp}/a/b/one.pt.trace.json", "{tmp}/a/b/two.pt.trace.json", "--json", "{tmp}/out.json"],
                      r"\| nccl \| 0\.03 \| 0\.05 \|"),
    "warmup": (["quickstart", "--steps", "3", "--every", "0.5", *TINY, "train.eval_every=0"],
               r"records: start 0 at \+"),
}

LONGEST = {"nemotron_h", "fsdp_8b", "moe", "real_run", "fp8_quality", "lm_eval_speed"}

# argv: JSON list of [argv, working directory], how many at once; prints one JSON object
# {" ".join(argv): [exit code, output, wall seconds, CPU seconds (with the processes it waited for)]}
SERVER = r'''
import json, os, runpy, sys, tempfile, time
import torch, torch._dynamo  # noqa: F401  (imported once, before the forks: most of each start)
import transformers, transformers.trainer  # noqa: F401
# the parts of Kiln the scripts import (a second of each start)
import kiln.config, kiln.data.load.loader, kiln.data.prepare.tokenizer, kiln.model.hf, kiln.train.run  # noqa: F401

starts, parallel = json.loads(sys.argv[1]), int(sys.argv[2])
loaded = {name.split(".")[0] for name in sys.modules}
shadowed = sorted({os.path.basename(a[0]).removesuffix(".py") for a, _ in starts if a[0] != "-m"} & loaded)
if shadowed:
    print(json.dumps({"shadowed": shadowed}))
    sys.exit(0)
root, running, done = os.getcwd(), {}, {}


def start(argv, cwd):
    out = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: one start, as `python ARGV` makes it in `cwd`
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        os.chdir(cwd)
        code = 0
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file there, as -m does
                sys.path[0] = cwd
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    running[pid] = (" ".join(argv), out, time.perf_counter())


def reap():
    pid, status, usage = os.wait4(-1, 0)
    how, out, t0 = running.pop(pid)
    out.seek(0)
    done[how] = [os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"),
                 round(time.perf_counter() - t0, 1), round(usage.ru_utime + usage.ru_stime, 1)]


for argv, cwd in starts:
    while len(running) >= parallel:
        reap()
    start(argv, cwd)
while running:
    reap()
print(json.dumps(done))
'''


def run_forked(starts: list[tuple[list[str], Path]], parallel: int, timeout: float) -> dict[str, list]:
    """{" ".join(argv): [exit code, output, wall s, CPU s]} of every start, forked from one interpreter with
    `parallel` at once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", SERVER, json.dumps([[a, str(c)] for a, c in starts]), str(parallel)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert "shadowed" not in results, f"benchmarks/ scripts named like modules imported first: {results}"
    assert sorted(results) == sorted(" ".join(a) for a, _ in starts)
    return results


def results_files() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (ROOT / "benchmarks" / "results").rglob("*")}


@pytest.mark.slow  # 27 scripts, several `kiln train` processes each: about 80 s on two cores
def test_every_benchmark_runs_its_smoke_run_on_the_cpu(tmp_path):
    """Each script, tiny, on the CPU, to its table: exit status 0 and the table's text in its output; the
    measured results in benchmarks/results/ stay as they are."""
    assert set(SMOKE) == set(SCRIPTS), f"a smoke run for every benchmark: {sorted(set(SCRIPTS) ^ set(SMOKE))}"
    _trace_inputs(tmp_path / "trace_summary" / "a" / "b")
    corpus = tmp_path / "tokenize_speed" / "corpus"
    corpus.mkdir(parents=True)
    for name in ("textwrap.py", "csv.py", "shlex.py"):
        (corpus / name).write_bytes((Path(json.__file__).parents[1] / name).read_bytes())
    starts = []
    for name in SCRIPTS:
        tmp = tmp_path / name
        tmp.mkdir(exist_ok=True)
        starts.append(([str(ROOT / "benchmarks" / f"{name}.py"), *(
            a.replace("{tmp}", str(tmp)).replace("{cache}", str(tmp_path / "cache")) for a in SMOKE[name][0])], tmp))
    before = results_files()
    # the longest first (several `kiln train` processes each): two at a time, the short ones fill in at the end
    results = run_forked(sorted(starts, key=lambda s: Path(s[0][0]).stem not in LONGEST), parallel=2, timeout=600)
    failed = {}
    for (argv, _), name in zip(starts, SCRIPTS):
        code, out, wall, cpu = results[" ".join(argv)]
        print(f"{name}: exit {code} after {wall} s, {cpu} s of CPU")
        found = re.search(SMOKE[name][1], out)
        if code != 0 or not found:
            failed[name] = f"exit {code}, {SMOKE[name][1]!r} {'' if found else 'NOT '}in the output:\n{out[-3000:]}"
    assert not failed, "\n\n".join(f"--- {k}: {v}" for k, v in failed.items())
    assert results_files() == before


def made_up_trace(nccl_us: float = 30) -> dict:
    """A Chrome trace of two steps (microseconds): a matmul 0-40 and an all-reduce from 30 on another stream (10
    beside compute, the rest alone), a kernel 80-100, then the same again 100 later; the host op aten::mm (20)
    holds a launch (5) of its own."""
    events = []
    for t0 in (0, 100):
        events += [
            {"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{t0}", "ts": t0, "dur": 100},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": t0, "dur": 40, "args": {"stream": 7}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": t0 + 30, "dur": nccl_us,
             "args": {"stream": 20}},
            {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add", "ts": t0 + 80, "dur": 20,
             "args": {"stream": 7}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t0, "dur": 20, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 5, "dur": 5, "pid": 1,
             "tid": 1},
        ]
    return {"traceEvents": events}


def _trace_inputs(folder: Path) -> None:
    """Two traces for trace_summary.py to compare: the second's all-reduce is longer."""
    folder.mkdir(parents=True)
    for name, nccl in (("one", 30), ("two", 50)):
        (folder / f"{name}.pt.trace.json").write_text(json.dumps(made_up_trace(nccl)))


@pytest.mark.slow
def test_every_benchmark_prints_help_as_a_script_and_as_a_module():
    assert "loader" in SCRIPTS and "tokenize_speed" in SCRIPTS and "tokenize" not in SCRIPTS
    starts = [(how, ROOT) for name in SCRIPTS
              for how in (["benchmarks/" + name + ".py", "--help"], ["-m", "benchmarks." + name, "--help"])]
    results = run_forked(starts, parallel=4, timeout=300)
    failed = {how: out[-2000:] for how, (code, out, _, _) in results.items() if code != 0 or "usage:" not in out}
    assert not failed, failed


def test_fsdp_8b_writes_the_final_checkpoint_only_where_the_disk_holds_two(monkeypatch, tmp_path, capsys):
    """An 8B checkpoint is ~96 GB: on a 128 GB disk the run keeps the mid-run one only; with no room for one
    it stops before starting a job."""
    import argparse
    import importlib
    from collections import namedtuple

    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.fsdp_8b")
    usage = namedtuple("usage", "total used free")

    def plan(free_gb: float, choice: str = "auto") -> str:
        monkeypatch.setattr(bench.shutil, "disk_usage", lambda path: usage(0, 0, int(free_gb * 1e9)))
        return bench.plan_disk(argparse.Namespace(size="8b", seq=8192, run_root=str(tmp_path), final_save=choice))

    assert plan(128) == "off" and "96.4 GB" in capsys.readouterr().out
    assert plan(235) == "on"
    assert plan(128, "on") == "on" and "may fill the disk" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="larger file system"):
        plan(64)


def test_trace_summary_splits_a_step_into_compute_nccl_idle_and_host_self_time(monkeypatch, tmp_path):
    """The made-up trace: the all-reduce runs 30-60 (10 beside the matmul, 20 alone)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))
    ts = importlib.import_module("benchmarks.trace_summary")
    path = tmp_path / "steps.pt.trace.json"
    path.write_text(json.dumps(made_up_trace(30)))
    s = ts.summarize(str(path))
    ms = 1e-3
    assert s["steps"] == 2
    assert s["span_ms"] == pytest.approx(100 * ms)  # 200 us over two steps
    assert s["busy_ms"] == pytest.approx(80 * ms) and s["idle_ms"] == pytest.approx(20 * ms)
    assert s["nccl_ms"] == pytest.approx(30 * ms)
    assert s["nccl_overlapped_ms"] == pytest.approx(10 * ms) and s["nccl_exposed_ms"] == pytest.approx(20 * ms)
    assert s["kinds_ms"]["matmul"] == pytest.approx(40 * ms) and s["kinds_ms"]["triton"] == pytest.approx(20 * ms)
    assert s["host_ms"]["aten::mm"] == pytest.approx(15 * ms)  # 20 less the launch nested in it
    assert s["host_ms"]["cudaLaunchKernel"] == pytest.approx(5 * ms)
    # the GPU idles 60-80 in each step, before the triton kernel: charged to the kernel that ends the gap
    assert s["idle_before_ms"] == {"triton_poi_fused_add": pytest.approx(20 * ms)}


def test_results_table_aligns_numbers_and_shows_missing_values(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))
    common = importlib.import_module("benchmarks.common")
    rows = [{"name": "kiln", "tps": 12345.6, "x": 1.5}, {"name": "hf-trainer", "tps": None, "x": float("nan")}]
    cols = [("run", "name"), ("tokens/s", "tps", ",.0f"), ("vs", "x", "{:.2f}x")]
    assert common.table(rows, cols).splitlines() == ["run        tokens/s    vs",
                                                     "kiln         12,346 1.50x",
                                                     "hf-trainer        -     -"]
    assert common.table(rows, cols, markdown=True).splitlines() == [
        "| run | tokens/s | vs |", "| --- | ---: | ---: |", "| kiln | 12,346 | 1.50x |", "| hf-trainer | - | - |"]


def test_random_tokens_come_through_kilns_loader_and_resume_where_they_stopped(monkeypatch, tmp_path):
    """The benchmarks' random data is Kiln's PackedLoader (the Trainer reads its state_dict every step): rows of
    about the documents asked for, and a position that resumes exactly."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(ROOT))
    synthetic = importlib.import_module("benchmarks.synthetic")
    loader = synthetic.random_loader(tmp_path / "a", batch=4, seq=64, vocab=1000, docs_per_row=4, prefetch=0)
    x, y, docs = next(loader)
    assert x.shape == y.shape == docs.shape == (4, 64) and int(x.max()) < 1000
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 2 <= float((docs[:, -1] + 1).float().mean()) <= 8  # documents per row, about 4
    state = loader.state_dict()
    after = next(loader)
    again = synthetic.random_loader(tmp_path / "b", batch=4, seq=64, vocab=1000, docs_per_row=4, prefetch=0)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(after, next(again)))
    causal = synthetic.random_loader(tmp_path / "c", batch=2, seq=64, vocab=70000, prefetch=0)
    assert next(causal)[2] is None and causal.rows.dtype == "uint32"
