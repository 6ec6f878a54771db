"""An 8B model (Llama-3-8B shape) with FSDP2 `full` on N GPUs: Kiln beside the Hugging Face Trainer, in one call.

    python benchmarks/fsdp_8b.py --nproc 4 --steps 30 --ac full                  # the 4-GPU measurement
    python benchmarks/fsdp_8b.py --nproc 4 --steps 30 --ac selective --kill-resume
    python benchmarks/fsdp_8b.py --nproc 4 --steps 30 --ac selective --skip-hf --fp8 tensorwise,rowwise  # fp8 vs bf16
    python benchmarks/fsdp_8b.py --size tiny --device cpu --nproc 2 --steps 12 --seq 64   # a smoke test (gloo)

(a) Kiln: `kiln train --nproc N` with model.size=SIZE (8b: d 4096, 32 layers, GQA 32/8, vocab 128256),
    dist.strategy=fsdp, dist.sharding=full, batch 1 per GPU, sequence SEQ, bf16, compile (GPU), activation
    checkpointing --ac, random init, on the standard library corpus (tokenized once into --cache-dir; the
    model keeps its 128256-entry vocabulary). One async checkpoint is written at --checkpoint-at: the time
    the loop was blocked by it is the step after it minus the median step (metrics.jsonl, logging.every=1),
    and the background write time is the checkpoint's meta.json write_seconds.
(b) The Hugging Face Trainer on the same shape (LlamaConfig built here, random init, bf16, fused AdamW,
    batch 1 per GPU, FSDP2 through accelerate with its own activation checkpointing and layer wrapping),
    random token ids; a TrainerCallback times every step (device synchronised), warm-up excluded.

tokens/s per GPU and MFU are medians over the steps after --warmup (both MFUs use Kiln's 6N + 12LdT FLOPs
per token and the card's peak), peak memory is torch.cuda.max_memory_allocated from the first training step
on. --kill-resume then starts another Kiln job, SIGKILLs all its processes once its first checkpoint is
complete, starts it again and checks it resumed from that checkpoint and its loss goes on from there. The
table is printed and appended, dated and with the card's name, to benchmarks/results/fsdp_8b.md. Each job's
phases are printed with their seconds (start-up and data, model build and init, first step with compile,
the steps, the end), so it shows where the time goes.

Disk: an 8B checkpoint (fp32 weights + AdamW moments, 12 bytes a parameter) is about 96 GB. One is written
mid-run; the checkpoint at the end of training (--final-save) is written before the mid-run one is deleted,
so it needs room for two. --final-save auto (the default) writes it only where --run-root has room for two
and says which it chose; the run stops before starting a job if there is no room for even one. The mid-run
checkpoint is the one --kill-resume restarts from, so one checkpoint on disk is enough for everything.
Time: each Kiln job initialises its shards on the GPUs (seconds) and compiles; the HF Trainer's model is
built on the GPU of each rank, then sharded by accelerate. --skip-hf or leaving out --kill-resume keeps one
call shorter.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/fsdp_8b.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time

import psutil

from benchmarks import hf_worker

RESULTS = Path(__file__).parent / "results" / "fsdp_8b.md"


def model_config(size: str, seq: int):
    from kiln.config import RunConfig

    return RunConfig.model_validate({"model": {"size": size, "max_seq_len": max(seq, 64)},
                                     "train": {"seq_len": seq}}).model


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    from kiln.monitor.meters import peak_for_name

    return peak_for_name(torch.cuda.get_device_name())


def kiln_command(args, run_dir: Path, checkpoint_every: int, variant: tuple[str, ...] = ()) -> list[str]:
    cuda = args.device == "cuda"
    vocab = 32000 if args.size != "tiny" else 512
    return [sys.executable, "-m", "kiln.cli", "train", f"model.size={args.size}",
            f"model.max_seq_len={max(args.seq, 64)}", f"train.seq_len={args.seq}", f"train.batch_size={args.batch}",
            f"train.grad_accum={args.accum}", f"train.max_steps={args.steps}",
            f"train.device={args.device}", f"train.precision={'bf16' if cuda else 'fp32'}",
            f"train.compile={str(cuda and not args.no_compile).lower()}", f"train.activation_checkpointing={args.ac}",
            # the evaluations at the start and the end (never skipped) take one batch: device time for the steps
            "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.warmup_steps=2",
            f"train.lr={hf_worker.LR}",
            "logging.every=1", "logging.plots=false",
            "logging.console=false", f"checkpoint.every={checkpoint_every}", "checkpoint.async_save=true",
            "checkpoint.save_final=false", f"checkpoint.at_end={str(args.final_save == 'on').lower()}",
            "checkpoint.keep_last=2", "dist.strategy=fsdp", "dist.sharding=full",
            f"data.vocab_size={vocab}", f"data.cache_dir={args.cache_dir}",
            f"train.run_dir={run_dir}", *args.set, *variant, "--nproc", str(args.nproc)]


def train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "train"]


def speed(recs: dict[int, dict], late: list[int]) -> dict:
    """A Kiln job's speed and losses from its train records by step: medians over the `late` steps, the peak over
    all of them."""
    return {"tokens_per_s_per_gpu": statistics.median(recs[s]["tokens_per_s_per_device"] for s in late),
            "mfu": statistics.median(recs[s].get("mfu") or 0.0 for s in late) or None,
            "peak_gib": max((r.get("peak_mem_gib") or 0.0 for r in recs.values()), default=0.0) or None,
            "first_loss": recs[min(recs)]["loss"], "last_loss": recs[max(recs)]["loss"]}


def publish(text: str, results: Path, append: bool, json_path: str | None, data: dict) -> None:
    """Print the result's text, append it to its results page (unless told not to) and write its JSON."""
    print(text)
    if append:
        results.parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as f:
            f.write(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1))


class Job:
    """A command started now, its output lines stamped with the time they came (time.time()) and kept in `log`."""

    running: set[Job] = set()  # stopped with this script (`stop_jobs`), not left holding the GPUs

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None):
        self.t0, self.lines, self.log = time.time(), [], log
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}  # lines come as printed: their times: phases
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        Job.running.add(self)

    def _read(self) -> None:
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                self.lines.append((time.time(), line.rstrip("\n")))
                f.write(line)
                f.flush()

    def wait(self) -> int:
        code = self.proc.wait()
        Job.running.discard(self)
        self._reader.join()
        self.t_end = time.time()
        return code

    def first(self, prefix: str) -> float | None:
        """When the first line starting with `prefix` came."""
        return next((t for t, line in self.lines if line.lstrip().startswith(prefix)), None)

    def text(self, tail: int = 6000) -> str:
        return "\n".join(line for _, line in self.lines)[-tail:]


def stop_jobs(signum: int, frame) -> None:
    """SIGTERM to this script (a time limit): pass it to the jobs (a Kiln job saves and stops), then exit."""
    for job in list(Job.running):
        job.proc.send_signal(signum)
    for job in list(Job.running):
        job.wait()
    sys.exit(128 + signum)


def kiln_phases(job: Job, recs: dict[int, dict]) -> dict[str, float]:
    """Seconds of each phase of a Kiln job, from the times its console lines and metrics records came."""
    model, built, loaded = job.first("model:"), job.first("global batch:"), job.first("resumed from")
    steps = sorted(recs)
    first, last = (recs[steps[0]]["time"], recs[steps[-1]]["time"]) if steps else (None, None)
    marks = [("start-up, data", job.t0, model), ("model build + init", model, built),
             ("checkpoint load", built, loaded),
             (f"first step {steps[0] if steps else '-'} (compile, first evaluation)", loaded or built, first),
             (f"steps {steps[0] + 1 if steps else '-'}-{steps[-1] if steps else '-'}", first, last),
             ("end (checkpoint wait, exit)", last, job.t_end)]
    return {name: round(b - a, 2) for name, a, b in marks if a is not None and b is not None}


def print_phases(name: str, phases: dict[str, float]) -> None:
    print(f"{name} phases: " + "; ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)


def run_kiln(args, root: Path, variant: tuple[str, ...] = ()) -> dict:
    run_dir = root / "kiln"
    at = args.checkpoint_at or max(args.warmup + 1, args.steps // 2)
    job = Job(kiln_command(args, run_dir, at, variant), root / "kiln.log")
    code = job.wait()
    recs = {r["step"]: r for r in train_records(run_dir)}
    failed = f"kiln train failed ({code}):\n{job.text()}"
    if code != 0 and max(recs, default=0) < args.steps:
        raise SystemExit(failed)
    if code != 0:  # every step was measured; what failed after them (the final save) is reported
        print(failed, flush=True)
    tokens = args.seq * args.batch * args.accum  # per GPU per step (a variant that changes them: blocked_s is off)
    step_s = {s: tokens / r["tokens_per_s_per_device"] for s, r in recs.items()}
    late = [s for s in recs if s > args.warmup and s != at + 1]
    median_step = statistics.median(step_s[s] for s in late)
    out = {**speed(recs, late),
           "losses": {s: r["loss"] for s, r in sorted(recs.items())},
           # wall seconds between consecutive steps' records: what the warm-up steps cost beside the median
           "step_wall_s": {s: round(recs[s]["time"] - recs[s - 1]["time"], 3) for s in sorted(recs) if s - 1 in recs},
           "data_wait": {s: r.get("data_wait") for s, r in sorted(recs.items())},  # the loader's share of each step
           "wall_s": job.t_end - job.t0, "exit_code": code, "phases": kiln_phases(job, recs)}
    ck = run_dir / "checkpoints" / f"step_{at:08d}" / "meta.json"
    if at < args.steps and at + 1 in step_s and ck.is_file():
        meta = json.loads(ck.read_text())
        # the save is called after step `at` is timed: what it blocked is in the time of step at + 1
        out.update(checkpoint_step=at, blocked_s=max(0.0, step_s[at + 1] - median_step),
                   checkpoint_write_s=meta.get("write_seconds"), checkpoint_gib=meta.get("bytes", 0) / 2**30)
    elif at < args.steps:
        out["checkpoint_missing"] = str(ck)
    return out


def descendants(root: int) -> list[int]:
    """Every process below `root`, parents before children (torchrun starts its workers in sessions of their own)."""
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_resume(args, root: Path, reference: dict) -> dict:
    """Start a Kiln job, SIGKILL every process of it once its first checkpoint is complete, start it again;
    its losses after the checkpoint beside those of the job that ran through (`reference`, step -> loss)."""
    run_dir = root / "kiln-kill"
    at = args.checkpoint_at or max(args.warmup + 1, args.steps // 2)  # the step run_kiln saved at
    cmd = kiln_command(args, run_dir, at)
    first = Job(cmd, root / "kill-first.log")
    meta = run_dir / "checkpoints" / f"step_{at:08d}" / "meta.json"
    while not meta.is_file():
        if first.proc.poll() is not None:
            first.wait()
            raise SystemExit(f"the job ended before its checkpoint (code {first.proc.returncode}):\n{first.text()}")
        time.sleep(0.05)
    killed_at = max(train_records(run_dir), key=lambda r: r["step"])["step"]
    for pid in [*reversed(descendants(first.proc.pid)), first.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.wait()
    on_disk = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    before = {r["step"]: r["loss"] for r in train_records(run_dir)}
    job = Job(cmd, root / "kill-resumed.log")
    if job.wait() != 0:
        raise SystemExit(f"the resumed job failed ({job.proc.returncode}):\n{job.text()}")
    recs = {r["step"]: r for r in train_records(run_dir)}
    after = {s: r["loss"] for s, r in recs.items()}
    out = "\n".join(line for _, line in job.lines)
    resumed = f"(step {at}," in out and "resumed from" in out
    ref = {int(k): v for k, v in reference.items()}
    compared = [s for s in after if s > at and s in ref]
    return {"steps_compared": len(compared),
            "max_loss_diff_vs_uninterrupted": max((abs(after[s] - ref[s]) for s in compared), default=None),
            "checkpoint_step": at, "killed_after_step": killed_at, "checkpoints_on_disk_at_kill": on_disk,
            "resumed_from_it": resumed, "restart_to_end_s": job.t_end - job.t0,
            "loss_at_checkpoint": before.get(at), "loss_after_resume": after.get(at + 1),
            "steps_logged": sorted(after) == list(range(1, args.steps + 1)),
            "phases": kiln_phases(job, {s: r for s, r in recs.items() if s > at})}


def run_hf(args, root: Path) -> dict:
    m = model_config(args.size, args.seq)
    vocab = 512 if args.size == "tiny" else m.vocab_size or 128256
    config = dict(vocab_size=vocab, hidden_size=m.d_model, intermediate_size=m.mlp_hidden, num_hidden_layers=m.n_layers,
                  num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, max_position_embeddings=args.seq,
                  rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False)
    spec = {"model": "LlamaForCausalLM", "config_class": "LlamaConfig", "config": config, "layer": "LlamaDecoderLayer",
            "tokens": vocab, "seq": args.seq, "batch": args.batch, "accum": args.accum, "steps": args.steps,
            "warmup": args.warmup, "ac": args.ac, "device": args.device, "out": str(root / "hf"),
            "report": ["reduce_dtype"], "t0": time.time()}
    t0 = time.perf_counter()
    job = Job(hf_worker.command(spec, args.nproc), root / "hf.log", env=hf_worker.env())
    code = job.wait()
    out = hf_worker.parse(x for _, x in job.lines)
    if code != 0 or out is None:
        return {"error": job.text(1500)}
    from kiln.model.registry import flops_per_token

    peak = peak_flops(args.device)
    out["mfu"] = out["tokens_per_s_per_gpu"] * flops_per_token(m, args.seq, vocab) / peak if peak else None
    out["wall_s"] = time.perf_counter() - t0
    return out


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def table(kiln: dict, hf: dict, variants: dict[str, dict] | None = None) -> list[str]:
    """The Markdown table of the jobs (a skipped or failed one says so), then each Kiln job's speed over the HF
    Trainer's."""
    from benchmarks.common import table as markdown

    named = [("Kiln", kiln), ("HF Trainer", hf), *((f"Kiln, `{v}`", r) for v, r in (variants or {}).items())]
    rows = [{**r, "trainer": name, "tokens": r.get("skipped") or ("failed" if "error" in r else
                                                                   r.get("tokens_per_s_per_gpu"))}
            for name, r in named]
    lines = [markdown(rows, [("trainer", "trainer"), ("tokens/s/GPU", "tokens", ",.0f"), ("MFU", "mfu", ".1%"),
                             ("peak GiB", "peak_gib", ".1f"),
                             ("first -> last loss", lambda r: f"{fmt(r.get('first_loss'), '.3f')} -> "
                                                              f"{fmt(r.get('last_loss'), '.3f')}"
                              if "tokens_per_s_per_gpu" in r else "")], markdown=True)]
    if "tokens_per_s_per_gpu" in hf:
        ratios = [(name, r["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"]) for name, r in named
                  if name != "HF Trainer" and "tokens_per_s_per_gpu" in r]
        lines += [f"\n{name} / HF Trainer: **{x:.2f}x** tokens/s per GPU" for name, x in ratios]
    if "tokens_per_s_per_gpu" in kiln:  # each variant (--fp8's float8 runs) against the first Kiln job
        lines += [f"\nKiln, `{v}` / Kiln: **{r['tokens_per_s_per_gpu'] / kiln['tokens_per_s_per_gpu']:.2f}x** "
                  f"tokens/s per GPU, peak memory {fmt(r.get('peak_gib'), '.1f')} against "
                  f"{fmt(kiln.get('peak_gib'), '.1f')} GiB" for v, r in (variants or {}).items()
                  if "tokens_per_s_per_gpu" in r]
    if hf.get("reduce_dtype"):
        lines.append(f"\nThe HF Trainer reduced its gradients in {hf['reduce_dtype']} (accelerate's FSDP2 mixed "
                     "precision); Kiln in float32 unless `dist.reduce_fp32=false`")
    return lines


def plan_disk(args) -> str:
    """'on' or 'off' for the checkpoint at the end of training, from --final-save and the free disk of --run-root
    against the checkpoint's size (12 bytes a parameter); stops here if one checkpoint does not fit."""
    from kiln.model.registry import param_count
    from kiln.plan.memory import checkpoint_bytes

    m = model_config(args.size, args.seq)
    size = checkpoint_bytes(param_count(m, m.vocab_size or 512))
    root = Path(args.run_root or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    gb = 1e9
    if free < 1.05 * size:
        raise SystemExit(f"{root} has {free / gb:.0f} GB free and one {args.size} checkpoint takes {size / gb:.0f} GB: "
                         "give --run-root a larger file system")
    choice = args.final_save
    if choice == "auto":
        choice = "on" if free >= 2.1 * size else "off"
    print(f"disk: {free / gb:.0f} GB free under {root}; one checkpoint is {size / gb:.1f} GB: the mid-run one "
          f"{'and the one at the end of training (two on disk while it is written)' if choice == 'on' else 'only'}"
          f" (--final-save {args.final_save})"
          + (" -- too little room for two: the final checkpoint may fill the disk" if choice == "on"
             and free < 2.1 * size else ""), flush=True)
    return choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b", help="model.size (8b; tiny for a CPU smoke test)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compile, allocator)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1, help="micro-batch per GPU, both trainers (cpt-8b-4gpu: 4)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches accumulated per step, both (cpt-8b-4gpu: 4)")
    ap.add_argument("--ac", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--no-compile", action="store_true", help="Kiln without torch.compile")
    ap.add_argument("--checkpoint-at", type=int, default=0, help="step of the async checkpoint (0: half way)")
    ap.add_argument("--kill-resume", action="store_true", help="also SIGKILL a Kiln job after its checkpoint, resume")
    ap.add_argument("--final-save", default="auto", choices=["auto", "on", "off"],
                    help="write Kiln's checkpoint at the end of training (a second one on disk beside the mid-run "
                         "one while it is written); auto: only where --run-root has room for two")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--run-root", default=None, help="where the run directories go (8B: ~100 GB free for the "
                    "mid-run checkpoint, ~200 GB with --final-save); default: the system's temporary directory")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "kiln-bench-cache"))
    ap.add_argument("--set", action="append", default=[], help="extra Kiln KEY=VALUE override (repeatable)")
    ap.add_argument("--variant", action="append", default=[], help="another Kiln job after the HF Trainer's, with "
                    "these overrides (KEY=VALUE, ';' between several), a row of its own (repeatable)")
    ap.add_argument("--fp8", default="", help="float8 Kiln jobs beside the bf16 one, one per recipe named "
                    "(tensorwise, rowwise; comma-separated): variants train.fp8.enabled=true;train.fp8.recipe=R")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None,
                    help="copy every job's whole output (kiln.log, hf.log, ...) into this folder")
    ap.add_argument("--no-append", action="store_true", help=f"do not append to {RESULTS}")
    args = ap.parse_args()
    args.variant += [f"train.fp8.enabled=true;train.fp8.recipe={r}" for r in filter(None, args.fp8.split(","))]
    signal.signal(signal.SIGTERM, stop_jobs)
    import torch

    from benchmarks.common import run_info

    card = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    info = run_info(torch.device(args.device), ["transformers", "accelerate"], card=card, nproc=args.nproc,
                    size=args.size, seq=args.seq, batch=args.batch, accum=args.accum, ac=args.ac, steps=args.steps)
    if args.checkpoint_at and 2 * args.checkpoint_at < args.steps:  # checkpoint.every: its multiples are saved too
        ap.error(f"--checkpoint-at {args.checkpoint_at}: give at least half of --steps, for one mid-run checkpoint")
    args.final_save = plan_disk(args)
    with tempfile.TemporaryDirectory(dir=args.run_root) as tmp:
        root = Path(tmp)
        kiln = run_kiln(args, root)
        print("kiln", json.dumps(kiln), flush=True)
        print_phases("kiln", kiln["phases"])
        if args.logs:  # a profiler window's traces (--set profile.steps=N) go with the run directory
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for trace in (root / "kiln").glob("**/profile/*.json"):
                shutil.copy(trace, Path(args.logs) / trace.name)
        shutil.rmtree(root / "kiln")  # its checkpoints (about 2 x 90 GB at 8B) make room for the next job's
        hf = {"skipped": "skipped (--skip-hf)"} if args.skip_hf else run_hf(args, root)
        if "error" in hf and args.device == "cpu":  # accelerate's FSDP may refuse the CPU: the smoke test goes on
            hf = {"skipped": "skipped on CPU", "error_tail": hf["error"][-300:]}
        print("hf", json.dumps(hf), flush=True)
        if "phases" in hf:
            print_phases("HF Trainer", hf["phases"])
        variants = {}
        for v in args.variant:  # each as the first Kiln job, plus its overrides (the compile cache is warm now)
            variants[v] = run_kiln(args, root, tuple(o.strip() for o in v.split(";") if o.strip()))
            shutil.rmtree(root / "kiln")
            print("kiln variant", v, json.dumps(variants[v]), flush=True)
        killed = kill_resume(args, root, kiln["losses"]) if args.kill_resume else None
        if killed:
            print("kill-resume", json.dumps(killed), flush=True)
            print_phases("kiln after SIGKILL", killed["phases"])
        if args.logs:  # the run directories go with the temporary folder: keep the jobs' output
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, Path(args.logs) / log.name)
    lines = [f"\n## {info['date']}: {args.size}, {args.nproc} x {card}, seq {args.seq}, batch {args.batch}/GPU x "
             f"accumulation {args.accum}, AC {args.ac}, "
             f"{args.steps} steps (median after {args.warmup})", "", *table(kiln, hf, variants)]
    if "blocked_s" in kiln:
        lines.append(f"\nAsync checkpoint at step {kiln['checkpoint_step']} ({kiln['checkpoint_gib']:.1f} GiB): "
                     f"training blocked {kiln['blocked_s']:.2f} s; written in the background in "
                     f"{kiln['checkpoint_write_s']:.1f} s.")
    if killed:
        lines.append(f"\nSIGKILL after step {killed['killed_after_step']} (checkpoint at {killed['checkpoint_step']}): "
                     f"resumed from it: {killed['resumed_from_it']}; loss {fmt(killed['loss_at_checkpoint'], '.3f')} "
                     f"at the checkpoint -> {fmt(killed['loss_after_resume'], '.3f')} the step after; every step "
                     f"logged: {killed['steps_logged']}; restart to end {killed['restart_to_end_s']:.0f} s; largest "
                     f"loss difference from the job that was not killed over the {killed['steps_compared']} steps "
                     f"after the checkpoint: {fmt(killed['max_loss_diff_vs_uninterrupted'], '.2e')}.")
    phases = [("Kiln", kiln.get("phases")), ("HF Trainer", hf.get("phases")),
              ("Kiln after SIGKILL", killed and killed.get("phases"))]
    lines += [f"\n{name} phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()) for name, ph in phases if ph]
    if "error" in hf:
        lines.append(f"\nHF Trainer failed: `{hf['error'][-300:]!r}`")
    publish("\n".join(lines), RESULTS, not args.no_append, args.json,
            {**info, "kiln": kiln, "hf": hf, "variants": variants, "kill_resume": killed})


if __name__ == "__main__":
    main()
