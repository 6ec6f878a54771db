"""Checkpoint speed: Kiln's checkpointer beside torch.save / torch.load of the same state, in one run.

    python benchmarks/checkpoint.py --size 1b            # GPU machine: 1.1B model + AdamW state
    python benchmarks/checkpoint.py --size tiny --device cpu   # a quick check anywhere

The state is a real model with the AdamW moments of one real training step (model, optimizer,
schedule, loader position, RNG). Measured, each in seconds:
  torch.save           torch.save({"model", "optim"}) of the device state dicts (no fsync), and + fsync
  torch.load           torch.load + load_state_dict into the same model and optimizer
  kiln sync save       Checkpointer.save(blocking=True): stage to CPU, DCP write, sha256, meta, rename
                       (first save: allocates the reusable pinned buffers; second: steady state)
  kiln async blocking  what the training loop waits for with async_save (the copy to CPU memory)
  kiln load            Checkpointer.load: DCP read into the live tensors (with and without re-hashing)
Both writers go to the same directory's file system; files stay in the page cache for the loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/checkpoint.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from benchmarks.common import device as pick_device
from benchmarks.common import run_info, sync, timed, write_json
from benchmarks.synthetic import random_loader
from kiln.config import RunConfig
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.state.checkpointer import Checkpointer
from kiln.train.trainer import Trainer


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", help="model size from the registry (tiny, 124m, 350m, 1b, ...)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dir", default="/tmp/kiln-checkpoint-bench", help="where checkpoints are written")
    ap.add_argument("--threads", type=int, default=8, help="checkpoint.write_threads")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    device = pick_device(args.device)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = RunConfig.model_validate({
        "model": {"size": args.size, **({"vocab_size": 32000} if args.size in ("tiny",) else {})},
        "train": {"seq_len": 128, "batch_size": 1, "device": str(device), "run_dir": str(root / "run")},
        "checkpoint": {"write_threads": args.threads, "keep_last": 1},
    })
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    data = tempfile.TemporaryDirectory()
    loader = random_loader(data.name, 1, 128, cfg.model.vocab_size, docs_per_row=2)  # Kiln's loader: a real position
    trainer = Trainer(cfg, model, loader, None, device)
    trainer.train_step()  # real AdamW moments
    trainer.step, trainer.tokens_seen = 1, 128
    sync(device)
    opt = trainer.optimizer
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    r = run_info(device, size=args.size, params=param_count(cfg.model), state_gb=round(state_bytes / 1e9, 2),
                 write_threads=args.threads)
    print(f"{args.size}: {r['params'] / 1e9:.2f}B parameters, {r['state_gb']} GB of model + AdamW state on "
          f"{r['device']}", flush=True)
    probe = next(iter(model.parameters())).detach().flatten()[:1000].clone()

    # --- baseline: torch.save / torch.load of the same state
    base = root / "torch.pt"
    r["torch_save_s"], _ = timed(lambda: torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                                                    base), device)
    r["torch_save_fsync_s"] = r["torch_save_s"] + timed(lambda: fsync_file(base), device)[0]

    def torch_load():
        sd = torch.load(base, map_location=device, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    r["torch_load_s"], _ = timed(torch_load, device)
    base.unlink()
    print(f"torch.save {r['torch_save_s']:.2f} s (+fsync {r['torch_save_fsync_s']:.2f} s), "
          f"torch.load {r['torch_load_s']:.2f} s", flush=True)
    write_json(args.json, r)

    # --- Kiln: sync saves (first allocates the reusable staging buffers), fsync on (the default)
    ck = Checkpointer(cfg.train.run_dir, cfg, {"bench": True}, print)
    r["kiln_sync_first_s"], path = timed(lambda: ck.save(trainer, blocking=True), device)
    trainer.step += 1
    r["kiln_sync_s"], path = timed(lambda: ck.save(trainer, blocking=True), device)
    r["kiln_write_s"] = json.loads((path / "meta.json").read_text())["write_seconds"]
    ck.ccfg = ck.ccfg.model_copy(update={"fsync": False})  # the config is frozen: the checkpointer gets a copy
    trainer.step += 1
    r["kiln_sync_nofsync_s"], path = timed(lambda: ck.save(trainer, blocking=True), device)
    ck.ccfg = ck.ccfg.model_copy(update={"fsync": True})
    r["kiln_hash_s"] = json.loads((path / "meta.json").read_text())["hash_seconds"]
    print(f"kiln sync save {r['kiln_sync_s']:.2f} s (first {r['kiln_sync_first_s']:.2f} s, without fsync "
          f"{r['kiln_sync_nofsync_s']:.2f} s)", flush=True)

    # --- Kiln: load (into the live model and optimizer), with and without re-hashing every file
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    r["kiln_load_s"], _ = timed(lambda: ck.load(trainer, path, check_hashes=False), device)
    r["kiln_load_verified_s"], _ = timed(lambda: ck.load(trainer, path, check_hashes=True), device)
    assert torch.equal(next(iter(model.parameters())).detach().flatten()[:1000], probe), "load lost the weights"
    print(f"kiln load {r['kiln_load_s']:.2f} s (with hash check {r['kiln_load_verified_s']:.2f} s)", flush=True)
    ck.close()  # its staging buffers go with it
    write_json(args.json, r)

    # --- Kiln: async saves; the loop blocks only for the copy to CPU memory. As in training, the
    # pinned buffers are allocated in the background after the first step (warm_up).
    ck = Checkpointer(cfg.train.run_dir, cfg, {"bench": True}, print)
    r["kiln_warm_up_s"], _ = timed(lambda: (ck.warm_up(trainer), ck.wait_warm_up()), device)
    for i in range(2):
        trainer.step += 1
        blocked, path = timed(lambda: ck.save(trainer, blocking=False), device)
        t0 = time.perf_counter()
        ck.wait()
        r[f"kiln_async_blocking_s{'' if i else '_first'}"] = blocked
        r["kiln_async_background_s"] = time.perf_counter() - t0
    r["kiln_async_hash_s"] = json.loads((path / "meta.json").read_text())["hash_seconds"]
    print(f"kiln async: loop blocked {r['kiln_async_blocking_s_first']:.2f} s then {r['kiln_async_blocking_s']:.2f} s "
          f"(buffers allocated in the background in {r['kiln_warm_up_s']:.2f} s); background write "
          f"{r['kiln_async_background_s']:.2f} s", flush=True)
    ck.close()
    loader.close()
    data.cleanup()
    shutil.rmtree(root, ignore_errors=True)

    r["ratio_sync_vs_torch_save"] = r["torch_save_s"] / r["kiln_sync_nofsync_s"]
    r["ratio_sync_fsync_vs_torch_save_fsync"] = r["torch_save_fsync_s"] / r["kiln_sync_s"]
    r["ratio_load_vs_torch_load"] = r["torch_load_s"] / r["kiln_load_s"]
    r = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    print(f"speed-up over torch.save: {r['ratio_sync_vs_torch_save']:.2f}x (both without fsync), "
          f"{r['ratio_sync_fsync_vs_torch_save_fsync']:.2f}x (both with fsync); "
          f"over torch.load: {r['ratio_load_vs_torch_load']:.2f}x; async blocking {r['kiln_async_blocking_s']:.2f} s")
    print(json.dumps(r))
    write_json(args.json, r)


if __name__ == "__main__":
    main()
