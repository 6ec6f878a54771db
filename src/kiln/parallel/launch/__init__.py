"""Starting a run on many processes: torchrun on this machine (local), Kubernetes and Slurm launch files."""
