"""Prediction: a Spec and a Model in, a simulated run and its metrics out. Never a fixture, never events (rule 1).

`predict` checks the types of what it is handed, so the boundary is structural:
a Fixture (which carries the truth and the events) is refused, not unpacked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hops_calib.model import Model
from hops_calib.spec import Spec
from hops_calib.timeline import BACKWARD, FORWARD, OPTIMIZER

if TYPE_CHECKING:
    from hops_calib.metrics import TimelineMetrics
    from hops_calib.sim.pipeline import Pipeline
    from hops_calib.sim.simulate import SimResult


STALL_RANGE_LEVEL = 0.9  # the share of real runs `Prediction.stall_throughput_range` is printed for


class StallRange(NamedTuple):
    """Throughput (per s) between which `share` of real runs would fall from random stalls alone."""

    low_per_s: float
    high_per_s: float
    share: float

    def text(self) -> str:
        return f"{self.low_per_s:.3f}-{self.high_per_s:.3f} /s for {100 * self.share:.0f} % of runs"


@dataclass(frozen=True)
class StagePhaseMs:
    """Predicted per-microbatch compute time of one rank (mean over its model chunks when interleaved)."""

    stage: int
    device: str
    forward_ms: float
    backward_ms: float
    optimizer_ms: float | None  # None when the model has no optimizer step


@dataclass(frozen=True)
class Prediction:
    run_id: str
    schedule: str
    model_sha256: str
    pipeline: Pipeline
    result: SimResult
    metrics: TimelineMetrics

    def _stall_counts(self) -> tuple[list[float], int] | None:
        """The chances of K = 0..N-1 stalls in the throughput window (Binomial(N - 1, p)) and the placed count;
        None when the prediction has no random stall."""
        from hops_calib.sim.simulate import stalls_in_window

        pipeline, window = self.pipeline, self.metrics.window_ms
        chances = pipeline.iterations - 1
        if pipeline.stall_ms <= 0 or pipeline.stall_probability <= 0 or chances < 1 or not window > 0:
            return None
        p = pipeline.stall_probability
        # Binomial(chances, p) by hand: scipy.stats would add half a second to every evaluate's start-up.
        pmf = [math.comb(chances, k) * p**k * (1 - p) ** (chances - k) for k in range(chances + 1)]
        return pmf, stalls_in_window(pipeline)

    @property
    def stall_noise_ape_pct(self) -> float:
        """The |throughput error| (%) to expect of this prediction from the random stalls alone.

        A stall (`Pipeline.stall_ms`, chance `stall_probability` per iteration) either happens or not: of
        the N - 1 pre-optimizer stretches inside the throughput window (the last iteration's comes after
        it) a real run has K ~ Binomial(N - 1, p) stalls where the simulation placed k0, so even a model
        exact in everything else is off by |K - k0| x stall / window. Its expectation is the noise floor
        of the run's throughput error: a suite's mean of it is the MAPE below which no deterministic
        model can go, computed from the configuration alone (no trace is read).
        """
        counts = self._stall_counts()
        if counts is None:
            return 0.0
        pmf, placed = counts
        expected_miss = sum(chance * abs(k - placed) for k, chance in enumerate(pmf))
        return expected_miss * self.pipeline.stall_ms / self.metrics.window_ms * 100.0

    def stall_throughput_range(self, level: float = STALL_RANGE_LEVEL) -> StallRange:
        """The window throughput (per s) real runs of this configuration would show from the random stalls alone,
        the model exact otherwise: K ~ Binomial(N - 1, p) stalls in the window in place of the k0 the simulation
        placed lengthen (or shorten) it by (K - k0) x stall. The range is the central interval of K holding at
        least `level` of the runs; K being whole, it holds `share` >= `level` of them (at p ~ 0.15 and ~17
        iterations its fast end is a run with no stall). Without random stalls: the prediction, all runs."""
        if not 0 < level < 1:
            raise ValueError(f"level = {level}: a probability strictly between 0 and 1")
        throughput, window = self.metrics.throughput_per_s, self.metrics.window_ms
        counts = self._stall_counts()
        if counts is None:
            return StallRange(throughput, throughput, 1.0)
        pmf, placed = counts
        cumulative = list(itertools.accumulate(pmf))

        def quantile(q: float) -> int:
            return next((k for k, c in enumerate(cumulative) if c >= q - 1e-12), len(pmf) - 1)

        tail = (1.0 - level) / 2.0
        fewest, most = quantile(tail), quantile(1.0 - tail)

        def at(stalls: int) -> float:
            return throughput * window / (window + (stalls - placed) * self.pipeline.stall_ms)

        return StallRange(at(most), at(fewest), sum(pmf[fewest : most + 1]))

    def phase_ms(self, spec: Spec) -> dict[tuple[str, int | None], float]:
        """The predicted durations an agent checks a hypothesis on, keyed (quantity, stage; None for the iteration):
        each stage's forward, backward (per microbatch) and optimizer step, and the iteration's parts (span, silent
        stretch, optimizer, rest: medians over iterations, as observe compares them) with each part's mean over
        iterations as `PART.mean` (a random stall placed in some iterations moves it, not the median)."""
        values: dict[tuple[str, int | None], float] = {}
        for row in self.stage_phase_ms(spec):
            values[("forward", row.stage)] = row.forward_ms
            values[("backward", row.stage)] = row.backward_ms
            if row.optimizer_ms is not None:
                values[("optimizer", row.stage)] = row.optimizer_ms
        parts, series = self.result.iteration_parts(), self.result.iteration_part_series()
        for part, value in parts.as_dict().items() if parts is not None else ():
            values[(part, None)] = float(value)
            every = getattr(series, f"{part}_ms", None) if series is not None else None
            if every is not None and len(every):
                values[(f"{part}.mean", None)] = float(every.mean())
        return values

    def stage_phase_ms(self, spec: Spec) -> list[StagePhaseMs]:
        return stage_phase_ms(self.pipeline, spec.devices, self.result)


def stage_phase_ms(pipeline: Pipeline, devices: Sequence[str], result: SimResult | None = None) -> list[StagePhaseMs]:
    """Each rank's predicted forward, backward and optimizer step: its costs (the mean over its model chunks), or
    where ranks share cores the median of what the simulation served (`result`, required then: a task's time
    there depends on what its core mates run meanwhile)."""
    ranks, rows = pipeline.ranks, []
    shared = pipeline.shares_cores
    if shared and result is None:
        raise ValueError("ranks sharing cores: their phase times come from the simulation; pass its result")
    for rank in range(ranks):
        chunks = pipeline.stages[rank::ranks]
        forward = sum(c.forward_ms for c in chunks) / len(chunks)
        backward = sum(c.backward_ms for c in chunks) / len(chunks)
        optimizer = pipeline.optimizer_ms[rank] if pipeline.optimizer_ms else None
        if shared and result is not None:  # (result is given where ranks share cores: checked above)
            forward = result.served_ms(rank, FORWARD) or forward
            backward = result.served_ms(rank, BACKWARD) or backward
            optimizer = result.served_ms(rank, OPTIMIZER) if optimizer is not None else None
        rows.append(
            StagePhaseMs(
                stage=rank, device=devices[rank], forward_ms=forward, backward_ms=backward, optimizer_ms=optimizer
            )
        )
    return rows


class ScheduleError(ValueError):
    """The pipeline a model priced cannot be simulated under the schedule asked for (which it names)."""

    def __init__(self, schedule: str, message: str):
        super().__init__(message)
        self.schedule = schedule


def predict(spec: Spec, model: Model, schedule: str | None = None) -> Prediction:
    """Simulate the run `spec` describes with `model`'s costs, under `schedule` (default: the spec's own).

    Takes the spec, never a fixture: a prediction cannot see the answer.
    """
    return predict_schedules(spec, model, (schedule,))[0]


def predict_schedules(spec: Spec, model: Model, schedules: Sequence[str | None]) -> tuple[Prediction, ...]:
    """`predict` under each of `schedules` (None: the spec's own): the model prices the spec once, each schedule
    simulates it.

    A ValueError when the model cannot price the spec; a ScheduleError when a schedule cannot run it.
    """
    if not isinstance(spec, Spec):
        raise TypeError(
            f"predict takes a Spec (what is known before the run), not a {type(spec).__name__}; "
            "pass fixture.spec, never the fixture or its events"
        )
    if not isinstance(model, Model):
        raise TypeError(f"predict takes a Model, not a {type(model).__name__}")
    from hops_calib.sim import simulate

    pipeline = model.pipeline(spec)
    predictions = []
    for schedule in schedules:
        schedule = schedule or spec.schedule
        try:
            result = simulate(pipeline, schedule)
        except ValueError as error:
            raise ScheduleError(schedule, str(error)) from None
        predictions.append(
            Prediction(
                run_id=spec.run_id,
                schedule=result.schedule,
                model_sha256=model.sha256,
                pipeline=pipeline,
                result=result,
                metrics=result.metrics(),
            )
        )
    return tuple(predictions)
