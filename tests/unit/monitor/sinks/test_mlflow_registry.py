"""logging.mlflow_register: a finished run's Hugging Face export becomes a new version in MLflow's model
registry (the local store), with its lineage: the data's manifest hashes, the config, the final metrics."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")


@pytest.mark.slow
def test_a_finished_run_is_registered_with_its_lineage(tmp_path):
    from mlflow.tracking import MlflowClient

    from kiln.monitor.sinks.mlflow_registry import register
    from kiln.train.run import run

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / n).read_text() for n in ("argparse.py", "textwrap.py"))
    (tmp_path / "corpus").mkdir()
    for i in range(30):
        (tmp_path / "corpus" / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        "model.size=tiny", "train.seq_len=32", "train.max_steps=3", "train.warmup_steps=1", "train.eval_every=0",
        "train.eval_batches=1", "train.sample_tokens=0", "train.device=cpu", "train.precision=fp32",
        "train.batch_size=4", "checkpoint.every=0", "logging.console=false", "logging.plots=false",
        f"data.sources=[{tmp_path / 'corpus'}]", "data.val_fraction=0.1", "data.vocab_size=300",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={run_dir}",
        "logging.mlflow=true", "logging.mlflow_register=kiln-tiny"])
    run(cfg)
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='kiln-tiny'")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    assert int(version.version) == 1 and version.run_id == run_id and version.source.endswith("/hf_model")
    tags = version.tags
    meta = json.loads(next((run_dir / "checkpoints").glob("step_*/meta.json")).read_text())
    dataset = meta["fingerprints"]["dataset"]
    manifest = tmp_path / "cache" / "datasets" / dataset / "manifest.json"
    assert tags["kiln.data.dataset"] == dataset and tags["kiln.step"] == "3"
    assert tags["kiln.data.manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert tags["kiln.data.tokenizer"] == meta["fingerprints"]["tokenizer"]
    assert tags["kiln.config_sha256"] == hashlib.sha256((run_dir / "config.yaml").read_bytes()).hexdigest()
    assert float(tags["kiln.metric.eval/val_loss"]) > 0 and float(tags["kiln.metric.train/loss"]) > 0
    # the registered source is a Hugging Face export that transformers loads, and the lineage is an artifact
    transformers = pytest.importorskip("transformers")
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    local = mlflow.artifacts.download_artifacts("models:/kiln-tiny/1", dst_path=str(tmp_path / "got"))
    model = transformers.AutoModelForCausalLM.from_pretrained(local)
    saved = json.loads((run_dir / "model" / "model_config.json").read_text())
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (saved["d_model"], saved["n_layers"])
    lineage = json.loads(Path(client.download_artifacts(run_id, "lineage.json", str(tmp_path))).read_text())
    assert lineage["data"]["manifests"][dataset]["manifest_sha256"] == tags["kiln.data.manifest_sha256"]
    # a second registration (another run, or this one again) is the next version
    again = register(client, run_id, "kiln-tiny", run_dir, cfg, log=print)
    assert int(again.version) == 2


def test_registering_needs_the_mlflow_sink():
    with pytest.raises(ConfigError, match="set logging.mlflow=true"):
        load_config(None, ["logging.mlflow_register=kiln-tiny"])
