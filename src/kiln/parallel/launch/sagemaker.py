"""`kiln launch sagemaker`: a SageMaker training job that runs `kiln train` with torchrun on every instance.

The job definition is the request of SageMaker's CreateTrainingJob API (what the SDK's PyTorch
estimator sends), written as JSON and, with `--submit`, sent through boto3:

- the image: one with kiln installed (e.g. built from the AWS PyTorch training image); its entry point
  is `python -m kiln.parallel.launch.sagemaker`, which reads SageMaker's description of the cluster
  (/opt/ml/input/config/resourceconfig.json) and starts Kiln's torchrun with a process per GPU, the
  instance's rank among the job's hosts and the first host as the rendezvous;
- the run directory and the data cache are under /opt/ml/checkpoints, which SageMaker copies to
  `checkpoint_s3_uri` as it changes and back at every start: a managed spot job (`--spot`) that is
  interrupted starts again from its newest checkpoint, with its prepared data;
- the resolved config travels as the input channel `config` (uploaded beside the job's output on
  `--submit`), data sets as further channels (`--input NAME=s3://...`, at /opt/ml/input/data/NAME);
- metric definitions parse Kiln's log lines (`step 40/400 (10%)  loss 5.2345  lr 1.00e-03 ...` and
  `eval step 40: val_loss 5.1234 ...`), so the job's console charts train:loss and eval:val_loss.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.parallel.launch.common import job_name, resolved_config
from kiln.parallel.launch.torchrun import TORCHRUN_ENV

CHECKPOINTS = "/opt/ml/checkpoints"
CONFIG_CHANNEL = "config"
RESOURCE_CONFIG = "/opt/ml/input/config/resourceconfig.json"
PORT = 29500
# GPUs per instance of the SageMaker types made for training
GPUS = {"ml.p5.48xlarge": 8, "ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8, "ml.p4d.24xlarge": 8,
        "ml.p4de.24xlarge": 8, "ml.p3.2xlarge": 1, "ml.p3.8xlarge": 4, "ml.p3.16xlarge": 8,
        "ml.p3dn.24xlarge": 8, "ml.g5.xlarge": 1, "ml.g5.2xlarge": 1, "ml.g5.4xlarge": 1, "ml.g5.8xlarge": 1,
        "ml.g5.16xlarge": 1, "ml.g5.12xlarge": 4, "ml.g5.24xlarge": 4, "ml.g5.48xlarge": 8, "ml.g6.xlarge": 1,
        "ml.g6.2xlarge": 1, "ml.g6.12xlarge": 4, "ml.g6.48xlarge": 8, "ml.g6e.xlarge": 1, "ml.g6e.12xlarge": 4,
        "ml.g6e.48xlarge": 8}
# (name, regex with one group) over the lines kiln.monitor.progress and the console sink write
METRICS = [
    ("train:loss", r"step \d+/\d+ \(\d+%\)\s+loss ([0-9.eE+-]+)"),
    ("train:lr", r"step \d+/\d+ \(\d+%\)\s+loss \S+\s+lr ([0-9.eE+-]+)"),
    ("eval:val_loss", r"eval step \d+: val_loss ([0-9.eE+-]+)"),
    ("eval:val_bpb", r"eval step \d+: .*val_bpb ([0-9.eE+-]+)"),
]
S3 = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?")
ROLE = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/\S+")


def _s3(uri: str, what: str) -> str:
    if not S3.fullmatch(uri):
        raise ConfigError(f"{what} {uri!r} is not an S3 URI (s3://bucket/prefix)")
    return uri.rstrip("/")


def gpus_of(instance_type: str, given: int | None) -> int:
    if given is not None:
        if given < 1:
            raise ConfigError(f"--gpus-per-instance {given}: give at least 1")
        return given
    if instance_type not in GPUS:
        raise ConfigError(f"--instance-type {instance_type}: its GPUs per instance are not known here; give "
                          "--gpus-per-instance N (known: " + ", ".join(sorted(GPUS)) + ")")
    return GPUS[instance_type]


def training_job(config: str | None, overrides: Sequence[str], *, instance_type: str, instance_count: int,
                 image: str, role: str, output_s3: str, checkpoint_s3: str | None = None, spot: bool = False,
                 max_run_s: int = 86400, max_wait_s: int | None = None, name: str | None = None,
                 gpus_per_instance: int | None = None, volume_gb: int = 200, inputs: Sequence[str] = (),
                 max_restarts: int = 0, now: float | None = None) -> tuple[dict[str, Any], str]:
    """(the CreateTrainingJob request, the resolved config YAML that its `config` channel must hold)."""
    if instance_count < 1:
        raise ConfigError(f"--instance-count {instance_count}: give at least 1")
    if not ROLE.fullmatch(role):
        raise ConfigError(f"--role {role!r} is not an IAM role ARN (arn:aws:iam::123456789012:role/NAME)")
    if not image or len(image) > 255:
        raise ConfigError("--image: give the URI of an image with kiln installed (at most 255 characters)")
    output_s3 = _s3(output_s3, "--output")
    gpus = gpus_of(instance_type, gpus_per_instance)
    if max_run_s < 1:
        raise ConfigError(f"--max-run {max_run_s}: give a positive number of seconds")
    if spot and max_wait_s is not None and max_wait_s < max_run_s:
        raise ConfigError(f"--max-wait {max_wait_s} is shorter than --max-run {max_run_s}: SageMaker needs the wait "
                          "for spot capacity plus the run to fit in it")
    if max_wait_s is not None and not spot:
        raise ConfigError("--max-wait applies to managed spot training; add --spot")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    job = f"{job_name(config, name)}-{stamp}"[:63].strip("-")
    checkpoint_s3 = _s3(checkpoint_s3, "--checkpoint-s3") if checkpoint_s3 else f"{output_s3}/{job}/checkpoints"
    cfg = resolved_config(config, list(overrides), f"{CHECKPOINTS}/run", f"{CHECKPOINTS}/cache")
    channels = [{"ChannelName": CONFIG_CHANNEL, "InputMode": "File", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": f"{output_s3}/{job}/config", "S3DataDistributionType": "FullyReplicated"}}}]
    for item in inputs:
        channel, sep, uri = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", channel) or channel == CONFIG_CHANNEL:
            raise ConfigError(f"--input {item!r}: give NAME=s3://bucket/prefix (NAME: letters, digits, '.', '_', '-'; "
                              f"not '{CONFIG_CHANNEL}'); the data is then at /opt/ml/input/data/NAME")
        channels.append({"ChannelName": channel, "InputMode": "FastFile", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": _s3(uri, "--input"), "S3DataDistributionType": "FullyReplicated"}}})
    request: dict[str, Any] = {
        "TrainingJobName": job,
        "RoleArn": role,
        "AlgorithmSpecification": {
            "TrainingImage": image, "TrainingInputMode": "File",
            "ContainerEntrypoint": ["python", "-m", "kiln.parallel.launch.sagemaker"],
            "ContainerArguments": ["--gpus-per-instance", str(gpus), "--max-restarts", str(max_restarts)],
            "MetricDefinitions": [{"Name": n, "Regex": r} for n, r in METRICS],
            "EnableSageMakerMetricsTimeSeries": True,
        },
        "InputDataConfig": channels,
        "OutputDataConfig": {"S3OutputPath": f"{output_s3}/{job}/output"},
        "ResourceConfig": {"InstanceType": instance_type, "InstanceCount": instance_count,
                           "VolumeSizeInGB": volume_gb},
        "StoppingCondition": {"MaxRuntimeInSeconds": max_run_s},
        "CheckpointConfig": {"S3Uri": checkpoint_s3, "LocalPath": CHECKPOINTS},
        "EnableManagedSpotTraining": spot,
        "Environment": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **TORCHRUN_ENV},
    }
    if spot:
        request["StoppingCondition"]["MaxWaitTimeInSeconds"] = max_wait_s or 2 * max_run_s
    return request, cfg.to_yaml()


def submit(request: dict[str, Any], config_yaml: str, region: str | None = None) -> str:
    """Upload the config to its channel and create the job (boto3, with the credentials of this machine)."""
    try:
        import boto3
    except ImportError:
        raise ConfigError("--submit needs boto3: pip install boto3 (and AWS credentials)") from None
    uri = request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"]
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    session = boto3.Session(region_name=region)
    session.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/config.yaml", Body=config_yaml.encode())
    return session.client("sagemaker").create_training_job(**request)["TrainingJobArn"]


# --------------------------------------------------------------------------- in the job's container


def torchrun_command(resource: dict[str, Any], gpus: int, max_restarts: int = 0,
                     config: str = f"/opt/ml/input/data/{CONFIG_CHANNEL}/config.yaml") -> list[str]:
    """The command each instance runs, from SageMaker's resourceconfig.json ({current_host, hosts, ...})."""
    hosts = sorted(resource["hosts"])  # algo-1, algo-2, ...: the same order on every instance
    rank = hosts.index(resource["current_host"])
    return [sys.executable, "-m", "kiln.parallel.launch.torchrun", f"--nnodes={len(hosts)}", f"--node_rank={rank}",
            f"--nproc_per_node={gpus}", f"--master_addr={hosts[0]}", f"--master_port={PORT}",
            f"--max-restarts={max_restarts}", "-m", "kiln.cli", "train", config]


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Run kiln train on this SageMaker instance (the job's entry point).")
    parser.add_argument("--gpus-per-instance", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=0)
    args = parser.parse_args(argv)
    resource = json.loads(Path(RESOURCE_CONFIG).read_text())
    cmd = torchrun_command(resource, args.gpus_per_instance, args.max_restarts)
    print("kiln: " + " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
