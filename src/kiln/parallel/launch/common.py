"""What both launch files need: a job name, and the run's config resolved for shared storage."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.config import RunConfig, load_config
from kiln.errors import ConfigError


def job_name(config: str | None, name: str | None = None) -> str:
    """A DNS-1123 name (lowercase letters, digits, '-'; at most 40 characters) for the job."""
    raw = name or ("kiln-" + Path(config).stem if config else "kiln-quickstart")
    clean = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")[:40].strip("-")
    if not clean:
        raise ConfigError(f"--name {raw!r} has no letters or digits; give a name like my-run")
    return clean


def check_shape(nodes: int, gpus_per_node: int) -> None:
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be at least 1")


def given_paths(config: str | None, overrides: list[str]) -> tuple[str | None, str | None]:
    """The run directory and data cache that the config or its overrides set (None: left at the default)."""
    from kiln.config import DataConfig

    cfg = load_config(config, overrides)
    cache = cfg.data.cache_dir if cfg.data.cache_dir != DataConfig.model_fields["cache_dir"].default else None
    return cfg.train.run_dir, cache


def resolved_config(config: str | None, overrides: list[str], run_dir: str, cache_dir: str) -> RunConfig:
    """The run's config with its run directory and data cache on the shared storage every node sees."""
    return load_config(config, [*overrides, f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}"])


def write_files(files: dict[Path, str]) -> None:
    """Write the launch files (folders made as needed); a file that cannot be written is a ConfigError."""
    for path, text in files.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror}; choose another --out") from None
