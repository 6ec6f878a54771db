"""Where torch.compile keeps what it compiled, so that the next run of the same model and shapes starts fast.

Inductor caches its compiled graphs (FX graph and AOT autograd caches) and Triton kernels on disk, by default in
/tmp/torchinductor_$USER: lost when the machine restarts, and not seen by other nodes. `use(path)` points
TORCHINDUCTOR_CACHE_DIR at `train.compile_cache` (unless the user set it elsewhere than torch's default), a
directory that survives between runs; several processes of one job, and several jobs, share it safely (entries are
written whole, then renamed). To share it between nodes, put it on a shared filesystem, or copy the directory to
the same path on the other node. Entries are keyed by the graph, the torch and Triton versions and the GPU, so a
cache from another setup is ignored, never misused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"


def use(path: str | None) -> str | None:
    """Point Inductor's cache at `path` (created; `~` expanded) unless TORCHINDUCTOR_CACHE_DIR is set.
    Returns the directory in force (None: torch's default)."""
    mine = os.environ.get(ENV)
    if mine and mine != _torch_default():  # torch writes its default there once it has looked: not the user's
        return mine
    if not path:
        return None
    where = Path(path).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(where)
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:  # this process compiled before: forget the directory it memoized (the name before 2.8)
        (getattr(utils, "clear_caches", None) or utils.clear_inductor_caches)()
    return str(where)


def _torch_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())
