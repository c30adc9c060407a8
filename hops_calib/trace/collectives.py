"""Trace room: what the `collective` lines of a rank log say (schema extension of issue #19; see
`hops_calib.trace.events.COLLECTIVE`): which collectives a stage issues per microbatch in each phase, and where its
data-parallel gradient reduction sits in the iteration. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from hops_calib.timeline import BACKWARD, COMPUTE, KINDS, OPTIMIZER, PHASES
from hops_calib.trace.events import CollectiveEvent


def summarize(
    collectives: Sequence[CollectiveEvent], columns: dict[str, np.ndarray], iterations: int, microbatches: int
) -> dict[str, Any]:
    """One rank's collectives: `per_microbatch`, the count of each (phase, collective, group, bytes) issued inside
    the forward and backward steps, over the traced iterations x microbatches; `per_iteration`, those outside a
    step (the data-parallel gradient reduction), with `placement` of each: "after_last_backward" when it starts
    once the rank's last backward of its iteration has ended and ends before its optimizer step starts, else
    "during_backward" (it overlaps the backwards) or "other"."""
    inside = Counter((c.phase, c.op, c.group, c.nbytes) for c in collectives if c.microbatch is not None)
    outside = [c for c in collectives if c.microbatch is None]
    steps = max(1, iterations * microbatches)
    compute = columns["kind"] == KINDS.index(COMPUTE)
    backward = compute & (columns["phase"] == PHASES.index(BACKWARD))
    optimizer = compute & (columns["phase"] == PHASES.index(OPTIMIZER))
    placements: Counter = Counter()
    for event in outside:
        this = columns["iteration"] == event.iteration
        ends = columns["end_ns"][backward & this]
        starts = columns["start_ns"][optimizer & this]
        if not len(ends):
            placements[(event.op, event.group, event.nbytes, "other")] += 1
            continue
        before_step = not len(starts) or event.end_ns <= starts.min()
        if event.start_ns >= ends.max() and before_step:
            placements[(event.op, event.group, event.nbytes, "after_last_backward")] += 1
        elif event.start_ns < ends.max():
            placements[(event.op, event.group, event.nbytes, "during_backward")] += 1
        else:
            placements[(event.op, event.group, event.nbytes, "other")] += 1
    return {
        "per_microbatch": [
            {"phase": phase, "collective": op, "group": group, "bytes": nbytes, "count": count / steps}
            for (phase, op, group, nbytes), count in sorted(inside.items())
        ],
        "per_iteration": [
            {
                "collective": op,
                "group": group,
                "bytes": nbytes,
                "placement": placement,
                "count": count / max(1, iterations),
            }
            for (op, group, nbytes, placement), count in sorted(placements.items())
        ],
    }
