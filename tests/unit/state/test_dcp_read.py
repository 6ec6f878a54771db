"""kiln.state.dcp_read: a part of a checkpoint is read whole, or refused naming what differs; a checkpoint crafted
to run code as it is unpickled is refused by every reader (resume, export, eval), and runs nothing."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kiln.errors import StateError
from kiln.state.checkpointer import Checkpointer
from kiln.state.dcp_read import SafeFileSystemReader, UnsafeCheckpoint, read_part, saved_names
from kiln.state.parts import TENSOR_KEYS, trainer_parts
from kiln.state.verify import hash_tree, read_meta, write_meta

from .conftest import PRINTS, make_trainer, saved_checkpoints


def test_a_part_reads_whole_and_equal(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    want = trainer.model.state_dict()
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    read_part(ckpt, "model", state)
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def test_names_that_differ_are_refused_not_left_as_allocated(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    names = list(trainer.model.state_dict())
    with pytest.raises(StateError, match=r"1 of the 1 tensors expected are not in it .*layers\.9\.w"):
        read_part(ckpt, "model", {"layers.9.w": torch.zeros(2)})  # nothing of it in the checkpoint
    fewer = {k: torch.zeros_like(v) for k, v in list(trainer.model.state_dict().items())[1:]}
    with pytest.raises(StateError, match=f"holds 1 tensors not expected .*{names[0]}"):
        read_part(ckpt, "model", fewer)
    assert all(not v.any() for v in fewer.values())  # nothing was read into it


def test_an_optional_name_may_be_missing(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    state = {k: torch.zeros_like(v) for k, v in trainer.model.state_dict().items()}
    state["extra.weight"] = torch.zeros(3)
    read_part(ckpt, "model", state, optional=frozenset({"extra.weight"}))
    assert "extra.weight" not in state


# --------------------------------------------------------------------------- a checkpoint crafted to run code


class RunsCode:
    """Unpickled, it creates the directory `marker`: what a crafted checkpoint would do (and worse)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def rehash(ckpt: Path) -> None:
    """meta.json's file hashes of the files as they are now: a crafted checkpoint passes the damage check."""
    meta = read_meta(ckpt)
    meta["files"] = hash_tree(ckpt)
    write_meta(ckpt, meta, fsync=False)


def reader_of(how: str):
    from kiln.evaluate import load_target
    from kiln.state.export import export_from

    def resume(ckpt: Path) -> None:
        trainer = make_trainer(ckpt.parent.parent)
        Checkpointer(trainer.cfg.train.run_dir, trainer.cfg, PRINTS, lambda m: None).load(trainer, ckpt)

    return {"resume": resume, "export": lambda ckpt: export_from(ckpt, ckpt.parent / "out"),
            "eval": load_target}[how]


@pytest.mark.parametrize("how", ["resume", "export", "eval"])
def test_a_crafted_metadata_file_is_refused_and_runs_nothing(trainer_factory, tmp_path, how):
    _, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    marker = tmp_path / "code-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rehash(ckpt)
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: it names posix\.mkdir.*could run code"):
        reader_of(how)(ckpt)
    assert not marker.exists()


def test_a_crafted_value_is_refused_on_resume_and_runs_nothing(trainer_factory, tmp_path):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    marker = tmp_path / "code-ran"
    parts = trainer_parts(trainer)
    tensors = {k: parts[k].state_dict() for k in TENSOR_KEYS}
    tensors["optim"]["param_groups"][0]["lr"] = RunsCode(marker)  # DCP stores it as a pickled value
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, checkpoint_id=str(ckpt), no_dist=True)
    rehash(ckpt)
    with pytest.raises(UnsafeCheckpoint, match="param_groups.0.lr"):
        reader_of("resume")(ckpt)
    assert not marker.exists()


def test_metadata_of_every_checkpoint_kind_is_admitted(trainer_factory):
    """The unpickler admits what DCP writes: a checkpoint with the model, the optimizer's moments and values."""
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    metadata = SafeFileSystemReader(str(ckpt)).read_metadata()
    assert saved_names(metadata, "model") == set(trainer.model.state_dict())
    assert pickle.loads((ckpt / ".metadata").read_bytes()).state_dict_metadata == metadata.state_dict_metadata


@pytest.mark.parametrize("module,name", [("builtins", "eval"), ("os", "system"), ("subprocess", "Popen"),
                                         ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
                                         ("torch", "load"), ("torch.serialization", "load")])
def test_only_metadata_classes_are_admitted(module, name):
    import io

    from kiln.state.dcp_read import MetadataUnpickler

    crafted = f"c{module}\n{name}\n(tR.".encode()  # protocol 0: GLOBAL module.name, called with no arguments
    with pytest.raises(UnsafeCheckpoint, match=f"names {module}.{name}"):
        MetadataUnpickler(io.BytesIO(crafted)).load()
