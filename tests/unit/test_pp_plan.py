"""What a pipeline schedule costs (trainer/parallel/pp_plan.py): the first stage's activations in
flight, against the action tables torch's own schedule classes build, and the bubble of each schedule
as make check says it; pp offered by the planner where it makes a model fit."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from trainer.config import load, resolve
from trainer.parallel import pp_plan
from trainer.preflight import check, memory

TORCH = {
    "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "interleaved_zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
}


def args(schedule: str, pp: int, m: int, v: int = 1) -> SimpleNamespace:
    """A parallel section with the keys pp_plan reads."""
    return SimpleNamespace(pp=pp, pp_microbatches=m, pp_schedule=schedule, pp_stages_per_rank=v)


def torch_peak(schedule: str, pp: int, m: int, v: int) -> int:
    """The most forwards rank 0 has run whose backward (B, or W under zero bubble) has not: from the
    action table torch's schedule class computes for rank 0 (its _calculate_single_rank_operations, the
    same arithmetic its __init__ runs for every rank, without stages or a process group)."""
    cls = TORCH[schedule]
    table = object.__new__(cls)
    rounds = max(1, m // pp)
    table.pp_group_size, table.n_local_stages, table._n_microbatches = pp, v, m
    table.number_of_rounds, table.microbatches_per_round = rounds, m // rounds
    table.rank, table.num_stages = 0, pp * v  # zbv reads the stages of the whole pipeline
    live = peak = 0
    for action in table._calculate_single_rank_operations(0):
        kind = action and action.computation_type
        live += 1 if kind == torch_schedules.F else -1 if kind in (torch_schedules.B, torch_schedules.W) else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", sorted(TORCH))
def test_the_first_stage_holds_what_torchs_own_schedule_keeps_in_flight(schedule):
    """For pp 2 to 8, m 1 to 5 pp (where torch takes m), v 2 to 4 (zbv: 2): the closed form, in chunks of
    1/v of a stage, is the peak of forwards without their backward in torch's table for rank 0."""
    checked = 0
    for pp in range(2, 9):
        for v in (2,) if schedule == "zbv" else (2, 3, 4):
            for m in range(1, 5 * pp + 1):
                if m % max(1, m // pp):  # torch refuses micro-batches that are not a multiple of its rounds
                    continue
                expected = torch_peak(schedule, pp, m, v)
                assert pp_plan.in_flight(args(schedule, pp, m, v)) * v == expected, (pp, m, v)
                checked += 1
    assert checked > 100


def test_interleaving_holds_pp_plus_pp_minus_1_over_v_as_megatron_says():
    """Korthikanti et al. 2022, 4.2.3: pp (1 + (pp-1)/(pp v)) micro-batches of a stage, for m a multiple of pp."""
    for pp, v in ((4, 2), (8, 4), (2, 3)):
        assert pp_plan.in_flight(args("interleaved_1f1b", pp, 2 * pp, v)) == pp + Fraction(pp - 1, v)
    assert pp_plan.in_flight(args("interleaved_zb", 8, 16, 2)) == 8  # 1F1B's pp, as ZB-H1 keeps
    assert pp_plan.in_flight(args("zbv", 8, 32)) == 8
    assert (pp_plan.in_flight(args("1f1b", 4, 8)), pp_plan.in_flight(args("gpipe", 4, 8))) == (4, 8)
    assert pp_plan.in_flight(args("1f1b", 4, 2)) == 2  # fewer micro-batches than stages


def test_each_schedules_bubble_is_its_papers_formula():
    assert pp_plan.bubble(args("1f1b", 4, 8)) == ("(pp-1)/(m+pp-1) = 3/11", Fraction(3, 11))
    assert pp_plan.bubble(args("gpipe", 4, 8)) == ("(pp-1)/(m+pp-1) = 3/11", Fraction(3, 11))
    assert pp_plan.bubble(args("interleaved_1f1b", 4, 8, 2)) == ("(pp-1)/(v*m+pp-1), v=2 = 3/19", Fraction(3, 19))
    assert pp_plan.bubble(args("interleaved_zb", 4, 8, 2)) == ("(pp-1)/(3*v*m+pp-1), v=2 = 3/51", Fraction(3, 51))
    assert pp_plan.bubble(args("zbv", 4, 8))[1] == 0
    unset = dict(pp=2, pp_microbatches=2, pp_stages_per_rank=None)  # the interleaved schedules' default: 2
    assert pp_plan.stages_per_rank(SimpleNamespace(**unset, pp_schedule="interleaved_1f1b")) == 2
    assert pp_plan.stages_per_rank(SimpleNamespace(**unset, pp_schedule="1f1b")) == 1


def test_make_check_says_an_interleaved_schedule_and_the_estimate_holds_its_chunks():
    """The plan line and the activations of interleaved 1F1B over 2 ranks x 2 stages each, 4 micro-batches: 2.5 stages'
    micro-batches in flight (5 chunks of half a stage), against 1F1B's 2."""
    base = ["model.seq_len=16", "train.global_batch_size=16"]
    profile = memory.measure(resolve(load(None, base)))  # test_pp.py's: measured once in a run of both
    cfg = resolve(load(None, [*base, "parallel.pp=2"]))
    parallel = dataclasses.replace(
        cfg.parallel, pp_microbatches=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2
    )
    interleaved = dataclasses.replace(cfg, parallel=parallel)
    one_f_one_b = dataclasses.replace(cfg, parallel=dataclasses.replace(parallel, pp_schedule="1f1b"))
    a, b = (memory.estimate(c, 4, 2, profile=profile) for c in (interleaved, one_f_one_b))
    per_stage_micro_batch = profile.activations // 2 * 2
    assert (a.activations, b.activations) == (int(per_stage_micro_batch * 2.5), per_stage_micro_batch * 2)
    assert "2.5 micro-batches in flight x 2 sample(s)" in a.notes["activations"]
    assert check.plan_lines(interleaved, 4, 1)[1] == (
        "pipeline: 4 stages (2 a rank), schedule interleaved_1f1b: bubble (pp-1)/(v*m+pp-1), v=2 = 1/9 = 11% of "
        "each forward/backward idle; the first stage holds 2.5 micro-batch(es) of activations at once"
    )


SMALL = ["model.size=small", "model.seq_len=16"]


@pytest.fixture(scope="module")
def small_profile():
    """The small model's profile, measured once for this file's planner tests (the pipeline, the
    batch and grad_sync do not change what one sample keeps: measure() keys on them all the same)."""
    return memory.measure(resolve(load(None, SMALL)), gpu=True)


def test_the_planner_offers_pipeline_stages_where_they_make_a_model_fit(small_profile):
    """Gradients accumulated at the last micro-batch are whole on every rank; a pipeline's stage
    reduce-scatters them at the end of each schedule step (sharded) and holds 1/2 of the blocks: the
    planner offers parallel.pp=2 with its estimate and its bubble, and the estimate is what a check
    of that config gives. Not offered where pp does not compose (here: CPU offload)."""
    base = [*SMALL, "train.global_batch_size=16", "train.micro_batch_size=1"]
    cfg = resolve(load(None, [*base, "parallel.grad_sync=last_micro_batch"]))
    profile = small_profile
    staged = resolve(load(None, [*base, "parallel.grad_sync=last_micro_batch", "parallel.pp=2"]))
    fits = memory.estimate(staged, 4, 1, 4, gpu=True, profile=profile).total
    assert memory.estimate(cfg, 4, 1, 4, gpu=True, profile=profile).total > fits
    fixes = memory.changes_that_fit(cfg, 4, 4, fits, profile=profile)
    assert f"parallel.pp=2 ({memory.gb(fits)}, 1f1b: a bubble of 33%)" in fixes, fixes
    offloaded = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cpu_offload=True))
    assert not [f for f in memory.changes_that_fit(offloaded, 4, 4, fits, profile=profile) if "parallel.pp" in f]


def test_more_nodes_are_offered_to_a_pipeline_only_where_its_micro_batches_fill(small_profile):
    """A pipeline of 2 stages needs 2 micro-batches of at least one sample a data-parallel rank: 4
    nodes of 4 would leave each of their 8 data-parallel ranks 1 of the 8 samples (it was offered,
    estimated with micro-batches of 0 samples); 2 nodes leave 2 (one a micro-batch), and do not fit here."""
    cfg = resolve(load(None, [*SMALL, "train.global_batch_size=8", "parallel.pp=2"]))
    profile = small_profile
    two_nodes = memory.estimate(cfg, 8, 1, 4, gpu=True, profile=profile).total
    assert memory.estimate(cfg, 16, 0, 4, gpu=True, profile=profile).total < two_nodes  # what 4 nodes were taken for
    fixes = memory.changes_that_fit(cfg, 4, 4, two_nodes - 1, profile=profile)
    assert not [f for f in fixes if f.startswith("--nnodes")], fixes
