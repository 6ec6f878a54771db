"""The quickstart preset caps only '@stdlib' at 8M characters, as the docs of data.max_bytes say."""

from __future__ import annotations

from kiln.config import load_config


def test_quickstart_caps_stdlib_only():
    assert load_config("quickstart").data.max_bytes == 8_000_000
    assert load_config("quickstart", ["data.sources=[corpus.jsonl]"]).data.max_bytes is None  # was 8M too
    assert load_config("quickstart", ["data.sources=[corpus.jsonl]", "data.max_bytes=1000"]).data.max_bytes == 1000
