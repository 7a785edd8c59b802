"""What a pipeline schedule costs, for the plan (`make check`) and the memory estimate: the activations
its first stage holds at once and its bubble, for every schedule name `parallel.pp_schedule` may take
(`SCHEDULES`), with `parallel.pp_stages_per_rank` (v, virtual stages a rank) where the schedule has
several. Arithmetic only: torch-free, as the config check runs it on a login node.

In flight, on the first stage (its peak; the last stage holds one), in micro-batches of one rank's
whole stage (1/pp of the model's layers), m micro-batches, pp ranks:

    gpipe             m                             every forward before any backward
    1f1b              min(pp, m)                    pp - 1 forwards of warm-up, then one forward, one backward
    interleaved_1f1b  min((v-1) r + 2(pp-1) + 1, m v) / v     (r = m / max(1, m // pp): micro-batches a round)
    interleaved_zb    min((v-1) r + (pp-1) + 1, m v) / v
    zbv               min(2 pp, m + 1) / 2          (v = 2: its V-shaped stages)

The interleaved forms are torch's own warm-up (torch/distributed/pipelining/schedules.py,
`_get_warmup_ops`: (v-1) r + 2 (pp-1-rank) forwards, zero bubble's with 1 for the 2) plus the forward
of the first steady step, in chunks of 1/v of a stage. For r = pp this is Megatron's
`num_warmup_microbatches` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473) and Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.2.3): pp (1 + (pp-1)/(pp v))
micro-batches, pp + (pp-1)/v. tests/unit/test_pp_plan.py checks every form against the action table
torch's schedule classes build, for pp up to 8 and m up to 5 pp.

The bubble, the share of a forward/backward each stage idles (the literature gives it over the ideal
time; over the whole it is bubble / (ideal + bubble), which is how it is said here):

    gpipe, 1f1b       (pp-1) / (m + pp-1)           GPipe (Huang et al. 2019, arXiv 1811.06965), Narayanan et
                                                    al. 2021 section 2.2.1: (pp-1)/m of the ideal time
    interleaved_1f1b  (pp-1) / (v m + pp-1)         Narayanan et al. 2021 section 2.2.2: 1/v of it
    interleaved_zb    (pp-1) / (3 v m + pp-1)      Qi et al. 2024 ("Zero Bubble Pipeline Parallelism",
                                                    arXiv 2401.10241, section 3.1, ZB-H1, torch's ZB1P):
                                                    (pp-1)(T_F + T_B - T_W) against 1F1B's (pp-1)(T_F + T_B +
                                                    T_W), a third with T_F = T_B = T_W; over v stages a rank
                                                    as interleaving divides it (our assumption)
    zbv               0                             Qi et al. section 6 (ZB-V) and torch's docstring: zero
                                                    only while forward, input-backward and weight-backward take
                                                    equal time, which real models do not: an ideal
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from trainer.parallel import pp as parallel_pp

if TYPE_CHECKING:
    from trainer.config import ParallelArgs

# parallel.pp_schedule's names (the config's Literal), and the stages a rank holds under each (None:
# parallel.pp_stages_per_rank's, 2 where it is not set: trainer/parallel/pp.py)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": None, "interleaved_zb": None, "zbv": 2}


def schedule(args: ParallelArgs) -> str:
    return args.pp_schedule


def stages_per_rank(args: ParallelArgs) -> int:
    """v: the stages one rank holds (zbv: 2; gpipe and 1f1b: 1; the interleaved ones:
    parallel.pp_stages_per_rank, 2 where it is not set)."""
    fixed = SCHEDULES.get(schedule(args), 1)
    return fixed if fixed is not None else parallel_pp.stages_per_rank(args)


def in_flight(args: ParallelArgs) -> Fraction:
    """Micro-batches of a whole stage whose activations the first stage holds at its peak (see the
    module's docstring); 1 without a pipeline."""
    pp, m, v, name = args.pp, parallel_pp.microbatches(args), stages_per_rank(args), schedule(args)
    if pp == 1:
        return Fraction(1)
    if name == "gpipe":
        return Fraction(m)
    if name == "zbv":
        return Fraction(min(2 * pp, m + 1), 2)
    if name in ("interleaved_1f1b", "interleaved_zb"):
        r = m // max(1, m // pp)  # torch's microbatches_per_round
        hops = 2 * (pp - 1) if name == "interleaved_1f1b" else pp - 1
        return Fraction(min((v - 1) * r + hops + 1, m * v), v)
    return Fraction(min(pp, m))


def bubble(args: ParallelArgs) -> tuple[str, Fraction]:
    """(the bubble's formula with its numbers, "(pp-1)/(m+pp-1) = 1/3", and its value) for the
    schedule (see the module's docstring)."""
    pp, m, v, name = args.pp, parallel_pp.microbatches(args), stages_per_rank(args), schedule(args)
    if name == "zbv":
        return "0 if forward, input-backward and weight-backward took equal time (ZB-V's ideal)", Fraction(0)
    form, ideal = {
        "interleaved_1f1b": (f"(pp-1)/(v*m+pp-1), v={v}", v * m),
        "interleaved_zb": (f"(pp-1)/(3*v*m+pp-1), v={v}", 3 * v * m),
    }.get(name, ("(pp-1)/(m+pp-1)", m))
    value = Fraction(pp - 1, ideal + pp - 1)
    return f"{form} = {pp - 1}/{ideal + pp - 1}", value
