"""`kiln launch k8s`: a Kubeflow PyTorchJob (training-operator v1) that runs `kiln train` under torchrun.

The manifest holds two documents: a ConfigMap with the resolved run config, and the PyTorchJob. Each
of the `nodes` worker pods runs torchrun with `gpus_per_node` processes; the elastic policy makes the
operator set torchrun's rendezvous (c10d) and lets a failed pod restart the job, which resumes from
the newest checkpoint in the run directory. The run directory and the data cache live on a shared
volume (a ReadWriteMany PersistentVolumeClaim) mounted in every pod; /dev/shm is a memory volume
sized for NCCL and the loader's pinned batches (a container's default is 64 MB). torchrun gets the
environment `kiln train --nproc` gives it (`TORCHRUN_ENV`), and a pod being stopped (preemption, a
drained node) has the time to pass SIGTERM to the workers and let them write their checkpoint before
Kubernetes kills it (terminationGracePeriodSeconds; Kubernetes' default is 30 s).
"""

from __future__ import annotations

import yaml

from kiln.errors import ConfigError
from kiln.parallel.launch.common import check_shape, given_paths, job_name, resolved_config
from kiln.parallel.launch.torchrun import SHUTDOWN_TIMEOUT_S, TORCHRUN_ENV

SHARED, CONFIG_DIR = "/shared", "/etc/kiln"
GRACE_S = SHUTDOWN_TIMEOUT_S + 30  # the pod's time from SIGTERM to SIGKILL: torchrun's shutdown timeout and a margin


def manifest(config: str | None, overrides: list[str], nodes: int, gpus_per_node: int, image: str, *,
             name: str | None = None, claim: str = "kiln-shared", shm_gib: int | None = None,
             max_restarts: int = 3, cpus_per_node: int | None = None, memory_gib: int | None = None) -> str:
    """The YAML text of the ConfigMap and PyTorchJob."""
    check_shape(nodes, gpus_per_node)
    if not image.strip() or any(c.isspace() for c in image):
        raise ConfigError(f"--image {image!r}: give the container image with kiln installed, e.g. "
                          "ghcr.io/me/kiln:1.0 (no spaces)")
    if shm_gib is not None and shm_gib < 1:
        raise ConfigError(f"--shm-gib {shm_gib}: the /dev/shm size must be at least 1 GiB (default: 4 per GPU, "
                          "8 at least)")
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts}: give how often the job may restart, 0 or more")
    job = job_name(config, name)
    run_dir, cache_dir = given_paths(config, overrides)  # on the shared volume, or left to this manifest
    for key, path in (("train.run_dir", run_dir), ("data.cache_dir", cache_dir)):
        if path is not None and not path.startswith(f"{SHARED}/"):
            raise ConfigError(f"{key}={path}: the pods see only the volume claim mounted at {SHARED}; give a path "
                              f"under {SHARED}/, or leave it unset ({SHARED}/runs/{job} and {SHARED}/cache)")
    cfg = resolved_config(config, overrides, run_dir or f"{SHARED}/runs/{job}", cache_dir or f"{SHARED}/cache")
    shm = shm_gib if shm_gib is not None else max(8, 4 * gpus_per_node)
    resources: dict = {"nvidia.com/gpu": gpus_per_node}
    if cpus_per_node:
        resources["cpu"] = cpus_per_node
    if memory_gib:
        resources["memory"] = f"{memory_gib}Gi"
    container = {
        "name": "pytorch",  # the training operator looks for this container name
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun as `kiln train --nproc` runs it (kiln.parallel.launch.torchrun: same arguments, and torchrun's
        # parser reads nnodes, nproc_per_node and the rendezvous from the operator's PET_* variables)
        "command": ["python", "-m", "kiln.parallel.launch.torchrun"],
        "args": ["-m", "kiln.cli", "train", f"{CONFIG_DIR}/config.yaml"],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                *({"name": k, "value": v} for k, v in TORCHRUN_ENV.items())],
        "resources": {"limits": resources, "requests": dict(resources)},
        "volumeMounts": [
            {"name": "shared", "mountPath": SHARED},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod = {
        "spec": {
            "terminationGracePeriodSeconds": GRACE_S,
            "containers": [container],
            "volumes": [
                {"name": "shared", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "config", "configMap": {"name": f"{job}-config"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}},
            ],
        },
    }
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{job}-config"},
                  "data": {"config.yaml": cfg.to_yaml()}}
    pytorch_job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job, "labels": {"app.kubernetes.io/name": "kiln"}},
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": nodes, "maxReplicas": nodes,
                              "maxRestarts": max_restarts, "nProcPerNode": gpus_per_node},
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {"Worker": {"replicas": nodes, "restartPolicy": "OnFailure", "template": pod}},
        },
    }
    head = (f"# kiln: {nodes} node(s) x {gpus_per_node} GPU(s); run directory {SHARED}/runs/{job} on PVC '{claim}' "
            f"(ReadWriteMany)\n# submit: kubectl apply -f FILE; follow: kubectl logs -f {job}-worker-0\n")
    return head + yaml.safe_dump_all([config_map, pytorch_job], sort_keys=False)
