"""Truth room: what a real run measured, computed from a fixture's events.

Everything here is a function of the events alone (the spec is not consulted),
and the headline metrics come from the one metrics function shared with the
simulator (`hops_calib.metrics.timeline_metrics`), so real and predicted runs
are measured alike (rule 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from hops_calib import timeline as tl
from hops_calib.metrics import TimelineMetrics, timeline_metrics

# Normalized events as stored in a fixture (one row per logged event, sorted by stage then start).
EVENT_COLUMNS = ("stage", "rank", "chunk", "iteration", "microbatch", "kind", "phase", "start_ns", "end_ns",
                 "peer_stage")
KIND_DTYPE = pd.CategoricalDtype(list(tl.KINDS))
PHASE_DTYPE = pd.CategoricalDtype(list(tl.PHASES))


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
class Truth:
    metrics: TimelineMetrics
    observed_schedule: str  # from the order of compute events per stage and iteration
    # Fraction of (stage, iteration) event orders that are exactly the observed schedule's order
    # (None for schedules whose order is recognised by its phases or chunks alone).
    schedule_agreement: float | None
    microbatches: int  # per iteration, as logged on stage 0
    iterations: tuple[int, ...]  # Megatron's iteration numbers in the trace
    phase_stats: tuple[PhaseStats, ...]
    # Per iteration: max over ranks of (first OPTIMIZER start - last backward end) on that rank, the
    # stretch of gradient reductions and logging no rank traces; None where an iteration has no optimizer.
    idle_ms_per_iteration: tuple[float | None, ...]
    optimizer_ms_per_stage: tuple[float | None, ...]  # median OPTIMIZER duration per stage
    t0_ns: int  # wall-clock epoch of the timeline's 0 ms (earliest event start)

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
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Truth":
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
        )


def events_frame(columns: dict[str, np.ndarray]) -> pd.DataFrame:
    """The fixture's events table from reader columns (kind and phase codes become categoricals)."""
    data: dict[str, Any] = {}
    for name in EVENT_COLUMNS:
        values = columns[name]
        if name == "kind":
            data[name] = pd.Categorical.from_codes(values, dtype=KIND_DTYPE)
        elif name == "phase":
            data[name] = pd.Categorical.from_codes(values, dtype=PHASE_DTYPE)
        else:
            data[name] = values
    return pd.DataFrame(data, copy=False)


def to_timeline(events: pd.DataFrame, t0_ns: int | None = None) -> pd.DataFrame:
    """Events as a timeline (`hops_calib.timeline`): ms from `t0_ns` (default: the earliest start)."""
    start = events["start_ns"].to_numpy()
    if t0_ns is None:
        t0_ns = int(start.min()) if len(start) else 0
    frame = pd.DataFrame({
        "stage": events["stage"].to_numpy(np.int64),
        "chunk": events["chunk"].to_numpy(np.int64),
        "iteration": events["iteration"].to_numpy(np.int64),
        "microbatch": events["microbatch"].to_numpy(np.int64),
        "kind": events["kind"].astype("string"),
        "phase": events["phase"].astype("string"),
        # Subtract in integer ns first: epoch ns do not fit a float64 exactly.
        "start_ms": (start - t0_ns) / 1e6,
        "end_ms": (events["end_ns"].to_numpy() - t0_ns) / 1e6,
        "peer_stage": events["peer_stage"].to_numpy(np.int64),
    })
    return tl.validate(frame)


def infer_schedule(timeline: pd.DataFrame, pp: int) -> tuple[str, float | None]:
    """The pipeline schedule that ran, from the order of compute events on each stage in each iteration.

    A split backward (BACKWARD_W) means zero-bubble; a second model chunk means
    interleaved 1F1B. Otherwise each (stage, iteration) order of forwards and
    backwards is compared with Megatron's non-interleaved 1F1B (min(p-s-1, m)
    warm-up forwards, then one-forward-one-backward, then the cool-down) and
    with GPipe (all forwards, then all backwards); the schedule matching more
    orders wins, 1F1B on a tie (with m <= p-s-1 on every stage the two orders
    are the same, and 1F1B is Megatron's default). Returns the schedule and
    the fraction of orders it matches.
    """
    compute = timeline[(timeline["kind"] == tl.COMPUTE) & (timeline["phase"] != tl.OPTIMIZER)]
    if (compute["phase"] == tl.BACKWARD_W).any():
        return "zb_h1", None
    if (compute["chunk"] > 0).any():
        return "interleaved_1f1b", None
    ordered = compute.sort_values(["stage", "iteration", "start_ms", "end_ms"], kind="stable")
    stage = ordered["stage"].to_numpy()
    iteration = ordered["iteration"].to_numpy()
    is_forward = (ordered["phase"] == tl.FORWARD).to_numpy()
    if len(stage) == 0:
        return "1f1b", None
    new_group = np.ones(len(stage), dtype=bool)
    new_group[1:] = (stage[1:] != stage[:-1]) | (iteration[1:] != iteration[:-1])
    group = np.cumsum(new_group) - 1
    group_start = np.flatnonzero(new_group)
    position = np.arange(len(stage)) - group_start[group]
    forwards = np.bincount(group, weights=is_forward).astype(np.int64)[group]
    warmup = np.minimum(pp - stage - 1, forwards)
    steady_end = warmup + 2 * (forwards - warmup)
    one_f_one_b = np.where(position < warmup, True,
                           np.where(position < steady_end, (position - warmup) % 2 == 0, False))
    gpipe = position < forwards
    n_groups = len(group_start)
    agree = {}
    for name, expected in (("1f1b", one_f_one_b), ("gpipe", gpipe)):
        mismatches = np.bincount(group, weights=expected != is_forward, minlength=n_groups)
        agree[name] = float(np.mean(mismatches == 0))
    best = "1f1b" if agree["1f1b"] >= agree["gpipe"] else "gpipe"
    return best, agree[best]


def _phase_stats(compute: pd.DataFrame) -> tuple[PhaseStats, ...]:
    duration = compute["end_ms"] - compute["start_ms"]
    grouped = duration.groupby([compute["stage"], compute["phase"]], sort=True, observed=True)
    table = pd.DataFrame({
        "count": grouped.size(),
        "median": grouped.median(),
        "mean": grouped.mean(),
        "p10": grouped.quantile(0.1),
        "p90": grouped.quantile(0.9),
    })
    return tuple(
        PhaseStats(stage=int(stage), phase=str(phase), count=int(row["count"]), median_ms=float(row["median"]),
                   mean_ms=float(row["mean"]), p10_ms=float(row["p10"]), p90_ms=float(row["p90"]))
        for (stage, phase), row in table.iterrows()
    )


def _idle_per_iteration(compute: pd.DataFrame, iterations: list[int]) -> tuple[float | None, ...]:
    backward = compute[compute["phase"].isin(tl.BACKWARD_PHASES)]
    optimizer = compute[compute["phase"] == tl.OPTIMIZER]
    last_backward = backward.groupby(["iteration", "stage"])["end_ms"].max()
    first_optimizer = optimizer.groupby(["iteration", "stage"])["start_ms"].min()
    gap = (first_optimizer - last_backward).dropna().groupby(level="iteration").max()
    return tuple(float(gap[i]) if i in gap.index else None for i in iterations)


def compute_truth(timeline: pd.DataFrame, pp: int, t0_ns: int = 0) -> Truth:
    """The truth summary of a real run's timeline (see `to_timeline`)."""
    compute = timeline[timeline["kind"] == tl.COMPUTE]
    iterations = sorted(int(i) for i in timeline["iteration"].unique())
    stage0_forward = compute[(compute["stage"] == 0) & (compute["phase"] == tl.FORWARD)]
    per_iteration = stage0_forward.groupby("iteration")["microbatch"].nunique()
    microbatches = int(per_iteration.median()) if len(per_iteration) else 0
    schedule, agreement = infer_schedule(timeline, pp)
    optimizer = compute[compute["phase"] == tl.OPTIMIZER]
    optimizer_median = (optimizer["end_ms"] - optimizer["start_ms"]).groupby(optimizer["stage"]).median()
    return Truth(
        metrics=timeline_metrics(timeline, microbatches, pp=pp),
        observed_schedule=schedule,
        schedule_agreement=agreement,
        microbatches=microbatches,
        iterations=tuple(iterations),
        phase_stats=_phase_stats(compute),
        idle_ms_per_iteration=_idle_per_iteration(compute, iterations),
        optimizer_ms_per_stage=tuple(float(optimizer_median[s]) if s in optimizer_median.index else None
                                     for s in range(pp)),
        t0_ns=int(t0_ns),
    )
