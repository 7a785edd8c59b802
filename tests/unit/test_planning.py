"""Planning a run for a GPU cluster from a machine without one: make check with GPU_MEM_GB."""

from __future__ import annotations

import pytest

from tests.helpers.run import ROOT
from trainer.config import load
from trainer.preflight import check, memory


def test_an_estimate_with_less_than_10_percent_headroom_warns():
    cfg = load(str(ROOT / "configs" / "default.yaml"))
    need = memory.estimate(cfg, 2, cfg.train.global_batch_size // 2, 2, gpu=True).total
    line = check.gpu_preflight(cfg, 2, 2, 1, str(need * 1.05 / 1e9))
    assert "warning: less than 10% headroom" in line
    assert "headroom" not in check.gpu_preflight(cfg, 2, 2, 1, str(need * 1.5 / 1e9))


# -- #44: the estimate's terms follow parallel.grad_sync and activation_checkpointing ----------------

# The tiny transformer (2 blocks), 4 micro-batches of 1 sequence on each of 8 ranks (FSDP full, float32).
MODES = ["model.seq_len=64", "train.global_batch_size=32", "train.micro_batch_size=1"]


@pytest.fixture(scope="module")
def modes_profile():
    return memory.measure(load(None, MODES), gpu=True)


def _estimate(profile, *overrides, world=8):
    cfg = load(None, [*MODES, *overrides])
    return memory.estimate(cfg, world, cfg.train.micro_batch_size, world, gpu=True, profile=profile)


def test_gradients_are_sharded_every_micro_batch_and_whole_at_the_last(modes_profile):
    n = modes_profile.params
    every = _estimate(modes_profile, "parallel.grad_sync=every_micro_batch")
    last = _estimate(modes_profile, "parallel.grad_sync=last_micro_batch")
    auto = _estimate(modes_profile)  # undecided: the estimate counts what last_micro_batch holds
    assert every.gradients == 4 * n // 8 and last.gradients == 4 * n == auto.gradients
    assert "reduce-scattered every micro-batch" in every.notes["gradients"]
    assert "until the last one's reduce-scatter (grad_sync=last_micro_batch" in last.notes["gradients"]
    assert every.total < last.total and every.activations == last.activations
    # DDP and a run without accumulation: the same either way
    for same in (["parallel.strategy=ddp"], ["train.micro_batch_size=4"]):
        e = _estimate(modes_profile, *same, "parallel.grad_sync=every_micro_batch")
        assert e == _estimate(modes_profile, *same, "parallel.grad_sync=last_micro_batch"), same


def test_activations_follow_the_checkpointing_mode(modes_profile):
    pr = modes_profile
    assert pr.activations > pr.activations_selective > pr.activations_checkpointed > 0
    got = {
        mode: _estimate(pr, f"parallel.activation_checkpointing={mode}").activations
        for mode in ("none", "selective", "full")
    }
    assert got == {"none": pr.activations, "selective": pr.activations_selective, "full": pr.activations_checkpointed}
    words = _estimate(pr, "parallel.activation_checkpointing=selective").notes["activations"]
    assert "with selective activation checkpointing (matmul and attention outputs kept" in words, words
    # every 2nd block in full: between none and full, measured with that wrapping
    every_2nd = memory.measure(load(None, [*MODES, "parallel.selective_ac=2"]), gpu=True).activations_selective
    assert pr.activations_checkpointed < every_2nd < pr.activations


def test_auto_takes_the_last_micro_batch_where_it_fits_else_every_one(modes_profile):
    cfg = load(None, MODES)
    last = memory.estimate(memory._with(cfg, parallel={"grad_sync": "last_micro_batch"}), 8, 1, 8, gpu=True)
    every = memory.estimate(memory._with(cfg, parallel={"grad_sync": "every_micro_batch"}), 8, 1, 8, gpu=True)
    roomy, line = memory.choose_grad_sync(cfg, 8, 1, 8, last.total, True, modes_profile)
    assert roomy.parallel.grad_sync == "last_micro_batch" and "fits" in line, line
    tight, line = memory.choose_grad_sync(cfg, 8, 1, 8, last.total - 1, True, modes_profile)
    assert tight.parallel.grad_sync == "every_micro_batch" and "more than" in line, line
    assert every.total < last.total - 1
    for nothing_to_choose in (["parallel.strategy=ddp"], ["train.micro_batch_size=4"]):
        cfg = load(None, [*MODES, *nothing_to_choose])
        chosen, line = memory.choose_grad_sync(cfg, 8, cfg.train.micro_batch_size, 8, 1, True, modes_profile)
        assert chosen.parallel.grad_sync == "last_micro_batch" and line is None, nothing_to_choose


def test_the_planner_offers_grad_sync_and_selective_where_they_fit(modes_profile):
    cfg = load(None, [*MODES, "parallel.grad_sync=last_micro_batch"])
    last = _estimate(modes_profile, "parallel.grad_sync=last_micro_batch")
    fixes = memory.changes_that_fit(cfg, 8, 8, last.total - 1, profile=modes_profile)
    assert fixes[0].startswith("parallel.grad_sync=every_micro_batch ("), fixes
    assert fixes[1].startswith("parallel.activation_checkpointing=selective ("), fixes
    assert fixes[2].startswith("parallel.activation_checkpointing=full ("), fixes
    done = load(None, [*MODES, "parallel.grad_sync=every_micro_batch", "parallel.activation_checkpointing=full"])
    assert not any(
        "grad_sync" in f or "activation" in f for f in memory.changes_that_fit(done, 8, 8, 1, profile=modes_profile)
    )
