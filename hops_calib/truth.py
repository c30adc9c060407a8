"""Truth room: what a real run measured, computed from a fixture's events.

Everything here is a function of the events alone (the spec is not consulted),
and the headline metrics come from the one metrics function shared with the
simulator (`hops_calib.metrics.timeline_metrics`), so real and predicted runs
are measured alike (rule 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from hops_calib import timeline as tl
from hops_calib.metrics import IterationMetrics, TimelineMetrics, timeline_metrics

if TYPE_CHECKING:  # imported where events become a frame: a fixture's stored truth (`Truth.from_dict`) needs none
    import pandas as pd

# Normalized events as stored in a fixture (one row per logged event, sorted by stage then start).
EVENT_COLUMNS = (
    "stage",
    "rank",
    "chunk",
    "iteration",
    "microbatch",
    "kind",
    "phase",
    "start_ns",
    "end_ns",
    "peer_stage",
)
CATEGORIES = {"kind": tl.KINDS, "phase": tl.PHASES}  # the event columns stored as categoricals, and their names


@cache
def category_dtype(column: str) -> pd.CategoricalDtype:
    """The categorical dtype of the event column `column` ('kind' or 'phase')."""
    import pandas as pd

    return pd.CategoricalDtype(list(CATEGORIES[column]))


@dataclass(frozen=True)
class PhaseStats:
    """Duration statistics of one phase's compute intervals on one stage, in ms."""

    stage: int
    phase: str
    count: int
    median_ms: float
    mean_ms: float
    p10_ms: float
    p90_ms: float


@dataclass(frozen=True)
class KernelStats:
    """Durations of one kernel (a GPU trace: device time) or operator (a CPU trace: the operator's self time) with
    one input shape, on one stage in one phase, over the traced iterations, in ms."""

    stage: int
    phase: str  # FORWARD, BACKWARD, OPTIMIZER, or OTHER (outside every schedule and optimizer step)
    kernel_class: (
        str  # gemm, attention, softmax, norm, elementwise, communication, memcpy, optimizer, ... (trace.profile)
    )
    name: str
    shape: str | None  # the launching operator's `Input Dims` as JSON; None where the trace recorded none
    count: int
    per_iteration_ms: float  # total over the traced iterations / their number
    median_ms: float | None  # None on the '(other kernels)' rows, which sum many kernels
    mean_ms: float
    source: str  # "gpu_kernel" or "cpu_op"


MAX_KERNEL_ROWS = 2000  # (stage, phase, kernel, shape) rows kept, by total time; the rest are summed per class


@dataclass(frozen=True)
class Truth:
    metrics: TimelineMetrics
    observed_schedule: str  # from the order of compute events per stage and iteration
    # Fraction of (stage, iteration) event orders that are exactly the observed schedule's order
    # (None for schedules whose order is recognised by its phases or chunks alone).
    schedule_agreement: float | None
    microbatches: int  # per iteration, as logged on stage 0
    iterations: tuple[int, ...]  # Megatron's iteration numbers in the trace
    phase_stats: tuple[PhaseStats, ...]
    # Per iteration, the silent stretch before the optimizer step: first OPTIMIZER start (any rank) minus
    # the last backward end (over all ranks). No rank logs anything in it (gradient reductions, norms,
    # loss and logging run there); None where an iteration has no optimizer events.
    idle_ms_per_iteration: tuple[float | None, ...]
    optimizer_ms_per_stage: tuple[float | None, ...]  # median OPTIMIZER duration per stage
    t0_ns: int  # wall-clock epoch of the timeline's 0 ms (earliest event start)
    # Per-kernel truth, from a profiler trace (Kineto, Nsight Systems): () for a run ingested from event logs
    kernels: tuple[KernelStats, ...] = ()
    kind = "events"

    @property
    def idle_ms(self) -> float | None:
        """Median inter-iteration idle stretch (None when no iteration has an optimizer step)."""
        values = [v for v in self.idle_ms_per_iteration if v is not None]
        return float(np.median(values)) if values else None

    def phase_median_ms(self, stage: int, phase: str) -> float | None:
        for stats in self.phase_stats:
            if stats.stage == stage and stats.phase == phase:
                return stats.median_ms
        return None

    def backward_median_ms(self, stage: int) -> float | None:
        """Median backward of a stage: BACKWARD, or BACKWARD_B + BACKWARD_W where zero-bubble split it."""
        whole = self.phase_median_ms(stage, tl.BACKWARD)
        if whole is not None:
            return whole
        b, w = (self.phase_median_ms(stage, phase) for phase in (tl.BACKWARD_B, tl.BACKWARD_W))
        return None if b is None or w is None else b + w

    def to_dict(self) -> dict[str, Any]:
        return {
            "metrics": self.metrics.to_dict(),
            "observed_schedule": self.observed_schedule,
            "schedule_agreement": self.schedule_agreement,
            "microbatches": self.microbatches,
            "iterations": list(self.iterations),
            "phase_stats": [vars(s) for s in self.phase_stats],
            "idle_ms_per_iteration": list(self.idle_ms_per_iteration),
            "optimizer_ms_per_stage": list(self.optimizer_ms_per_stage),
            "t0_ns": self.t0_ns,
            **({"kernels": [vars(k) for k in self.kernels]} if self.kernels else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Truth:
        metrics = dict(data["metrics"])
        for name in ("utilization_per_stage", "iteration_periods_ms"):
            metrics[name] = tuple(metrics[name])
        return cls(
            metrics=TimelineMetrics(**metrics),
            observed_schedule=data["observed_schedule"],
            schedule_agreement=data.get("schedule_agreement"),
            microbatches=int(data["microbatches"]),
            iterations=tuple(data["iterations"]),
            phase_stats=tuple(PhaseStats(**s) for s in data["phase_stats"]),
            idle_ms_per_iteration=tuple(data["idle_ms_per_iteration"]),
            optimizer_ms_per_stage=tuple(data["optimizer_ms_per_stage"]),
            t0_ns=int(data["t0_ns"]),
            kernels=tuple(KernelStats(**k) for k in data.get("kernels", ())),
        )


@dataclass(frozen=True)
class IterationTruth:
    """What a run measured at iteration level (a training log, a run table row): iteration times, the timers
    where logged, the run's own throughput figures; no events, so no bubble, utilization or schedule."""

    metrics: IterationMetrics
    last_iterations: tuple[int, ...] = ()  # the iteration each kept log interval ends at (logs)
    # Timer -> {"max": ms} / {"min": ms, "max": ms} / {"rank r": ms}: ms per iteration (Megatron's normalizer is
    # --log-interval), median over the kept intervals.
    timers_ms: dict[str, dict[str, float]] | None = None
    timing_log_option: str | None = None
    reported: dict[str, float] | None = None  # as printed: tflops_per_gpu, samples_per_s
    kind = "iteration"

    @property
    def microbatches(self) -> int:
        return self.metrics.microbatches_per_iteration

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "microbatches_per_iteration": self.metrics.microbatches_per_iteration,
            "iteration_periods_ms": list(self.metrics.iteration_periods_ms),
            "interval_iterations": list(self.metrics.interval_iterations),
            "last_iterations": list(self.last_iterations),
            "timers_ms": self.timers_ms or {},
            "timing_log_option": self.timing_log_option,
            "reported": self.reported or {},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IterationTruth:
        metrics = IterationMetrics(
            microbatches_per_iteration=int(data["microbatches_per_iteration"]),
            iteration_periods_ms=tuple(float(v) for v in data["iteration_periods_ms"]),
            interval_iterations=tuple(int(v) for v in data["interval_iterations"]),
            timers_ms=dict(data.get("timers_ms") or {}) or None,
        )
        if not metrics.iteration_periods_ms or len(metrics.iteration_periods_ms) != len(metrics.interval_iterations):
            raise ValueError("iteration times and their interval lengths do not pair up")
        return cls(
            metrics=metrics,
            last_iterations=tuple(int(v) for v in data.get("last_iterations", ())),
            timers_ms=dict(data.get("timers_ms") or {}),
            timing_log_option=data.get("timing_log_option"),
            reported=dict(data.get("reported") or {}),
        )


def compact_timeline(columns: dict[str, np.ndarray], t0_ns: int) -> pd.DataFrame:
    """The timeline's columns and values with narrow dtypes (int32, categoricals), sharing the reader's arrays.

    `compute_truth` gives the same result on it as on `to_timeline` (which
    widens to the timeline contract's int64 and strings); ingest uses it so a
    multi-gigabyte trace fits in memory. Consumes `columns`' start_ns/end_ns
    (they become the ms columns in place).
    """
    import pandas as pd

    data: dict[str, Any] = {name: columns[name] for name in ("stage", "chunk", "iteration", "microbatch")}
    for name in CATEGORIES:
        data[name] = pd.Categorical.from_codes(columns[name], dtype=category_dtype(name))
    for name in ("start", "end"):
        nanoseconds = columns.pop(f"{name}_ns")
        # In place: integer ns relative to t0 are exact; then one float conversion (same values as to_timeline).
        np.subtract(nanoseconds, t0_ns, out=nanoseconds)
        data[f"{name}_ms"] = nanoseconds / 1e6
        del nanoseconds
    data["peer_stage"] = columns["peer_stage"]
    return pd.DataFrame(data, copy=False)


def _as_strings(values: pd.Series) -> pd.api.extensions.ExtensionArray:
    """A categorical column as the timeline's string dtype (a take on the categories: cheaper than astype)."""
    import pandas as pd

    if isinstance(values.dtype, pd.CategoricalDtype):
        names = np.asarray(values.cat.categories, dtype=object)
        return pd.array(names[values.cat.codes.to_numpy()], dtype="string")
    return pd.array(values, dtype="string")


def to_timeline(events: pd.DataFrame, t0_ns: int | None = None) -> pd.DataFrame:
    """Events as a timeline (`hops_calib.timeline`): ms from `t0_ns` (default: the earliest start)."""
    import pandas as pd

    start = events["start_ns"].to_numpy()
    if t0_ns is None:
        t0_ns = int(start.min()) if len(start) else 0
    frame = pd.DataFrame(
        {
            "stage": events["stage"].to_numpy(np.int64),
            "chunk": events["chunk"].to_numpy(np.int64),
            "iteration": events["iteration"].to_numpy(np.int64),
            "microbatch": events["microbatch"].to_numpy(np.int64),
            "kind": _as_strings(events["kind"]),
            "phase": _as_strings(events["phase"]),
            # Subtract in integer ns first: epoch ns do not fit a float64 exactly.
            "start_ms": (start - t0_ns) / 1e6,
            "end_ms": (events["end_ns"].to_numpy() - t0_ns) / 1e6,
            "peer_stage": events["peer_stage"].to_numpy(np.int64),
        }
    )
    return tl.validate(frame)


class _Columns:
    """The timeline's columns as numpy arrays (phases as codes into timeline.PHASES), read once."""

    def __init__(self, timeline: pd.DataFrame) -> None:
        import pandas as pd

        # Native dtypes (int32 on a compact timeline): no widened copies of a multi-million-row table.
        self.stage = timeline["stage"].to_numpy()
        self.chunk = timeline["chunk"].to_numpy()
        self.iteration = timeline["iteration"].to_numpy()
        self.microbatch = timeline["microbatch"].to_numpy()
        self.start = timeline["start_ms"].to_numpy(np.float64)
        self.end = timeline["end_ms"].to_numpy(np.float64)
        self.compute = (timeline["kind"] == tl.COMPUTE).to_numpy(bool)
        self.phase = pd.Categorical(timeline["phase"], categories=list(tl.PHASES)).codes

    def is_phase(self, *names: str) -> np.ndarray:
        return np.isin(self.phase, [tl.PHASES.index(name) for name in names]) & self.compute


def infer_schedule(timeline: pd.DataFrame, pp: int) -> tuple[str, float | None]:
    """The pipeline schedule that ran, from the order of compute events on each stage in each iteration.

    A split backward (BACKWARD_W) means zero-bubble; a second model chunk means
    interleaved 1F1B (its agreement is with Megatron's interleaved order, see
    `megatron_interleaved_order`). Otherwise each (stage, iteration) order of forwards and
    backwards is compared with Megatron's non-interleaved 1F1B (min(p-s-1, m)
    warm-up forwards, then one-forward-one-backward, then the cool-down) and
    with GPipe (all forwards, then all backwards); the schedule matching more
    orders wins, 1F1B on a tie (with m <= p-s-1 on every stage the two orders
    are the same, and 1F1B is Megatron's default). Returns the schedule and
    the fraction of orders it matches.
    """
    return _infer_schedule(_Columns(timeline), pp)


def _infer_schedule(cols: _Columns, pp: int) -> tuple[str, float | None]:
    passes = cols.is_phase(tl.FORWARD, *tl.BACKWARD_PHASES)
    if cols.is_phase(tl.BACKWARD_W).any():
        return "zb_h1", None
    if (cols.chunk[passes] > 0).any():
        return "interleaved_1f1b", _interleaved_agreement(cols, passes, pp)
    if not passes.any():
        return "1f1b", None
    # One stage at a time keeps the temporaries small on multi-million-event traces.
    matches = {"1f1b": 0, "gpipe": 0}
    n_orders = 0
    forward_code = tl.PHASES.index(tl.FORWARD)
    for stage in range(pp):
        rows = np.flatnonzero(passes & (cols.stage == stage))
        if len(rows) == 0:
            continue
        rows = rows[np.lexsort((cols.end[rows], cols.start[rows], cols.iteration[rows]))]
        iteration = cols.iteration[rows]
        is_forward = cols.phase[rows] == forward_code
        del rows
        new_group = np.ones(len(iteration), dtype=bool)
        new_group[1:] = iteration[1:] != iteration[:-1]
        group = np.cumsum(new_group) - 1
        group_start = np.flatnonzero(new_group)
        position = np.arange(len(iteration)) - group_start[group]
        forwards = np.bincount(group, weights=is_forward).astype(np.int64)[group]
        warmup = np.minimum(pp - stage - 1, forwards)
        steady_end = warmup + 2 * (forwards - warmup)
        orders = {
            "1f1b": np.where(
                position < warmup, True, np.where(position < steady_end, (position - warmup) % 2 == 0, False)
            ),
            "gpipe": position < forwards,
        }
        for name, expected in orders.items():
            mismatches = np.bincount(group, weights=expected != is_forward, minlength=len(group_start))
            matches[name] += int(np.count_nonzero(mismatches == 0))
        n_orders += len(group_start)
    agree = {name: count / n_orders for name, count in matches.items()}
    best = "1f1b" if agree["1f1b"] >= agree["gpipe"] else "gpipe"
    return best, agree[best]


def megatron_interleaved_order(
    pp: int, stage: int, microbatches: int, chunks: int, group_size: int | None = None
) -> list[tuple[bool, int]]:
    """(is_forward, model chunk) of each pass on one rank in Megatron-core's interleaved 1F1B.

    As in `forward_backward_pipelining_with_interleaving`: virtual microbatches
    run in groups of `group_size` (default pp) microbatches per chunk; warm-up
    is 2 (pp - stage - 1) + (chunks - 1) group_size forwards, then one forward
    and one backward at a time, then the cool-down backwards; a backward's chunk
    mirrors the forward's (chunks - 1 - chunk).
    """
    group_size = group_size or pp
    table = []
    for first in range(0, microbatches, group_size):
        last = microbatches if first + group_size >= microbatches else first + group_size
        table += [chunk for chunk in range(chunks) for _ in range(first, last)]
    total = microbatches * chunks
    warmup = min(2 * (pp - stage - 1) + (chunks - 1) * group_size, total)
    order = [(True, table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(True, table[warmup + k]), (False, chunks - 1 - table[k])]
    order += [(False, chunks - 1 - table[k]) for k in range(total - warmup, total)]
    return order


def _interleaved_agreement(cols: _Columns, passes: np.ndarray, pp: int) -> float:
    """Fraction of (stage, iteration) pass orders equal to Megatron's interleaved order."""
    chunks = int(cols.chunk[passes].max()) + 1
    forward_code = tl.PHASES.index(tl.FORWARD)
    expected: dict[tuple[int, int], np.ndarray] = {}
    matches = n_orders = 0
    for stage in range(pp):
        rows = np.flatnonzero(passes & (cols.stage == stage))
        rows = rows[np.lexsort((cols.end[rows], cols.start[rows], cols.iteration[rows]))]
        # One code per pass: chunk for a forward, chunks + chunk for a backward.
        codes = cols.chunk[rows] + chunks * (cols.phase[rows] != forward_code)
        bounds = np.flatnonzero(np.diff(cols.iteration[rows])) + 1
        for order in np.split(codes, bounds):
            n_orders += 1
            microbatches = int(np.count_nonzero(order < chunks)) // chunks
            key = (stage, microbatches)
            if key not in expected:
                expected[key] = np.array(
                    [
                        chunk + (0 if forward else chunks)
                        for forward, chunk in megatron_interleaved_order(pp, stage, microbatches, chunks)
                    ]
                )
            matches += bool(np.array_equal(order, expected[key]))
    return matches / n_orders if n_orders else 0.0


def _phase_stats(cols: _Columns, pp: int) -> tuple[PhaseStats, ...]:
    duration = cols.end - cols.start
    stats = []
    for stage in range(pp):
        on_stage = cols.compute & (cols.stage == stage)
        for code, phase in enumerate(tl.PHASES):
            values = duration[on_stage & (cols.phase == code)]
            if len(values) == 0:
                continue
            p10, median, p90 = np.quantile(values, [0.1, 0.5, 0.9])
            stats.append(
                PhaseStats(
                    stage=stage,
                    phase=phase,
                    count=len(values),
                    median_ms=float(median),
                    mean_ms=float(values.mean()),
                    p10_ms=float(p10),
                    p90_ms=float(p90),
                )
            )
    return tuple(stats)


def _idle_per_iteration(cols: _Columns, iterations: np.ndarray) -> tuple[float | None, ...]:
    slot = np.searchsorted(iterations, cols.iteration)
    last_backward = np.full(len(iterations), -np.inf)
    backward = cols.is_phase(*tl.BACKWARD_PHASES)
    np.maximum.at(last_backward, slot[backward], cols.end[backward])
    first_optimizer = np.full(len(iterations), np.inf)
    optimizer = cols.is_phase(tl.OPTIMIZER)
    np.minimum.at(first_optimizer, slot[optimizer], cols.start[optimizer])
    gap = first_optimizer - last_backward
    return tuple(float(g) if np.isfinite(g) else None for g in gap)


def compute_truth(timeline: pd.DataFrame, pp: int, t0_ns: int = 0) -> Truth:
    """The truth summary of a real run's timeline (see `to_timeline`)."""
    cols = _Columns(timeline)
    iterations = np.unique(cols.iteration)
    stage0_forward = cols.is_phase(tl.FORWARD) & (cols.stage == 0)
    pairs = np.unique(np.stack([cols.iteration[stage0_forward], cols.microbatch[stage0_forward]]), axis=1)
    per_iteration = np.unique(pairs[0], return_counts=True)[1]
    microbatches = int(np.median(per_iteration)) if len(per_iteration) else 0
    schedule, agreement = _infer_schedule(cols, pp)
    optimizer = cols.is_phase(tl.OPTIMIZER)
    optimizer_ms = []
    for stage in range(pp):
        durations = (cols.end - cols.start)[optimizer & (cols.stage == stage)]
        optimizer_ms.append(float(np.median(durations)) if len(durations) else None)
    return Truth(
        metrics=timeline_metrics(timeline, microbatches, pp=pp),
        observed_schedule=schedule,
        schedule_agreement=agreement,
        microbatches=microbatches,
        iterations=tuple(int(i) for i in iterations),
        phase_stats=_phase_stats(cols, pp),
        idle_ms_per_iteration=_idle_per_iteration(cols, iterations),
        optimizer_ms_per_stage=tuple(optimizer_ms),
        t0_ns=int(t0_ns),
    )


def kernel_truth(parts: list[Any], iterations: int) -> tuple[KernelStats, ...]:
    """KernelStats of the kernel rows of a run's ranks (`trace.profile.KernelRows`, one per stage), the largest
    MAX_KERNEL_ROWS by total time; the rest summed into one row per (stage, phase, class) named '(other kernels)'."""
    import pandas as pd

    from hops_calib.trace.profile import OTHER_PHASE, kernel_class

    frames = []
    for part in parts:
        if not len(part.duration_ns):
            continue
        names = np.asarray(part.names, dtype=object)
        shapes = np.asarray(part.shapes + [""], dtype=object)
        phase_names = np.asarray(list(tl.PHASES) + [OTHER_PHASE], dtype=object)
        frames.append(
            pd.DataFrame(
                {
                    "stage": part.stage,
                    "phase": phase_names[np.where(part.phase < 0, len(tl.PHASES), part.phase)],
                    "name": names[part.name_id],
                    "shape": shapes[np.where(part.shape_id < 0, len(shapes) - 1, part.shape_id)],
                    "ms": part.duration_ns / 1e6,
                    "source": "gpu_kernel" if part.device else "cpu_op",
                }
            )
        )
    if not frames:
        return ()
    rows = pd.concat(frames, ignore_index=True)
    grouped = rows.groupby(["stage", "phase", "name", "shape", "source"], sort=False)["ms"]
    table = grouped.agg(["count", "sum", "median", "mean"]).reset_index().sort_values("sum", ascending=False)
    table["kernel_class"] = [kernel_class(name) for name in table["name"]]
    kept, rest = table.iloc[:MAX_KERNEL_ROWS], table.iloc[MAX_KERNEL_ROWS:]
    stats = [
        KernelStats(
            stage=int(r.stage),
            phase=str(r.phase),
            kernel_class=str(r.kernel_class),
            name=str(r.name),
            shape=str(r.shape) or None,
            count=int(r.count),
            per_iteration_ms=float(r.sum) / iterations,
            median_ms=float(r.median),
            mean_ms=float(r.mean),
            source=str(r.source),
        )
        for r in kept.itertuples()
    ]
    if len(rest):
        rest = rest.assign(total=rest["sum"])
        for (stage, phase, label, source), group in rest.groupby(["stage", "phase", "kernel_class", "source"]):
            count = int(group["count"].sum())
            stats.append(
                KernelStats(
                    stage=int(stage),
                    phase=str(phase),
                    kernel_class=str(label),
                    name="(other kernels)",
                    shape=None,
                    count=count,
                    per_iteration_ms=float(group["total"].sum()) / iterations,
                    median_ms=None,
                    mean_ms=float(group["total"].sum()) / count,
                    source=str(source),
                )
            )
    return tuple(
        sorted(
            stats, key=lambda k: (k.stage, tl.PHASES.index(k.phase) if k.phase in tl.PHASES else 9, -k.per_iteration_ms)
        )
    )
