"""`logging.mlflow_register: NAME`: the final model as a new version of NAME in MLflow's model registry.

At the end of a finished run the MLflow sink exports model/ in the Hugging Face layout (kiln export),
logs it as the run's artifact `hf_model` with `lineage.json`, and registers it: a new version of the
registered model NAME (made on first use), whose source is that artifact and whose run is the MLflow
run (the config as its params, the metrics' histories). The version's tags are its lineage, so the
registry alone says where a model came from:

    kiln.data.dataset / .manifest_sha256 / .tokenizer   the prepared data (content-addressed) it trained on
    kiln.config_sha256, kiln.config_fingerprint          the resolved config, and the part that shapes training
    kiln.step, kiln.tokens_seen                          how far it trained
    kiln.metric.<name>                                   the run's final metrics (eval/val_loss, train/loss, ...)
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _newest_meta(run_dir: Path) -> dict[str, Any]:
    metas = sorted((run_dir / "checkpoints").glob("step_*/meta.json"))
    for path in reversed(metas):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lineage(run_dir: Path, cfg, metrics: dict[str, float]) -> dict[str, Any]:
    """What the model came from: data manifests, config, progress and final metrics."""
    meta = _newest_meta(run_dir)
    prints = meta.get("fingerprints", {})
    written = run_dir / "config.yaml"  # the resolved config the run wrote (derived sizes and paths included)
    config_yaml = written.read_text() if written.is_file() else cfg.to_yaml()
    out: dict[str, Any] = {
        "run_dir": str(run_dir.resolve()), "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(),
        "config_fingerprint": prints.get("config"), "step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"),
        "data": {"dataset": prints.get("dataset"), "tokenizer": prints.get("tokenizer"),
                 "train_tokens": prints.get("train_tokens"), "manifests": {}},
        "metrics": dict(sorted(metrics.items())), "config": config_yaml,
    }
    cache = Path(cfg.data.cache_dir).expanduser() / "datasets"
    dirs = [Path(e.dataset).expanduser() for e in cfg.data.mixture if e.dataset] or []
    if prints.get("dataset"):
        dirs.append(cache / str(prints["dataset"]))
    for d in dirs:
        manifest = d / "manifest.json"
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            out["data"]["manifests"][m.get("id", d.name)] = {"manifest_sha256": _sha256(manifest),
                                                             "settings_hash": m.get("settings_hash"),
                                                             "tokenizer_hash": m.get("tokenizer_hash")}
    return out


def version_tags(info: dict[str, Any]) -> dict[str, str]:
    data = info["data"]
    tags = {"kiln.config_sha256": info["config_sha256"], "kiln.config_fingerprint": info["config_fingerprint"],
            "kiln.step": info["step"], "kiln.tokens_seen": info["tokens_seen"], "kiln.run_dir": info["run_dir"],
            "kiln.data.dataset": data["dataset"], "kiln.data.tokenizer": data["tokenizer"],
            "kiln.data.train_tokens": data["train_tokens"]}
    manifests = data["manifests"]
    if len(manifests) == 1:
        tags["kiln.data.manifest_sha256"] = next(iter(manifests.values()))["manifest_sha256"]
    for key, m in manifests.items():
        tags[f"kiln.data.manifest_sha256.{key}"] = m["manifest_sha256"]
    tags.update({f"kiln.metric.{k}": v for k, v in info["metrics"].items()})
    return {k: str(v) for k, v in tags.items() if v is not None}


def register(client, run_id: str, name: str, run_dir: Path, cfg, log: Callable[[str], None] = print):
    """Export model/, log it with its lineage, and register it as a new version of `name`; returns the version."""
    from mlflow.exceptions import MlflowException

    from kiln.state.export import export_from

    run = client.get_run(run_id)
    info = lineage(Path(run_dir), cfg, dict(run.data.metrics))
    with tempfile.TemporaryDirectory(prefix="kiln-register-") as tmp:
        export_from(Path(run_dir) / "model", Path(tmp) / "hf_model")
        client.log_artifacts(run_id, str(Path(tmp) / "hf_model"), "hf_model")
        (Path(tmp) / "lineage.json").write_text(json.dumps(info, indent=1) + "\n")
        client.log_artifact(run_id, str(Path(tmp) / "lineage.json"))
    try:
        client.create_registered_model(name, description="Trained with Kiln")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    step = info["step"]
    version = client.create_model_version(
        name, f"{run.info.artifact_uri.rstrip('/')}/hf_model", run_id=run_id, tags=version_tags(info),
        description=f"{Path(run_dir).name}" + (f", step {step}" if step is not None else "")
                    + (f", val_loss {info['metrics']['eval/val_loss']:.4f}" if "eval/val_loss" in info["metrics"]
                       else ""))
    log(f"MLflow model registry: {name} version {version.version} (the Hugging Face export of {run_dir}/model)")
    return version
