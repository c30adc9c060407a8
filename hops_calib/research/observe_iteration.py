"""Observe's contributors on runs measured at iteration level (a training log, a run table, the vTrain table): no
event times a part of such a run, so each term of the iteration the model predicts is judged by how much of the
runs' iteration-time residual it can explain.

Each run's predicted iteration is cut into the terms that price it (`iteration_terms`): the model's breakdown
(`Model.breakdown`, a sum of work per pipeline rank) on the rank with the most work, which paces the pipeline, as
compute (less recomputation), recomputation, tensor-parallel collectives, the exposed data-parallel reduction,
pipeline p2p, the tied-embedding all-reduce between the ends, the optimizer step and host time, and the bubble: the
predicted iteration time less that rank's work (its idle time; negative where the breakdown counts work the
simulator overlaps). They add up to the predicted iteration time.

A contributor is one term within one group of runs (`configuration_groups`: the event stores' run groups and the
launch's t, d, h and s alone). Predicted minus real iteration time (e, ms) of each member is regressed on the
term's predicted ms (q), both relative to the real iteration time (so that every run weighs as in the MAPE),
through the origin by least absolute deviations (as the MAPE weighs errors): the term is `scale` too long (a fitted
share of itself, within +-SCALE_BOUND), what one change of a term's parameters scaling it on those runs can do. Its numbers, in the event stores' names:

- `bias_ms`: scale x the mean predicted ms of the term (predicted minus implied real: positive, predicted too long);
  `real_ms_mean` is the implied real value (predicted less bias: `implied` true, no event measures it);
- `fixable_mape_pp`: the suite's throughput MAPE (pp) saved when every member's term is `scale` shorter (the run's
  predicted throughput scales by T / (T - scale q)), negative where the term's error offsets another;
- `contribution_pp`: at most what the term could remove: each member's whole residual taken out of it (never below
  zero; nothing where the term prices nothing on the run);
- `residual_spread_ms`: the spread of the members' iteration residuals left after the fit; `noise_ms`: the real
  iteration time's spread between repeats of one configuration (None without repeats); `noise_mape_pp`: the
  contribution's share that noise explains, as on event stores.

Pure computation on predictions and the runs' iteration times.
"""

from __future__ import annotations

import math

import numpy as np

from hops_calib.research.observe_contributors import DOMINANT_RUNS, Contributor, _carriers, _groupings
from hops_calib.research.observe_rows import ITERATION_QUANTITIES, RunRow, iteration_terms, run_groups

LEVEL = "iteration"


def predicted_terms(spec, model) -> dict[str, float]:
    """`iteration_terms` of `spec` under `model` (its breakdown and simulated iteration time)."""
    from hops_calib.model.predict import predict

    return iteration_terms(model.breakdown(spec), predict(spec, model).metrics.iteration_time_ms)


def configuration_groups(spec) -> dict[str, str]:
    """The groups an iteration-level run belongs to: `run_groups` and each of t, d, h and s alone."""
    return {
        **run_groups(spec),
        "tp": str(spec.tp),
        "dp": str(spec.dp),
        "hidden": str(spec.model.hidden_size),
        "seq": str(spec.model.seq_length),
    }


def _shifted(run: RunRow, shift_ms: float) -> tuple[float, float]:
    """The run's throughput and steady errors % with its predicted iteration `shift_ms` shorter."""
    period = run.prediction.metrics.iteration_time_ms
    factor = period / (period - shift_ms)
    return ((1 + run.score.throughput_error_pct / 100) * factor - 1) * 100, (
        (1 + run.score.steady_throughput_error_pct / 100) * factor - 1
    ) * 100


SCALE_BOUND = 1.0  # the fitted term stays between none and twice its predicted value: a larger miss is no error of
# that term's parameters but a mechanism the model lacks, and a small term fitted further would soak up others' errors


def fitted_scale(x: np.ndarray, y: np.ndarray) -> float:
    """The scale a minimizing sum |y - a x| (least absolute deviations through the origin, as the MAPE weighs
    errors: the median of y / x weighted by |x|), within +-SCALE_BOUND."""
    used = x != 0
    ratios, weights = y[used] / x[used], np.abs(x[used])
    order = np.argsort(ratios, kind="stable")
    cumulative = np.cumsum(weights[order])
    median = float(ratios[order][np.searchsorted(cumulative, cumulative[-1] / 2.0)])
    return min(max(median, -SCALE_BOUND), SCALE_BOUND)


def _contributor(
    quantity: str, dimension: str, group: str, aliases: list[tuple[str, str]], runs: list[RunRow], n_suite: int
) -> Contributor | None:
    terms = np.array([(r.breakdown_ms or {})[quantity] for r in runs])  # (each has one: iteration_contributors)
    if not np.any(terms != 0):
        return None  # the term prices nothing on these runs
    real = np.array([r.real_metrics.iteration_time_ms for r in runs])
    residual = np.array([r.prediction.metrics.iteration_time_ms for r in runs]) - real
    scale = fitted_scale(terms / real, residual / real)
    now = np.array([[abs(r.score.throughput_error_pct), abs(r.score.steady_throughput_error_pct)] for r in runs])
    fitted = np.abs(np.array([_shifted(r, scale * q) for r, q in zip(runs, terms)]))
    whole = np.where(terms != 0, np.minimum(residual, np.where(terms > 0, terms, np.inf)), 0.0)
    absorbed = np.abs(np.array([_shifted(r, s) for r, s in zip(runs, whole)]))
    per_run = (now - fitted) / n_suite
    upper = (now - absorbed) / n_suite
    predicted = float(terms.mean())
    bias = scale * predicted
    left = residual - scale * terms
    repeats: dict[str, list[float]] = {}
    for run, value in zip(runs, real):
        repeats.setdefault(run.score.group, []).append(float(value))
    groups = [np.array(v) for v in repeats.values() if len(v) > 1]
    noise = (
        float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)))
        if groups
        else None
    )
    square = float(residual.mean() ** 2 + residual.std() ** 2)
    share = min(noise**2, float(residual.std()) ** 2) / square if noise is not None and square > 0 else 0.0
    order = np.argsort(-per_run[:, 0], kind="stable")
    return Contributor(
        quantity=quantity,
        level=LEVEL,
        dimension=dimension,
        group=group,
        aliases=tuple(aliases),
        n_runs=len(runs),
        n_stages=None,
        real_ms_mean=predicted - bias,
        predicted_ms_mean=predicted,
        residual_ms_mean=bias,
        residual_pct=scale / (1 - scale) * 100 if scale < 1 else math.nan,
        contribution_pp=float(upper[:, 0].sum()),
        steady_contribution_pp=float(upper[:, 1].sum()),
        dominant_runs=tuple(
            {
                "id": runs[i].id,
                "run_id": runs[i].id,
                "contribution_pp": float(per_run[i, 0]),
                "throughput_error_pct": runs[i].score.throughput_error_pct,
            }
            for i in order[:DOMINANT_RUNS]
            if per_run[i, 0] > 0
        ),
        residual_spread_ms=float(left.std()),
        noise_ms=noise,
        fixable_mape_pp=float(per_run[:, 0].sum()),
        noise_mape_pp=float(upper[:, 0].sum()) * share,
        members=tuple((r.id, None) for r in runs),
        residuals=tuple(float(v) for v in residual),
        noise_from="repeats in the group" if noise is not None else None,
        carriers=_carriers([r.id for r in runs], per_run[:, 0]),
        scale=scale,
        implied=True,
    )


def iteration_contributors(runs: list[RunRow], n_suite: int) -> list[Contributor]:
    """Every term of `ITERATION_QUANTITIES` within every configuration group of the runs measured at iteration
    level (`runs`: those with a predicted breakdown and no events); `n_suite`: the runs the suite's MAPE is over."""
    runs = [r for r in runs if not r.real_metrics.has_events and r.breakdown_ms is not None]
    if not runs:
        return []
    contributors = []
    for (dimension, group), (indices, aliases) in _groupings([configuration_groups(r.spec) for r in runs]).items():
        members = [runs[i] for i in indices]
        for quantity in ITERATION_QUANTITIES:
            found = _contributor(quantity, dimension, group, aliases, members, n_suite)
            if found is not None:
                contributors.append(found)
    return contributors


def pricing_sample(runs: list[RunRow]) -> list[RunRow]:
    """The first iteration-level run of every configuration group: each group has a member whose terms are nudged
    (`research.pricing`), so that a parameter's `applies` is found on a few runs, not all."""
    chosen: dict[str, RunRow] = {}
    seen: set[tuple[str, str]] = set()
    for run in runs:
        if run.real_metrics.has_events or run.breakdown_ms is None:
            continue
        for key in configuration_groups(run.spec).items():
            if key not in seen:
                seen.add(key)
                chosen.setdefault(run.id, run)
    return list(chosen.values())


def measured_terms(spec, model) -> dict[tuple[str, int | None], tuple[float, ...]]:
    """`predicted_terms` in the form `research.pricing.pricing` compares."""
    return {(quantity, None): (value,) for quantity, value in predicted_terms(spec, model).items()}
