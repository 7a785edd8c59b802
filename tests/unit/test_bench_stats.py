"""bench/stats.py: medians, bootstrap intervals and verdicts (pure functions)."""

from bench import stats


def test_median_of_a_known_sample():
    assert stats.median([5.0, 1.0, 3.0]) == 3.0
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert stats.median([]) is None


def test_interval_contains_the_median_and_is_reproducible():
    rounds = [0.91, 0.95, 0.88, 1.02, 0.97, 0.93, 0.90]
    low, high = stats.interval(rounds)
    assert min(rounds) <= low <= stats.median(rounds) <= high <= max(rounds)
    assert stats.interval(rounds) == [low, high]  # fixed seed


def test_interval_of_equal_rounds_is_a_point_and_of_one_round_none():
    assert stats.interval([2.0] * 5) == [2.0, 2.0]
    assert stats.interval([2.0]) is None


def test_verdicts_at_most():
    assert stats.verdict([0.95, 1.05], "<=", 1.1) == "met"
    assert stats.verdict([1.12, 1.30], "<=", 1.1) == "missed"
    assert stats.verdict([1.05, 1.15], "<=", 1.1) == "within noise"


def test_verdicts_at_least():
    assert stats.verdict([0.92, 0.99], ">=", 0.9) == "met"
    assert stats.verdict([0.70, 0.85], ">=", 0.9) == "missed"
    assert stats.verdict([0.85, 0.95], ">=", 0.9) == "within noise"


def test_no_verdict_without_goal_or_interval():
    assert stats.verdict([0.9, 1.0], None, None) is None
    assert stats.verdict(None, "<=", 1.1) is None


def test_figure_keeps_rounds_median_interval_goal_and_verdict():
    f = stats.figure([1.0, 1.02, 0.98, 1.01, 0.99], "<=", 1.1)
    assert f["rounds"] == [1.0, 1.02, 0.98, 1.01, 0.99]
    assert f["median"] == 1.0
    assert f["ci95"][0] <= 1.0 <= f["ci95"][1]
    assert f["goal"] == {"op": "<=", "value": 1.1}
    assert f["verdict"] == "met"


def test_an_exact_figure_is_judged_by_its_value():
    assert stats.figure([1.0], "<=", 1.05, exact=True)["verdict"] == "met"
    assert stats.figure([1.2], "<=", 1.05)["verdict"] is None  # one timed round: no interval, no verdict
