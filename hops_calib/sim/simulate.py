"""Simulator room: `simulate(pipeline, schedule)`, training iterations around the engine.

One iteration: the schedule's programs run on every rank (`engine.run_iteration`);
after the last task on every rank there is a barrier (gradient reductions wait for
the slowest rank; without `optimizer_barrier` each rank goes on alone), then `pre_optimizer_ms` of work outside the pipeline, then each
rank's optimizer step `optimizer_ms[r]` (an OPTIMIZER row); rank r starts the next
iteration `post_optimizer_ms` after its optimizer ends (its forwards still wait for
their inputs), or, with `iteration_barrier`, after the slowest rank's optimizer ends. Real Megatron traces have this shape (see the trace-format doc).

Costs are the same in every iteration, so once one iteration starts every rank by
the same shift after the one before, every later iteration is that one shifted by a
constant period. With a barrier that holds from iteration 2 on (iteration 1 differs
only by starting every rank at 0); without one, ranks may drift apart for a few
iterations. The simulator times iterations until the shift is the same on every rank
(at least 1 and 2) and copies the rest; `replicate=False` times every iteration and
must give the same timeline.

A pipeline's occasional stall (`stall_ms` with `stall_probability`, a TCP
retransmission timeout on the all-reduce) delays one iteration's optimizer step
and, since every rank waits for it, shifts everything after it by the same
amount. The simulator places the stalls as a typical run has them, not as an
average smeared over every iteration: iteration i (1-based) stalls when
round(i * p) exceeds round((i - 1) * p), so N iterations carry round(N * p)
stalls, evenly spread - the median stall count of N independent chances, and
an iteration that stalls less than half the time is, at the median, one without.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from hops_calib.metrics import (
    IterationParts,
    IterationPartSeries,
    TimelineMetrics,
    column_iteration_part_series,
    column_iteration_parts,
    column_metrics,
)
from hops_calib.sim.cores import Cores
from hops_calib.sim.engine import Rows, run_iteration
from hops_calib.sim.pipeline import Pipeline
from hops_calib.sim.schedules import AUTO, BB, BW, Programs, build_programs
from hops_calib.timeline import BACKWARD_PHASES, COLUMNS, COMPUTE, KINDS, OPTIMIZER, PHASES

if TYPE_CHECKING:  # the frame is built on demand (`SimResult.timeline`); metrics read the columns
    import pandas as pd

OPTIMIZER_PHASE = PHASES.index(OPTIMIZER)
_BACKWARD_CODES = [PHASES.index(phase) for phase in BACKWARD_PHASES]


def auto_schedule(pipeline: Pipeline) -> str:
    """The HopsHetero rule, from the per-stage costs before the first microbatch.

    ZB-H1 when (max over stages of f+b+w) - (f+b+w of the last stage) >= w of the last
    stage (the last stage has room to absorb its deferred weight gradients), else 1F1B.
    """
    if pipeline.chunks != 1:
        raise ValueError(
            f"schedule 'auto' chooses between 1f1b and zb_h1, which run one model chunk per rank; "
            f"the pipeline has chunks={pipeline.chunks} (name interleaved_1f1b explicitly)"
        )
    totals = [cost.forward_ms + cost.backward_ms for cost in pipeline.stages]  # backward_ms = b + w
    last = pipeline.stages[-1]
    return "zb_h1" if max(totals) - totals[-1] >= last.weight_grad_ms else "1f1b"


@dataclass(frozen=True)
class SimResult:
    """A simulated run: the timeline (as columns, framed on demand), memory and makespan."""

    schedule: str  # resolved name ("auto" becomes the schedule it chose)
    ranks: int
    microbatches: int  # per iteration
    iterations: int
    makespan_ms: float
    peak_activations: tuple[int, ...]  # per rank, in microbatches of one model chunk (see peak_stage_activations)
    columns: dict[str, np.ndarray] = field(repr=False)  # the timeline's columns; kind and phase as codes
    chunks: int = 1  # model chunks per rank

    @property
    def peak_stage_activations(self) -> tuple[float, ...]:
        """The most activations each rank holds at once, in stage microbatches: one unit is one microbatch's
        activations of a whole stage (all the rank's layers), so a model chunk of interleaved 1F1B, 1/chunks of
        the rank's layers, counts 1/chunks. The one unit the planner and the what-if report memory in."""
        return tuple(n / self.chunks for n in self.peak_activations)

    @property
    def tasks(self) -> int:
        """Compute rows of the timeline."""
        return int(np.count_nonzero(self.columns["kind"] == KINDS.index(COMPUTE)))

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """The timeline (schema of `hops_calib.timeline`) by start time, then stage; ties keep execution order."""
        import pandas as pd

        cols = self.columns
        order = np.lexsort((cols["stage"], cols["start_ms"]))
        data = {name: cols[name][order] for name in COLUMNS if name not in ("kind", "phase")}
        data["kind"] = np.asarray(KINDS, dtype=object)[cols["kind"][order]]
        data["phase"] = np.asarray(PHASES, dtype=object)[cols["phase"][order]]
        return pd.DataFrame(data)[list(COLUMNS)].astype(COLUMNS)

    def metrics(self) -> TimelineMetrics:
        """The shared metrics of this timeline, computed on its columns without building the frame."""
        cols = self.columns
        return column_metrics(
            stage=cols["stage"],
            iteration=cols["iteration"],
            microbatch=cols["microbatch"],
            is_compute=cols["kind"] == KINDS.index(COMPUTE),
            is_backward=np.isin(cols["phase"], _BACKWARD_CODES),
            start_ms=cols["start_ms"],
            end_ms=cols["end_ms"],
            microbatches_per_iteration=self.microbatches,
            pp=self.ranks,
        )

    def served_ms(self, rank: int, phase: str) -> float | None:
        """The median simulated duration of rank `rank`'s tasks of `phase` (FORWARD, BACKWARD, OPTIMIZER, ...), or
        None when it ran none: on ranks sharing a core (processor sharing) what a trace measures of a task, which
        its cost alone is not."""
        cols = self.columns
        mask = (cols["stage"] == rank) & (cols["kind"] == KINDS.index(COMPUTE)) & (cols["phase"] == PHASES.index(phase))
        if not mask.any():
            return None
        return float(np.median(cols["end_ms"][mask] - cols["start_ms"][mask]))

    def iteration_parts(self) -> IterationParts | None:
        """The median iteration cut into span, silent stretch, optimizer and rest (the real runs' function)."""
        return column_iteration_parts(**self._part_columns())

    def iteration_part_series(self) -> IterationPartSeries | None:
        """Every iteration's parts (the real runs' function): what the median hides, e.g. a stall in some of them."""
        return column_iteration_part_series(**self._part_columns())

    def _part_columns(self) -> dict[str, np.ndarray]:
        cols = self.columns
        return dict(
            iteration=cols["iteration"],
            is_compute=cols["kind"] == KINDS.index(COMPUTE),
            is_backward=np.isin(cols["phase"], _BACKWARD_CODES),
            is_optimizer=cols["phase"] == OPTIMIZER_PHASE,
            start_ms=cols["start_ms"],
            end_ms=cols["end_ms"],
        )


def _task_ms(pipeline: Pipeline) -> list[list[float]]:
    """Compute cost per phase and virtual stage, as the engine indexes them."""
    forward = [c.forward_ms for c in pipeline.stages]
    backward = [c.backward_ms for c in pipeline.stages]
    input_grad = [c.backward_ms - c.weight_grad_ms for c in pipeline.stages]
    weight_grad = [c.weight_grad_ms for c in pipeline.stages]
    table = [forward, backward, input_grad, weight_grad, [0.0] * len(pipeline.stages)]
    assert len(table) == len(PHASES) and table[BB] is input_grad and table[BW] is weight_grad
    return table


def _columns(rows: Rows, iteration: list[int]) -> dict[str, np.ndarray]:
    return {
        "stage": np.asarray(rows.stage, dtype=np.int64),
        "chunk": np.asarray(rows.chunk, dtype=np.int64),
        "iteration": np.asarray(iteration, dtype=np.int64),
        "microbatch": np.asarray(rows.microbatch, dtype=np.int64),
        "kind": np.asarray(rows.is_transfer, dtype=np.int8),  # KINDS: 0 compute, 1 transfer
        "phase": np.asarray(rows.phase, dtype=np.int8),
        "start_ms": np.asarray(rows.start_ms, dtype=np.float64),
        "end_ms": np.asarray(rows.end_ms, dtype=np.float64),
        "peer_stage": np.asarray(rows.peer_stage, dtype=np.int64),
    }


def _after_grad_reduce(pipeline: Pipeline, rows: Rows, first_row: int, ends: list[float]) -> list[float]:
    """Each rank's end once its gradient reduction is done (`Pipeline.grad_reduce_ms`): after its last backward by
    the tail, and no earlier than the whole reduction from that backward's start (rows from `first_row` are this
    iteration's)."""
    last_start = [0.0] * pipeline.ranks
    last_end = [-1.0] * pipeline.ranks
    for k in range(first_row, len(rows.stage)):
        if rows.is_transfer[k]:
            continue
        rank = rows.stage[k]
        if rows.end_ms[k] > last_end[rank]:
            last_end[rank], last_start[rank] = rows.end_ms[k], rows.start_ms[k]
    return [
        max(end + tail, start + whole)
        for end, start, tail, whole in zip(ends, last_start, pipeline.grad_reduce_tail_ms, pipeline.grad_reduce_ms)
    ]


def simulate(
    pipeline: Pipeline,
    schedule: str,
    *,
    gpipe_flush: int | None = None,
    seed: int = 0,
    replicate: bool = True,
    compute_factors: np.ndarray | None = None,
) -> SimResult:
    """Simulate `pipeline.iterations` training iterations of `schedule`.

    `schedule` is one of "1f1b", "interleaved_1f1b", "gpipe", "zb_h1", "auto";
    `gpipe_flush` runs GPipe in flushes of that many microbatches. Costs are
    deterministic, so `seed` changes nothing today; it is part of the signature so
    that stochastic cost models keep the call explicit and reproducible.
    `compute_factors[i, r]` (iterations x ranks), when given, multiplies rank r's compute and optimizer step in
    iteration i + 1 (transient stragglers, `perturb.straggler_factors`); every iteration is then timed.
    """
    del seed  # no random draw here: random perturbations come in drawn (see compute_factors)
    resolved = auto_schedule(pipeline) if schedule == AUTO else schedule
    programs: Programs = build_programs(
        resolved, pipeline.ranks, pipeline.chunks, pipeline.microbatches, gpipe_flush, pipeline.overlap_p2p
    )
    hops = len(pipeline.stages) - 1
    forward_transfer = list(pipeline.forward_transfer_ms) or [0.0] * hops
    backward_transfer = list(pipeline.backward_transfer_ms) or [0.0] * hops
    task_ms = _task_ms(pipeline)
    host_ms = [c.host_ms for c in pipeline.stages]
    ranks = pipeline.ranks
    optimizer = list(pipeline.optimizer_ms)
    if compute_factors is not None:
        compute_factors = np.asarray(compute_factors, dtype=float)
        if (
            compute_factors.shape != (pipeline.iterations, ranks)
            or not np.all(np.isfinite(compute_factors))
            or np.any(compute_factors <= 0)
        ):
            raise ValueError(
                f"compute_factors must be finite positive numbers of shape (iterations, ranks) = "
                f"({pipeline.iterations}, {ranks}); got shape {compute_factors.shape}"
            )
        replicate = False
    nominal_task_ms, nominal_optimizer = task_ms, optimizer
    cores = Cores(pipeline.core_load) if pipeline.shares_cores else None

    rows = Rows.empty()
    iteration: list[int] = []
    starts = [0.0] * ranks
    barriers: list[float] = []
    timed = 0
    for number in range(1, pipeline.iterations + 1):
        timed = number
        began = starts
        first_row = len(rows.stage)
        if compute_factors is not None:
            factor = compute_factors[number - 1]
            task_ms = [[ms * factor[k % ranks] for k, ms in enumerate(row)] for row in nominal_task_ms]
            optimizer = [ms * factor[r] for r, ms in enumerate(nominal_optimizer)]
        if cores is not None:
            ends, barrier, starts = _shared_iteration(
                pipeline,
                programs,
                cores,
                task_ms,
                optimizer,
                forward_transfer,
                backward_transfer,
                starts,
                rows,
                host_ms,
            )
        else:
            ends = run_iteration(
                programs,
                pipeline.blocking_p2p,
                task_ms,
                forward_transfer,
                backward_transfer,
                starts,
                rows,
                host_ms,
                pipeline.host_after_receive_only,
            )
            if pipeline.grad_reduce_ms:
                ends = _after_grad_reduce(pipeline, rows, first_row, ends)
            barrier = max(ends)
            optimizer_starts = [
                (barrier if pipeline.optimizer_barrier else end) + pipeline.pre_optimizer_ms for end in ends
            ]
            starts = [start + pipeline.post_ms(rank) for rank, start in enumerate(optimizer_starts)]
            for rank, cost in enumerate(optimizer):
                rows.add_step(rank, OPTIMIZER_PHASE, optimizer_starts[rank], optimizer_starts[rank] + cost)
                starts[rank] += cost
        barriers.append(barrier)
        if pipeline.iteration_barrier:
            starts = [max(starts)] * ranks
        iteration.extend([number] * (len(rows.stage) - len(iteration)))
        # Steady state: the next iteration starts every rank by the same shift after this one, so it (and every
        # later one) is this one shifted. A barrier gives that from iteration 2 on; without one, ranks that drift
        # apart are timed until they stop drifting (copying earlier would let a rank start its next iteration
        # before its own work is done).
        if replicate and number >= 2 and _uniform_shift(began, starts):
            break

    columns = _columns(rows, iteration)
    if timed < pipeline.iterations:
        columns = _replicate_last(columns, timed, pipeline.iterations, barriers[-1] - barriers[-2])
    if pipeline.stall_ms > 0 and pipeline.stall_probability > 0:
        _delay(columns, stalled_iterations(pipeline.stall_probability, pipeline.iterations), pipeline.stall_ms)
    return SimResult(
        schedule=resolved,
        ranks=ranks,
        microbatches=pipeline.microbatches,
        iterations=pipeline.iterations,
        makespan_ms=float(columns["end_ms"].max()),
        peak_activations=programs.peak_activations,
        columns=columns,
        chunks=pipeline.chunks,
    )


def _shared_iteration(
    pipeline: Pipeline,
    programs: Programs,
    cores: Cores,
    task_ms: list[list[float]],
    optimizer: list[float],
    forward_transfer: list[float],
    backward_transfer: list[float],
    starts: list[float],
    rows: Rows,
    host_ms: list[float],
) -> tuple[list[float], float, list[float]]:
    """One iteration on ranks that share cores: (each rank's end of its pipeline work, the barrier, each rank's
    start of the next iteration). Each rank's gradient reduction follows its last task as work on its core (the
    captures reduce after the last backward: an overlapped reduction's part under that backward is not modelled
    here), and so does its optimizer step unless the step waits for every rank (`optimizer_barrier`): then the
    steps start together after the barrier and share the cores among themselves."""
    ranks = pipeline.ranks
    reduce = list(pipeline.grad_reduce_tail_ms) or [0.0] * ranks
    steps = optimizer or [0.0] * ranks
    alone = not pipeline.optimizer_barrier
    tails = [
        [(-1, reduce[r])]
        + ([(-1, pipeline.pre_optimizer_ms), (OPTIMIZER_PHASE if optimizer else -1, steps[r])] if alone else [])
        for r in range(ranks)
    ]
    ends = run_iteration(
        programs,
        pipeline.blocking_p2p,
        task_ms,
        forward_transfer,
        backward_transfer,
        starts,
        rows,
        host_ms,
        pipeline.host_after_receive_only,
        cores,
        tails,
    )
    if alone:
        # the rank's end before its step: the step's row starts after the reduction and the pre-optimizer work
        return ends, max(ends), [end + pipeline.post_ms(rank) for rank, end in enumerate(ends)]
    barrier = max(ends)
    begin = barrier + pipeline.pre_optimizer_ms
    nexts = [begin + pipeline.post_ms(rank) for rank in range(ranks)]
    if optimizer:
        for rank in range(ranks):
            cores.submit(rank, begin, (steps[rank],))
        while cores.active:
            for rank, marks in cores.advance():
                rows.add_step(rank, OPTIMIZER_PHASE, marks[0], marks[1])
                nexts[rank] += marks[1] - begin
    return ends, barrier, nexts


def _uniform_shift(before: list[float], after: list[float]) -> bool:
    shifts = [b - a for a, b in zip(before, after)]
    return max(shifts) - min(shifts) <= 1e-9 * max(1.0, abs(max(shifts)))


def stalled_iterations(probability: float, iterations: int) -> list[int]:
    """The iterations (1-based) that stall in a typical run of `iterations` with a stall chance `probability` each."""

    def rounded(x: float) -> int:
        return int(np.floor(x + 0.5))

    return [i for i in range(1, iterations + 1) if rounded(i * probability) > rounded((i - 1) * probability)]


def stalls_in_window(pipeline: Pipeline) -> int:
    """How many placed stalls fall inside the throughput window: every iteration's but the last one's, whose
    pre-optimizer work comes after the window's end (the last backward of stage 0)."""
    if pipeline.stall_ms <= 0 or pipeline.stall_probability <= 0:
        return 0
    stalled = stalled_iterations(pipeline.stall_probability, pipeline.iterations)
    return sum(1 for i in stalled if i < pipeline.iterations)


def _delay(columns: dict[str, np.ndarray], stalled: list[int], stall_ms: float) -> None:
    """Delay the optimizer step of each stalled iteration, and everything after it, by `stall_ms` (in place)."""
    shift = np.zeros(len(columns["start_ms"]))
    is_optimizer = columns["phase"] == OPTIMIZER_PHASE
    for number in stalled:
        shift += stall_ms * ((columns["iteration"] > number) | ((columns["iteration"] == number) & is_optimizer))
    columns["start_ms"] = columns["start_ms"] + shift
    columns["end_ms"] = columns["end_ms"] + shift


def _replicate_last(
    columns: dict[str, np.ndarray], timed: int, iterations: int, period_ms: float
) -> dict[str, np.ndarray]:
    """Append iterations timed+1..iterations as copies of iteration `timed` shifted by `period_ms` each."""
    last = columns["iteration"] == timed
    copies = iterations - timed
    block = {name: values[last] for name, values in columns.items()}
    shift = np.repeat(np.arange(1, copies + 1, dtype=np.float64) * period_ms, len(block["start_ms"]))
    out = {}
    for name, values in columns.items():
        extra = np.tile(block[name], copies)
        if name in ("start_ms", "end_ms"):
            extra = extra + shift
        elif name == "iteration":
            extra = extra + np.repeat(np.arange(1, copies + 1, dtype=np.int64), len(block[name]))
        out[name] = np.concatenate([values, extra])
    return out
