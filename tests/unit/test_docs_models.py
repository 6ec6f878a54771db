"""The model tables (docs/models.md, the README's) are generated from kiln.model.families and the native
architectures, every family Kiln imports or the parity matrix covers has a row, every test a row names exists,
and the committed tables are current."""

from __future__ import annotations

import ast
import json
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


def test_generic_rows_take_their_speed_from_a_committed_gpu_result_and_only_from_one(tmp_path):
    """benchmarks/generic_families.py's JSON on a GPU fills the speed cells of the families it measured (tokens/s
    and the ratio to the native Llama, or the error of a family that failed); a CPU smoke run's JSON does not;
    a family in no result stays "not measured"; a row's own speed is kept."""
    shutil.copyfile(REPO / README, tmp_path / README)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    rows = [{"family": "llama", "name": "native", "tokens_per_s": 500_000.0, "over_llama": 1.0},
            {"family": "gpt2", "name": "generic", "tokens_per_s": 412_345.0, "over_llama": 0.82469},
            {"family": "bloom", "name": "generic", "error": "TypeError: a | b"},
            {"family": "phi3", "name": "generic", "tokens_per_s": 7_777_000.0, "over_llama": 9.0}]  # its own
    (results / "generic_families_124m_h100.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "args": {"size": "124m", "device": "cuda"}, "rows": rows}))
    (results / "generic_families_cpu.json").write_text(json.dumps({  # a smoke run: not a measurement
        "device": "x86_64", "args": {"size": "tiny", "device": "cpu"},
        "rows": [{"family": "opt", "name": "generic", "tokens_per_s": 9.0, "over_llama": 2.0}]}))
    assert main([str(tmp_path)]) == 0
    page = (tmp_path / PAGE).read_text()
    where = "benchmarks/results/generic_families_124m_h100.json"
    assert (f"| GPT-2 | `gpt2` | generic (`hf_class=auto`) | yes | - | - | yes | 124m on one H100: 412K tokens/s, "
            f"0.82x the native Llama of its size ({where}) |") in page
    assert f"| 124m on one H100: failed to train (TypeError: a \\| b; {where}) |" in page
    assert [line for line in page.splitlines() if line.startswith("| OPT |")][0].count("| not measured |") == 1
    phi3 = next(f for f in FAMILIES if "phi3" in f.model_types)
    assert f"| {phi3.speed} |" in page and "7777K" not in page
    (results / "generic_families_124m_h100.json").write_text("{")
    assert main([str(tmp_path)]) == 2  # a damaged result is said, not read as no result
