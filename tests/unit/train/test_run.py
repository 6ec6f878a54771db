"""kiln.train.run's checks before any work: a model shape no Hugging Face class can hold is said then, not when
`kiln export` fails at the end."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kiln.config import load_config
from kiln.errors import ConfigError, DataError
from kiln.train.run import run


def test_a_shape_export_cannot_write_is_said_before_training(tmp_path):
    args = ["model.size=tiny", "model.mlp=relu2", "train.device=cpu",
            "data.sources=[nowhere]"]
    out = io.StringIO()
    with pytest.raises(DataError):  # the warning comes first; then the missing data stops the run
        run(load_config(None, [*args, f"train.run_dir={tmp_path / 'a'}"]), console=Console(file=out, width=400))
    assert "warning: no Hugging Face class holds this model shape" in out.getvalue()
    assert "model.norm=rmsnorm" in out.getvalue() and "kiln export` will not be able to write it" in out.getvalue()
    with pytest.raises(ConfigError, match="model.hf_model_type=llama: .*LlamaForCausalLM cannot have model.mlp=relu2"):
        run(load_config(None, [*args, "model.hf_model_type=llama", f"train.run_dir={tmp_path / 'b'}"]))
    assert not (tmp_path / "b").exists()  # refused before the run directory was made
