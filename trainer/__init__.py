"""An FSDP2 trainer for one workstation or a Slurm cluster, with exact resume from DCP checkpoints.

From Python: `from trainer import api` (config, train, launch, metrics; README's "Python API").
Not imported here: this package is the bottom floor every module imports (tools/imports.py), and
`import trainer` stays free of torch.
"""

__version__ = "0.1.0"  # the one source: pyproject.toml, --version, checkpoints' meta.json (CHANGELOG.md)
