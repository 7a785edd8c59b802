"""The statistics every bench figure is reported with: its rounds, their median, a 95% interval, and
a verdict against its goal.

A figure is measured in rounds (one value each, usually a ratio of two things timed side by side).
The interval is a percentile bootstrap of the median of the rounds, with a fixed seed so that the
same rounds always give the same interval. A goal counts as met only when the whole interval clears
it, missed when the whole interval fails it, and otherwise the rounds cannot tell ("within noise").
"""

from __future__ import annotations

import random
import statistics

SEED = 0  # the bootstrap's seed: the same rounds give the same interval
RESAMPLES = 10_000  # bootstrap resamples


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def interval(
    values: list[float], level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED
) -> list[float] | None:
    """[low, high]: the percentile bootstrap interval of the median of `values`; None for fewer than
    two values (one round says nothing about the spread)."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return [medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1) + 0.5)]]


def verdict(ci: list[float] | None, op: str | None, goal: float | None) -> str | None:
    """ "met" when the whole interval clears the goal, "missed" when the whole interval fails it,
    "within noise" when it straddles the goal; None without an interval or a goal."""
    if ci is None or op is None or goal is None:
        return None
    low, high = ci
    if op == "<=":
        return "met" if high <= goal else "missed" if low > goal else "within noise"
    if op == ">=":
        return "met" if low >= goal else "missed" if high < goal else "within noise"
    raise ValueError(f"goal operator {op!r}: expected '<=' or '>='")


def figure(rounds: list[float], op: str | None = None, goal: float | None = None, exact: bool = False) -> dict:
    """One figure as the results JSON keeps it: every round, their median, the 95% interval, the goal
    and the verdict, so that a reader can check the claim without running anything. `exact`: a
    count, not a timing (e.g. bytes), the same in every round: its interval is the value itself."""
    rounds = [float(x) for x in rounds]
    ci = [min(rounds), max(rounds)] if exact and rounds else interval(rounds)
    return {
        "rounds": rounds,
        "median": median(rounds),
        "ci95": ci,
        "goal": None if goal is None else {"op": op, "value": goal},
        "verdict": verdict(ci, op, goal),
    }
