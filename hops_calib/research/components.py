"""Component errors: a model's per-task costs against the parts a trace measures directly (train split).

Throughput and bubble judge the whole simulated run; a term's parameters are
better identified by the quantities the term itself prices. A trace measures,
per stage, the median forward and backward time of a microbatch and the
optimizer step, and per iteration the silent stretch before the optimizer and
the rest before the next iteration (means over iterations). The
model prices the same quantities in the `Pipeline` it builds from the spec, with
no simulation needed. `mispriced_time_pct` is what `tune --objective
components` minimizes: per run, the time the model misprices over an iteration
(each quantity's |error| times how often it occurs: a stage's forward and
backward once per microbatch, its optimizer once, the silent stretch and the
rest once on every rank) as a share of the measured time of those same
quantities, averaged over runs. Weighting by time keeps a 3 ms gap from
counting as much as a 300 ms one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hops_calib.metrics import timeline_iteration_part_series
from hops_calib.sim.pipeline import Pipeline
from hops_calib.timeline import FORWARD

KINDS = ("forward", "backward", "optimizer", "silent", "rest")


@dataclass(frozen=True)
class Components:
    """Named quantities of one run (ms): 'forward/<stage>', 'backward/<stage>', 'optimizer/<stage>', 'silent', 'rest'."""

    values: dict[str, float]


def real_components(fixture, timeline=None, series=None) -> Components:
    """The measured quantities of a fixture (reads its events once, for the between-iteration parts).

    `timeline`: the fixture's `timeline()`, when the caller has built it already; `series`: its
    `timeline_iteration_part_series`, likewise (then the timeline is not needed).
    """
    truth = fixture.truth
    values: dict[str, float] = {}
    if fixture.kind != "events":  # measured per iteration (a log's, a table's): no per-stage phases to fit
        return Components(values)
    for stage in range(fixture.spec.pp):
        forward = truth.phase_median_ms(stage, FORWARD)
        backward = truth.backward_median_ms(stage)
        optimizer = truth.optimizer_ms_per_stage[stage] if stage < len(truth.optimizer_ms_per_stage) else None
        for kind, value in (("forward", forward), ("backward", backward), ("optimizer", optimizer)):
            if value is not None and value > 0:
                values[f"{kind}/{stage}"] = float(value)
    # Means over iterations, not the median iteration's parts: a model prices expected values (a stall that
    # hits one iteration in seven adds a seventh of itself), and the gate's window throughput averages them all.
    if series is None:
        series = timeline_iteration_part_series(fixture.timeline() if timeline is None else timeline)
    between = series.mean_between_iterations() if series is not None else None
    if between is not None:
        values["silent"], values["rest"] = between
    return Components(values)


def predicted_components(pipeline: Pipeline, schedule: str | None = None) -> Components:
    """The same quantities as the model prices them (per rank: the mean over its model chunks; where ranks share
    cores, what the simulation of `schedule` serves them: `hops_calib.model.predict.stage_phase_ms`)."""
    from hops_calib.model.predict import stage_phase_ms

    result = None
    if pipeline.shares_cores:
        from hops_calib.sim import simulate

        if schedule is None:
            raise ValueError("ranks sharing cores: their components come from a simulation; name its schedule")
        result = simulate(pipeline, schedule)
    values = {}
    for row in stage_phase_ms(pipeline, [""] * pipeline.ranks, result):
        values[f"forward/{row.stage}"] = row.forward_ms
        values[f"backward/{row.stage}"] = row.backward_ms
        if row.optimizer_ms is not None:
            values[f"optimizer/{row.stage}"] = row.optimizer_ms
    values["silent"] = pipeline.expected_pre_optimizer_ms
    values["rest"] = pipeline.post_optimizer_ms + max(pipeline.post_optimizer_rank_ms, default=0.0)
    return Components(values)


def component_errors_pct(real: Components, predicted: Components) -> dict[str, float]:
    """Signed percentage error of every quantity the trace measured (a quantity the model does not price is 0 ms)."""
    errors = {}
    for name, measured in real.values.items():
        if measured <= 0:
            continue
        errors[name] = (predicted.values.get(name, 0.0) - measured) / measured * 100.0
    return errors


def occurrences(name: str, microbatches: int, pp: int) -> int:
    """How often a quantity occurs in one iteration, over all ranks."""
    kind = name.split("/")[0]
    return microbatches if kind in ("forward", "backward") else pp if kind in ("silent", "rest") else 1


def mispriced_time_pct(
    reals: list[Components], predicted: list[Components], microbatches: list[int], pps: list[int]
) -> float:
    """Mean over runs of the share of measured time the model misprices (see the module docstring)."""
    shares = []
    for real, pred, m, pp in zip(reals, predicted, microbatches, pps):
        measured = mispriced = 0.0
        for name, value in real.values.items():
            if value <= 0:
                continue
            count = occurrences(name, m, pp)
            measured += count * value
            mispriced += count * abs(pred.values.get(name, 0.0) - value)
        if measured > 0:
            shares.append(mispriced / measured * 100.0)
    return float(np.mean(shares)) if shares else float("nan")
