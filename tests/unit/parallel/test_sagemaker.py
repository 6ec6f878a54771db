"""`kiln launch sagemaker`: a CreateTrainingJob request that botocore's model of the API accepts, with torchrun on
every instance, the run directory on the synced checkpoint path for spot recovery, and metric definitions that
parse the lines Kiln writes."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import yaml
from typer.testing import CliRunner

from kiln.cli import app
from kiln.errors import ConfigError
from kiln.parallel.launch.sagemaker import CHECKPOINTS, METRICS, torchrun_command, training_job

ROLE = "arn:aws:iam::123456789012:role/sagemaker"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/kiln:1"
JOB = dict(instance_type="ml.p5.48xlarge", instance_count=2, image=IMAGE, role=ROLE, output_s3="s3://my-bucket/kiln")


def test_a_spot_job_on_two_p5_instances(tmp_path):
    out = tmp_path / "job.json"
    res = CliRunner().invoke(app, ["launch", "sagemaker", "gpu-1b", "train.lr=1e-4", "--instance-type",
                                   "ml.p5.48xlarge", "--instance-count", "2", "--image", IMAGE, "--role", ROLE,
                                   "--output", "s3://my-bucket/kiln/", "--spot", "--max-run", "36000",
                                   "--input", "train=s3://my-bucket/corpus", "--out", str(out)])
    assert res.exit_code == 0, res.output
    job = json.loads(out.read_text())
    name = job["TrainingJobName"]
    assert re.fullmatch(r"kiln-gpu-1b-\d{8}-\d{6}", name)
    assert job["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge" and job["ResourceConfig"]["InstanceCount"] == 2
    assert job["EnableManagedSpotTraining"] is True
    assert job["StoppingCondition"] == {"MaxRuntimeInSeconds": 36000, "MaxWaitTimeInSeconds": 72000}
    assert job["CheckpointConfig"] == {"S3Uri": f"s3://my-bucket/kiln/{name}/checkpoints", "LocalPath": CHECKPOINTS}
    spec = job["AlgorithmSpecification"]
    assert spec["TrainingImage"] == IMAGE
    assert spec["ContainerEntrypoint"] == ["python", "-m", "kiln.parallel.launch.sagemaker"]
    assert spec["ContainerArguments"] == ["--gpus-per-instance", "8", "--max-restarts", "0"]
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert channels == {"config": f"s3://my-bucket/kiln/{name}/config", "train": "s3://my-bucket/corpus"}
    cfg = yaml.safe_load((tmp_path / "job.config.yaml").read_text())  # what the config channel is to hold
    assert cfg["train"]["run_dir"] == f"{CHECKPOINTS}/run" and cfg["data"]["cache_dir"] == f"{CHECKPOINTS}/cache"
    assert cfg["train"]["lr"] == 1e-4
    # the request is one the SageMaker API takes: botocore's own model of CreateTrainingJob, offline
    botocore = pytest.importorskip("botocore.session")
    from botocore.validate import ParamValidator

    shape = botocore.get_session().get_service_model("sagemaker").operation_model("CreateTrainingJob").input_shape
    report = ParamValidator().validate(job, shape)
    assert not report.has_errors(), report.generate_report()


def test_every_instance_runs_torchrun_with_its_rank():
    resource = {"current_host": "algo-2", "hosts": ["algo-1", "algo-2", "algo-3"], "network_interface_name": "eth0"}
    cmd = torchrun_command(resource, 8, max_restarts=2)
    assert cmd[0] == sys.executable and cmd[1:3] == ["-m", "kiln.parallel.launch.torchrun"]
    assert {"--nnodes=3", "--node_rank=1", "--nproc_per_node=8", "--master_addr=algo-1", "--max-restarts=2"} <= set(cmd)
    assert cmd[-3:] == ["kiln.cli", "train", "/opt/ml/input/data/config/config.yaml"]
    from torch.distributed.run import parse_args

    args = parse_args(cmd[3:])  # torchrun reads these arguments as meant
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr, args.max_restarts) == \
        ("3", 1, "8", "algo-1", 2)
    assert args.module and args.training_script == "kiln.cli"


def test_metric_definitions_parse_kilns_lines():
    from rich.console import Console

    from kiln.monitor.progress import ProgressLines
    from kiln.monitor.sinks import ConsoleSink

    train = ProgressLines(lambda s: None, 400).line(40, {"loss": 5.2345, "lr": 1e-3, "tokens_per_s": 2530.0})
    buf = io.StringIO()
    sink = ConsoleSink(Console(file=buf, width=200))
    sink.on_eval_end(None, {"step": 40, "val_loss": 5.1234, "val_ppl": 167.9, "val_bpb": 1.2345})
    found = {}
    for name, regex in METRICS:
        for line in (train, buf.getvalue()):
            m = re.search(regex, line)
            if m:
                found[name] = float(m.group(1))
    assert found == {"train:loss": 5.2345, "train:lr": 1e-3, "eval:val_loss": 5.1234, "eval:val_bpb": 1.2345}


@pytest.mark.parametrize("change, message", [
    (dict(role="my-role"), "not an IAM role ARN"),
    (dict(output_s3="my-bucket/kiln"), "not an S3 URI"),
    (dict(instance_type="ml.x9.huge"), "give --gpus-per-instance"),
    (dict(spot=True, max_wait_s=10), "shorter than --max-run"),
    (dict(max_wait_s=100000), "add --spot"),
    (dict(instance_count=0), "at least 1"),
    (dict(inputs=["train"]), "NAME=s3://"),
    (dict(inputs=["config=s3://b/x"]), "not 'config'"),
])
def test_bad_options_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        training_job(None, [], **{**JOB, **change})
    assert training_job(None, [], **{**JOB, "instance_type": "ml.x9.huge", "gpus_per_instance": 2})[0][
        "AlgorithmSpecification"]["ContainerArguments"][1] == "2"
