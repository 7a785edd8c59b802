"""An FSDP2 trainer for one workstation or a Slurm cluster, with exact resume from DCP checkpoints."""

__version__ = "0.1.0"  # the one source: pyproject.toml, --version, checkpoints' meta.json (CHANGELOG.md)
