import os

import pytest
import torch

from kiln.parallel import compile_cache


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    yield monkeypatch


def test_use_points_inductor_at_the_directory_and_creates_it(tmp_path, no_env):
    where = tmp_path / "a" / "compile"
    assert compile_cache.use(str(where)) == str(where)
    assert where.is_dir() and os.environ[compile_cache.ENV] == str(where)


def test_a_cache_directory_the_user_set_wins(tmp_path, no_env):
    no_env.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.use(str(tmp_path / "kiln")) == str(tmp_path / "mine")
    assert not (tmp_path / "kiln").exists()


def test_torchs_own_default_in_the_environment_is_not_taken_for_the_users(tmp_path, no_env):
    no_env.setenv(compile_cache.ENV, compile_cache._torch_default())  # torch writes it there once it has looked
    assert compile_cache.use(str(tmp_path / "kiln")) == str(tmp_path / "kiln")


def test_null_keeps_torchs_default(no_env):
    assert compile_cache.use(None) is None and compile_cache.ENV not in os.environ


@pytest.mark.slow
def test_a_second_compile_of_the_same_graph_is_read_from_the_directory(tmp_path, no_env):
    from torch._dynamo.utils import counters

    compile_cache.use(str(tmp_path / "cc"))

    def f(x):
        return torch.nn.functional.gelu(x * 3.0 + 1.0).sum(-1)

    x = torch.randn(4, 8)
    want = torch.compile(f)(x)
    assert any((tmp_path / "cc").rglob("*")), "nothing was written to the cache directory"
    torch._dynamo.reset()  # forget the in-memory graphs: only the directory can serve the next compile
    counters.clear()
    got = torch.compile(f)(x)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    torch.testing.assert_close(got, want)
