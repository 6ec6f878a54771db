"""The config reference page is generated from the schema's docstrings, and the committed one is current."""

import html
from pathlib import Path

from pydantic import BaseModel

from kiln.config import RunConfig
from kiln.docs_ref import COMMAND, PAGE, config_reference, main

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_config_reference_is_current():
    page = REPO / PAGE
    assert page.is_file(), f"{PAGE} is missing: run `{COMMAND}` from the repository's root"
    assert page.read_text(encoding="utf-8") == config_reference(), (
        f"{PAGE} is stale (a config field, its type, default or docstring changed): "
        f"run `{COMMAND}` from the repository's root and commit the page")


def test_the_page_of_another_tree_is_never_written(tmp_path, monkeypatch, capsys):
    """Run from a checkout whose src/ is not the kiln imported (one installed from elsewhere), the default
    would write the other tree's page from the other tree's schema: refused, saying how to run it here."""
    (tmp_path / "mkdocs.yml").write_text("site_name: x\n")
    monkeypatch.chdir(tmp_path)
    before = (REPO / PAGE).stat().st_mtime_ns
    assert main([]) == 2
    assert f"PYTHONPATH=src {COMMAND}" in capsys.readouterr().err
    assert (REPO / PAGE).stat().st_mtime_ns == before and not (tmp_path / "docs").exists()


def _keys(cls: type[BaseModel], prefix: str) -> list[tuple[str, object]]:
    out = []
    for name, f in cls.model_fields.items():
        out.append((prefix + name, f))
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _keys(ann, f"{prefix}{name}.")
    return out


def test_every_key_has_a_row_with_its_docstring():
    text = config_reference()
    keys = [k for s, f in RunConfig.model_fields.items() for k in _keys(f.annotation, f"{s}.")]
    assert len(keys) > 100
    for key, field in keys:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, f"{key}: {len(rows)} rows"
        shown = html.unescape(rows[0].replace("\\|", "|"))
        assert " ".join(field.description.split()) in shown, key
    assert "## `dist`" in text and "### `train.early_stop`" in text and "### `model.rope_scaling`" in text


def test_a_row_gives_type_bounds_and_default_as_yaml_writes_them():
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ")[1:] for line in config_reference().splitlines()
            if line.startswith("| `")}
    assert rows["train.lr"][:2] == ["float, > 0, <= 1", "`0.002`"]
    assert rows["train.batch_size"][:2] == ["int or `auto`", "`8`"]
    assert rows["train.schedule"][:2] == ["`cosine`, `wsd` or `constant`", "`cosine`"]
    assert rows["model.n_kv_heads"][:2] == ["int or null, >= 1", "`null`"]
    assert rows["model.tie_embeddings"][:2] == ["bool", "`true`"]
    assert rows["data.sources"][:2] == ["list of str", '`["@stdlib"]`']
    assert rows["model.rope_scaling"][:2] == ["section or null (below)", "`null`"]
    assert rows["weight"][0] == "float, > 0"  # an entry of data.mixture, under its own heading
    assert rows["weights"][:2] == ["list of float >= 0", "required"]  # of a data.schedule stage: no default
    # token names are text, not HTML tags; a pipe inside a cell does not end it
    assert "tokenizer's &lt;\\|endoftext\\|&gt;, &lt;\\|end_of_text\\|&gt;, &lt;/s&gt;" in rows["data.eos_token"][2]


def test_check_fails_on_a_stale_page_and_passes_once_written(tmp_path, capsys):
    page = tmp_path / "config.md"
    assert main(["--check", str(page)]) == 1  # missing
    assert COMMAND in capsys.readouterr().err
    page.write_text(config_reference().replace("Peak learning rate", "Learning rate"))
    assert main(["--check", str(page)]) == 1
    assert main([str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    assert page.read_text() == config_reference()


def test_bad_arguments_are_a_usage_line(capsys):
    assert main(["--out", "x"]) == 2
    assert "usage" in capsys.readouterr().err
