"""What a run reads, from its config (kiln.data.build)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.data.build import build_data


def test_a_step_larger_than_the_train_split_is_said(tmp_path):
    """train.batch_size x train.grad_accum beyond the data: every step repeats the whole split, without a word."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text((Path(sysconfig.get_paths()["stdlib"]) / "bisect.py").read_text())
    common = [f"data.sources=[{corpus}]", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
              "data.workers=1", "data.val_fraction=0", "train.seq_len=16"]
    data = build_data(load_config(None, [*common, "train.batch_size=4"]), torch.device("cpu"), rank=0, world=1)
    held = data.manifest["splits"]["train"]["tokens"]
    assert "warning" not in data.summary and 64 < held < 4096
    data.train.close()
    big = build_data(load_config(None, [*common, "train.batch_size=64", "train.grad_accum=4"]), torch.device("cpu"),
                     rank=0, world=1)
    assert (f"warning: one optimizer step reads 4,096 tokens, more than the {held:,} of the train split, so every "
            "step repeats all of it") in big.summary
    big.train.close()
