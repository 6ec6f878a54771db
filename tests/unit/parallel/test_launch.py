"""`kiln launch k8s|slurm` write files that parse (YAML; `bash -n`) and carry the job's shape, the shared
storage and the resolved config; `kiln train --nproc` builds the torchrun command it starts."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml
from typer.testing import CliRunner

from kiln.cli import app
from kiln.config import RunConfig
from kiln.errors import ConfigError
from kiln.parallel.launch.local import torchrun_command, without_nproc

runner = CliRunner()


def test_k8s_manifest_is_an_elastic_pytorchjob_with_shared_storage(tmp_path):
    out = tmp_path / "job.yaml"
    res = runner.invoke(app, ["launch", "k8s", "gpu-1b", "train.lr=1e-4", "--nodes", "2", "--gpus-per-node", "4",
                              "--image", "ghcr.io/me/kiln:1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    config_map, job = list(yaml.safe_load_all(out.read_text()))
    assert config_map["kind"] == "ConfigMap" and job["kind"] == "PyTorchJob"
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "kiln-gpu-1b"
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3,
                                     "nProcPerNode": 4}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    pod = worker["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["image"] == "ghcr.io/me/kiln:1"
    assert c["command"] == ["python", "-m", "kiln.parallel.launch.torchrun"]
    assert c["args"] == ["-m", "kiln.cli", "train", "/etc/kiln/config.yaml"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"shared": "/shared", "config": "/etc/kiln", "dshm": "/dev/shm"}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "kiln-shared"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    cfg = RunConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert cfg.train.lr == 1e-4 and cfg.model.d_model == 2048  # the preset, with the override
    assert cfg.train.run_dir == "/shared/runs/kiln-gpu-1b" and cfg.data.cache_dir == "/shared/cache"


def test_slurm_script_starts_torchrun_on_every_node_with_the_first_as_rendezvous(tmp_path):
    out = tmp_path / "train.sbatch"
    res = runner.invoke(app, ["launch", "slurm", "gpu-124m", "--nodes", "2", "--gpus-per-node", "8", "--time",
                              "1:00:00", "--run-dir", str(tmp_path / "shared" / "run"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    directives = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH --") and "=" in line)
    assert directives["nodes"] == "2" and directives["gpus-per-node"] == "8" and directives["ntasks-per-node"] == "1"
    assert directives["time"] == "1:00:00"
    command = text[text.index("srun"):].replace("\\\n", " ").split()
    assert command[:5] == ["srun", "--kill-on-bad-exit=1", "python", "-m", "kiln.parallel.launch.torchrun"]
    assert "--nproc_per_node=8" in command and "--rdzv_backend=c10d" in command
    assert '--rdzv_endpoint="$head_node:29500"' in command and '--nnodes="$SLURM_JOB_NUM_NODES"' in command
    assert "scontrol show hostnames" in text and "sed -n 1p" in text
    config_path = tmp_path / "train.config.yaml"
    assert command[-3:] == ["kiln.cli", "train", str(config_path)]
    cfg = RunConfig.model_validate(yaml.safe_load(config_path.read_text()))
    assert cfg.train.run_dir == str(tmp_path / "shared" / "run") and cfg.model.d_model == 768


TORCHRUN_ENV = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_the_k8s_job_gives_torchrun_the_environment_of_kiln_train_nproc_and_time_to_checkpoint(tmp_path):
    out = tmp_path / "job.yaml"
    res = runner.invoke(app, ["launch", "k8s", "gpu-1b", "--nodes", "2", "--gpus-per-node", "4", "--image", "kiln:1",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    _, job = list(yaml.safe_load_all(out.read_text()))
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert {k: env.get(k) for k in TORCHRUN_ENV} == TORCHRUN_ENV
    assert "NCCL_NVLS_ENABLE" not in env
    # Kubernetes waits this long between SIGTERM and SIGKILL: longer than torchrun waits for its workers
    assert pod["terminationGracePeriodSeconds"] > int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_slurm_script_gives_torchrun_the_environment_of_kiln_train_nproc(tmp_path):
    """The script itself, run by bash with stand-ins for scontrol and srun: what srun starts torchrun with."""
    out = tmp_path / "train.sbatch"
    res = runner.invoke(app, ["launch", "slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--time",
                              "2:00:00", "--run-dir", str(tmp_path / "run"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    term = next(line for line in text.splitlines() if line.startswith("#SBATCH --signal="))
    assert term.startswith("#SBATCH --signal=TERM@") and int(term.rsplit("@", 1)[1]) > 120  # SIGTERM before the end
    srun = f"env > {tmp_path / 'srun.env'}\necho \"$@\" > {tmp_path / 'srun.args'}"
    env = slurm_stand_ins(tmp_path, ["node-a", "node-b"], srun)
    done = subprocess.run(["bash", str(out)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line)
    assert {k: seen.get(k) for k in TORCHRUN_ENV} == TORCHRUN_ENV
    assert "NCCL_NVLS_ENABLE" not in seen
    assert "--rdzv_endpoint=node-a:29500" in (tmp_path / "srun.args").read_text().split()
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "300"  # the user's own value wins, as under kiln train --nproc
    subprocess.run(["bash", str(out)], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in (tmp_path / "srun.env").read_text().splitlines()


def slurm_stand_ins(tmp_path, nodes: list[str], srun: str) -> dict[str, str]:
    """The environment in which bash runs an sbatch script as Slurm would on the first of `nodes`: stand-ins for
    scontrol (the job's host names) and srun (a shell script's body), and the job's SLURM_* variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + "".join(f"echo {n}\n" for n in nodes))
    (bin_dir / "srun").write_text(f"#!/bin/sh\n{srun}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and k != "NCCL_NVLS_ENABLE"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="nodes",
               SLURM_JOB_NUM_NODES=str(len(nodes)), SLURM_JOB_ID="42")
    return env


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_slurm_script_runs_kiln_torchrun_which_does_not_restart_a_job_that_would_fail_again(tmp_path):
    """The script run by bash on one node, its srun running the command as given: a job whose data is missing
    fails at every start, so its --max-restarts are not spent (plain torchrun would start it 4 times)."""
    out = tmp_path / "train.sbatch"
    missing = tmp_path / "nowhere.jsonl"
    res = runner.invoke(app, ["launch", "slurm", "quickstart", "model.size=tiny", "train.device=cpu",
                              f"data.sources=[{missing}]", "--nodes", "1", "--gpus-per-node", "2",
                              "--run-dir", str(tmp_path / "run"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    env = slurm_stand_ins(tmp_path, ["127.0.0.1"], 'shift\nexec "$@"')  # srun --kill-on-bad-exit=1 COMMAND
    done = subprocess.run(["bash", str(out)], capture_output=True, text=True, env=env, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text  # a data error's exit code, as kiln train's in one process
    assert text.count(f"data source '{missing}' does not exist") == 1, text
    assert text.count("kiln: not restarting the job") == 1 and "Traceback" not in text, text


def test_launch_refuses_a_bad_shape():
    res = runner.invoke(app, ["launch", "slurm", "quickstart", "--nodes", "0"])
    assert res.exit_code != 0 and "at least 1" in str(res.exception)


def test_a_launch_file_that_cannot_be_written_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the output's folder should be
    res = runner.invoke(app, ["launch", "k8s", "quickstart", "--image", "img", "--out", str(blocker / "a.yaml")])
    assert isinstance(res.exception, ConfigError) and f"cannot write {blocker / 'a.yaml'}" in str(res.exception)
    res = runner.invoke(app, ["launch", "slurm", "quickstart", "--out", str(blocker / "a.sbatch")])
    assert isinstance(res.exception, ConfigError) and "choose another --out" in str(res.exception)


def test_nproc_becomes_a_torchrun_command():
    assert without_nproc(["cfg.yaml", "--nproc", "4", "train.lr=1", "--nproc=2"]) == ["cfg.yaml", "train.lr=1"]
    cmd = torchrun_command(4, ["cfg.yaml"])
    assert cmd[1:] == ["-m", "kiln.parallel.launch.torchrun", "--standalone", "--nproc_per_node=4", "-m", "kiln.cli",
                       "train", "cfg.yaml"]
    assert without_nproc(["cfg.yaml", "--max-restarts", "3", "--nproc=2", "--max-restarts=1"]) == ["cfg.yaml"]
    cmd = torchrun_command(2, ["cfg.yaml"], max_restarts=3)
    assert cmd[1:] == ["-m", "kiln.parallel.launch.torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=3",
                       "-m", "kiln.cli", "train", "cfg.yaml"]


def test_max_restarts_passes_through_to_torchrun_and_sigterm_is_forwarded(monkeypatch):
    """`kiln train --nproc 2 --max-restarts 3` starts torchrun with --max-restarts=3 and a long shutdown timeout;
    a SIGTERM to it reaches torchrun (here a stand-in that reports the signal it got)."""
    import signal
    import subprocess

    from kiln.parallel.launch import local

    started = {}

    class Torchrun:
        def __init__(self, cmd, env):
            started.update(cmd=cmd, env=env)
            self.got = None

        def send_signal(self, signum):
            self.got = signum

        def wait(self):
            if self.got is None:
                signal.raise_signal(signal.SIGTERM)  # the scheduler preempts the job
            return 128 + self.got

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(subprocess, "Popen", Torchrun)
    before = signal.getsignal(signal.SIGTERM)
    code = local.relaunch(2, ["train", "cfg.yaml", "--nproc", "2", "--max-restarts", "3"], max_restarts=3)
    assert code == 128 + signal.SIGTERM
    assert "--max-restarts=3" in started["cmd"] and started["cmd"][-2:] == ["train", "cfg.yaml"]
    timeout = started["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    assert timeout == local.TORCHRUN_ENV["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"
    assert started["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    with pytest.raises(ConfigError, match="0 or more"):
        local.relaunch(2, ["train"], max_restarts=-1)


def test_a_sigint_or_sighup_sent_to_kiln_train_nproc_alone_reaches_torchrun(monkeypatch):
    """`kill -INT` (or a process manager's SIGINT) to `kiln train --nproc 2`: it waited on, and the job trained to
    the end; SIGHUP killed it, leaving the job to stop without it. Under nohup SIGHUP stays ignored."""
    import signal
    import subprocess

    from kiln.parallel.launch import local

    got = []

    class Torchrun:
        def __init__(self, cmd, env):
            self.waited = False

        def send_signal(self, signum):
            got.append(signum)

        def wait(self):
            if not self.waited:
                self.waited = True
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGHUP)
            return 128 + got[0] if got else 0

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(subprocess, "Popen", Torchrun)
    assert local.relaunch(2, ["train", "cfg.yaml"]) == 128 + signal.SIGINT and got == [signal.SIGINT, signal.SIGHUP]
    got.clear()
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    try:
        local.relaunch(2, ["train", "cfg.yaml"])
        assert got == [signal.SIGINT] and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("argv", [["--nproc", "0"]])
def test_nproc_must_be_positive(argv, monkeypatch):
    from kiln.parallel.launch.local import relaunch

    with pytest.raises(ConfigError, match="1 or more"):
        relaunch(0, ["train", *argv])


def _no_launch(monkeypatch):
    """relaunch must fail before it starts torchrun: a Popen that fails the test."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def started(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", started)


def test_kiln_train_nproc_checks_the_job_shape_before_starting_any_process(monkeypatch):
    """Hybrid replicas that do not divide --nproc and nccl on the CPU used to fail in every process, after
    starting and building the model (the replicas one with gloo's C++ stack frames between the errors)."""
    from kiln.config import load_config
    from kiln.parallel.launch import local

    _no_launch(monkeypatch)
    hybrid = load_config(None, ["train.device=cpu", "dist.strategy=fsdp", "dist.sharding=hybrid", "dist.replicas=3"])
    with pytest.raises(ConfigError, match="dist.replicas=3 does not divide the 2 processes of --nproc 2"):
        local.relaunch(2, ["train"], cfg=hybrid)
    nccl = load_config(None, ["train.device=cpu", "dist.backend=nccl"])
    with pytest.raises(ConfigError, match="dist.backend=nccl needs CUDA GPUs.*gloo"):
        local.relaunch(2, ["train"], cfg=nccl)
    lora = load_config(None, ["train.device=cpu", "lora.rank=8"])  # was printed once per start under --max-restarts
    with pytest.raises(ConfigError, match="lora.rank is set but model.init_from is not"):
        local.relaunch(2, ["train", "--max-restarts", "2"], max_restarts=2, cfg=lora)
    tokens = load_config(None, ["train.device=cpu", "train.seq_len=32", "train.global_batch_tokens=128"])
    with pytest.raises(ConfigError, match="is 4 sequences, which 3 data-parallel ranks cannot share evenly"):
        local.relaunch(3, ["train"], cfg=tokens)  # said by a rank, between torchrun's log lines
    cut = load_config(None, ["train.device=cpu", "train.seq_len=32", "train.global_batch_tokens=256",
                             "train.batch_size=3"])
    with pytest.raises(ConfigError, match="gives 4 sequences per rank per step, not a multiple of train.batch_size=3"):
        local.relaunch(2, ["train"], cfg=cut)
    offload = load_config(None, ["train.device=cpu", "train.offload=optimizer"])  # said by rank 1 after preparing data
    with pytest.raises(ConfigError, match="train.offload=optimizer runs in one process.*--nproc 2"):
        local.relaunch(2, ["train"], cfg=offload)
    local.check_world(offload, 1)  # one process under --max-restarts: the offload's own setting


def test_more_cpu_processes_than_memory_holds_is_an_error_and_more_than_cores_a_warning(monkeypatch):
    """--nproc 64 on a 2-core CPU machine used to start 64 processes that never got to train."""
    import psutil

    from kiln.config import load_config
    from kiln.errors import ResourceError
    from kiln.parallel.launch import local

    _no_launch(monkeypatch)
    cfg = load_config(None, ["train.device=cpu"])
    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 8 << 30})())
    with pytest.raises(ResourceError, match=r"--nproc 64: 64 CPU training processes need at least 32 GiB.*8\.0 GiB"):
        local.relaunch(64, ["train"], cfg=cfg)
    said = []
    local.check_world(cfg, 4, said.append)  # 2 GiB: fits; 4 processes on 2 cores: said
    assert len(said) == 1 and "--nproc 4 on 2 CPU cores" in said[0]
    said.clear()
    local.check_world(cfg, 2, said.append)
    assert said == []


def test_a_gpu_run_with_more_processes_than_gpus_fails_before_starting(monkeypatch):
    import torch

    from kiln.config import load_config
    from kiln.errors import ResourceError
    from kiln.parallel.launch import local

    _no_launch(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ResourceError, match="--nproc 4: this machine has 2 GPU"):
        local.relaunch(4, ["train"], cfg=load_config(None, ["train.device=auto"]))


def test_a_world_size_that_is_not_a_number_is_a_config_error(monkeypatch):
    from kiln.parallel.launch import local

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ConfigError, match="WORLD_SIZE='abc' is not an integer"):
        local.relaunch(2, ["train"])


def test_dist_replicas_without_hybrid_sharding_is_a_config_problem():
    """It used to pass validation and fail in every process after the model was built."""
    from kiln.config import load_config

    with pytest.raises(ConfigError, match="dist.replicas=2 applies to dist.sharding=hybrid only"):
        load_config(None, ["dist.strategy=fsdp", "dist.replicas=2"])
    assert load_config(None, ["dist.sharding=hybrid", "dist.replicas=2"]).dist.replicas == 2


@pytest.mark.parametrize("args, message", [
    (["--image", ""], "--image '': give the container image"),
    (["--image", "my image"], "no spaces"),
    (["--image", "kiln:1", "--shm-gib", "0"], "--shm-gib 0: the /dev/shm size must be at least 1 GiB"),
    (["--image", "kiln:1", "--shm-gib", "-3"], "--shm-gib -3"),
])
def test_k8s_refuses_an_image_or_shm_size_the_cluster_would_reject(tmp_path, args, message):
    """An empty image and '--shm-gib -3' used to be written as is (sizeLimit: -3Gi); 0 quietly became 8."""
    out = tmp_path / "job.yaml"
    res = runner.invoke(app, ["launch", "k8s", "gpu-124m", *args, "--out", str(out)])
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError) and message in str(res.exception)
    assert not out.exists()


def test_launch_files_with_spaces_in_their_paths_parse_and_the_commands_printed_can_be_pasted(tmp_path):
    """The Slurm output directive split at the space, the run directory (where Slurm opens the job's output
    before the script runs) did not exist, and `sbatch my dir/job.sbatch` was printed unquoted."""
    import shlex

    cfg = tmp_path / "my config.yaml"
    cfg.write_text("model:\n  size: tiny\n")
    run_dir = tmp_path / "shared runs" / "r 1"
    out = tmp_path / "out dir" / "my job.sbatch"
    res = runner.invoke(app, ["launch", "slurm", str(cfg), "--gpus-per-node", "2", "--run-dir", str(run_dir),
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"sbatch {shlex.quote(str(out))}" in res.output
    assert run_dir.is_dir()
    text = out.read_text()
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(out)], capture_output=True).returncode == 0
    (output,) = [line for line in text.splitlines() if line.startswith("#SBATCH --output")]
    assert shlex.split(output) == ["#SBATCH", f"--output={run_dir}/slurm-%j.out"]  # one argument, as sbatch reads it
    assert shlex.split(text.splitlines()[-1])[-1] == str(out.with_name("my job.config.yaml"))
    k8s_out = tmp_path / "out dir" / "my job.yaml"
    res = runner.invoke(app, ["launch", "k8s", str(cfg), "--image", "kiln:1", "--out", str(k8s_out)])
    assert res.exit_code == 0 and f"kubectl apply -f {shlex.quote(str(k8s_out))}" in res.output
    assert [d["kind"] for d in yaml.safe_load_all(k8s_out.read_text())] == ["ConfigMap", "PyTorchJob"]


@pytest.mark.parametrize("args, message", [
    (["--time", "a b"], "--time 'a b' is not a Slurm time limit"),
    (["--time", "1 day"], "not a Slurm time limit"),
    (["--partition", "gpu; rm -rf ~"], "is not a partition name"),
])
def test_slurm_refuses_a_time_limit_or_partition_sbatch_would_reject(tmp_path, args, message):
    out = tmp_path / "job.sbatch"
    res = runner.invoke(app, ["launch", "slurm", "gpu-124m", *args, "--out", str(out)])
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError) and message in str(res.exception)
    assert not out.exists()


@pytest.mark.parametrize("limit", ["90", "30:00", "12:00:00", "2-00", "1-12:00", "1-00:00:00", "UNLIMITED"])
def test_slurm_accepts_its_time_formats(limit):
    from kiln.parallel.launch.slurm import check_options

    check_options(limit, "gpu,debug")


def test_one_named_gpu_for_several_processes_or_no_gpu_at_all_fails_before_starting(monkeypatch):
    """train.device=cuda:1 put every process on GPU 1; train.device=cuda on a CPU machine said 'start at most 0'."""
    import torch

    from kiln.config import load_config
    from kiln.errors import ResourceError
    from kiln.parallel.launch import local

    _no_launch(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ResourceError, match="train.device=cuda, but no CUDA GPU is visible here"):
        local.relaunch(2, ["train"], cfg=load_config(None, ["train.device=cuda"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match="train.device=cuda:1 names one GPU for all 2 processes"):
        local.relaunch(2, ["train"], cfg=load_config(None, ["train.device=cuda:1"]))


def test_the_slurm_script_reads_the_first_node_of_a_long_node_list_without_failing(tmp_path):
    """`scontrol show hostnames | head -n 1` under `set -o pipefail`: head leaves after one line, scontrol dies of
    SIGPIPE writing the rest, and the script ended with 141 before starting anything (seen with a 2-node list)."""
    import os

    out = tmp_path / "train.sbatch"
    res = runner.invoke(app, ["launch", "slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2",
                              "--run-dir", str(tmp_path / "run"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    many = "\n".join(f"node-{i:05d}" for i in range(20000))  # more than a pipe holds
    (bin_dir / "nodes.txt").write_text(many + "\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\nwhile read -r n; do echo $n; done < {bin_dir / 'nodes.txt'}\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'srun.args'}\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[0-19999]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "42"}
    done = subprocess.run(["bash", str(out)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--rdzv_endpoint=node-00000:29500" in (tmp_path / "srun.args").read_text().split()


def test_a_run_directory_or_cache_given_as_an_override_is_the_one_the_launch_files_use(tmp_path):
    """`kiln launch slurm CONFIG train.run_dir=/shared/x data.cache_dir=/shared/cache`: both were replaced, silently,
    by runs/NAME here and ~/.cache/kiln (each node's own); k8s took any path, though the pods see only /shared."""
    run_dir, cache = tmp_path / "shared" / "my run", tmp_path / "shared" / "cache"
    out = tmp_path / "job.sbatch"
    res = runner.invoke(app, ["launch", "slurm", "quickstart", f"train.run_dir={run_dir}", f"data.cache_dir={cache}",
                              "--gpus-per-node", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    cfg = RunConfig.model_validate(yaml.safe_load((tmp_path / "job.config.yaml").read_text()))
    assert cfg.train.run_dir == str(run_dir) and cfg.data.cache_dir == str(cache)
    assert f'--output="{run_dir}/slurm-%j.out"' in out.read_text() and run_dir.is_dir()
    res = runner.invoke(app, ["launch", "slurm", "quickstart", f"train.run_dir={run_dir}", "--run-dir",
                              str(tmp_path / "other"), "--out", str(out)])
    assert res.exit_code != 0 and "name two run directories; give one" in str(res.exception or res.output)

    k8s_out = tmp_path / "job.yaml"
    res = runner.invoke(app, ["launch", "k8s", "quickstart", "train.run_dir=/shared/runs/mine", "--image", "kiln:1",
                              "--out", str(k8s_out)])
    assert res.exit_code == 0, res.output
    config_map, _ = list(yaml.safe_load_all(k8s_out.read_text()))
    cfg = RunConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert cfg.train.run_dir == "/shared/runs/mine" and cfg.data.cache_dir == "/shared/cache"
    res = runner.invoke(app, ["launch", "k8s", "quickstart", f"data.cache_dir={cache}", "--image", "kiln:1",
                              "--out", str(k8s_out)])
    assert res.exit_code != 0 and "the pods see only the volume claim mounted at /shared" in str(res.exception)
