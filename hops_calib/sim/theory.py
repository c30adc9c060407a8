"""Simulator room: closed forms of pipeline theory for balanced stages (no simulation).

The simulator is checked against these before it is trusted on real traces, and
planners use them directly. Balanced means every stage costs the same and
transfers are free; f, b and w are per-stage costs of a forward, a whole backward
and the weight-gradient part of that backward (as in `StageCosts`). Bubble here
is the metrics' definition for one iteration: idle share of the makespan,
1 - work / makespan.
"""

from __future__ import annotations

import math
from fractions import Fraction

from hops_calib.metrics import schedule_bubble
from hops_calib.sim.pipeline import Pipeline, StageCosts
from hops_calib.sim.schedules import interleaved_warmup


def balanced_pipeline(
    stages: int,
    microbatches: int,
    forward_ms: float = 1.0,
    backward_ms: float = 2.0,
    weight_grad_ms: float = 0.0,
    chunks: int = 1,
    **fields,
) -> Pipeline:
    """p equal stages; with `chunks` v > 1 each of the p*v virtual stages does 1/v of a stage's work.

    Other `Pipeline` fields (iterations, blocking_p2p, transfers...) pass through.
    """
    cost = StageCosts(forward_ms / chunks, backward_ms / chunks, weight_grad_ms / chunks)
    return Pipeline(stages=(cost,) * (stages * chunks), microbatches=microbatches, chunks=chunks, **fields)


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble of balanced 1F1B or GPipe, (p-1)/(m+p-1); interleaved over v chunks, (p-1)/(v*m+p-1)."""
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    return schedule_bubble(stages, microbatches, chunks)


def microbatches_for_bubble(stages: int, target_bubble: float) -> int:
    """Fewest microbatches whose balanced 1F1B bubble is at most `target_bubble`: ceil((p-1)(1-t)/t)."""
    _check_positive(stages=stages)
    if not 0.0 < target_bubble < 1.0:
        raise ValueError(f"target bubble must be between 0 and 1 exclusive (got {target_bubble})")
    # Exact arithmetic: (p-1)(1-t)/t for t = 0.1 is 63.000000000000014 in floats.
    t = Fraction(target_bubble).limit_denominator(10**12)
    return max(1, math.ceil((stages - 1) * (1 - t) / t))


def gpipe_flushes(microbatches: int, flush: int | None) -> list[int]:
    """Sizes of GPipe's flushes: groups of `flush` microbatches, the last one possibly smaller."""
    flush = flush or microbatches
    return [min(flush, microbatches - lo) for lo in range(0, microbatches, flush)]


def balanced_makespan(
    schedule: str,
    stages: int,
    microbatches: int,
    forward_ms: float = 1.0,
    backward_ms: float = 2.0,
    weight_grad_ms: float = 0.0,
    chunks: int = 1,
    gpipe_flush: int | None = None,
) -> float:
    """Makespan of one iteration of `schedule` on balanced stages with free transfers.

    ZB-H1: m(f+b) + (p-1)(F + B - W) with F = f, B = b - w, W = w, the form of the
    zero-bubble paper, which assumes W <= min(F, B) (refused otherwise).
    """
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    p, m, step = stages, microbatches, forward_ms + backward_ms
    if schedule == "1f1b":
        return (m + p - 1) * step
    if schedule == "gpipe":
        return sum((size + p - 1) * step for size in gpipe_flushes(m, gpipe_flush))
    if schedule == "interleaved_1f1b":
        return m * step + (p - 1) * step / chunks
    if schedule == "zb_h1":
        input_grad = backward_ms - weight_grad_ms
        if weight_grad_ms > min(forward_ms, input_grad):
            raise ValueError(
                f"the ZB-H1 closed form assumes W <= min(F, B); got F={forward_ms}, B={input_grad}, W={weight_grad_ms}"
            )
        return m * step + (p - 1) * (forward_ms + input_grad - weight_grad_ms)
    raise ValueError(f"no closed form for schedule {schedule!r}; expected 1f1b, gpipe, interleaved_1f1b or zb_h1")


def peak_activations(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, gpipe_flush: int | None = None
) -> tuple[int, ...]:
    """Most microbatches in flight per rank (interleaved: in model chunks, each 1/v of a stage)."""
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    p, m = stages, microbatches
    if schedule == "gpipe":
        return (max(gpipe_flushes(m, gpipe_flush)),) * p
    if schedule == "1f1b":
        return tuple(min(p - s, m) for s in range(p))
    if schedule == "zb_h1":  # rank s holds s weight gradients back on top of 1F1B's p - s
        return (min(p, m),) * p
    if schedule == "interleaved_1f1b":
        return tuple(min(interleaved_warmup(r, p, chunks, m) + 1, m * chunks) for r in range(p))
    raise ValueError(f"no closed form for schedule {schedule!r}; expected 1f1b, gpipe, interleaved_1f1b or zb_h1")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1 (got {value})")


def closed_form_holds(
    schedule: str,
    stages: int,
    microbatches: int,
    forward_ms: float,
    backward_ms: float,
    weight_grad_ms: float,
    chunks: int = 1,
) -> bool:
    """Whether `balanced_makespan` and `peak_activations` give the simulator's numbers for this shape: always for
    1F1B, GPipe and interleaved 1F1B (the shapes they run), and for ZB-H1 when W <= min(F, B) (the paper's
    assumption) and there are at least as many microbatches as stages (fewer leave its warm-up incomplete)."""
    if schedule != "zb_h1":
        return True
    return weight_grad_ms <= min(forward_ms, backward_ms - weight_grad_ms) and microbatches >= stages


def schedule_bubble_of(
    schedule: str,
    stages: int,
    microbatches: int,
    chunks: int = 1,
    forward_ms: float = 1.0,
    backward_ms: float = 2.0,
    weight_grad_ms: float = 0.0,
) -> float:
    """The schedule's own bubble on balanced stages with free transfers, from its closed-form makespan:
    1 - m (f + b) / makespan. 1F1B and GPipe (one flush): (p-1)/(m+p-1); interleaved 1F1B: (p-1)/(v m+p-1); ZB-H1:
    (p-1)(F+B-W) / (m(f+b) + (p-1)(F+B-W)), its deferred weight gradients filling the bubble. ZB-H1's form assumes
    W <= min(F, B); a larger W cannot fill more than those slots, so W is taken at most min(F, b/2) there."""
    if schedule == "zb_h1":
        weight_grad_ms = min(weight_grad_ms, forward_ms, backward_ms / 2)
    work = microbatches * (forward_ms + backward_ms)
    makespan = balanced_makespan(schedule, stages, microbatches, forward_ms, backward_ms, weight_grad_ms, chunks)
    return 1.0 - work / makespan if makespan > 0 else 0.0


def pipeline_schedule_bubble(pipeline: Pipeline, schedule: str) -> float:
    """`schedule_bubble_of` for a pipeline's ranks, on its mean per-rank forward, backward and weight-gradient
    costs (the balanced pipeline nearest it)."""
    stages = pipeline.stages
    ranks = len(stages) // max(1, pipeline.chunks)
    mean = [
        sum(getattr(s, name) for s in stages) * pipeline.chunks / len(stages)
        for name in ("forward_ms", "backward_ms", "weight_grad_ms")
    ]
    if mean[0] + mean[1] <= 0:
        return schedule_bubble(ranks, pipeline.microbatches, pipeline.chunks)
    return schedule_bubble_of(schedule, ranks, pipeline.microbatches, pipeline.chunks, *mean)
