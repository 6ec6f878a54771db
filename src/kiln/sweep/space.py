"""A sweep's search space file: which config keys vary, how, and what the sweep optimises.

    search: tpe                 # grid, random or tpe (Optuna's, through Ray Tune)
    metric: val_loss            # any metric of the run's evaluations (hellaswag/acc with eval.tasks)
    mode: min                   # min or max
    asha: {grace: 2, reduction: 3}   # stop poor trials early, in evaluations (omit: every trial runs out)
    params:
      train.lr: {loguniform: [1.0e-4, 3.0e-3]}
      optim.weight_decay: {uniform: [0.0, 0.2]}
      train.batch_size: {choice: [8, 16]}
      model.n_layers: {grid: [2, 4]}       # every value, each with the sampled others
      data.schedule.stages.1.at: {randint: [100, 1000]}

Keys are the dotted keys of `kiln train` overrides, checked against the config before any trial
starts. This module reads and checks the file; it does not import Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import ConfigError

KINDS = {"choice": "a list of values", "grid": "a list of values", "uniform": "[low, high]",
         "loguniform": "[low, high], both above 0", "randint": "[low, high) integers"}
SEARCHES = ("grid", "random", "tpe")


@dataclass(frozen=True)
class Param:
    key: str
    kind: str  # one of KINDS
    values: tuple

    def sample_value(self) -> Any:
        """A value of the domain, for checking the key against the config."""
        return self.values[0]


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    search: str = "random"
    metric: str = "val_loss"
    mode: str = "min"
    asha: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def grid_size(self) -> int:
        n = 1
        for p in self.params:
            if p.kind == "grid":
                n *= len(p.values)
        return n


def _param(key: str, spec: Any, where: str) -> Param:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"{where}: params.{key} must be one of {{{', '.join(KINDS)}: ...}}, got {spec!r}")
    (kind, values), = spec.items()
    if kind not in KINDS:
        raise ConfigError(f"{where}: params.{key}: unknown kind '{kind}'; use one of {', '.join(KINDS)}")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: params.{key}.{kind} takes {KINDS[kind]}, got {values!r}")
    if kind in ("uniform", "loguniform", "randint"):
        if len(values) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: params.{key}.{kind} takes {KINDS[kind]}, got {values!r}")
        low, high = values
        if not low < high or (kind == "loguniform" and low <= 0):
            need = "low < high" + (" and low > 0" if kind == "loguniform" else "")
            raise ConfigError(f"{where}: params.{key}.{kind}: need {need}, got {values!r}")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}: params.{key}.randint takes integers, got {values!r}")
    return Param(key, kind, tuple(values))


def read_space(path: str | Path) -> Space:
    """The Space of a YAML file (ConfigError naming the file and key for anything wrong)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--space {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping with 'params' (and search, metric, mode, asha)")
    unknown = set(data) - {"params", "search", "metric", "mode", "asha"}
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {', '.join(sorted(unknown))}; a space has params, search, metric, "
                          "mode and asha")
    params = data.get("params")
    if not isinstance(params, dict) or not params:
        raise ConfigError(f"{p}: 'params' must map config keys to domains, e.g. optim.lr: {{loguniform: [1e-4, 1e-2]}}")
    search = data.get("search", "random")
    if search not in SEARCHES:
        raise ConfigError(f"{p}: search: '{search}' is not one of {', '.join(SEARCHES)}")
    mode = data.get("mode", "min")
    if mode not in ("min", "max"):
        raise ConfigError(f"{p}: mode: '{mode}' is not min or max")
    space = Space(tuple(_param(str(k), v, str(p)) for k, v in params.items()), search, str(data.get("metric",
                  "val_loss")), mode, _asha(data.get("asha"), p))
    kinds = {q.kind for q in space.params}
    if search == "grid" and kinds - {"grid", "choice"}:
        raise ConfigError(f"{p}: search: grid takes only grid (or choice) params; sample {', '.join(sorted(kinds))} "
                          "with search: random or tpe")
    if search == "tpe" and "grid" in kinds:
        raise ConfigError(f"{p}: search: tpe cannot take grid params (Optuna samples every key); use choice")
    return space


def _asha(spec: Any, p: Path) -> dict[str, int] | None:
    if spec is None or spec is False:
        return None
    spec = {} if spec is True else spec
    if not isinstance(spec, dict) or set(spec) - {"grace", "reduction"}:
        raise ConfigError(f"{p}: asha: expected {{grace: N, reduction: M}} (evaluations before a trial may stop, "
                          f"and the fraction 1/M kept at each rung), got {spec!r}")
    out = {"grace": int(spec.get("grace", 1)), "reduction": int(spec.get("reduction", 3))}
    if out["grace"] < 1 or out["reduction"] < 2:
        raise ConfigError(f"{p}: asha: grace must be at least 1 and reduction at least 2, got {spec!r}")
    return out


def override(key: str, value: Any) -> str:
    """A `kiln train` override setting `key` to `value` (YAML, as overrides are read)."""
    if hasattr(value, "item"):  # a NumPy scalar from the search
        value = value.item()
    if isinstance(value, str | int | float | bool) or value is None:
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    else:
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
    return f"{key}={text}"
