import os

import pytest

from kiln.config import DistConfig
from kiln.parallel import allocator
from kiln.parallel.mesh import init_mesh


@pytest.fixture
def clean_env(monkeypatch):
    for name in allocator.USER:  # set first, so that what a test sets is undone after it, as the values were
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_run_turns_on_expandable_segments_where_the_user_set_nothing(clean_env):
    mesh = init_mesh("cpu", DistConfig())
    assert mesh.world == 1
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("name", allocator.USER)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:128"])
def test_the_users_allocator_setting_is_left_alone(clean_env, name, value):
    clean_env.setenv(name, value)
    assert allocator.configure() is None
    assert os.environ[name] == value
    assert [n for n in allocator.USER if n != name and os.environ.get(n)] == []
