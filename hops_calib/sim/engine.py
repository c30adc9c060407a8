"""Simulator room: the engine, which times one iteration of per-rank programs.

Static-order list scheduling: every rank runs its operations (`schedules.Programs`)
in order, one at a time, each as early as its inputs allow. There is no event
queue: the engine sweeps the ranks, advancing each as far as it can, until all are
done; a sweep in which no rank can advance is a deadlock and raises.

Transfers. A transfer occupies its directed link (sender rank, direction) for its
cost; links are full duplex and a link carries one transfer at a time, in the
order the sender issues them.

- Blocking p2p (Megatron): an exchange is one p2p call of the program. The rank
  posts all its sends and receives at once and resumes only when every one of them
  has completed (a POST lets it compute before that wait). A transfer starts when
  the sender has posted its send (so the tensor exists), the receiver has posted the
  matching receive, and the link is free; so a fast sender waits for a slow receiver
  to reach the receive in its own order, and both are held until the data has
  moved. This is what places the bubble on heterogeneous stages.
- Fire-and-forget: exchanges are skipped; a transfer starts as soon as its producer
  finishes and the link is free, and the consumer waits only for its arrival.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hops_calib.sim.cores import Cores
from hops_calib.sim.schedules import COMPUTE, POST, Programs

NOT_YET = -1.0  # times are >= 0, so a negative stamp means "has not happened"


@dataclass
class Rows:
    """Timeline rows as parallel lists (the cheapest thing to append to in Python)."""

    stage: list[int]
    chunk: list[int]
    microbatch: list[int]
    is_transfer: list[bool]
    phase: list[int]  # index into hops_calib.timeline.PHASES
    start_ms: list[float]
    end_ms: list[float]
    peer_stage: list[int]

    @classmethod
    def empty(cls) -> Rows:
        return cls([], [], [], [], [], [], [], [])

    def add_step(self, rank: int, phase: int, start_ms: float, end_ms: float) -> None:
        """A compute row of `rank` outside any microbatch (chunk 0, microbatch -1): its optimizer step."""
        self.stage.append(rank)
        self.chunk.append(0)
        self.microbatch.append(-1)
        self.is_transfer.append(False)
        self.phase.append(phase)
        self.start_ms.append(start_ms)
        self.end_ms.append(end_ms)
        self.peer_stage.append(-1)


class DeadlockError(RuntimeError):
    """No rank can make progress: the programs wait on each other."""


def run_iteration(
    programs: Programs,
    blocking: bool,
    task_ms: list[list[float]],
    forward_transfer_ms: list[float],
    backward_transfer_ms: list[float],
    start_ms: list[float],
    rows: Rows,
    host_ms: list[float] | None = None,
    host_after_receive_only: bool = False,
    cores: Cores | None = None,
    tails: list[list[tuple[int, float]]] | None = None,
) -> list[float]:
    """Time one iteration starting each rank at `start_ms[rank]`; append its rows; return each rank's end.

    `task_ms[phase][virtual_stage]` is a compute cost; `forward_transfer_ms[k]` the
    activation k -> k+1 and `backward_transfer_ms[k]` the gradient k+1 -> k.
    `host_ms[virtual_stage]` is host time spent before each compute task once its
    input is there: the rank is held, but no compute row is recorded for it. With
    `host_after_receive_only`, only tasks whose input arrives over a link pay it
    (`Pipeline.host_after_receive_only`).

    With `cores` (ranks time-sharing processors, `hops_calib.sim.cores`), a task's host time and cost are work
    served at the rank's share of its core: each is submitted when its input is there, and the ranks sweep on
    once `cores` says which task ends next; after its program each rank runs its `tails[rank]` (phase, work)
    items there too (the gradient reduction, the optimizer step; phase -1 records no row).
    """
    host = host_ms or [0.0] * programs.virtual_stages
    ranks, m = programs.ranks, programs.microbatches
    virtual_stages = programs.virtual_stages
    per_rank = programs.per_rank if blocking else programs.per_rank_compute
    n_transfers = 2 * virtual_stages * m
    send_posted = [NOT_YET] * n_transfers
    recv_posted = [NOT_YET] * n_transfers
    arrival = [NOT_YET] * n_transfers
    link_free = [0.0] * (2 * ranks)  # index sender_rank * 2 + direction
    clock = list(start_ms)
    position = [0] * ranks
    served: list[list[float] | None] = [None] * ranks  # shared cores: the times of the task a rank waits on
    closed = [False] * ranks  # done with the iteration
    # Bound methods and locals: this loop runs thousands of times per calibration trial.
    add_stage, add_chunk, add_mb = rows.stage.append, rows.chunk.append, rows.microbatch.append
    add_transfer, add_phase = rows.is_transfer.append, rows.phase.append
    add_start, add_end, add_peer = rows.start_ms.append, rows.end_ms.append, rows.peer_stage.append
    per_direction = virtual_stages * m

    def move(transfer: int, ready: float) -> float:
        """Start `transfer` no earlier than `ready` on its link; record it; return its arrival."""
        direction, rest = divmod(transfer, per_direction)
        from_stage, microbatch = divmod(rest, m)
        sender = from_stage % ranks
        if direction == 0:
            cost, peer = forward_transfer_ms[from_stage], (from_stage + 1) % ranks
        else:
            cost, peer = backward_transfer_ms[from_stage - 1], (from_stage - 1) % ranks
        link = 2 * sender + direction
        begin = ready if ready > link_free[link] else link_free[link]
        end = begin + cost
        link_free[link] = end
        arrival[transfer] = end
        add_stage(sender)
        add_chunk(from_stage // ranks)
        add_mb(microbatch)
        add_transfer(True)
        add_phase(direction)
        add_start(begin)
        add_end(end)
        add_peer(peer)
        return end

    unfinished = ranks
    while unfinished:
        progressed = False
        for rank in range(ranks):
            ops = per_rank[rank]
            if closed[rank]:
                continue
            i = position[rank]
            n = len(ops)
            now = clock[rank]
            while i < n:
                op = ops[i]
                if op[0] == COMPUTE:
                    _, phase, stage, microbatch, needs, produces = op
                    if needs >= 0:
                        ready = arrival[needs]
                        if ready < 0:
                            break  # fire-and-forget: the input has not been sent yet
                        if ready > now:
                            now = ready
                    if cores is not None:  # served at the core's share: the task's times once `cores` has them
                        paid = host[stage] if needs >= 0 or not host_after_receive_only else 0.0
                        marks = _serve(cores, rank, now, (paid, task_ms[phase][stage]), served)
                        if marks is None:
                            break
                        now, end = marks[2], marks[3]
                    else:
                        if needs >= 0 or not host_after_receive_only:
                            now += host[stage]
                        end = now + task_ms[phase][stage]
                    add_stage(rank)
                    add_chunk(stage // ranks)
                    add_mb(microbatch)
                    add_transfer(False)
                    add_phase(phase)
                    add_start(now)
                    add_end(end)
                    add_peer(-1)
                    now = end
                    if produces >= 0 and not blocking:
                        move(produces, end)
                else:  # POST, or EXCHANGE: post (unless posted before), then wait for every transfer
                    kind, sends, receives = op
                    waiting = False
                    for t in sends:
                        if send_posted[t] < 0:
                            send_posted[t] = now
                            progressed = True
                        if recv_posted[t] < 0:
                            waiting = True
                    for t in receives:
                        if recv_posted[t] < 0:
                            recv_posted[t] = now
                            progressed = True
                        if send_posted[t] < 0:
                            waiting = True
                    if kind == POST:
                        i += 1
                        continue
                    if waiting:
                        break
                    done = now
                    for t in sends + receives:
                        end = arrival[t]
                        if end < 0:
                            posted = send_posted[t] if send_posted[t] > recv_posted[t] else recv_posted[t]
                            end = move(t, posted)
                        if end > done:
                            done = end
                    now = done
                i += 1
            if i != position[rank]:
                progressed = True
                position[rank] = i
                clock[rank] = now
            if i == n:
                if cores is not None and tails and tails[rank]:
                    now, done = _run_tail(cores, rank, now, tails[rank], served, rows)
                    if not done:
                        continue
                    clock[rank] = now
                    progressed = True
                closed[rank] = True
                unfinished -= 1
        if unfinished and not progressed:
            if cores is not None and cores.active:
                for rank, marks in cores.advance():
                    served[rank] = marks
                continue
            raise DeadlockError(_describe_deadlock(programs, per_rank, position))
    return clock


def _serve(
    cores: Cores, rank: int, now: float, work: Sequence[float], served: list[list[float] | None]
) -> list[float] | None:
    """The [start, end] of each item of `work` once `cores` has served it to `rank` (`served[rank]`, taken), else
    None: submitted from `now` the first time the rank asks (while its chain runs, `cores.active` holds it)."""
    marks = served[rank]
    if marks is None:
        if rank not in cores.active:
            cores.submit(rank, now, work)
        return None
    served[rank] = None
    return marks


def _run_tail(
    cores: Cores, rank: int, now: float, tail: list[tuple[int, float]], served: list, rows: Rows
) -> tuple[float, bool]:
    """A rank's work after its program on shared cores: submitted once, recorded when served; (clock, done)."""
    marks = _serve(cores, rank, now, [work for _, work in tail], served)
    if marks is None:
        return now, False
    for k, (phase, _) in enumerate(tail):
        if phase >= 0:
            rows.add_step(rank, phase, marks[2 * k], marks[2 * k + 1])
    return marks[-1], True


def _describe_deadlock(programs: Programs, per_rank, position: list[int]) -> str:
    stuck = []
    for rank, ops in enumerate(per_rank):
        if position[rank] < len(ops):
            stuck.append(f"rank {rank} at operation {position[rank]} {ops[position[rank]]}")
    return (
        f"{programs.schedule} deadlocks with {programs.ranks} ranks, {programs.chunks} chunks, "
        f"{programs.microbatches} microbatches: " + "; ".join(stuck)
    )
