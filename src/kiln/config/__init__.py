"""Typed run config: one pydantic section per component, loaded from YAML plus dotted overrides.

    cfg = load_config("my.yaml", ["train.lr=3e-4", "model.n_layers=4"])

Every field has a type, a default where one makes sense and a one-line docstring, which is what
`kiln train --help-config` prints. Unknown keys and bad values raise one `ConfigError` that lists
every problem with its full key path and, for typos, the closest valid key.

Bounds of single values are pydantic constraints on the fields; checks that involve several fields
are each section's `problems()`. `load_config` reports all of them in one pass: it validates with
those checks deferred, sets aside the values that failed, and runs every check whose fields are
all valid, so a typo in one section never hides a wrong value in another.

One module per section (`model`, `data`, `train`, `optim`, `checkpoint`, `recovery`, `logging`,
`monitor`, `parallel` for `dist:`, `lora`, `eval`), `run` for the whole config and its checks across sections,
`load` for files, presets, overrides and `derive`, and `describe` for what `kiln train --help-config` and the
config reference page say of each key.
"""

from kiln.config.base import Problem, Section
from kiln.config.checkpoint import CheckpointConfig
from kiln.config.data import DataConfig, MixtureEntry
from kiln.config.describe import describe_fields
from kiln.config.eval import EvalConfig
from kiln.config.load import PRESETS_DIR, derive, dotted, load_config, resolve_config_path
from kiln.config.logging import LoggingConfig
from kiln.config.lora import LoraConfig
from kiln.config.model import MambaConfig, ModelConfig, RopeScaling
from kiln.config.moe import MoEConfig
from kiln.config.monitor import MonitorConfig, ProfileConfig
from kiln.config.optim import OptimConfig
from kiln.config.parallel import DistConfig
from kiln.config.recovery import RecoveryConfig
from kiln.config.run import RunConfig
from kiln.config.train import EarlyStopConfig, TrainConfig

__all__ = [
    "PRESETS_DIR", "CheckpointConfig", "DataConfig", "DistConfig", "EarlyStopConfig", "EvalConfig", "LoggingConfig",
    "LoraConfig", "MambaConfig", "MoEConfig", "MixtureEntry", "ModelConfig", "MonitorConfig", "OptimConfig",
    "Problem", "ProfileConfig", "RecoveryConfig",
    "RopeScaling", "RunConfig", "Section", "TrainConfig", "derive", "describe_fields", "dotted", "load_config",
    "resolve_config_path",
]
