"""Simulator room: the critical path of a simulated timeline (pure).

Walking back from the last interval to the start of the run, each step takes the interval that released the
current one: the latest to end, no later than the current one starts, among those it can wait for - the same
rank's earlier intervals, the transfers into the rank (and, for a transfer, the receiver's, since a blocking
exchange needs both ends), and, for an optimizer step or a rank's first task of an iteration, any rank's (the
barriers before and after the step). Gaps between the released interval and the current one (host time, the
pre-optimizer work, a placed stall) belong to no rank's compute.

What the path holds per rank says how much a slowdown of that rank costs: stretching a rank's compute on the
path by a factor f lengthens the run by at least (f - 1) x that time, and by exactly that while the path stays
critical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hops_calib.sim.pipeline import Pipeline
from hops_calib.sim.simulate import OPTIMIZER_PHASE, SimResult
from hops_calib.timeline import COMPUTE, KINDS

_COMPUTE_CODE = KINDS.index(COMPUTE)
_RELATIVE_TOLERANCE = 1e-9  # float rounding of times up to the run's length


def critical_path(result: SimResult, pipeline: Pipeline | None = None) -> np.ndarray:
    """Row indices (into `result.columns`) of the critical path, first interval first.

    With the `pipeline` simulated, a compute interval's host time (`StageCosts.host_ms`, spent after its input
    arrived) is known, so the interval that released it is found exactly even when another one ended in between.
    """
    cols = result.columns
    host = np.zeros(len(cols["start_ms"]))
    if pipeline is not None:
        virtual = cols["chunk"] * result.ranks + cols["stage"]
        host_ms = np.array([c.host_ms for c in pipeline.stages])
        host = np.where(cols["kind"] == _COMPUTE_CODE, host_ms[np.minimum(virtual, len(host_ms) - 1)], 0.0)
    stage, peer, kind = cols["stage"], cols["peer_stage"], cols["kind"]
    start, end, phase, iteration = cols["start_ms"], cols["end_ms"], cols["phase"], cols["iteration"]
    is_transfer = kind != _COMPUTE_CODE
    # A rank's first task of an iteration follows the previous iteration's optimizer steps (a barrier may hold it)
    first_of_iteration = np.zeros(len(start), dtype=bool)
    for rank in np.unique(stage):
        for number in np.unique(iteration):
            rows = np.flatnonzero((stage == rank) & (iteration == number) & ~is_transfer)
            if len(rows):
                first_of_iteration[rows[np.argmin(start[rows])]] = True
    visited = np.zeros(len(start), dtype=bool)
    current = int(np.argmax(end))
    path = [current]
    visited[current] = True
    while True:
        rank = stage[current]
        if phase[current] == OPTIMIZER_PHASE or first_of_iteration[current]:
            allowed = np.ones(len(start), dtype=bool)
        else:
            allowed = (stage == rank) | (is_transfer & (peer == rank))
            if is_transfer[current]:
                receiver = peer[current]
                allowed |= (stage == receiver) | (is_transfer & (peer == receiver))
        tolerance = _RELATIVE_TOLERANCE * max(1.0, start[current])
        allowed &= ~visited & (end <= start[current] + tolerance)
        candidates = np.flatnonzero(allowed)
        if not len(candidates):
            break
        # The releasing interval ends where this one starts, or its host time before; else (a gap of work that
        # has no interval: the pre-optimizer stretch, a stall) the latest one before it.
        ends = end[candidates]
        exact = candidates[np.abs(ends - start[current]) <= tolerance]
        if not len(exact) and host[current] > 0:
            exact = candidates[np.abs(ends - (start[current] - host[current])) <= tolerance]
        pool = exact if len(exact) else candidates
        current = int(pool[np.argmax(end[pool])])
        path.append(current)
        visited[current] = True
    return np.asarray(path[::-1], dtype=np.int64)


@dataclass(frozen=True)
class CriticalShare:
    """What the critical path holds: per rank its compute and optimizer time, per link (the two ranks' pair,
    lower first) its transfer time, in ms."""

    compute_ms: tuple[float, ...]
    transfer_ms: dict[tuple[int, int], float]


def critical_share(result: SimResult, pipeline: Pipeline | None = None) -> CriticalShare:
    """The critical path's time per rank (compute) and per link (transfers)."""
    cols = result.columns
    path = critical_path(result, pipeline)
    held = [0.0] * result.ranks
    links: dict[tuple[int, int], float] = {}
    for row in path:
        duration = float(cols["end_ms"][row] - cols["start_ms"][row])
        rank = int(cols["stage"][row])
        if cols["kind"][row] == _COMPUTE_CODE:
            held[rank] += duration
        else:
            pair = (min(rank, int(cols["peer_stage"][row])), max(rank, int(cols["peer_stage"][row])))
            links[pair] = links.get(pair, 0.0) + duration
    return CriticalShare(tuple(held), links)
