"""BatchNorm under FSDP: the running statistics are averaged over the ranks before evaluation and
saving, so neither depends on the rank (each rank's own statistics follow its own batches)."""

import textwrap

import pytest
import torch

from tests.helpers.outputs import weights
from tests.helpers.run import TORCHRUN, run_command, train

pytestmark = pytest.mark.slow  # every test trains on 2 processes

RESNET = [
    "model.name=resnet18",
    "model.num_classes=4",
    "model.image_size=32",
    "data.name=synthetic_images",
    "train.global_batch_size=8",
    "log.interval=1",
    "log.progress=false",
    "checkpoint.interval=0",
    "optim.warmup_steps=0",
]

SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from trainer import data, dist as distributed, models, train
    from trainer.parallel import plan
    from trainer.config import load

    cfg = load(None, sys.argv[1:])
    env = distributed.init(timeout_s=60)
    model = train.build_model(cfg, env)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _ = next(data.loader(data.build(cfg.data, cfg.model, 0, True), cfg.data, 0, 0, 8, 4, env.rank, 2))
    models.loss_fn(model(x), y).backward()
    optimizer.step()
    bn = [b for n, b in model.named_buffers() if "running_" in n]
    def gathered():
        flat = torch.cat([b.flatten() for b in bn])
        every = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(every, flat)
        return every
    before = gathered()
    plan.average_batchnorm_stats(model)
    after = gathered()
    counts = [torch.empty(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(counts, model.bn1.num_batches_tracked.reshape(1))
    if env.rank == 0:
        print("differed", (before[0] - before[1]).abs().max().item())
        print("equal", torch.equal(after[0], after[1]), "mean", torch.allclose(after[0], (before[0] + before[1]) / 2))
        print("tracked", [c.item() for c in counts])
    distributed.exit_process(0)
""")


def test_running_stats_are_equal_on_all_ranks_after_a_step(tmp_path):
    script = tmp_path / "bn.py"
    script.write_text(SCRIPT)
    proc = run_command([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script), *RESNET], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert float(lines["differed"]) > 1e-3  # the ranks' batches gave them different statistics
    assert lines["equal"] == "True mean True"
    assert lines["tracked"] == "[1, 1]"


def test_the_checkpoint_holds_the_statistics_of_all_ranks(tmp_path):
    """After one step the first BatchNorm's running mean is 0.1 x the mean of its input over the
    batch (the weights before the step are the same everywhere): 2 ranks must save what one
    process saw over the whole global batch, not one rank's half."""
    train(tmp_path / "one", 1, *RESNET, "train.steps=1", "parallel.strategy=none")
    train(tmp_path / "two", 2, *RESNET, "train.steps=1", "eval.interval=1", "eval.batches=1")
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert one["bn1.running_mean"].abs().max() > 1e-3
    torch.testing.assert_close(two["bn1.running_mean"], one["bn1.running_mean"], atol=1e-6, rtol=1e-4)
