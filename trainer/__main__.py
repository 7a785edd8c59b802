"""Entry point: `torchrun [...] -m trainer --config configs/X.yaml [key=value ...]`.

Plain `python -m trainer ...` is the same with one process.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainer import signals

signals.install()  # before the slow imports below: a stop signal during start-up is kept, not fatal
signals.stop_with_launcher()  # a rank whose launcher died (kill -9) saves and stops, never trains on alone

from trainer import launch
from trainer.check import check_float8, check_gpu_memory, check_gpus, validate
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, load_run, resolve
from trainer.data import DataError
from trainer.dist import NodeError, exit_process, node_name, peer_gone, read_env, shutdown
from trainer.health import HealthError
from trainer.lease import LeaseError, LeaseLost
from trainer.metrics import setup_logging
from trainer.requeue import HEALTH_FAILED, LEASE_LOST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Train a model with FSDP2.")
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument(
        "--config-default",
        action="store_true",
        help="the --config file is a default the user did not choose (make run without CONFIG=): a resumed "
        "run's differences from it are not worth a line",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100")
    args = parser.parse_intermixed_args(argv)  # overrides may come before --config too
    env = read_env()
    setup_logging(env.rank)

    def fail(message: str, code: int = 2) -> int:
        if code == 2:  # first: this node's launcher may be signalled as soon as another node exits 2
            launch.mark(launch.BAD_INPUT_MARK)
        if env.rank == 0:  # every rank finds the same problem; one says it
            print(f"error: {message}", file=sys.stderr, flush=True)
        return code

    try:  # all of this before any process group or file exists
        cfg, where, notes = load_run(
            args.config, args.overrides, not args.config_default
        )  # a run dir's own run is the base
        checked = os.environ.get(launch.MEMORY_CHECKED_ENV)  # the launcher checked this node's memory
        validate(
            cfg,
            env.world_size,
            where=where,
            overrides=args.overrides,
            ranks_per_node=None if checked else env.local_world_size,
        )
        cfg = resolve(cfg, where=where, world_size=env.world_size)  # as config.yaml records it
        check_gpus(env.local_world_size)
        check_gpu_memory(cfg, env.world_size, env.device, env.local_world_size, where=where)
        check_float8(cfg, env.device, where=where)
    except ConfigError as e:
        return fail(str(e))
    if env.rank == 0:
        for line in notes:
            print(line, flush=True)

    from trainer.train import Diverged, StuckRank, train  # torch.distributed set-up lives there

    try:
        train(cfg)
    except (CheckpointError, DataError, NodeError, LeaseError) as e:
        return fail(str(e))
    except LeaseLost as e:  # another run has the run dir now: neither a success nor bad input, not requeued
        launch.mark(launch.LEASE_LOST_MARK)  # not restarted: the run dir is another run's
        return fail(str(e), code=LEASE_LOST)
    except HealthError as e:  # the all-reduce below its floor: rank 0 said it; not restarted in the allocation
        launch.mark(launch.HEALTH_MARK)
        return fail(str(e), code=HEALTH_FAILED)
    except Diverged as e:
        launch.mark(launch.DIVERGED_MARK)  # not restarted: it would diverge again
        return fail(str(e), code=1)  # not bad input: the run itself failed
    except StuckRank as e:  # said by every rank that saw it: the stuck one may be rank 0
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        gone = peer_gone(e)
        if gone is None:  # a failure of this rank's own: its traceback says where
            raise
        print(
            f"error: rank {env.rank} on {node_name()}: a peer went away during a collective ({gone}); the "
            "launcher says which rank or node failed first",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        shutdown()  # for callers of main() in-process; exit_process below checks and skips it
    return 0


if __name__ == "__main__":
    exit_process(main())
