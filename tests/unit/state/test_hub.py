"""kiln export --push-to-hub: a trained run's export, with its model card, uploaded through huggingface_hub to a
Hub stand-in on 127.0.0.1 (HF_ENDPOINT; never the network), and the errors a user can cause there."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.config import load_config
from kiln.errors import ConfigError, StateError
from kiln.state.hub import push_to_hub
from kiln.train.run import run

from .fake_hub import FakeHub

pytest.importorskip("huggingface_hub")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("push")
    (root / "corpus").mkdir()
    for name in ("argparse.py", "textwrap.py", "csv.py", "shlex.py"):
        (root / "corpus" / name).write_text((STDLIB / name).read_text())
    return run(load_config(None, [
        "model.size=tiny", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64",
        f"data.sources=[{root / 'corpus'}]", f"data.cache_dir={root / 'cache'}", "data.vocab_size=300",
        "data.workers=1", "data.text_unit=paragraph", "data.val_fraction=0.25", "train.seq_len=32",
        "train.batch_size=2", "train.max_steps=3",
        "train.eval_every=3", "train.eval_batches=1", "train.device=cpu", "train.sample_tokens=0",
        f"train.run_dir={root / 'run'}", "checkpoint.every=0", "logging.console=false", "logging.plots=false"]))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        yield hub


def test_export_is_pushed_with_its_model_card(run_dir, hub, tmp_path):
    result = CliRunner().invoke(app, ["export", str(run_dir), "--to", str(tmp_path / "out"), "--push-to-hub",
                                      "kiln-org/tiny", "--private"])
    assert result.exit_code == 0, result.output
    assert f"pushed to {hub.url}/kiln-org/tiny/commit/" in result.output
    repo = hub.repos["kiln-org/tiny"]
    assert repo["private"] and len(repo["commits"]) == 1
    local = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    assert repo["files"] == local  # every file of the export, byte for byte, in one commit
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(local)
    card = local["README.md"].decode()
    metrics = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event": "train"' in line]
    assert "# kiln-org/tiny" in card and "library_name: transformers" in card
    assert "| base model | none (trained from scratch) |" in card and "| steps | 3 of 3 |" in card
    assert "| tokens | 192 |" in card and f"| data | `{run_dir.parent / 'corpus'}` |" in card
    assert "| final training loss | " in card and "final validation loss | - " not in card
    assert '"loss": ' in metrics[-1] and f"{__import__('json').loads(metrics[-1])['loss']:.4f}" in card
    assert "```yaml\nmodel:\n" in card and "max_steps: 3" in card  # the run's whole config
    assert hub.cards == [{"library_name": "transformers", "pipeline_tag": "text-generation",
                          "tags": ["kiln", "text-generation"]}]


def test_push_errors_say_what_to_do(run_dir, hub, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(StateError, match=r"failed \(.*401.*log in with a token that may write there.*push it again"):
        push_to_hub(out, "kiln-org/tiny")
    assert hub.repos == {}
    with pytest.raises(StateError, match="not a Hub repository id"):
        push_to_hub(out, "kiln org/tiny!")
    with pytest.raises(StateError, match="as OWNER/NAME"):
        push_to_hub(out, "tiny")
    result = CliRunner().invoke(app, ["export", str(run_dir), "--to", str(tmp_path / "x"), "--private"])
    assert isinstance(result.exception, ConfigError) and "--private applies to --push-to-hub" in str(result.exception)
    # a repository id that cannot be pushed to is refused before the export is written, not after
    result = CliRunner().invoke(app, ["export", str(run_dir), "--to", str(tmp_path / "y"), "--push-to-hub", "tiny"])
    assert isinstance(result.exception, StateError) and "as OWNER/NAME" in str(result.exception)
    assert not (tmp_path / "y").exists()


@pytest.mark.slow  # two processes that import torch and transformers
def test_the_kiln_command_pushes_where_hf_endpoint_points(run_dir, tmp_path):
    """As a user runs it: `kiln export ... --push-to-hub` in its own process, HF_ENDPOINT and HF_TOKEN in its
    environment."""
    import os
    import subprocess
    import sys

    with FakeHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HOME": str(tmp_path / "hf")}
        done = subprocess.run([sys.executable, "-m", "kiln.cli", "export", str(run_dir), "--to", str(tmp_path / "o"),
                               "--push-to-hub", "kiln-org/cli"], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert sorted(hub.repos["kiln-org/cli"]["files"]) == sorted(f.name for f in (tmp_path / "o").iterdir())
        env["HF_TOKEN"] = "hf_wrong"
        done = subprocess.run([sys.executable, "-m", "kiln.cli", "export", str(run_dir), "--to", str(tmp_path / "p"),
                               "--push-to-hub", "kiln-org/cli"], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert "log in with a token that may write there" in done.stderr
