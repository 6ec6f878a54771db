"""`kiln launch`: a launch file (or job) that runs `kiln train` on a cluster."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from kiln.cli.app import app, console

launch_app = typer.Typer(no_args_is_help=True, help="Write a launch file that runs `kiln train` on a cluster: a "
                         "Kubeflow PyTorchJob (k8s), an sbatch script (slurm) or a SageMaker training job "
                         "(sagemaker); or run it on a Ray cluster (ray).")
app.add_typer(launch_app, name="launch")


@launch_app.command("k8s")
def launch_k8s(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    nodes: int = typer.Option(1, "--nodes", help="Worker pods (one per node)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs (training processes) per pod."),
    image: str = typer.Option(..., "--image", help="Container image with kiln installed."),
    out: str | None = typer.Option(None, "--out", "-o", help="Manifest file to write (default NAME.yaml)."),
    name: str | None = typer.Option(None, "--name", help="Job name (default kiln-<config name>)."),
    claim: str = typer.Option("kiln-shared", "--volume-claim", help="ReadWriteMany PVC for runs and the cache."),
    shm_gib: int | None = typer.Option(None, "--shm-gib", help="/dev/shm size (default 4 GiB per GPU, 8 at least)."),
) -> None:
    """Write a Kubeflow PyTorchJob manifest (elastic, c10d rendezvous) for `kiln train CONFIG`.

    Example: kiln launch k8s gpu-1b --nodes 2 --gpus-per-node 8 --image ghcr.io/me/kiln:latest
    """
    from kiln.parallel.launch import k8s

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    text = k8s.manifest(config, list(overrides or []), nodes, gpus_per_node, image, name=name, claim=claim,
                        shm_gib=shm_gib)
    from kiln.parallel.launch.common import job_name, write_files

    path = Path(out or f"{job_name(config, name)}.yaml")
    write_files({path: text})
    console.print(f"wrote {path}; submit with: kubectl apply -f {shlex.quote(str(path))}", highlight=False)


@launch_app.command("slurm")
def launch_slurm(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes to run on."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs (training processes) per node."),
    out: str | None = typer.Option(None, "--out", "-o", help="Script to write (default NAME.sbatch); the "
                                      "resolved config goes beside it as NAME.config.yaml."),
    name: str | None = typer.Option(None, "--name", help="Job name (default kiln-<config name>)."),
    run_dir: str | None = typer.Option(None, "--run-dir", help="Run directory on shared storage "
                                          "(default runs/NAME here)."),
    time_limit: str | None = typer.Option(None, "--time", help="Slurm time limit, e.g. 2-00:00:00."),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition."),
) -> None:
    """Write an sbatch script that starts torchrun on every node (c10d rendezvous on the first).

    Example: kiln launch slurm gpu-1b --nodes 2 --gpus-per-node 8 --time 1-00:00:00
    """
    import yaml

    from kiln.parallel.launch import slurm
    from kiln.parallel.launch.common import job_name, write_files

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    script_path = Path(out or f"{job_name(config, name)}.sbatch")
    config_path = script_path.with_name(script_path.name.rsplit(".", 1)[0] + ".config.yaml")
    text, cfg_yaml = slurm.script(config, list(overrides or []), nodes, gpus_per_node, config_path, name=name,
                                  run_dir=run_dir, time_limit=time_limit, partition=partition)
    write_files({config_path: cfg_yaml, script_path: text})
    note = slurm.make_log_dir(yaml.safe_load(cfg_yaml)["train"]["run_dir"])  # as the script resolved it
    console.print(f"wrote {script_path} and {config_path}; submit with: sbatch {shlex.quote(str(script_path))}"
                  + (f"\n{note}" if note else ""), highlight=False)


@launch_app.command("sagemaker")
def launch_sagemaker(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    instance_type: str = typer.Option(..., "--instance-type", help="e.g. ml.p5.48xlarge."),
    instance_count: int = typer.Option(1, "--instance-count", help="Instances (nodes)."),
    image: str = typer.Option(..., "--image", help="ECR URI of an image with kiln installed."),
    role: str = typer.Option(..., "--role", help="IAM role ARN the job runs as."),
    output: str = typer.Option(..., "--output", help="S3 prefix for the job's config, output and checkpoints."),
    checkpoint_s3: str | None = typer.Option(None, "--checkpoint-s3", help="S3 prefix SageMaker syncs the run "
                                             "directory to (default OUTPUT/JOB/checkpoints)."),
    spot: bool = typer.Option(False, "--spot", help="Managed spot training: resumes from its checkpoints."),
    max_run: int = typer.Option(86400, "--max-run", help="Seconds of training at most."),
    max_wait: int | None = typer.Option(None, "--max-wait", help="With --spot: seconds of waiting plus training "
                                        "(default twice --max-run)."),
    gpus_per_instance: int | None = typer.Option(None, "--gpus-per-instance", help="Default: the instance type's."),
    inputs: list[str] | None = typer.Option(None, "--input", help="A data channel NAME=s3://..., at "
                                            "/opt/ml/input/data/NAME in the job (repeat for more)."),
    name: str | None = typer.Option(None, "--name", help="Job name prefix (default kiln-<config name>)."),
    out: str | None = typer.Option(None, "--out", "-o", help="JSON file to write (default JOB.json); the config "
                                   "goes beside it as JOB.config.yaml."),
    submit: bool = typer.Option(False, "--submit", help="Upload the config and create the job (boto3)."),
    region: str | None = typer.Option(None, "--region", help="AWS region for --submit (default: your AWS config)."),
) -> None:
    """Write (and with --submit, create) a SageMaker training job: torchrun on every instance, the run directory
    synced to S3 for spot recovery, metrics parsed from Kiln's log lines.

    Example: kiln launch sagemaker gpu-1b --instance-type ml.p5.48xlarge --instance-count 2 --spot --image
    123456789012.dkr.ecr.us-east-1.amazonaws.com/kiln:latest --role arn:aws:iam::123456789012:role/sm
    --output s3://my-bucket/kiln
    """
    import json

    from kiln.parallel.launch import sagemaker
    from kiln.parallel.launch.common import write_files

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    request, cfg_yaml = sagemaker.training_job(
        config, list(overrides or []), instance_type=instance_type, instance_count=instance_count, image=image,
        role=role, output_s3=output, checkpoint_s3=checkpoint_s3, spot=spot, max_run_s=max_run, max_wait_s=max_wait,
        name=name, gpus_per_instance=gpus_per_instance, inputs=list(inputs or []))
    path = Path(out or f"{request['TrainingJobName']}.json")
    config_path = path.with_name(path.name.rsplit(".", 1)[0] + ".config.yaml")
    write_files({path: json.dumps(request, indent=1) + "\n", config_path: cfg_yaml})
    console.print(f"wrote {path} (the CreateTrainingJob request) and {config_path}", highlight=False)
    if submit:
        arn = sagemaker.submit(request, cfg_yaml, region)
        console.print(f"created {arn}", highlight=False)
    else:
        console.print(f"submit: kiln launch sagemaker ... --submit, or upload {config_path} as config.yaml under "
                      f"{request['InputDataConfig'][0]['DataSource']['S3DataSource']['S3Uri']} and run aws "
                      f"sagemaker create-training-job --cli-input-json file://{path}", highlight=False)


@launch_app.command("ray")
def launch_ray(
    config: str | None = typer.Argument(None, help="YAML config file or preset name."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted KEY=VALUE overrides."),
    workers: int = typer.Option(..., "--workers", help="Training processes (Ray Train workers)."),
    gpus_per_worker: float = typer.Option(0, "--gpus-per-worker", help="GPUs per worker (0: CPU workers, gloo)."),
    cpus_per_worker: float = typer.Option(1, "--cpus-per-worker", help="CPUs per worker."),
    address: str | None = typer.Option(None, "--address", help="An existing Ray cluster (auto, or ray://HOST:10001); "
                                       "default: Ray on this machine."),
    max_failures: int = typer.Option(0, "--max-failures", help="Times Ray restarts the workers after a failure "
                                     "(they resume from the newest checkpoint)."),
    resume: str = typer.Option("auto", "--resume", help="auto, never or force (as kiln train)."),
) -> None:
    """Run `kiln train` on a Ray cluster through Ray Train's TorchTrainer: the process group from Ray, the
    same run and exact resume as under torchrun; the run directory must be on storage every node sees.

    Example: kiln launch ray gpu-1b --workers 16 --gpus-per-worker 1 --address auto train.run_dir=/shared/runs/a
    """
    from kiln.train.on_ray import launch

    if config is not None and "=" in config:
        overrides, config = [config, *(overrides or [])], None
    run_dir = launch(config, list(overrides or []), workers, gpus_per_worker=gpus_per_worker,
                     cpus_per_worker=cpus_per_worker, address=address, max_failures=max_failures, resume=resume,
                     log=lambda m: console.print(m, highlight=False))
    console.print(f"run directory: {run_dir}", highlight=False)
