"""Search space files: every domain kind, Tune's domains for them, and clear errors for bad files and keys."""

from __future__ import annotations

import pytest
import yaml

from kiln.errors import ConfigError
from kiln.sweep.space import Param, override, read_space


def write(tmp_path, text: str):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


def test_a_space_of_every_kind(tmp_path):
    space = read_space(write(tmp_path, """
search: random
metric: tiny_mc/acc
mode: max
asha: {grace: 2, reduction: 2}
params:
  train.lr: {loguniform: [1.0e-4, 1.0e-2]}
  optim.weight_decay: {uniform: [0.0, 0.2]}
  train.batch_size: {choice: [4, 8]}
  model.n_layers: {grid: [2, 3]}
  train.warmup_steps: {randint: [1, 10]}
"""))
    assert space.metric == "tiny_mc/acc" and space.mode == "max" and space.asha == {"grace": 2, "reduction": 2}
    assert space.params[0] == Param("train.lr", "loguniform", (1e-4, 1e-2)) and space.grid_size == 2
    pytest.importorskip("ray.tune")
    from ray.tune.search.sample import Categorical, Float, Integer

    from kiln.sweep.tune import param_space

    domains = param_space(space)
    assert isinstance(domains["train.lr"], Float) and isinstance(domains["train.batch_size"], Categorical)
    assert isinstance(domains["train.warmup_steps"], Integer) and domains["model.n_layers"] == {"grid_search": [2, 3]}


@pytest.mark.parametrize("text, message", [
    ("params: {train.lr: {normal: [0, 1]}}", "unknown kind 'normal'"),
    ("params: {train.lr: {loguniform: [0, 1]}}", "low > 0"),
    ("params: {train.lr: {uniform: [2, 1]}}", "low < high"),
    ("params: {train.warmup_steps: {randint: [1.5, 3]}}", "integers"),
    ("params: {train.lr: [1, 2]}", "must be one of"),
    ("params: {}", "'params' must map"),
    ("search: bayes\nparams: {train.lr: {choice: [1]}}", "'bayes' is not one of grid, random, tpe"),
    ("search: grid\nparams: {train.lr: {uniform: [0.1, 1]}}", "grid takes only grid"),
    ("search: tpe\nparams: {train.lr: {grid: [0.1, 1]}}", "tpe cannot take grid"),
    ("mode: up\nparams: {train.lr: {choice: [1]}}", "not min or max"),
    ("asha: {grace: 0}\nparams: {train.lr: {choice: [1]}}", "grace must be at least 1"),
    ("trials: 3\nparams: {train.lr: {choice: [1]}}", "unknown key(s) trials"),
    ("params: [", "not valid YAML"),
])
def test_bad_spaces(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_space(write(tmp_path, text))


def test_keys_and_values_are_checked_against_the_config(tmp_path):
    from kiln.sweep.tune import check_space

    with pytest.raises(ConfigError, match="did you mean 'train.lr'"):
        check_space(None, [], read_space(write(tmp_path, "params: {optim.lr: {choice: [0.1]}}")))
    with pytest.raises(ConfigError, match="train.batch_size"):
        check_space(None, [], read_space(write(tmp_path, "params: {train.batch_size: {choice: [4, -1]}}")))
    cfg = check_space(None, ["train.max_steps=7"], read_space(write(tmp_path, "params: {train.lr: {choice: [0.1]}}")))
    assert cfg.train.lr == 0.1 and cfg.train.max_steps == 7


def test_overrides_are_yaml():
    import numpy as np

    assert override("train.lr", np.float64(0.001)) == "train.lr=0.001"
    for value in (["a b", "c: d", "1"], {"unit": "steps", "stages": [{"at": 0, "weights": [1, 0]}]}, "yes", "1e-3"):
        key, _, text = override("data.x", value).partition("=")
        assert key == "data.x" and yaml.safe_load(text) == value
    assert override("train.compile", True) == "train.compile=true"


def test_the_search_and_the_scheduler_follow_the_space(tmp_path):
    pytest.importorskip("ray.tune")
    pytest.importorskip("optuna")
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    from kiln.sweep.tune import scheduler_for, search_algorithm

    tpe = read_space(write(tmp_path, "search: tpe\nasha: {grace: 2, reduction: 4}\n"
                                     "params: {train.lr: {loguniform: [1.0e-4, 1.0e-2]}}"))
    assert isinstance(search_algorithm(tpe, 0), OptunaSearch)
    asha = scheduler_for(tpe, evals=5)
    assert isinstance(asha, ASHAScheduler) and asha._max_t == 6 and asha._reduction_factor == 4
    plain = read_space(write(tmp_path, "params: {train.lr: {choice: [0.1]}}"))
    assert search_algorithm(plain, 0) is None and scheduler_for(plain, 5) is None


def test_the_data_is_prepared_once_before_any_trial(tmp_path):
    from kiln.errors import DataError
    from kiln.sweep.tune import sweep

    space = write(tmp_path, "params: {train.lr: {choice: [0.1]}}")
    with pytest.raises(DataError, match="matches no readable file"):
        sweep(None, space, 1, tmp_path / "out", [f"data.sources=[{tmp_path}/nowhere/*.txt]"])
    assert not (tmp_path / "out").exists()  # nothing started
