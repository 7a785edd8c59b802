"""Launchers: the torchrun launcher of one node, the Slurm submission, the requeue
check and the submitit guard. A new launcher (Kubernetes) joins here."""
