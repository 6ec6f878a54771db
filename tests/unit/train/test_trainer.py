"""kiln.train.trainer: what a step's batch looks like when the model gets it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kiln.train.trainer import Trainer


def test_every_part_of_a_batch_goes_to_the_device_doc_ids_included():
    """DDP and FSDP2 copy an input left on the CPU with a blocking copy (a host wait for the whole GPU queue at
    every forward pass): the trainer hands the model tokens, targets and doc_ids on its device."""
    rows = torch.zeros(2, 8, dtype=torch.int64)
    loader = iter([(rows, rows, rows.to(torch.int32)), (rows, rows, None)])
    trainer = SimpleNamespace(device=torch.device("meta"))  # any device but the loader's
    tokens, targets, docs = Trainer._batch(trainer, loader)
    assert [t.device.type for t in (tokens, targets, docs)] == ["meta"] * 3 and docs.dtype == torch.int32
    assert Trainer._batch(trainer, loader)[2] is None  # no document masking: no doc_ids
