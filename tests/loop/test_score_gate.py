"""Scoring (per-run errors, Spearman with its edge cases, suite aggregates) and the tolerance gate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from scipy.stats import rankdata, spearmanr
from hypothesis import strategies as st

from hops_calib.loop.gate import Tolerances, gate
from hops_calib.loop.score import aggregate, average_ranks, score_run, spearman_rho
from hops_calib.metrics import TimelineMetrics


def metrics(throughput: float, bubble: float, utilization: tuple[float, ...], steady: float | None = None):
    return TimelineMetrics(throughput_per_s=throughput, steady_throughput_per_s=steady or throughput,
                           bubble_ratio=bubble, utilization_per_stage=utilization, makespan_ms=1.0, window_ms=1.0,
                           completed_microbatches=1, iteration_periods_ms=(), iteration_time_ms=1.0)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=3, max_size=8))
def test_spearman_matches_scipy_wherever_scipy_defines_it(pairs):
    x = np.array([p[0] for p in pairs], dtype=float) / 7
    y = np.array([p[1] for p in pairs], dtype=float) / 3
    assert average_ranks(x) == pytest.approx(rankdata(x))
    if np.ptp(x) > 0 and np.ptp(y) > 0:
        assert spearman_rho(x, y) == pytest.approx(spearmanr(x, y).statistic)


def test_spearman_edge_cases_are_defined():
    assert spearman_rho([0.3, 0.3, 0.3], [0.5, 0.5, 0.5]) == 1.0  # both constant: same (tied) order
    assert spearman_rho([0.3], [0.9]) == 1.0  # one stage: nothing to order
    assert spearman_rho([0.1, 0.2, 0.3], [0.5, 0.5, 0.5]) == 0.0  # prediction carries no order
    assert spearman_rho([0.4, 0.4], [0.1, 0.2]) == 0.0
    assert spearman_rho([0.1, 0.2], [0.3, 0.4]) == pytest.approx(1.0)  # two stages: +1 or -1
    assert spearman_rho([0.1, 0.2], [0.4, 0.3]) == pytest.approx(-1.0)
    # Float noise from simulating identical stages is a tie, not an order.
    assert spearman_rho([0.1, 0.2, 0.3], [0.5, 0.5 + 1e-13, 0.5 - 1e-13]) == 0.0
    with pytest.raises(ValueError, match="3 real with 2 predicted"):
        spearman_rho([0.1, 0.2, 0.3], [0.1, 0.2])


def test_score_run_signs_and_units():
    real = metrics(10.0, 0.60, (0.5, 0.4, 0.3), steady=12.0)
    predicted = metrics(11.0, 0.55, (0.45, 0.44, 0.46), steady=9.0)
    score = score_run("r", real, predicted)
    assert score.throughput_error_pct == pytest.approx(10.0)
    assert score.steady_throughput_error_pct == pytest.approx(-25.0)
    assert score.bubble_error_pp == pytest.approx(-5.0)
    assert score.util_spearman_rho == pytest.approx(-0.5)


def test_unscorable_truth_is_named():
    with pytest.raises(ValueError, match="run r7: real throughput is nan"):
        score_run("r7", metrics(float("nan"), 0.5, (0.5,)), metrics(1.0, 0.5, (0.5,)))


def test_suite_aggregates():
    runs = [score_run(f"r{i}", metrics(10.0, 0.5, (0.1, 0.2)), metrics(10.0 + e, 0.5 + b, u))
            for i, (e, b, u) in enumerate([(1.0, 0.02, (0.1, 0.2)), (-3.0, -0.04, (0.2, 0.1)), (0.5, 0.0, (0.3, 0.3))])]
    suite = aggregate(runs)
    assert suite.n_fixtures == 3
    assert suite.throughput_mape_pct == pytest.approx((10 + 30 + 5) / 3)
    assert suite.throughput_median_ape_pct == pytest.approx(10.0)
    assert suite.bubble_mae_pp == pytest.approx(2.0)
    assert suite.util_spearman_mean == pytest.approx(0.0)
    with pytest.raises(ValueError):
        aggregate([])


def scores(errors: list[tuple[float, float]]):
    """Run scores with given (throughput error %, bubble error pp) against a fixed truth."""
    runs = [score_run(f"run{i}", metrics(100.0, 0.5, (0.1, 0.2, 0.3)),
                      metrics(100.0 + t, 0.5 + b / 100, (0.1, 0.2, 0.3))) for i, (t, b) in enumerate(errors)]
    return runs, aggregate(runs)


def test_gate_accepts_an_improvement_and_states_every_check():
    before, before_suite = scores([(10, 5), (-8, 4), (6, -3)])
    after, after_suite = scores([(4, 3), (-3, 2), (6, -3)])
    result = gate(before, after, before_suite, after_suite)
    assert result.accepted and result.decision == "accepted" and not result.regressions
    assert len(result.reasons) == 8
    assert "improves" in result.reasons[0] and "holds" in result.reasons[2]
    assert "not computed here, not judged" in result.reasons[5]  # no run's memory was predicted
    # run2 is predicted as before: the result counts the runs the change moved.
    # run2 is predicted as before: the result names the runs the change moved.
    assert result.runs_moved == ("run0", "run1") and result.reasons[-2] == "the change moves the predictions of 2 of 3 runs"
    # The change per run is -6, -5 and 0 pp: resampling the configurations, the suite's change stays in there.
    low, high = result.mape_change_interval_pp
    assert -6.0 <= low < high <= 0.0 and "paired bootstrap" in result.reasons[-1]
    # within noise exactly when the interval straddles 0, said beside the rules that decided
    assert result.within_noise == (low <= 0.0 <= high) and result.to_dict()["within_noise"] == result.within_noise
    assert ("within noise" in result.reasons[-1]) == result.within_noise
    assert result.to_dict()["decided_by"].startswith("every rule held")
    same = gate(before, before, before_suite, before_suite)
    assert same.accepted and same.runs_moved == () and "changing nothing the scores read" in same.reasons[-2]
    assert same.to_dict()["runs_moved"] == [] and same.to_dict()["n_runs_moved"] == 0
    assert same.to_dict()["mape_change_interval_pp"] == [0.0, 0.0] and same.within_noise


def test_gate_names_a_run_that_regressed_even_when_the_suite_improves():
    before, before_suite = scores([(10, 5), (-8, 4), (1, 0)])
    after, after_suite = scores([(0, 0), (0, 0), (-4, 0)])
    result = gate(before, after, before_suite, after_suite)
    assert after_suite.throughput_mape_pct < before_suite.throughput_mape_pct
    assert not result.accepted
    assert [(r.run_id, r.metric) for r in result.regressions] == [("run2", "throughput")]
    assert result.regressions[0].growth_pp == pytest.approx(3.0)
    assert any("run2" in reason and "fails" in reason for reason in result.reasons)
    # A looser per-run tolerance lets it through, and the result says which tolerance it used.
    loose = gate(before, after, before_suite, after_suite, Tolerances(run_throughput_pp=3.5))
    assert loose.accepted and loose.to_dict()["tolerances"]["run_throughput_pp"] == 3.5


def test_gate_can_read_each_runs_stall_free_error_where_it_has_one():
    # run0 met more stalls than the simulation placed: its window error swings by a whole stall (4 pp) when the
    # candidate moves its stall-free prediction by 1 pp; run1 has no stall-free error (no optimizer events).
    before, before_suite = scores([(0.5, 0), (1.0, 0)])
    after, after_suite = scores([(4.5, 0), (1.0, 0)])
    before = [dataclasses.replace(before[0], stall_free_error_pct=-0.5), before[1]]
    after = [dataclasses.replace(after[0], stall_free_error_pct=0.5), after[1]]
    window = gate(before, after, before_suite, after_suite, Tolerances(throughput_mape_pp=5))
    assert not window.accepted and [r.run_id for r in window.regressions] == ["run0"]
    stall_free = gate(before, after, before_suite, after_suite,
                      Tolerances(throughput_mape_pp=5, run_throughput_error="stall-free"))
    assert stall_free.accepted and not stall_free.regressions
    assert stall_free.to_dict()["tolerances"]["run_throughput_error"] == "stall-free"
    assert "stall-free throughput error" in stall_free.reasons[3]
    # Where a run has no stall-free error the rule reads its window error, and says which error it read.
    worse = [after[0], dataclasses.replace(after[1], throughput_error_pct=5.0)]
    fallback = gate(before, worse, before_suite, aggregate(worse),
                    Tolerances(throughput_mape_pp=5, run_throughput_error="stall-free"))
    assert [(r.run_id, r.error) for r in fallback.regressions] == [("run1", "window")]
    assert "|throughput error|" in fallback.regressions[0].describe()
    worse_free = [dataclasses.replace(after[0], stall_free_error_pct=3.0), after[1]]
    flagged = gate(before, worse_free, before_suite, after_suite,
                   Tolerances(throughput_mape_pp=5, run_throughput_error="stall-free"))
    assert [(r.run_id, r.error) for r in flagged.regressions] == [("run0", "stall-free")]
    assert "|stall-free throughput error| 0.50% -> 3.00%" in flagged.regressions[0].describe()
    with pytest.raises(ValueError, match="run_throughput_error must be one of window, stall-free"):
        Tolerances(run_throughput_error="median")


def test_gate_rejects_a_worse_suite_and_falling_rho():
    before, before_suite = scores([(2, 1), (-2, 1)])
    after, after_suite = scores([(3, 1), (-3, 1)])
    result = gate(before, after, before_suite, after_suite)
    assert not result.accepted and "fails" in result.reasons[0] and not result.regressions
    worse_rho = dataclasses.replace(before_suite, util_spearman_mean=before_suite.util_spearman_mean - 0.1)
    result = gate(before, before, before_suite, worse_rho)
    assert not result.accepted and "rho" in [r for r in result.reasons if "fails" in r][0]
    assert gate(before, before, before_suite, worse_rho, Tolerances(util_spearman=0.2)).accepted


def test_gate_refuses_different_run_sets_and_negative_tolerances():
    before, before_suite = scores([(2, 1), (-2, 1)])
    after, after_suite = scores([(2, 1)])
    with pytest.raises(ValueError, match="run sets differ"):
        gate(before, after, before_suite, after_suite)
    with pytest.raises(ValueError, match="must be >= 0"):
        Tolerances(run_bubble_pp=-1)


def test_a_suite_change_below_float_rounding_holds():
    from hops_calib.loop.gate import ROUNDING, _suite_check

    passes, reason = _suite_check("bubble MAE pp", " pp", 2.5126, 2.5126 + ROUNDING / 10, 0.0, higher_is_better=False)
    assert passes and reason.endswith("holds")
    passes, reason = _suite_check("bubble MAE pp", " pp", 2.5126, 2.5126 + 1e-6, 0.0, higher_is_better=False)
    assert not passes and "fails" in reason


def test_the_mape_bootstrap_resamples_whole_configurations():
    from hops_calib.loop.score import interval, mape_draws

    # Two repeats of configuration a (errors 1 %), one run of b (3 %): drawing whole configurations, a resample's
    # MAPE can only be 1 (a, a), 3 (b, b) or 5/3 (a and b); drawing runs one by one would also give e.g. 2.
    runs, _ = scores([(1, 0), (-1, 0), (3, 0)])
    draws = mape_draws(runs, ["a", "a", "b"], draws=500, seed=3)
    assert np.allclose(sorted(set(np.round(draws, 9))), [1.0, 5 / 3, 3.0])
    assert np.array_equal(draws, mape_draws(runs, ["a", "a", "b"], draws=500, seed=3))  # seeded
    low, high = interval(draws)
    assert low == 1.0 and high == 3.0
    same, _ = scores([(2, 0), (-2, 0), (2, 0)])
    assert interval(mape_draws(same, ["a", "b", "c"], draws=200)) == (2.0, 2.0)
    with pytest.raises(ValueError):
        mape_draws(runs, ["a", "b"])


def with_memory(runs, fractions):
    return [dataclasses.replace(r, predicted_memory_fraction=f) for r, f in zip(runs, fractions)]


def test_the_memory_fit_rule_counts_measured_runs_predicted_not_to_fit():
    # Every measured run ran: a model that says one does not fit in memory is wrong about it, so a change may
    # not make more such verdicts; a verdict that flips moves its run even where no time moved.
    runs, _ = scores([(4, 3), (-3, 2), (6, -3)])
    fits = with_memory(runs, (0.5, 0.9, 1.0))
    over = with_memory(runs, (0.5, 1.2, 1.0))
    assert [r.predicted_fits for r in over] == [True, False, True] and runs[0].predicted_fits is None
    assert aggregate(fits).runs_predicted_not_to_fit == 0 and aggregate(over).runs_predicted_not_to_fit == 1
    assert aggregate(runs).runs_predicted_not_to_fit is None
    worse = gate(fits, over, aggregate(fits), aggregate(over))
    assert not worse.accepted and worse.failed_rules == ("memory_fit",)
    assert worse.runs_moved == ("run1",) and "0 -> 1 (may not grow) -> fails" in worse.reasons[5]
    better = gate(over, fits, aggregate(over), aggregate(fits))
    assert better.accepted and better.runs_moved == ("run1",) and "improves" in better.reasons[5]
    # a fraction that moves without flipping a verdict moves nothing the scores read
    same = gate(fits, with_memory(runs, (0.6, 0.8, 0.9)), aggregate(fits), aggregate(with_memory(runs, (0.6, 0.8, 0.9))))
    assert same.accepted and same.runs_moved == () and "holds" in same.reasons[5]
