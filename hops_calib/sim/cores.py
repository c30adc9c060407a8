"""Simulator room: ranks that time-share a processor (processor-sharing service).

A CPU capture with more ranks than cores runs several ranks on one core. The scheduler gives each runnable
process an equal share, so a rank runs at full speed while its core's other ranks wait (for an input, a
transfer, a barrier) and at 1/n of it while n of them compute. `load[r][q]` says how many processes running
pipeline rank q's work share rank r's core (rank q's stage with its tensor- and data-parallel copies, which run
alike): rank r, when it computes, progresses at

    rate_r(t) = 1 / sum over q of load[r][q] * busy_q(t)

(`busy_q`: rank q is computing at t; `load[r][r]` >= 1 counts r itself). One rank per core (`load` the
identity) is the unshared machine: every task takes its cost. A flat `load = k I` is the old 1/k price.

`Cores` serves chains of work items: a rank submits its next items (the host time before a task, then the
task; or its gradient reduction, then its optimizer step) with the time they may start, and `advance` moves time
to the next moment a rank's chain is done, each item progressing at its rank's current rate. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

Load = tuple[tuple[float, ...], ...]


def check_load(load: Sequence[Sequence[float]], ranks: int) -> None:
    """A ValueError unless `load` is ranks x ranks, finite, >= 0, with every diagonal entry >= 1."""
    if len(load) != ranks or any(len(row) != ranks for row in load):
        raise ValueError(f"core_load must be {ranks} x {ranks} (one row and column per rank)")
    for r, row in enumerate(load):
        if not all(0 <= v < float("inf") for v in row) or row[r] < 1:
            raise ValueError(
                f"core_load row {r} = {tuple(row)}: entries must be finite and >= 0, and the rank's own "
                "entry >= 1 (it counts the rank itself)"
            )


def is_unshared(load: Sequence[Sequence[float]]) -> bool:
    """Whether `load` is the identity (empty included): every rank has a processor of its own."""
    return all(v == (1.0 if r == q else 0.0) for r, row in enumerate(load) for q, v in enumerate(row))


class Cores:
    """Chains of work items on ranks that share processors (see the module docstring)."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.now = 0.0
        ranks = len(load)
        self.release = [0.0] * ranks  # when the rank's current chain may start
        self.items: list[list[float]] = [[] for _ in range(ranks)]  # remaining work of the chain's items, in order
        self.marks: list[list[float]] = [[] for _ in range(ranks)]  # start then end of each item, as they happen
        self.active: list[int] = []  # ranks with a chain submitted and not yet done

    def submit(self, rank: int, start_ms: float, work_ms: Sequence[float]) -> None:
        """Rank `rank` runs the items `work_ms` (ms at full speed) one after the other from `start_ms` (not before
        the present: a rank submits at its own clock, which never runs behind the events it waits on)."""
        if self.items[rank]:
            raise ValueError(f"rank {rank} submitted work while its chain runs")
        self.release[rank] = start_ms if start_ms > self.now else self.now
        self.items[rank] = list(work_ms)
        self.marks[rank] = []
        self.active.append(rank)

    def advance(self) -> list[tuple[int, list[float]]]:
        """Move time to the next moment some chains are done; return them as (rank, [start, end] of each item).

        Between events the set of computing ranks is fixed, so each progresses at a constant rate and the next
        event (a chain released, an item done) is exact; items are done in the order their remaining work runs
        out. Raises ValueError when nothing was submitted."""
        if not self.active:
            raise ValueError("no work submitted")
        load, items, marks = self.load, self.items, self.marks
        while True:
            now = self.now
            running = [r for r in self.active if self.release[r] <= now]
            for r in running:
                if not marks[r]:
                    marks[r].append(now)
            finished = self._drop_done(running, now)
            if finished:
                return finished
            waiting = [self.release[r] for r in self.active if self.release[r] > now]
            if not running:
                self.now = min(waiting)
                continue
            rates = {r: 1.0 / sum(load[r][q] for q in running) for r in running}
            step = min(items[r][0] / rates[r] for r in running)
            if waiting and min(waiting) - now < step:
                step = min(waiting) - now
                for r in running:
                    items[r][0] -= step * rates[r]
                self.now = min(waiting)
                continue
            end = now + step
            for r in running:
                left = items[r][0] - step * rates[r]
                # the item that set the step (and any whose work runs out with it, up to rounding) is done
                items[r][0] = 0.0 if left <= 1e-12 * max(1.0, items[r][0]) else left
            self.now = end

    def _drop_done(self, running: list[int], now: float) -> list[tuple[int, list[float]]]:
        """Close the running ranks' items whose work is done at `now`; return the chains that are over."""
        finished = []
        for r in running:
            work, marks = self.items[r], self.marks[r]
            while work and work[0] <= 0.0:
                work.pop(0)
                marks.append(now)  # end of this item
                if work:
                    marks.append(now)  # start of the next
            if not work:
                finished.append((r, marks))
                self.active.remove(r)
                self.marks[r] = []
        return finished
