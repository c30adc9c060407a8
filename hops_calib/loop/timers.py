"""Loop room: Megatron's logged timers scored against their counterparts in the simulation.

Megatron times parts of each iteration on every rank (megatron-core `megatron/core/timers.py`; the names are the
ones `training.py::train_step` and the pipeline schedules, `megatron/core/pipeline_parallel/schedules.py`, start
and stop). `Timers.log` prints each timer's time accumulated since the last log line divided by the normalizer,
--log-interval: ms per iteration; under `--timing-log-option max` the largest over ranks, `minmax` the smallest
and largest, `all` every rank's. The simulation predicts, per rank (one rank per pipeline stage: the runs the
model prices have no tensor or data parallelism), in its steady iterations:

- `forward-compute`: the rank's forward passes of the iteration, summed (`forward_step`, every microbatch and
  model chunk);
- `backward-compute`: its backward passes, summed (`backward_step`; both halves of a split backward);
- `optimizer`: its optimizer step;
- `forward-backward`: `forward_backward_func` whole, p2p waits included: from the iteration's start (the timer
  starts after a barrier, `barrier_with_L1_time`, so every rank starts it together: the simulated iteration's
  first event on any rank) to the rank's optimizer start (its last event of the iteration without one).

A timer is scored by its largest value over ranks (what `max` prints, the largest `minmax` prints, the largest
of `all`), as a relative error in %. The p2p timers (`forward-recv`, `backward-send-forward-recv`, ...: time in
blocking sends and receives, waits included), `all-grads-sync`, `embedding-grads-all-reduce` and the rest are
logged but have no counterpart with their meaning yet: they are counted as not predicted, never scored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from hops_calib.timeline import BACKWARD_PHASES, COMPUTE, FORWARD, KINDS, OPTIMIZER, PHASES

PREDICTED_TIMERS = ("forward-backward", "forward-compute", "backward-compute", "optimizer")


def predicted_timers_ms(columns: Mapping[str, np.ndarray]) -> dict[str, tuple[float, ...]]:
    """Each predicted timer's ms per iteration on every rank (by stage), the median over the simulated iterations
    after the first (the steady ones; Megatron's logged intervals follow a dropped warm-up)."""
    stage, iteration = columns["stage"], columns["iteration"]
    start, end = columns["start_ms"], columns["end_ms"]
    compute = columns["kind"] == KINDS.index(COMPUTE)
    phase = columns["phase"]
    forward = compute & (phase == PHASES.index(FORWARD))
    backward = compute & np.isin(phase, [PHASES.index(p) for p in BACKWARD_PHASES])
    optimizer = compute & (phase == PHASES.index(OPTIMIZER))
    ranks = int(stage.max()) + 1
    iterations = np.unique(iteration)
    steady = iterations[1:] if len(iterations) > 1 else iterations
    values: dict[str, list[list[float]]] = {name: [] for name in PREDICTED_TIMERS}
    duration = end - start
    for i in steady:
        of = iteration == i
        begin = float(start[of].min())
        per: dict[str, list[float]] = {name: [] for name in PREDICTED_TIMERS}
        for rank in range(ranks):
            mine = of & (stage == rank)
            steps = mine & optimizer
            per["forward-compute"].append(float(duration[mine & forward].sum()))
            per["backward-compute"].append(float(duration[mine & backward].sum()))
            per["optimizer"].append(float(duration[steps].sum()))
            per["forward-backward"].append(
                (float(start[steps].min()) if steps.any() else float(end[mine].max())) - begin
            )
        for name in PREDICTED_TIMERS:
            values[name].append(per[name])
    out = {name: tuple(float(v) for v in np.median(np.array(values[name]), axis=0)) for name in PREDICTED_TIMERS}
    if not optimizer.any():
        del out["optimizer"]  # a model without an optimizer step predicts none
    return out


def logged_max_ms(logged: Mapping[str, float]) -> float | None:
    """A logged timer's largest value over ranks ({"max"}, {"min", "max"}, {"rank r": ...}); None when it ran
    on no rank (Megatron prints no line, or 0 for a rank that did not run it)."""
    ran = [float(v) for v in logged.values() if v is not None and float(v) > 0]
    return max(ran) if ran else None


def timer_errors_pct(
    logged: Mapping[str, Mapping[str, float]] | None, columns: Mapping[str, np.ndarray]
) -> dict[str, float | None]:
    """Timer -> the relative error (%) of its predicted largest value over ranks against the logged one, for every
    timer the run logged: None for a logged timer without a predicted counterpart."""
    if not logged:
        return {}
    predicted = predicted_timers_ms(columns)
    out: dict[str, float | None] = {}
    for name in sorted(logged):
        real = logged_max_ms(logged[name])
        if real is None:
            continue
        out[name] = (max(predicted[name]) / real - 1.0) * 100.0 if name in predicted else None
    return out


def timer_rows(
    logged: Mapping[str, Mapping[str, float]] | None, columns: Mapping[str, np.ndarray]
) -> list[dict[str, Any]]:
    """One run's logged timers beside the simulation's: per timer the logged and predicted largest value over ranks
    (ms per iteration; predicted None without a counterpart) and the error %, as `timer_errors_pct` scores them."""
    if not logged:
        return []
    predicted = predicted_timers_ms(columns)
    rows = []
    for name in sorted(logged):
        real = logged_max_ms(logged[name])
        if real is None:
            continue
        value = max(predicted[name]) if name in predicted else None
        rows.append(
            {
                "timer": name,
                "logged_ms": real,
                "predicted_ms": value,
                "error_pct": (value / real - 1.0) * 100.0 if value is not None else None,
            }
        )
    return rows


def timer_summary(per_run: Iterable[Mapping[str, float | None] | None]) -> dict[str, dict[str, Any]]:
    """Timer -> {"runs": logged on, "scored": runs with a prediction, "mape_pct" (None when none),
    "predicted": whether the simulation has its counterpart}, over the runs' `timer_errors_pct`."""
    runs: dict[str, list[float | None]] = {}
    for errors in per_run:
        for name, error in (errors or {}).items():
            runs.setdefault(name, []).append(error)
    out = {}
    for name in sorted(runs):
        scored = [abs(e) for e in runs[name] if e is not None]
        out[name] = {
            "runs": len(runs[name]),
            "scored": len(scored),
            "mape_pct": float(np.mean(scored)) if scored else None,
            "predicted": name in PREDICTED_TIMERS,
        }
    return out
