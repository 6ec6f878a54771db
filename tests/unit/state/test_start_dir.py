"""A run's relative input paths are read from the directory it started in, wherever it is resumed from."""

from __future__ import annotations

import pytest
import yaml

from kiln.config import load_config
from kiln.errors import DataError
from kiln.state.resume import config_differences
from kiln.state.rundir import run_config, write_config


def started(tmp_path, monkeypatch, *overrides: str):
    """A project with data/ and a run of it whose config.yaml names its inputs relative to the project, the run
    directory given absolute (so only the record tells where it started); the current directory then elsewhere."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    (project / "data" / "a.txt").write_text("def f(x):\n    return x\n")
    (project / "tasks").mkdir()
    elsewhere.mkdir()
    run_dir = tmp_path / "runs" / "one"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(project)
    write_config(run_dir, load_config(None, [f"train.run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                                             "eval.include_path=[tasks]", *overrides]))
    monkeypatch.chdir(elsewhere)
    return project, elsewhere, run_dir


def test_relative_sources_are_read_from_where_the_run_started_not_where_it_resumes(tmp_path, monkeypatch):
    project, elsewhere, run_dir = started(tmp_path, monkeypatch, "data.sources=[data/*.txt, data/a.txt]")
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "b.txt").write_text("other files of the same relative name")
    cfg = run_config(run_dir, strict=True)
    assert cfg.data.sources == [str(project / "data" / "*.txt"), str(project / "data" / "a.txt")]
    assert cfg.eval.include_path == [str(project / "tasks")]
    assert run_config(run_dir, ["data.sources=[data/b.txt]"], strict=True).data.sources == ["data/b.txt"]
    # resumed from the directory it started in, the config is read as written
    monkeypatch.chdir(project)
    assert run_config(run_dir).data.sources == ["data/*.txt", "data/a.txt"]


def test_a_mixtures_relative_entries_are_read_from_there_and_their_place_is_no_config_change(tmp_path, monkeypatch):
    project, _, run_dir = started(tmp_path, monkeypatch, "data.mixture=[{sources: [data], weight: 2}, "
                                  "{sources: ['@stdlib'], weight: 1}]")
    cfg = run_config(run_dir, strict=True)
    assert [e.sources for e in cfg.data.mixture] == [[str(project / "data")], ["@stdlib"]]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config_differences(saved, cfg.model_dump(mode="json")) == []  # the same data, found where it lives
    moved = cfg.model_dump(mode="json")
    moved["data"]["mixture"][0]["weight"] = 3.0
    assert config_differences(saved, moved) == ["data.mixture: [{'weight': 2.0}, {'weight': 1.0}] -> "
                                                "[{'weight': 3.0}, {'weight': 1.0}]"]


def test_data_found_in_neither_place_names_both_and_what_to_do(tmp_path, monkeypatch):
    project, elsewhere, run_dir = started(tmp_path, monkeypatch, "data.sources=[data/*.txt]")
    (project / "data" / "a.txt").unlink()
    with pytest.raises(DataError) as e:
        run_config(run_dir, strict=True)
    said = str(e.value)
    assert f"{project / 'data' / '*.txt'} (where the run started)" in said
    assert f"{elsewhere / 'data' / '*.txt'} (the current directory)" in said
    assert "data.sources=[/new/place" in said
    assert run_config(run_dir).data.sources == ["data/*.txt"]  # not strict (kiln eval of the run): read as given
