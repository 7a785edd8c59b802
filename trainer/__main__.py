"""Entry point: `torchrun [...] -m trainer --config configs/X.yaml [key=value ...]`.

Plain `python -m trainer ...` is the same with one process.
"""

from __future__ import annotations

import argparse
import sys

from trainer.resilience import signals

signals.install()  # before the slow imports below: a stop signal during start-up is kept, not fatal
signals.stop_with_launcher()  # a rank whose launcher died (kill -9) saves and stops, never trains on alone

from trainer import cli
from trainer.config import ConfigError
from trainer.dist import exit_process, node_name, peer_gone, read_env, shutdown
from trainer.launchers import torchrun
from trainer.observe.metrics import setup_logging
from trainer.preflight.startup import Target, preflight
from trainer.resilience import outcomes


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("trainer", "Train a model with FSDP2.")
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument(
        "--config-default",
        action="store_true",
        help="the --config file is a default the user did not choose (make run without CONFIG=): a resumed "
        "run's differences from it are not worth a line",
    )
    parser.add_argument(
        "--memory-checked",
        action="store_true",
        help=argparse.SUPPRESS,  # the launcher checked this node's memory for its ranks (preflight/startup.py)
    )
    parser.add_argument(
        "--weights-checked",
        action="store_true",
        help=argparse.SUPPRESS,  # the launcher read model.init_from's index and headers: config.json alone here
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100")
    args = parser.parse_intermixed_args(argv)  # overrides may come before --config too
    env = read_env()
    setup_logging(env.rank)

    def stop(outcome: outcomes.Outcome, line: str) -> int:
        """Mark the outcome for this node's launcher, say `line`, and return the outcome's exit code."""
        if outcome.mark:  # first: this node's launcher may be signalled as soon as another node exits
            torchrun.mark(outcome.mark)
        if outcome.every_rank or env.rank == 0:  # else every rank finds the same problem; one says it
            print(line, file=sys.stderr, flush=True)
        return outcome.code

    try:  # all of this before any process group or file exists; a run dir's own run is the base
        target = Target.rank(env, memory_checked=args.memory_checked, weights_checked=args.weights_checked)
        ready = preflight(target, args.config, args.overrides, not args.config_default)
    except ConfigError as e:
        return stop(outcomes.BAD_INPUT, outcomes.RANK_ERROR.format(message=e))
    if env.rank == 0:
        for line in ready.notes:
            print(line, flush=True)
        if ready.cfg.parallel.deprecated:
            print(f"warning: {ready.cfg.parallel.deprecated}", flush=True)

    from trainer.train import train  # torch.distributed set-up lives there

    try:
        train(ready)
    except Exception as e:  # what each means: trainer/resilience/outcomes.py; any other is raised again
        outcome = outcomes.of_exception(e)
        if outcome is not None:  # bad input, a lost lease, a failed health check, divergence, a stuck rank
            return stop(outcome, outcomes.RANK_ERROR.format(message=e))
        gone = peer_gone(e)
        if gone is None:  # a failure of this rank's own: its traceback says where
            raise
        return stop(outcomes.PEER_GONE, outcomes.PEER_GONE.line.format(rank=env.rank, node=node_name(), gone=gone))
    finally:
        from trainer.checkpoint import remote

        remote.remove_copies()  # s3:// resume_from's, init_from's local copies: exit_process skips atexit
        shutdown()  # for callers of main() in-process; exit_process below checks and skips it
    return 0


if __name__ == "__main__":
    exit_process(main())
