"""An FSDP2 trainer for one workstation or a Slurm cluster, with exact resume from DCP checkpoints."""
