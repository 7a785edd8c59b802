"""Export a checkpoint as one consolidated model file (the tutorials' "full state dict").

    python -m trainer.export RUN_DIR [--step N] --out model.pt

Runs in one process whatever number of processes trained. The file loads straight into the plain
model: `model.load_state_dict(torch.load("model.pt", weights_only=True))`. With an `.safetensors`
name it is written in that format (needs the safetensors package).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

from trainer import checkpoint, models
from trainer.config import ConfigError, load


def consolidate(run_dir: str, step: int | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The full model state dict of a run's checkpoint (the newest complete one by default)."""
    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{run_dir} has no config.yaml: is it a run_dir of this trainer?")
    cfg = load(config_file)
    found = dict(checkpoint.complete(run_dir))
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint to export")
    if step is None:
        step = max(found)
    if step not in found:
        raise ConfigError(f"{run_dir} has no complete checkpoint for step {step}; it has steps {sorted(found)}")
    path = found[step]
    with torch.device("meta"):
        model = models.build(cfg.model)
    model.to_empty(device="cpu")  # storage only: every saved tensor is loaded below
    state = model.state_dict()
    checkpoint.check_compatible(path, checkpoint.read_meta(path)["shapes"], checkpoint.shapes(state))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=path)
    return state, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int, help="checkpoint step; default: the newest complete one")
    parser.add_argument("--out", required=True, help="output file: .pt (torch.save) or .safetensors")
    args = parser.parse_args(argv)
    try:
        state, path = consolidate(args.run_dir, args.step)
        if args.out.endswith(".safetensors"):
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise ConfigError("writing .safetensors needs the safetensors package: pip install safetensors") from None
            save_file({k: v.contiguous() for k, v in state.items()}, args.out)
        else:
            torch.save(state, args.out)
    except (ConfigError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} ({sum(v.numel() for v in state.values()) / 1e6:.2f}M values) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
