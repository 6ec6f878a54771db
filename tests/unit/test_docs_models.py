"""The model tables (docs/models.md, the README's) are generated from kiln.model.families and the native
architectures, every family Kiln imports or the parity matrix covers has a row, every test a row names exists,
and the committed tables are current."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

from kiln.docs_models import COMMAND, PAGE, README, main, models_page
from kiln.model.families import ASPECTS, FAMILIES, is_native
from kiln.model.hf import ARCHITECTURES

from ..integration.hf_dirs import MATRIX

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_tables_are_current(capsys):
    assert main(["--check", str(REPO)]) == 0, (f"{capsys.readouterr().err}: run `{COMMAND}` from the repository's "
                                                "root and commit docs/models.md and README.md")


def test_every_family_kiln_imports_or_the_matrix_covers_has_one_row():
    kinds = [k for f in FAMILIES for k in f.model_types]
    assert len(kinds) == len(set(kinds)), "a model_type in two rows"
    assert not (set(ARCHITECTURES) | set(MATRIX)) - set(kinds), "a family without a row in kiln/model/families.py"
    page = models_page()
    for f in FAMILIES:
        row = [line for line in page.splitlines() if line.startswith(f"| {f.name} |")]
        assert len(row) == 1 and ("| native |" in row[0]) == is_native(f), f.name


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_every_test_a_row_names_exists():
    for f in FAMILIES:
        assert set(f.tests) <= set(ASPECTS), f.name
        for aspect, ref in f.tests.items():
            m = re.fullmatch(r"([\w/]+\.py)::(\w+)(?:\[(\w+)\])?", ref)
            assert m, f"{f.name} {aspect}: {ref} is not path::function[param]"
            path, func, param = REPO / m[1], m[2], m[3]
            assert path.is_file() and func in _defined(path), f"{f.name} {aspect}: no test {ref}"
            if param and func == "test_parity":  # the parity matrix is parametrized by MATRIX's model_types
                assert param in MATRIX, ref
            elif param:
                assert f'"{param}"' in path.read_text(), f"{f.name} {aspect}: {path.name} has no case {param}"


def test_a_family_made_native_shows_as_native_once_generated(monkeypatch):
    gpt2 = next(f for f in FAMILIES if "gpt2" in f.model_types)
    assert not is_native(gpt2)
    monkeypatch.setitem(ARCHITECTURES, "gpt2", "GPT2LMHeadModel")
    assert is_native(gpt2)
    assert "| GPT-2 | `gpt2` | native |" in models_page()


def test_check_fails_on_a_stale_table_and_passes_once_written(tmp_path, capsys):
    shutil.copyfile(REPO / README, tmp_path / README)
    assert main(["--check", str(tmp_path)]) == 1  # docs/models.md missing
    assert COMMAND in capsys.readouterr().err
    assert main([str(tmp_path)]) == 0
    assert main(["--check", str(tmp_path)]) == 0
    readme = (tmp_path / README).read_text()
    (tmp_path / README).write_text(readme.replace("| Qwen3 | native |", "| Qwen3 | generic |"))
    assert main(["--check", str(tmp_path)]) == 1
    assert main([str(tmp_path)]) == 0 and (tmp_path / README).read_text() == readme
    assert (tmp_path / PAGE).read_text() == models_page()
    assert main(["--oops"]) == 2
