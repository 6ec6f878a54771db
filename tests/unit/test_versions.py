import re
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.versions import MINIMUM, check, parse, require, too_old

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_floors_checked_are_pyprojects():
    text = PYPROJECT.read_text()
    for name, minimum in MINIMUM.items():
        floors = re.findall(rf'"{name}>=([0-9.]+)"', text)  # in the hf extra and the dev one
        assert len(floors) == 2 and all(parse(f) == parse(minimum) for f in floors), (name, floors)


def test_an_older_release_is_refused_with_the_version_needed_and_how_to_get_it():
    with pytest.raises(ConfigError, match=r"model.hf_class=auto needs transformers>=5\.16, but transformers "
                                          r"4\.45\.2 is installed: pip install -U 'kiln\[hf\]'"):
        check("transformers", "4.45.2", "model.hf_class=auto")
    with pytest.raises(ConfigError, match=r"transformers>=5\.16"):
        check("transformers", "5.15.0", "model.hf_class=auto")
    for fine in ("5.16.0", "5.16.0.dev0", "5.24.0", "6.0", "10.1"):
        check("transformers", fine, "model.hf_class=auto")
    assert too_old("0.9.9", "0.13") and not too_old("0.13.2", "0.13") and not too_old("unknown", "0.13")


def test_the_installed_libraries_pass():
    transformers = pytest.importorskip("transformers")
    assert require("transformers", "model.hf_class=auto") is transformers
