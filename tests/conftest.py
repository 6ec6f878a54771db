"""Shared test setup: GPU-marked tests skip cleanly without CUDA; caches stay inside tmp dirs."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep ~/.cache/kiln of the machine out of tests (the default cache_dir expands ~)."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.getbasetemp() / "home"))
