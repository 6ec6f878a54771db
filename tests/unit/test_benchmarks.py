"""Every script in benchmarks/ starts both ways a user runs it: `python benchmarks/X.py` and
`python -m benchmarks.X` (from the repository root), here with --help, which needs no GPU.

One fresh interpreter imports torch (the bulk of every start) once, then forks a child per start; each
child sets sys.argv and sys.path[0] as the interpreter would (the script's folder, or the current
folder for -m) and runs the script as __main__ the way `python` does (runpy). A script named like a
module imported before the fork would shadow it in a real script start without the fork showing it, so
the test fails on such a name first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")

# argv: JSON list of [how, ...]; prints one JSON object {how: [exit code, output]}
SERVER = r'''
import json, os, runpy, sys, tempfile
import torch, torch._dynamo  # noqa: F401  (imported once, before the forks: most of each start)

starts = json.loads(sys.argv[1])
loaded = {name.split(".")[0] for name in sys.modules}
shadowed = sorted({os.path.basename(h[0]).removesuffix(".py") for h in starts if h[0] != "-m"} & loaded)
if shadowed:
    print(json.dumps({"shadowed": shadowed}))
    sys.exit(0)
cwd, children = os.getcwd(), {}
for how in starts:
    out = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: one start, as `python ARGS --help` makes it
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        code = 0
        try:
            if how[0] == "-m":
                sys.argv = [how[1], "--help"]  # runpy puts the module's file there, as -m does
                sys.path[0] = cwd
                runpy.run_module(how[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [how[0], "--help"]
                sys.path[0] = os.path.dirname(os.path.realpath(how[0]))
                runpy.run_path(how[0], run_name="__main__")
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
    children[pid] = (" ".join(how), out)
done = {}
for pid, (how, out) in children.items():
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    done[how] = [os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")]
print(json.dumps(done))
'''


@pytest.mark.slow
def test_every_benchmark_prints_help_as_a_script_and_as_a_module():
    assert "loader" in SCRIPTS and "tokenize_speed" in SCRIPTS and "tokenize" not in SCRIPTS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    starts = [how for name in SCRIPTS for how in (["benchmarks/" + name + ".py"], ["-m", "benchmarks." + name])]
    done = subprocess.run([sys.executable, "-c", SERVER, json.dumps(starts)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert "shadowed" not in results, f"benchmarks/ scripts named like modules torch imports: {results}"
    assert sorted(results) == sorted(" ".join(how) for how in starts)
    failed = {how: out[-2000:] for how, (code, out) in results.items() if code != 0 or "usage:" not in out}
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
    """Two steps of a made-up trace (microseconds): a matmul 0-40 and an all-reduce 30-60 on another stream
    (10 beside compute, 20 alone), a kernel 80-100, then the same again 100 later; the host op aten::mm
    (20) holds a launch (5) of its own."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))
    ts = importlib.import_module("benchmarks.trace_summary")
    events = []
    for t0 in (0, 100):
        events += [
            {"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{t0}", "ts": t0, "dur": 100},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": t0, "dur": 40, "args": {"stream": 7}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": t0 + 30, "dur": 30,
             "args": {"stream": 20}},
            {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add", "ts": t0 + 80, "dur": 20,
             "args": {"stream": 7}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t0, "dur": 20, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 5, "dur": 5, "pid": 1,
             "tid": 1},
        ]
    path = tmp_path / "steps.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
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
