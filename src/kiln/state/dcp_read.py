"""Reading one part of a checkpoint's DCP files in this process, all of it or an error.

    read_part(ckpt, "model", state)     # fills every tensor of `state` from the checkpoint's "model" part

`state` (name -> tensor) says what the reader expects: its names must be exactly those the checkpoint
holds under the part. A checkpoint of another model (a run's config read as the wrong architecture,
an adapter-only checkpoint read as a whole model) then fails here, naming what differs, instead of
leaving the tensors as they were allocated (uninitialised memory, written out or evaluated as if trained).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from kiln.errors import StateError


def saved_names(metadata, part: str) -> set[str]:
    """The names the checkpoint holds under `part` ("model"): DCP's planner data maps each flat key to its
    path in the saved dict (part, name)."""
    paths = getattr(metadata, "planner_data", None) or {}
    if paths:
        return {str(p[1]) for p in paths.values() if len(p) == 2 and p[0] == part}
    prefix = part + "."
    return {k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)}


def _differences(want: set[str], have: set[str]) -> str:
    missing, extra = sorted(want - have), sorted(have - want)
    out = []
    if missing:
        out.append(f"{len(missing)} of the {len(want)} tensors expected are not in it (e.g. {', '.join(missing[:3])})")
    if extra:
        out.append(f"it holds {len(extra)} tensors not expected (e.g. {', '.join(extra[:3])})")
    return "; ".join(out)


def read_part(ckpt: Path, part: str, state: dict[str, torch.Tensor], what: str = "this model",
              optional: frozenset[str] = frozenset()) -> None:
    """Fill the tensors of `state` in place from `part` of the checkpoint `ckpt` (one process, any saved world
    size). StateError when the checkpoint holds other names than `state` (`what` names the expected model);
    names in `optional` may be missing (they are then dropped from `state`)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(ckpt))
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, ValueError) as e:
        raise StateError(f"{ckpt}: its DCP metadata (.metadata) cannot be read ({e}); `kiln inspect {ckpt}` checks "
                         "the checkpoint") from None
    saved = saved_names(metadata, part)
    for name in optional - saved:
        state.pop(name, None)
    differ = _differences(set(state), saved)
    if differ:
        raise StateError(f"{ckpt} does not hold the weights of {what}: {differ}. The checkpoint's meta.json config "
                         "does not describe the model it saved (a changed or copied run directory?)")
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({part: state}, storage_reader=reader, no_dist=True)
    except Exception as e:  # DCP wraps storage and planning errors in its own types
        raise StateError(f"{ckpt}: the {part} weights cannot be read ({e}); `kiln inspect {ckpt}` checks it") from None
