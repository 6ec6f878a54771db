"""Reading a checkpoint's DCP files without running code from them, one part whole or an error.

    read_part(ckpt, "model", state)     # fills every tensor of `state` from the checkpoint's "model" part
    dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner())

DCP keeps a checkpoint's index in `.metadata`, a pickle, and torch's reader unpickles it whole: a crafted
file runs code as it loads. `SafeFileSystemReader` reads it with an unpickler that builds only the
classes DCP's metadata is made of (torch.distributed.checkpoint's metadata dataclasses, torch.Size and
dtypes, paths) and refuses anything else before building it. The values DCP stores as bytes (an
optimizer's hyperparameters) are pickles too: `SafeLoadPlanner` reads them with `torch.load(weights_only=
True)`, as torch already reads the tensors. Every reader of a checkpoint in Kiln (resume, export, eval)
goes through these two.

`state` (name -> tensor) says what the reader expects: its names must be exactly those the checkpoint
holds under the part. A checkpoint of another model (a run's config read as the wrong architecture,
an adapter-only checkpoint read as a whole model) then fails here, naming what differs, instead of
leaving the tensors as they were allocated (uninitialised memory, written out or evaluated as if trained).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from kiln.errors import StateError

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


class UnsafeCheckpoint(StateError):
    """A checkpoint file holds a pickle that would build something DCP's metadata never holds."""


def _admitted(module: str, name: str) -> Any | None:
    """The object `module.name` if DCP's metadata may hold it, else None."""
    import importlib

    if module in _METADATA_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        # a dataclass or enum defined in that module, which holds values only (not a reader or writer of files, a
        # function, nor a name it imported from elsewhere)
        plain = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        return obj if plain and obj.__module__ == module and "Reader" not in name and "Writer" not in name else None
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if module == "torch.serialization" and name == "_get_layout":  # a layout by its name, from torch's own table
        return torch.serialization._get_layout
    if module == "pathlib" and name in _PATHS:  # StorageMeta.checkpoint_id
        import pathlib

        return getattr(pathlib, name)
    if module == "collections" and name == "OrderedDict":
        import collections

        return collections.OrderedDict
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _admitted(module, name)
        if obj is None:
            raise UnsafeCheckpoint(f"it names {module}.{name}, which DCP's metadata never holds")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("it holds a persistent reference, which DCP's metadata never does")


def _refused(path: Path, why: object) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{path}: {why}. It was not written by torch.distributed.checkpoint as Kiln saves, and "
                            "loading it could run code, so Kiln did not load it. Use a checkpoint you wrote or "
                            "trust (another step of the run: `kiln inspect RUN` lists them)")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader, its `.metadata` read by `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = Path(self.path) / name
        data = path.read_bytes()  # an OSError goes to the caller, which reports its errno
        try:
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
        except UnsafeCheckpoint as e:
            raise _refused(path, e) from None
        except Exception as e:  # a damaged pickle raises whatever its opcodes lead to
            raise StateError(f"{path} is damaged ({type(e).__name__}: {e}); use another checkpoint of the "
                             "run") from None
        if not isinstance(metadata, Metadata):
            raise _refused(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, its bytes values read with `torch.load(weights_only=True)` (plain Python values
    and tensors), not the unrestricted unpickling of torch's default."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"its value {fqn} holds what a checkpoint of plain values never does "
                                   f"({str(e).splitlines()[0]})") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


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
    reader = SafeFileSystemReader(str(ckpt))
    try:
        metadata = reader.read_metadata()  # StateError if refused or damaged
    except OSError as e:
        raise StateError(f"{ckpt}: its DCP metadata cannot be read ({e}); `kiln inspect {ckpt}` checks the "
                         "checkpoint") from None
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
            dcp.load({part: state}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except Exception as e:  # DCP wraps storage and planning errors in its own types
        raise StateError(f"{ckpt}: the {part} weights cannot be read ({e}); `kiln inspect {ckpt}` checks it") from None
