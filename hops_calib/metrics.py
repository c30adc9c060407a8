"""One metrics function for real and simulated timelines (rule 3: both sides measured alike).

Definitions are those of HOPS (../shared/docs/megatron-trace-format.md), so the
numbers compare side by side with the published simulator:

- throughput = completed microbatches / (last stage-0 backward end - first event start);
  a microbatch completes when its last backward interval on stage 0 ends;
- per-stage utilization = merged compute intervals of the stage / makespan over all stages
  (transfers excluded; makespan = last end - first start over every interval);
- bubble ratio = 1 - mean per-stage utilization.

Beside them, the iteration period (first event of iteration i+1 minus first event
of iteration i) and steady throughput = microbatches per iteration / median period.

Throughput, for both kinds of fixture, is microbatches of one pipeline completed per second over the
measured window (`throughput_per_s`). A run with events is measured over the HOPS window above; a run
measured at iteration level (a training log, a run table: `IterationMetrics`) over the whole iterations it
kept, which are the steady state (warm-up dropped), so its throughput is microbatches per iteration /
iteration time, and a prediction of it is the simulated steady throughput. Bubble and utilization exist
only where there are events.

Samples per second (what a training log's own figures count) follow from it: each microbatch of one pipeline
is `micro_batch_size` samples on each of the `data_parallel_size` replicas (global batch = microbatches x micro
batch x data parallel), so samples/s = throughput x micro batch size x data parallel size (`samples_per_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hops_calib.timeline import BACKWARD_PHASES, COMPUTE, OPTIMIZER

if TYPE_CHECKING:  # the functions read a frame's columns; the simulator's metrics need no pandas
    import pandas as pd


@dataclass(frozen=True)
class TimelineMetrics:
    throughput_per_s: float  # window definition (HOPS)
    steady_throughput_per_s: float  # microbatches per iteration / median iteration period
    bubble_ratio: float
    utilization_per_stage: tuple[float, ...]
    makespan_ms: float
    window_ms: float  # first event start -> last stage-0 backward end
    completed_microbatches: int
    iteration_periods_ms: tuple[float, ...]
    iteration_time_ms: float  # median iteration period (window / iterations when only one iteration)
    has_events: ClassVar[bool] = True  # bubble and per-stage utilization are measured

    def to_dict(self) -> dict[str, object]:
        return {
            "throughput_per_s": self.throughput_per_s,
            "steady_throughput_per_s": self.steady_throughput_per_s,
            "bubble_ratio": self.bubble_ratio,
            "utilization_per_stage": list(self.utilization_per_stage),
            "makespan_ms": self.makespan_ms,
            "window_ms": self.window_ms,
            "completed_microbatches": self.completed_microbatches,
            "iteration_periods_ms": list(self.iteration_periods_ms),
            "iteration_time_ms": self.iteration_time_ms,
        }


@dataclass(frozen=True)
class IterationMetrics:
    """What a run measured at iteration level gives (no events: no bubble, no per-stage utilization).

    `iteration_periods_ms` are the kept log intervals' mean iteration times, each over
    `interval_iterations[k]` iterations (Megatron averages over --log-interval); a table row gives one.
    """

    microbatches_per_iteration: int  # of one pipeline: global batch / (micro batch x data parallel)
    iteration_periods_ms: tuple[float, ...]
    interval_iterations: tuple[int, ...]
    # Megatron's logged timers where the run logged them (`IterationTruth.timers_ms`), scored by loop/timers.py
    timers_ms: dict[str, dict[str, float]] | None = field(default=None, compare=False, hash=False)
    has_events: ClassVar[bool] = False
    bubble_ratio: ClassVar[None] = None
    utilization_per_stage: ClassVar[tuple[float, ...]] = ()

    @property
    def iteration_time_ms(self) -> float:
        """Median of the logged iteration times."""
        return float(np.median(self.iteration_periods_ms))

    @property
    def window_ms(self) -> float:
        """The time of every kept iteration."""
        return float(np.dot(self.iteration_periods_ms, self.interval_iterations))

    @property
    def completed_microbatches(self) -> int:
        return int(self.microbatches_per_iteration * sum(self.interval_iterations))

    @property
    def throughput_per_s(self) -> float:
        """Microbatches completed over the kept iterations per second (their window)."""
        return self.completed_microbatches / (self.window_ms / 1e3)

    @property
    def steady_throughput_per_s(self) -> float:
        return self.microbatches_per_iteration / (self.iteration_time_ms / 1e3)

    def to_dict(self) -> dict[str, object]:
        return {
            "microbatches_per_iteration": self.microbatches_per_iteration,
            "iteration_periods_ms": list(self.iteration_periods_ms),
            "interval_iterations": list(self.interval_iterations),
            "throughput_per_s": self.throughput_per_s,
            "steady_throughput_per_s": self.steady_throughput_per_s,
            "iteration_time_ms": self.iteration_time_ms,
            "window_ms": self.window_ms,
        }


THROUGHPUT_UNIT = "microbatches of one pipeline per second"


def samples_per_s(throughput_per_s: float | None, micro_batch_size: int, data_parallel_size: int = 1) -> float | None:
    """Samples per second of a throughput in microbatches of one pipeline per second (module docstring)."""
    if throughput_per_s is None:
        return None
    return float(throughput_per_s) * int(micro_batch_size) * int(data_parallel_size or 1)


def comparable_throughputs(
    real: TimelineMetrics | IterationMetrics, predicted: TimelineMetrics
) -> tuple[float, float, float, float]:
    """(real, predicted) throughput and (real, predicted) steady throughput of a run, each pair measured alike:
    a run with events over the HOPS window on both sides; a run measured at iteration level over whole
    steady-state iterations, so its prediction is the simulated steady throughput (module docstring)."""
    if real.has_events:
        return (
            real.throughput_per_s,
            predicted.throughput_per_s,
            real.steady_throughput_per_s,
            predicted.steady_throughput_per_s,
        )
    return (
        real.throughput_per_s,
        predicted.steady_throughput_per_s,
        real.steady_throughput_per_s,
        predicted.steady_throughput_per_s,
    )


def merged_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of intervals [start, end)."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # A new merged block begins where an interval starts after everything before it ended.
    new_block = np.empty(len(starts), dtype=bool)
    new_block[0] = True
    new_block[1:] = starts[1:] > reach[:-1]
    block_id = np.cumsum(new_block) - 1
    block_start = starts[new_block]
    block_end = np.zeros(block_id[-1] + 1)
    np.maximum.at(block_end, block_id, ends)
    return float(np.sum(block_end - block_start))


def timeline_metrics(timeline: pd.DataFrame, microbatches_per_iteration: int, pp: int | None = None) -> TimelineMetrics:
    """Throughput, bubble, utilization and iteration periods of a timeline (real or simulated).

    `pp` is the number of stages; stages with no compute count as 0 % utilized.
    """
    if timeline.empty:
        raise ValueError("cannot compute metrics of an empty timeline")
    return column_metrics(
        stage=timeline["stage"].to_numpy(),
        iteration=timeline["iteration"].to_numpy(),
        microbatch=timeline["microbatch"].to_numpy(),
        is_compute=(timeline["kind"] == COMPUTE).to_numpy(dtype=bool),
        is_backward=timeline["phase"].isin(BACKWARD_PHASES).to_numpy(dtype=bool),
        start_ms=timeline["start_ms"].to_numpy(dtype=np.float64),
        end_ms=timeline["end_ms"].to_numpy(dtype=np.float64),
        microbatches_per_iteration=microbatches_per_iteration,
        pp=pp,
    )


def column_metrics(
    stage: np.ndarray,
    iteration: np.ndarray,
    microbatch: np.ndarray,
    is_compute: np.ndarray,
    is_backward: np.ndarray,
    start_ms: np.ndarray,
    end_ms: np.ndarray,
    microbatches_per_iteration: int,
    pp: int | None = None,
) -> TimelineMetrics:
    """`timeline_metrics` on a timeline's columns as arrays (the simulator's path: no DataFrame to build)."""
    if len(start_ms) == 0:
        raise ValueError("cannot compute metrics of an empty timeline")
    t0 = float(start_ms.min())
    makespan = float(end_ms.max()) - t0

    n_stages = pp if pp is not None else int(stage.max()) + 1
    busy = np.zeros(n_stages)
    compute_stage = stage[is_compute]
    for s in np.unique(compute_stage):
        of_stage = is_compute & (stage == s)
        busy[int(s)] = merged_length(start_ms[of_stage], end_ms[of_stage])
    utilization = busy / makespan if makespan > 0 else np.zeros(n_stages)

    # A microbatch completes when its last backward interval on stage 0 ends.
    stage0_backward = is_compute & is_backward & (stage == 0)
    completed = (
        len(np.unique(np.stack([iteration[stage0_backward], microbatch[stage0_backward]]), axis=1)[0])
        if stage0_backward.any()
        else 0
    )
    window = float(end_ms[stage0_backward].max()) - t0 if completed else float("nan")
    throughput = completed / (window / 1e3) if window and window > 0 else float("nan")

    iterations, first_row = np.unique(iteration, return_inverse=True)
    first_by_iteration = np.full(len(iterations), np.inf)
    np.minimum.at(first_by_iteration, first_row, start_ms)
    periods = np.diff(first_by_iteration)
    iteration_time = float(np.median(periods)) if len(periods) else window
    steady = microbatches_per_iteration / (iteration_time / 1e3) if iteration_time > 0 else float("nan")

    return TimelineMetrics(
        throughput_per_s=float(throughput),
        steady_throughput_per_s=float(steady),
        bubble_ratio=float(1.0 - utilization.mean()),
        utilization_per_stage=tuple(float(u) for u in utilization),
        makespan_ms=makespan,
        window_ms=window,
        completed_microbatches=int(completed),
        iteration_periods_ms=tuple(float(p) for p in periods),
        iteration_time_ms=iteration_time,
    )


# --- where an iteration's time goes (the observe step) ---------------------------------------------


@dataclass(frozen=True)
class IterationParts:
    """An iteration period cut into four consecutive parts (ms); they add up to `iteration_ms` exactly.

    - span: first event of the iteration -> last backward end on any rank (the pipeline itself);
    - silent: -> first optimizer start on any rank (gradient reductions, norms, logging: no rank traces it);
    - optimizer: -> last optimizer end on any rank;
    - rest: -> first event of the next iteration (negative when a rank starts it before the slowest
      optimizer ends).

    An iteration with no optimizer events (`optimizer_traced` False) has optimizer = rest = 0: the
    silent stretch runs to the next iteration.
    """

    span_ms: float
    silent_ms: float
    optimizer_ms: float
    rest_ms: float
    iterations: tuple[int, ...]  # the median iteration(s) these parts come from (two when averaged)
    optimizer_traced: bool

    NAMES = ("span", "silent", "optimizer", "rest")

    @property
    def iteration_ms(self) -> float:
        return self.span_ms + self.silent_ms + self.optimizer_ms + self.rest_ms

    def as_dict(self) -> dict[str, float]:
        """Part name -> ms, in the order of NAMES."""
        return {name: getattr(self, f"{name}_ms") for name in self.NAMES}

    def to_dict(self) -> dict[str, object]:
        return {
            **{f"{name}_ms": value for name, value in self.as_dict().items()},
            "iteration_ms": self.iteration_ms,
            "iterations": list(self.iterations),
            "optimizer_traced": self.optimizer_traced,
        }


def column_iteration_parts(
    iteration: np.ndarray,
    is_compute: np.ndarray,
    is_backward: np.ndarray,
    is_optimizer: np.ndarray,
    start_ms: np.ndarray,
    end_ms: np.ndarray,
) -> IterationParts | None:
    """The parts of the median iteration (None with fewer than two iterations: no period to cut).

    Iterations are ordered by period (first event to the next iteration's first event, as in
    `column_metrics`); the parts are those of the middle one, or the mean of the two middle ones for
    an even count, so they add up to exactly the median period, `TimelineMetrics.iteration_time_ms`.
    Taking one whole iteration rather than each part's own median keeps that sum exact.
    """
    series = column_iteration_part_series(iteration, is_compute, is_backward, is_optimizer, start_ms, end_ms)
    if series is None:
        return None
    periods = series.periods_ms
    order = np.argsort(periods, kind="stable")
    middle = order[[(len(order) - 1) // 2, len(order) // 2]]
    middle = middle[:1] if middle[0] == middle[1] else middle
    return IterationParts(
        span_ms=float(series.span_ms[middle].mean()),
        silent_ms=float(series.silent_ms[middle].mean()),
        optimizer_ms=float(series.optimizer_ms[middle].mean()),
        rest_ms=float(series.rest_ms[middle].mean()),
        iterations=tuple(int(series.iterations[i]) for i in middle),
        optimizer_traced=bool(series.optimizer_traced[middle].all()),
    )


@dataclass(frozen=True)
class IterationPartSeries:
    """The four parts of every iteration but the last (which has no next one to end it), as arrays."""

    iterations: np.ndarray
    periods_ms: np.ndarray
    span_ms: np.ndarray
    silent_ms: np.ndarray
    optimizer_ms: np.ndarray
    rest_ms: np.ndarray
    optimizer_traced: np.ndarray  # bool per iteration

    def mean_between_iterations(self) -> tuple[float, float] | None:
        """Mean silent stretch and rest over the iterations with an optimizer step (None without any)."""
        traced = self.optimizer_traced
        if not traced.any():
            return None
        return float(self.silent_ms[traced].mean()), float(self.rest_ms[traced].mean())


def column_iteration_part_series(
    iteration: np.ndarray,
    is_compute: np.ndarray,
    is_backward: np.ndarray,
    is_optimizer: np.ndarray,
    start_ms: np.ndarray,
    end_ms: np.ndarray,
) -> IterationPartSeries | None:
    """Every iteration's parts (see `IterationParts`); None with fewer than two iterations."""
    numbers, row_of = np.unique(iteration, return_inverse=True)
    if len(numbers) < 2:
        return None
    n = len(numbers)

    def reduce(mask: np.ndarray, values: np.ndarray, fill: float, reducer) -> np.ndarray:
        out = np.full(n, fill)
        reducer.at(out, row_of[mask], values[mask])
        return out

    everything = np.ones(len(start_ms), dtype=bool)
    first = reduce(everything, start_ms, np.inf, np.minimum)
    last_backward = reduce(is_compute & is_backward, end_ms, -np.inf, np.maximum)
    optimizer = is_compute & is_optimizer
    first_optimizer = reduce(optimizer, start_ms, np.inf, np.minimum)
    last_optimizer = reduce(optimizer, end_ms, -np.inf, np.maximum)
    traced = np.isfinite(first_optimizer)
    # Iterations without a backward have no pipeline end; the span then covers nothing.
    last_backward = np.where(np.isfinite(last_backward), last_backward, first)

    next_first = first[1:]
    return IterationPartSeries(
        iterations=numbers[:-1],
        periods_ms=np.diff(first),
        span_ms=last_backward[:-1] - first[:-1],
        silent_ms=np.where(traced[:-1], first_optimizer[:-1], next_first) - last_backward[:-1],
        optimizer_ms=np.where(traced[:-1], last_optimizer[:-1] - first_optimizer[:-1], 0.0),
        rest_ms=np.where(traced[:-1], next_first - last_optimizer[:-1], 0.0),
        optimizer_traced=traced[:-1],
    )


def timeline_iteration_parts(timeline: pd.DataFrame) -> IterationParts | None:
    """`column_iteration_parts` of a timeline frame (a real run's, or a simulated one's)."""
    return column_iteration_parts(**_part_columns(timeline))


def timeline_iteration_part_series(timeline: pd.DataFrame) -> IterationPartSeries | None:
    """`column_iteration_part_series` of a timeline frame."""
    return column_iteration_part_series(**_part_columns(timeline))


def _part_columns(timeline: pd.DataFrame) -> dict[str, np.ndarray]:
    return dict(
        iteration=timeline["iteration"].to_numpy(),
        is_compute=(timeline["kind"] == COMPUTE).to_numpy(dtype=bool),
        is_backward=timeline["phase"].isin(BACKWARD_PHASES).to_numpy(dtype=bool),
        is_optimizer=(timeline["phase"] == OPTIMIZER).to_numpy(dtype=bool),
        start_ms=timeline["start_ms"].to_numpy(dtype=np.float64),
        end_ms=timeline["end_ms"].to_numpy(dtype=np.float64),
    )


def schedule_bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The schedule's own bubble on balanced stages with free transfers, (p-1)/(v m+p-1): 1F1B and GPipe at v = 1,
    interleaved 1F1B over v model chunks. Not what a trace measures (`TimelineMetrics.bubble_ratio`, the idle share,
    which also holds unbalanced stages, transfers and the silent stretch before the optimizer)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)
