"""Scoring: per-run errors of a prediction against the truth, and suite aggregates.

Both sides are `TimelineMetrics` from the one metrics function (rule 3). Per run:

- throughput error % = (predicted - real) / real x 100, signed, on the window
  definition of HOPS (the one the gate uses); the same on steady throughput
  (microbatches per iteration / median iteration period);
- bubble error pp = (predicted - real bubble ratio) x 100, signed;
- utilization rho = Spearman rank correlation of real and predicted per-stage
  utilization.

Spearman rho with 2-6 points is coarse, and is defined here for every case:
utilizations are compared after rounding to 1e-9 (so float noise in a
simulation of identical stages is a tie, not an order). If both vectors are
constant (all stages tied, or a single stage), rho = 1: the prediction orders
the stages exactly as the run did. If only one is constant, rho = 0: one side
carries no order, so nothing is predicted about it (scipy would return NaN,
which a mean cannot absorb). Otherwise rho is Spearman's with average ranks for
ties. With 2 stages rho is therefore +1 (same order), -1 (swapped) or 0/1 for
ties, and it enters the suite mean like any other run.

Suite: throughput MAPE and median APE, steady-throughput MAPE, bubble MAE (pp),
mean rho.

Each metric is scored on the runs that measured it, and the suite says how many
(`counts`): throughput on every run (the one definition of `hops_calib.metrics`:
a run measured at iteration level against the simulated steady state), bubble and
utilization only on runs with events (an iteration-level run's are None, and a
suite without such runs has None for their aggregates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from hops_calib.metrics import IterationMetrics, TimelineMetrics, comparable_throughputs

UTILIZATION_DECIMALS = 9


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank (scipy.stats.rankdata 'average')."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    last_rank = np.cumsum(counts)
    return (last_rank - (counts - 1) / 2.0)[inverse]


def spearman_rho(real: Sequence[float], predicted: Sequence[float]) -> float:
    """Spearman rank correlation, defined for constant vectors as the module docstring says.

    Implemented with numpy rather than scipy.stats, whose import alone costs
    more than the whole speed budget of `evaluate`; a test checks it against
    scipy.stats.spearmanr.
    """
    x = np.round(np.asarray(real, dtype=float), UTILIZATION_DECIMALS)
    y = np.round(np.asarray(predicted, dtype=float), UTILIZATION_DECIMALS)
    if x.shape != y.shape:
        raise ValueError(f"cannot correlate {len(x)} real with {len(y)} predicted utilizations")
    x_constant, y_constant = bool(np.ptp(x) == 0), bool(np.ptp(y) == 0)
    if x_constant and y_constant:
        return 1.0
    if x_constant or y_constant:
        return 0.0
    return float(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1])


@dataclass(frozen=True)
class RunScore:
    run_id: str
    real_throughput_per_s: float
    predicted_throughput_per_s: float
    throughput_error_pct: float
    real_steady_throughput_per_s: float
    predicted_steady_throughput_per_s: float
    steady_throughput_error_pct: float
    real_bubble_ratio: float | None  # None: the run has no events (measured at iteration level)
    predicted_bubble_ratio: float
    bubble_error_pp: float | None
    util_spearman_rho: float | None
    real_utilization: tuple[float, ...]
    predicted_utilization: tuple[float, ...]
    # Expected |throughput error| from random stalls alone (Prediction.stall_noise_ape_pct): a floor, not a fault.
    stall_noise_ape_pct: float = 0.0
    # The throughput error with the real run's stalls and the simulation's placed ones taken out of both windows
    # (`stall_free_error_pct`); None when not computed or not computable (no optimizer events).
    stall_free_error_pct: float | None = None
    # The configuration the run repeats (its stored group: repeats share a split, a fold, a bootstrap draw).
    group: str = ""
    # Logged timer -> relative error (%) of its predicted largest value over ranks (None: no counterpart), on a
    # run that logged timers (`hops_calib.loop.timers`); None on a run that logged none.
    timer_errors_pct: dict[str, float | None] | None = field(default=None, hash=False)
    # The predicted peak memory of the run's fullest GPU over that GPU's memory (`model.memory.stage_memory`);
    # above 1 the model says the launch does not fit, which a measured run disproves. None: not computed.
    predicted_memory_fraction: float | None = None

    @property
    def predicted_fits(self) -> bool | None:
        """Whether the model says every GPU of the run holds its peak memory (None: not computed)."""
        return None if self.predicted_memory_fraction is None else self.predicted_memory_fraction <= 1.0

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["real_utilization"] = list(self.real_utilization)
        data["predicted_utilization"] = list(self.predicted_utilization)
        return data


def _relative_error_pct(run_id: str, what: str, real: float, predicted: float) -> float:
    if not (math.isfinite(real) and real > 0):
        raise ValueError(f"run {run_id}: real {what} is {real}; the fixture's truth cannot be scored against")
    if not math.isfinite(predicted):
        raise ValueError(f"run {run_id}: predicted {what} is {predicted}")
    return (predicted - real) / real * 100.0


def score_run(
    run_id: str,
    real: TimelineMetrics | IterationMetrics,
    predicted: TimelineMetrics,
    *,
    stall_noise_ape_pct: float = 0.0,
    group: str | None = None,
) -> RunScore:
    """A run's errors; `group`: the configuration it repeats as the store holds it (a run with events: its id
    without `_run<N>`, which is also the default here)."""
    from hops_calib.store.split import group_of

    real_tput, predicted_tput, real_steady, predicted_steady = comparable_throughputs(real, predicted)
    events = real.has_events
    return RunScore(
        run_id=run_id,
        real_throughput_per_s=real_tput,
        predicted_throughput_per_s=predicted_tput,
        throughput_error_pct=_relative_error_pct(run_id, "throughput", real_tput, predicted_tput),
        real_steady_throughput_per_s=real_steady,
        predicted_steady_throughput_per_s=predicted_steady,
        steady_throughput_error_pct=_relative_error_pct(run_id, "steady throughput", real_steady, predicted_steady),
        real_bubble_ratio=real.bubble_ratio,
        predicted_bubble_ratio=predicted.bubble_ratio,
        bubble_error_pp=(predicted.bubble_ratio - real.bubble_ratio) * 100.0 if real.bubble_ratio is not None else None,
        util_spearman_rho=spearman_rho(real.utilization_per_stage, predicted.utilization_per_stage) if events else None,
        real_utilization=tuple(real.utilization_per_stage),
        predicted_utilization=tuple(predicted.utilization_per_stage),
        stall_noise_ape_pct=stall_noise_ape_pct,
        group=group if group is not None else group_of(run_id),
    )


# A real iteration stalled when its silent stretch exceeds the run's median by this much: a retransmission
# timeout adds ~180 ms (Linux TCP_RTO_MIN 200 ms), while stall-free stretches of one run stay within ~20 ms.
STALL_EXCESS_MS = 100.0


def stall_free_error_pct(prediction, real_metrics, series) -> float | None:
    """Window throughput error with the retransmission stalls taken out of both sides.

    The real run's stalls (iterations whose silent stretch exceeds the run's median by STALL_EXCESS_MS, before
    its last iteration: the window ends there) and the simulation's placed ones (`Pipeline.stall_ms` in the
    iterations before the last) are removed from their windows; what is left is the error of everything but
    the stalls' random count, so runs that met more or fewer stalls than the simulation placed stop hiding or
    inflating the model's own error. `series`: the real run's `timeline_iteration_part_series`. None without
    a traced optimizer (no silent stretch to read).
    """
    from hops_calib.sim.simulate import stalls_in_window

    if series is None or not real_metrics.has_events or not series.optimizer_traced.any():
        return None
    silent = series.silent_ms[series.optimizer_traced]
    inside = silent[:-1]  # the last traced iteration's silent stretch comes after the window's end
    median = float(np.median(silent))
    real_excess = float(np.sum(inside[inside > median + STALL_EXCESS_MS] - median))
    pipeline, predicted = prediction.pipeline, prediction.metrics
    predicted_window = predicted.window_ms - stalls_in_window(pipeline) * pipeline.stall_ms
    # Same completed microbatches on both sides: the throughput ratio is the inverse window ratio.
    real_window = predicted.window_ms * predicted.throughput_per_s / real_metrics.throughput_per_s
    if not (predicted_window > 0 and real_window - real_excess > 0):
        return None
    return ((real_window - real_excess) / predicted_window - 1.0) * 100.0


def prediction_fingerprint(
    throughput_per_s: float,
    steady_throughput_per_s: float,
    bubble_ratio: float,
    utilization: Iterable[float],
    stall_noise_ape_pct: float,
) -> str:
    """What the scores read of one prediction (throughputs, bubble, per-stage utilization, stall spread), to 9
    significant digits: two predictions with the same fingerprint are scored alike, float noise aside."""
    values = (throughput_per_s, steady_throughput_per_s, bubble_ratio, *utilization, stall_noise_ape_pct)
    return " ".join(f"{v:.9g}" for v in values)


def run_fingerprint(run: RunScore) -> str:
    """`prediction_fingerprint` of a scored run's prediction."""
    return prediction_fingerprint(
        run.predicted_throughput_per_s,
        run.predicted_steady_throughput_per_s,
        run.predicted_bubble_ratio,
        run.predicted_utilization,
        run.stall_noise_ape_pct,
    )


def score_prediction(
    run_id: str, real: TimelineMetrics | IterationMetrics, prediction, series=None, group: str | None = None
) -> RunScore:
    """`score_run` of a `hops_calib.model.predict.Prediction`, with its random-stall spread, and with `series` (the
    real run's `timeline_iteration_part_series`) its stall-free error too."""
    score = score_run(run_id, real, prediction.metrics, stall_noise_ape_pct=prediction.stall_noise_ape_pct, group=group)
    logged = getattr(real, "timers_ms", None)
    if logged:
        from hops_calib.loop.timers import timer_errors_pct

        score = replace(score, timer_errors_pct=timer_errors_pct(logged, prediction.result.columns) or None)
    if series is None:
        return score
    return replace(score, stall_free_error_pct=stall_free_error_pct(prediction, real, series))


@dataclass(frozen=True)
class SuiteScore:
    n_fixtures: int
    throughput_mape_pct: float
    throughput_median_ape_pct: float
    steady_throughput_mape_pct: float
    bubble_mae_pp: float | None  # None: no run of the suite has events
    util_spearman_mean: float | None
    # The throughput MAPE a model exact but for the random stalls would score here (mean of the runs' floors).
    stall_noise_mape_pct: float = 0.0
    # Runs each metric was scored on (METRIC_COUNTS); None in records written before the counts were kept.
    counts: dict[str, int] | None = None
    # Megatron's logged timers (`hops_calib.loop.timers.timer_summary`): per timer the runs that logged it, those
    # scored and their MAPE; None where no run logged timers. Reported, not judged by the gate.
    timers: dict[str, dict[str, Any]] | None = field(default=None, hash=False)
    # Measured runs the model predicts not to fit in their GPUs' memory: each ran, so each such verdict is an error
    # of the memory model (the gate's memory_fit rule: it may not grow). None: no run's memory was computed.
    runs_predicted_not_to_fit: int | None = None

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def count(self, metric: str) -> int:
        """Runs `metric` (a key of METRIC_COUNTS) was scored on (all of them in an older record)."""
        return self.n_fixtures if self.counts is None else int(self.counts.get(metric, self.n_fixtures))


# metric -> the RunScore field that holds it per run; the suite scores each on the runs where it is not None.
METRIC_COUNTS = {
    "throughput": "throughput_error_pct",
    "steady_throughput": "steady_throughput_error_pct",
    "bubble": "bubble_error_pp",
    "utilization": "util_spearman_rho",
}


def or_nan(value: float | None) -> float:
    """A suite aggregate for display or a number-only record: NaN where no run measured it (None)."""
    return math.nan if value is None else value


def _present(runs: Sequence[RunScore], name: str) -> np.ndarray:
    return np.array([getattr(r, name) for r in runs if getattr(r, name) is not None], dtype=float)


def aggregate(runs: Iterable[RunScore]) -> SuiteScore:
    runs = list(runs)
    if not runs:
        raise ValueError("no runs to aggregate")
    throughput = np.abs([r.throughput_error_pct for r in runs])
    bubble, rho = _present(runs, "bubble_error_pp"), _present(runs, "util_spearman_rho")
    return SuiteScore(
        n_fixtures=len(runs),
        throughput_mape_pct=float(np.mean(throughput)),
        throughput_median_ape_pct=float(np.median(throughput)),
        steady_throughput_mape_pct=float(np.mean(np.abs([r.steady_throughput_error_pct for r in runs]))),
        bubble_mae_pp=float(np.mean(np.abs(bubble))) if len(bubble) else None,
        util_spearman_mean=float(np.mean(rho)) if len(rho) else None,
        stall_noise_mape_pct=float(np.mean([r.stall_noise_ape_pct for r in runs])),
        counts={metric: sum(getattr(r, name) is not None for r in runs) for metric, name in METRIC_COUNTS.items()},
        timers=_timers(runs),
        runs_predicted_not_to_fit=(
            sum(r.predicted_fits is False for r in runs) if any(r.predicted_fits is not None for r in runs) else None
        ),
    )


def _timers(runs: Sequence[RunScore]) -> dict[str, dict[str, Any]] | None:
    if not any(r.timer_errors_pct for r in runs):
        return None
    from hops_calib.loop.timers import timer_summary

    return timer_summary(r.timer_errors_pct for r in runs)


def _group_draws(groups: Sequence[str], draws: int, rng: np.random.Generator) -> np.ndarray:
    """`draws` bootstrap resamples of the runs, whole configurations at a time: a (draws, n_runs) array of how
    many times each run is drawn (repeats of a configuration are not independent evidence)."""
    names = sorted(set(groups))
    members = np.array([[g == name for g in groups] for name in names], dtype=float)  # (n_groups, n_runs)
    picks = rng.integers(0, len(names), size=(draws, len(names)))
    # each draw's picks counted per group at once: draw d's group g is bin d * n_groups + g
    offsets = np.arange(draws)[:, None] * len(names)
    counts = np.bincount((picks + offsets).ravel(), minlength=draws * len(names)).reshape(draws, len(names))
    return counts @ members


def mape_draws(
    runs: Sequence[RunScore],
    groups: Sequence[str],
    *,
    draws: int = 2000,
    seed: int = 0,
    baseline: Sequence[RunScore] | None = None,
) -> np.ndarray:
    """The throughput MAPE of `draws` configuration-bootstrap resamples of `runs` (`groups[i]` is run i's
    configuration), with an explicit seed: how much the suite MAPE depends on which configurations were run.
    With `baseline` (the same runs scored by another model), the change of the MAPE from it on the same draws
    (a paired bootstrap)."""
    if len(runs) != len(groups) or not runs or (baseline is not None and len(baseline) != len(runs)):
        raise ValueError("one configuration per run, and at least one run")
    weights = _group_draws(groups, draws, np.random.default_rng(seed))
    errors = np.abs([r.throughput_error_pct for r in runs])
    if baseline is not None:
        errors = errors - np.abs([r.throughput_error_pct for r in baseline])
    return (weights @ errors) / weights.sum(axis=1)


def interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` percentile interval of `values`."""
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)
