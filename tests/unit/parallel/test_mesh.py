"""kiln.parallel.mesh: the environment torchrun describes, checked before a process group is joined; a backend that
cannot drive the run's device and a MASTER_PORT another program holds are errors that say what to do."""

from __future__ import annotations

import socket

import pytest

from kiln.config import DistConfig
from kiln.errors import ConfigError, ResourceError
from kiln.parallel.mesh import init_mesh, process_env

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


@pytest.fixture
def env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    return set_env


def test_no_torchrun_environment_is_a_one_process_run(env):
    assert process_env() == (1, 0, 0, 1)
    env(RANK=0)  # rank 0 of one: the same
    assert process_env() == (1, 0, 0, 1)


def test_a_rank_left_in_the_environment_of_a_one_process_run_is_an_error(env):
    """RANK=1 alone used to train as one process that took itself for rank 1: no config.yaml, no model/."""
    env(RANK=1)
    with pytest.raises(ConfigError, match=r"RANK=1 is set but WORLD_SIZE is not.*unset them"):
        process_env()
    env(WORLD_SIZE=1)
    with pytest.raises(ConfigError, match="RANK=1 is set but WORLD_SIZE is 1"):
        init_mesh("cpu", DistConfig())


def test_world_size_without_the_rest_of_torchruns_environment_names_what_is_missing(env):
    """WORLD_SIZE=2 alone used to end in torch's ValueError traceback from env:// rendezvous."""
    env(WORLD_SIZE=2)
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 is set .* but RANK, MASTER_ADDR, MASTER_PORT are not"):
        init_mesh("cpu", DistConfig())
    env(RANK=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    with pytest.raises(ConfigError, match=r"RANK=2 is outside 0\.\.1"):
        process_env()
    env(WORLD_SIZE=0, RANK=0)
    with pytest.raises(ConfigError, match="WORLD_SIZE=0"):
        process_env()


def test_nccl_on_the_cpu_is_a_config_error_before_any_group_is_joined(env):
    env(WORLD_SIZE=2, RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    with pytest.raises(ConfigError, match="dist.backend=nccl needs CUDA GPUs.*use dist.backend=gloo"):
        init_mesh("cpu", DistConfig(backend="nccl"))


def test_a_master_port_in_use_is_a_resource_error_naming_it(env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env(WORLD_SIZE=2, RANK=0, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with pytest.raises(ResourceError, match=f"127.0.0.1:{port}: the port is in use.*--master_port"):
            init_mesh("cpu", DistConfig(timeout_s=5))


@pytest.mark.parametrize("strategy, dist_cfg, expected", [
    ("ddp", DistConfig(), "ddp"),
    ("fsdp", DistConfig(), "fsdp full (ZeRO-3)"),
    ("fsdp", DistConfig(sharding="grad_op", cpu_offload=True), "fsdp grad_op (ZeRO-2), cpu_offload"),
    ("fsdp", DistConfig(sharding="hybrid"), "fsdp hybrid, 2 replica(s) x 4 shards"),
    ("fsdp", DistConfig(sharding="hybrid", replicas=4), "fsdp hybrid, 4 replica(s) x 2 shards"),
])
def test_the_start_of_a_run_says_how_the_model_is_spread(strategy, dist_cfg, expected):
    """An explicit dist.strategy used to be logged nowhere (only auto's choice was), nor the hybrid mesh."""
    from kiln.parallel.mesh import Mesh

    assert Mesh(world=8, local_world=4).describe(strategy, dist_cfg) == expected


def _check_configs(rank: int, port: int, out: str, overrides: list[list[str]]) -> None:
    import os

    import torch.distributed as dist

    from kiln.config import load_config
    from kiln.parallel.mesh import Mesh, check_same_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = Mesh(rank=rank, world=2, local_world=1)  # two nodes of one process each
        for i, given in enumerate(overrides):
            try:
                check_same_config(load_config("quickstart", given[rank].split()), mesh)
                said = "same"
            except ConfigError as e:
                said = str(e)
            with open(f"{out}.{i}.{rank}", "w") as f:
                f.write(said)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a real two-process gloo group
def test_nodes_started_with_different_configs_are_told_which_keys_differ_on_every_process(tmp_path):
    """Two nodes, the second started with another train.lr (its command typed apart, or its copy of the config
    file older): it trained beside rank 0 without a word, its replica's steps not rank 0's. Now every process
    raises the same ConfigError naming the rank, its node and the keys."""
    import torch.multiprocessing as mp

    cases = [["train.lr=1e-3", "train.lr=1e-3"], ["train.lr=1e-3", "train.lr=5e-2 model.n_layers=2"]]
    mp.spawn(_check_configs, args=(_free_port(), str(tmp_path / "said"), cases), nprocs=2, join=True)
    said = [[(tmp_path / f"said.{i}.{r}").read_text() for r in (0, 1)] for i in range(len(cases))]
    assert said[0] == ["same", "same"]
    assert said[1][0] == said[1][1]
    assert said[1][0].startswith("the processes of this job were started with different configs: rank 1 (node 1) "
                                 "has model.n_layers=2, train.lr=0.05 where rank 0 has model.n_layers=4, "
                                 "train.lr=0.001. Start the same `kiln train` command on every node")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
