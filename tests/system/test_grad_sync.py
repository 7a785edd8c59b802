"""parallel.grad_sync (#44 item 1): under gradient accumulation FSDP reduce-scatters every micro-batch
(every_micro_batch: the gradients held are the sharded ones, 1/N) or only the last
(last_micro_batch: unsharded until then). On 2 and 4 CPU ranks (and hybrid sharding, which
all-reduces across its replicas at the last micro-batch only) the gradients after each micro-batch
are sharded DTensors (hybrid: FSDP's partial reduce output, 1/shard_size, until that all-reduce),
and the step's gradients, the losses and the weights equal today's accumulation; a checkpoint
saved in one mode resumes in the other (the mode is no part of it)."""

import textwrap

import pytest

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, weights
from tests.helpers.run import TINY, TORCHRUN, run_command, train
from trainer.rundir import layout

pytestmark = pytest.mark.slow  # every test starts ranks

# One rank's view, run under torchrun: the same 4 micro-batches of 2 sequences through the tiny
# transformer in each mode, the model built as the trainer builds it, the micro-batches through the
# plan's grad_sync as the loop runs them. Rank 0 prints every rank's lines, one per check.
PROBE = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from trainer import dist as distributed, models
    from trainer.parallel.plan import Plan
    from trainer.config import load, resolve
    from trainer.train import build_model

    env = distributed.init(timeout_s=120)
    accum, grads, said = 4, {}, []
    for mode in ("last_micro_batch", "every_micro_batch"):
        overrides = ["model.seq_len=32", *sys.argv[1:], f"parallel.grad_sync={mode}"]
        cfg = resolve(load(None, overrides), world_size=env.world_size)
        plan = Plan.of(cfg.parallel, env)
        model, family = build_model(cfg, env, plan), models.spec(cfg.model)
        seeded = torch.Generator().manual_seed(plan.dp_rank)
        x = torch.randint(0, cfg.model.vocab_size, (accum, 2, 32), generator=seeded)
        for i in range(accum):
            with plan.grad_sync(model, i, accum):
                (family.loss(model(x[i]), x[i]) / accum).backward()
            if i == accum - 1:
                continue
            params = list(model.parameters())
            if mode == "last_micro_batch":  # FSDP holds them unsharded, outside .grad, until the last
                said.append(f"last {i} {'none' if all(p.grad is None for p in params) else 'some'}")
                continue
            if plan.hybrid:  # reduce-scattered in the shard group, held by FSDP until the replicas' all-reduce
                states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
                held = [g._partial_reduce_output for state in states for g in state._fsdp_param_groups]
                sharded = all(p.grad is None for p in params) and all(h is not None for h in held)
                local, full = sum(h.numel() for h in held if h is not None), sum(p.numel() for p in params)
                said.append(f"every {i} {'sharded' if sharded else 'not sharded'} {local / full:.3f}")
                continue
            sharded = all(
                isinstance(p.grad, DTensor)
                and p.grad.placements == p.placements
                and p.grad.to_local().shape == p.to_local().shape
                and p.grad.to_local().numel() <= -(-p.numel() // plan.dp_shard)
                for p in params
            )
            local, full = sum(p.grad.to_local().numel() for p in params), sum(p.numel() for p in params)
            said.append(f"every {i} {'sharded' if sharded else 'not sharded'} {local / full:.3f}")
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    every = grads["every_micro_batch"]
    worst = max(((every[n] - g).abs().max() / g.abs().max()).item() for n, g in grads["last_micro_batch"].items())
    said.append(f"largest relative difference {'below 1e-5' if worst < 1e-5 else worst}")
    every_rank = [None] * env.world_size
    dist.all_gather_object(every_rank, said)
    if env.rank == 0:
        print("\\n".join(line for lines in every_rank for line in lines))
    # Past Python's teardown, as the trainer's ranks end: destroy_process_group alone still aborted
    # a rank at exit in the closing CI run of 2026-11-28 (the device mesh holds the group; trainer/dist.py).
    distributed.exit_process(0)
    """
)


@pytest.mark.parametrize(
    "nproc, overrides, share",
    [(2, [], 0.5), (4, ["parallel.sharding=hybrid", "parallel.shard_size=2"], 0.5), (4, [], 0.25)],
    ids=["fsdp2", "hybrid2x2", "fsdp4"],
)
def test_every_micro_batch_keeps_the_gradients_sharded_and_equal(tmp_path, nproc, overrides, share):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run_command([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(script), *overrides], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 7 * nproc, proc.stdout  # every rank says each
    for i in range(3):
        assert lines.count(f"last {i} none") == nproc, proc.stdout
        # the parameters' shards: 1/N of every one, up to the rounding of a dimension 0 that N does not divide
        every = [line for line in lines if line.startswith(f"every {i} sharded ")]
        assert len(every) == nproc, proc.stdout
        assert all(abs(float(line.split()[-1]) - share) < 0.01 for line in every), proc.stdout
    assert lines.count("largest relative difference below 1e-5") == nproc, proc.stdout


# 3 micro-batches a step on each rank: 12 sequences over 2 ranks, 2 at a time (over 4 ranks: 1 at a time).
ACCUM = [*TINY, "checkpoint.interval=3", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def last(tmp_path_factory):
    """Today's accumulation, gradients reduced at the last micro-batch, on 2 ranks: what
    grad_sync=auto chooses here (the estimate against this machine's memory over its ranks: the tiny
    model fits). The run dir; the run's output is its out.txt."""
    run_dir = tmp_path_factory.mktemp("last")
    (run_dir / "out.txt").write_text(train(run_dir, 2, *ACCUM, "train.micro_batch_size=2").stdout)
    return run_dir


def test_auto_chooses_the_last_micro_batch_where_it_fits_and_says_why(last):
    said = (last / "out.txt").read_text()
    assert "parallel.grad_sync=auto: last_micro_batch (one reduce-scatter a step): its estimate, " in said, said


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (2, ["train.micro_batch_size=2"]),
        (4, ["train.micro_batch_size=1", "parallel.sharding=hybrid", "parallel.shard_size=2"]),
    ],
    ids=["fsdp2", "hybrid2x2"],
)
def test_every_micro_batch_trains_as_the_last(tmp_path, last, nproc, overrides):
    proc = train(tmp_path, nproc, *ACCUM, *overrides, "parallel.grad_sync=every_micro_batch")
    assert "3 micro-batches per rank" in proc.stdout, proc.stdout
    assert_same_losses(losses(tmp_path), losses(last))
    assert_same_weights(weights(tmp_path), weights(last))


def test_a_checkpoint_resumes_in_the_other_mode(tmp_path, last):
    """Saved at step 3 by a run that reduced at the last micro-batch, resumed reducing every
    micro-batch: steps 4-6 are the first run's, and so are the weights."""
    proc = train(
        tmp_path,
        2,
        *ACCUM,
        "train.micro_batch_size=2",
        "parallel.grad_sync=every_micro_batch",
        f"checkpoint.resume_from={layout.step_path(last, 3)}",
    )
    assert "at step 3" in proc.stdout, proc.stdout
    got, before = losses(tmp_path), losses(last)
    assert sorted(got) == [4, 5, 6], got
    assert_same_losses(got, {step: before[step] for step in got})
    assert_same_weights(weights(tmp_path), weights(last))
