"""The lowest versions of the optional libraries that Kiln's features are tested with (pyproject.toml's floors,
which CI installs and tests: .ci/run), checked when a feature first imports one.

pip honours the floors of `kiln[hf]`, but an environment may hold an older transformers or peft installed
beside Kiln without the extra, or pinned by another project. Under such a version Kiln's Hugging Face code would
fail deep inside the library (an unknown config key, a renamed argument, a missing model class); `require`
says instead which version the feature needs and how to get it.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from kiln.errors import ConfigError

# keep equal to pyproject.toml's floors (tests/unit/test_versions.py checks)
MINIMUM = {
    "transformers": "5.16",  # the families' config keys and classes as Kiln reads and writes them (Nemotron-H's
    # layer types and weight names, rope_parameters, dtype=), and MoE routers whose aux loss Kiln's matches
    "peft": "0.13",
    "huggingface_hub": "1.5",  # what transformers 5.16 needs
}

def parse(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ('5.16.0.dev0' -> (5, 16, 0)); () when it has none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def too_old(found: str, minimum: str) -> bool:
    """Whether `found` is a release older than `minimum` (an unreadable version counts as new enough)."""
    have = parse(found)
    return bool(have) and have < parse(minimum)


def check(name: str, found: str, feature: str) -> None:
    """A ConfigError if `found`, the installed version of `name`, is below Kiln's floor for it."""
    minimum = MINIMUM[name]
    if too_old(found, minimum):
        raise ConfigError(f"{feature} needs {name}>={minimum}, but {name} {found} is installed: "
                          f"pip install -U 'kiln[hf]' (or pip install '{name}>={minimum}')")


def require(name: str, feature: str) -> ModuleType:
    """Import `name`, an optional library of the hf extra, for `feature`: a ConfigError naming the extra when it
    is missing, or the version needed when the one installed is older than Kiln's floor."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{feature} needs {name} ({e}): pip install 'kiln[hf]'") from None
    check(name, str(getattr(module, "__version__", "")), feature)
    return module
