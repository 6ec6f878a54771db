"""Run in each process of the 2-process gloo build tests (started by torchrun from test_materialize.py).

argv: OUT_DIR CONFIG_JSON [HF_DIR]. Builds the model with kiln.parallel.materialize.build_model after the
one-process seed, gathers every parameter's full tensor, and rank 0 saves them (and the peak RSS growth
of the build on each rank) to OUT_DIR/built.pt. With HF_DIR, the same job then builds the model again
from those weights (model.init_from) into OUT_DIR/built_init_from.pt (its memory is not measured: the
first build's is, in a fresh process)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from kiln.config import RunConfig
from kiln.model.registry import param_count
from kiln.parallel.materialize import build_model
from kiln.parallel.mesh import init_mesh


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def main() -> None:
    out, cfg = Path(sys.argv[1]), RunConfig.model_validate(json.loads(sys.argv[2]))
    weights = sys.argv[3] if len(sys.argv) > 3 else None
    mesh = init_mesh("cpu", cfg.dist)
    small = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": 1, "vocab_size": 64})})
    build_model(small, mesh, param_count(small.model), lambda s: None)  # warm up: imports and op caches
    build(out / "built.pt", cfg, mesh)
    if weights:
        build(out / "built_init_from.pt", cfg, mesh, weights)
    mesh.close(clean=True)


def build(path: Path, cfg: RunConfig, mesh, weights: str | None = None) -> None:
    torch.manual_seed(cfg.train.seed)
    before = rss_bytes()  # now; the build's peak is measured from here
    model = build_model(cfg, mesh, param_count(cfg.model), lambda s: None, weights_from=weights)
    grew = peak_rss_bytes() - before
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    growth = [None] * mesh.world
    torch.distributed.all_gather_object(growth, grew)
    after = torch.rand(4)  # the global generator after the build: as in one process
    if mesh.rank == 0:
        torch.save({"state": full, "rng_after": after, "rss_growth": growth,
                    "tied": model.lm_head.weight is model.embed_tokens.weight,
                    "rope": (model.rope_cos.clone(), model.rope_sin.clone()),
                    "kinds": sorted({type(p).__name__ for p in model.parameters()})}, path)


if __name__ == "__main__":
    main()
