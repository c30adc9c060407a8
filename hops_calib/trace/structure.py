"""Trace room: whether a run's events add up to the pipeline its configuration describes.

Line by line, `events.read_rank_events` checks each event alone. This module checks
them together, on the compact columns of all ranks, before anything is written:

- every microbatch and model chunk an event names exists in the configuration;
- no compute event is logged twice;
- the iterations are numbered one after another, and every stage logged every
  iteration completely: a forward and a backward (or a zero-bubble input-gradient
  B, with its weight-gradient W when W is logged at all) for each microbatch and
  model chunk, and its optimizer step when it logs one in any iteration;
- a stage's iterations follow each other in time;
- a stage never starts a forward before the stage that feeds it finished it, nor
  a backward before the stage after it finished its own, beyond the nodes' clock
  skew (`skew_ms`): the real runs keep at least 0.5 ms between them.

A problem found here has no single bad line, so the error names the rank log and
the line of the event that shows it (found by reading that log again: the happy
path pays nothing). A microbatch or chunk that does not exist is refused even with
`lenient` (the configuration, not a line, is wrong: dropping would store another
run). With `lenient`, repeated events are dropped, and iterations logged incompletely at
the start or the end of the trace (a log cut short) are dropped on every stage;
an incomplete iteration between complete ones (lines dropped there) is kept and
flagged, since dropping it would leave a hole in the throughput window.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.timeline import COMPUTE, KINDS, PHASES
from hops_calib.trace.errors import TraceError
from hops_calib.trace.events import _loads
from hops_calib.trace.reading import bounded_lines, open_regular

DEFAULT_SKEW_MS = 2.0
_COMPUTE = KINDS.index(COMPUTE)
_F, _B, _BB, _BW, _OPT = (
    PHASES.index(name) for name in ("FORWARD", "BACKWARD", "BACKWARD_B", "BACKWARD_W", "OPTIMIZER")
)
_LENIENT = "or ingest with --lenient to drop it"


@dataclass
class StructureReport:
    """What the checks dropped (lenient only): event counts by reason, and whole iterations."""

    dropped: dict[str, int] = field(default_factory=dict)
    dropped_iterations: list[int] = field(default_factory=list)
    incomplete_iterations: list[int] = field(default_factory=list)  # kept (lenient): between complete ones
    notes: list[str] = field(default_factory=list)


def locate_all(
    path: Path,
    *,
    iteration: int,
    kind: int = _COMPUTE,
    phase: int | None = None,
    microbatch: int | None = None,
    chunk: int | None = None,
    limit: int | None = None,
) -> list[int]:
    """Line numbers of the events of `path` of this kind with these values (at most `limit`)."""
    found: list[int] = []
    with open_regular(path) as handle:
        for number, raw in bounded_lines(handle):
            if raw is None:  # a line over the limit, which the reader dropped
                continue
            try:
                record = _loads(raw)
            except Exception:  # noqa: BLE001 - a line the reader dropped (lenient) matches nothing
                continue
            if not isinstance(record, dict) or record.get("iteration") != iteration:
                continue
            if record.get("event_type") != KINDS[kind]:
                continue
            if phase is not None and record.get("phase") != PHASES[phase]:
                continue
            if microbatch is not None and record.get("microbatch") != microbatch:
                continue
            if chunk is not None and record.get("model_chunk", 0) != chunk:
                continue
            found.append(number)
            if limit is not None and len(found) >= limit:
                break
    return found


class _Run:
    """The columns and where each stage's events came from, to name files and lines."""

    def __init__(self, columns: dict[str, np.ndarray], rank_paths: Mapping[int, Path], trace_dir: Path) -> None:
        self.columns = columns
        self.rank_paths = rank_paths
        self.trace_dir = trace_dir

    def path_of_stage(self, stage: int) -> Path:
        ranks = np.unique(self.columns["rank"][self.columns["stage"] == stage])
        if len(ranks) == 1 and int(ranks[0]) in self.rank_paths:
            return self.rank_paths[int(ranks[0])]
        return self.rank_paths.get(stage, self.trace_dir)

    def event_lines(self, index: int, limit: int = 1) -> tuple[Path, list[int]]:
        """The rank log holding the event at row `index`, and the lines (up to `limit`) that log it."""
        c = self.columns
        path = self.rank_paths.get(int(c["rank"][index]), self.trace_dir)
        phase = int(c["phase"][index])
        lines = locate_all(
            path,
            iteration=int(c["iteration"][index]),
            kind=int(c["kind"][index]),
            phase=phase,
            microbatch=None if phase == _OPT else int(c["microbatch"][index]),
            chunk=int(c["chunk"][index]),
            limit=limit,
        )
        return path, lines

    def fail(self, index: int, problem: str, field_name: str, hint: str) -> TraceError:
        path, lines = self.event_lines(index)
        return TraceError(path, problem, line=lines[0] if lines else None, field=field_name, hint=hint)


def _keep(columns: dict[str, np.ndarray], mask: np.ndarray) -> None:
    for name in columns:
        columns[name] = columns[name][mask]


def check_structure(
    columns: dict[str, np.ndarray],
    *,
    pp: int,
    vp: int,
    microbatches: int,
    rank_paths: Mapping[int, Path],
    trace_dir: Path,
    lenient: bool = False,
    skew_ms: float = DEFAULT_SKEW_MS,
    config_source: Any = "the configuration",
) -> StructureReport:
    """Check (and, lenient, trim in place) the concatenated event columns of one run; TraceError on a problem."""
    report = StructureReport()
    run = _Run(columns, rank_paths, trace_dir)
    _check_ranges(run, pp=pp, vp=vp, microbatches=microbatches, config_source=config_source)
    _check_repeats(run, lenient=lenient, report=report)
    _check_complete(
        run, pp=pp, vp=vp, microbatches=microbatches, lenient=lenient, report=report, config_source=config_source
    )
    _check_iteration_order(run, pp=pp)
    _check_causality(run, pp=pp, vp=vp, skew_ms=skew_ms)
    return report


def _check_ranges(run: _Run, *, pp: int, vp: int, microbatches: int, config_source: Any) -> None:
    c = run.columns
    checks = (
        (
            "microbatch",
            "microbatch",
            microbatches,
            f"microbatch(es) per iteration in {config_source}",
            "the configuration's batch sizes (--global-batch-size / (--micro-batch-size x data-parallel size)) and "
            "the trace disagree: fix the configuration (or, if one line is damaged, that line)",
        ),
        (
            "model_chunk",
            "chunk",
            vp,
            f"model chunk(s) per stage in {config_source}",
            (
                "an interleaved trace needs --num-layers-per-virtual-pipeline-stage (or "
                "--virtual-pipeline-model-parallel-size) in the configuration: add it"
                if vp == 1
                else f"the configuration's virtual pipeline setting gives {vp} chunks and the trace has more: fix it"
            )
            + " (or, if one line is damaged, that line)",
        ),
    )
    for name, column, limit, what, hint in checks:
        bad = (c[column] >= limit) & (c["phase"] != _OPT)
        if not bad.any():
            continue
        # Not a bad line but a configuration the trace contradicts: --lenient would drop a whole microbatch or
        # chunk and store a different run, so it is refused either way.
        first = int(np.flatnonzero(bad)[0])
        raise run.fail(
            first,
            f"is {int(c[column][first])} but there are {limit} {what} (0..{limit - 1}); "
            f"{int(bad.sum())} event(s) name one outside",
            name,
            hint,
        )


def _work_key(c: dict[str, np.ndarray]) -> np.ndarray:
    """One int64 per compute event: (stage, iteration, phase, chunk, microbatch)."""
    stage = c["stage"].astype(np.int64)
    iteration = c["iteration"].astype(np.int64)
    chunk = c["chunk"].astype(np.int64)
    microbatch = c["microbatch"].astype(np.int64) + 1  # OPTIMIZER's -1 becomes 0
    phase = c["phase"].astype(np.int64)
    return ((((stage << 24) | iteration) << 4 | phase) << 12 | chunk) << 16 | microbatch


def _check_repeats(run: _Run, *, lenient: bool, report: StructureReport) -> None:
    c = run.columns
    compute = np.flatnonzero(c["kind"] == _COMPUTE)
    keys = _work_key({name: c[name][compute] for name in ("stage", "iteration", "chunk", "microbatch", "phase")})
    order = np.argsort(keys, kind="stable")
    repeat = np.zeros(len(keys), dtype=bool)
    repeat[order[1:]] = keys[order[1:]] == keys[order[:-1]]
    if not repeat.any():
        return
    if not lenient:
        first = int(compute[np.flatnonzero(repeat)[0]])
        phase = PHASES[int(c["phase"][first])]
        what = (
            f"{phase} of iteration {int(c['iteration'][first])}"
            + (f" microbatch {int(c['microbatch'][first])}" if int(c["phase"][first]) != _OPT else "")
            + (f" chunk {int(c['chunk'][first])}" if int(c["chunk"][first]) else "")
        )
        path, lines = run.event_lines(first, limit=2)
        again = f" (first on line {lines[0]})" if len(lines) == 2 else ""
        raise TraceError(
            path,
            f"logs the {what} on stage {int(c['stage'][first])} a second time{again}",
            line=lines[-1] if lines else None,
            field="phase",
            hint="each compute event is logged once: remove the repeated line (a log appended twice?), " + _LENIENT,
        )
    drop = np.zeros(len(c["stage"]), dtype=bool)
    drop[compute[repeat]] = True
    report.dropped["repeated event"] = int(drop.sum())
    _keep(c, ~drop)


def _missing(
    c: dict[str, np.ndarray],
    compute: np.ndarray,
    stage: int,
    iteration: int,
    *,
    microbatches: int,
    vp: int,
    split_backward: bool,
) -> str:
    """What a stage lacks of one iteration, e.g. "FORWARD mb 1; BACKWARD mb 0, 1" (chunks named when > 1)."""
    here = compute & (c["stage"] == stage) & (c["iteration"] == iteration)
    have = set(zip(c["phase"][here].tolist(), c["chunk"][here].tolist(), c["microbatch"][here].tolist()))
    phases = (_F, _BB, _BW) if split_backward else (_F, _B)
    parts = []
    for phase in phases:
        # the first seven, found lazily: the configuration may name far more microbatches than the trace has (a
        # split backward stands for a whole one)
        wanted = (
            (chunk, mb)
            for chunk in range(vp)
            for mb in range(microbatches)
            if (phase, chunk, mb) not in have and not (phase == _B and (_BB, chunk, mb) in have)
        )
        gone = list(itertools.islice(wanted, 7))
        if gone:
            shown = ", ".join(f"{mb}" if vp == 1 else f"{mb}/chunk {chunk}" for chunk, mb in gone[:6])
            parts.append(f"{PHASES[phase]} mb {shown}{' ...' if len(gone) > 6 else ''}")
    return "; ".join(parts)


def _check_complete(
    run: _Run, *, pp: int, vp: int, microbatches: int, lenient: bool, report: StructureReport, config_source: Any
) -> None:
    c = run.columns
    compute = c["kind"] == _COMPUTE
    iterations = np.unique(c["iteration"][compute])
    if len(iterations) == 0:
        return
    holes = np.flatnonzero(np.diff(iterations) != 1)
    if len(holes):  # no stage logged these: a hole in the throughput window, never mended by dropping
        k = int(holes[0])
        after = int(iterations[k + 1])
        first = int(np.flatnonzero(compute & (c["iteration"] == after))[0])
        gap = (
            f"iteration {after - 1}"
            if after - int(iterations[k]) == 2
            else f"iterations {int(iterations[k]) + 1}..{after - 1}"
        )
        raise run.fail(
            first,
            f"the trace goes from iteration {int(iterations[k])} to {after}: no stage logged {gap}",
            "iteration",
            "a run's iterations are numbered one after another: re-copy the logs from the job (lines of "
            "those iterations were lost on every rank)",
        )
    expected = microbatches * vp
    counts = np.zeros((pp, len(iterations), len(PHASES)), dtype=np.int64)
    it_idx = np.searchsorted(iterations, c["iteration"][compute])
    np.add.at(counts, (c["stage"][compute], it_idx, c["phase"][compute]), 1)
    forward = counts[:, :, _F]
    backward = counts[:, :, _B] + counts[:, :, _BB]
    weight = counts[:, :, _BW]
    optimizer = counts[:, :, _OPT]
    # a stage logs its optimizer step in every iteration or in none (a trace without them: see the quality flags)
    logs_optimizer = np.any(optimizer, axis=1, keepdims=True)
    complete = (
        (forward == expected)
        & (backward == expected)
        & ((weight == 0) | (weight == counts[:, :, _BB]))
        & ((optimizer == 1) | ~logs_optimizer)
    )
    whole = complete.all(axis=0)  # per iteration: every stage complete
    if whole.all():
        return
    bad = np.flatnonzero(~whole)
    edge = np.zeros(len(iterations), dtype=bool)
    k = 0
    while k < len(iterations) and not whole[k]:
        edge[k] = True
        k += 1
    k = len(iterations) - 1
    while k >= 0 and not whole[k]:
        edge[k] = True
        k -= 1
    if lenient and whole.any():
        cut = bad[edge[bad]]
        if len(cut):
            dropped = [int(iterations[k]) for k in cut]
            report.dropped_iterations = dropped
            report.notes.append(
                f"dropped iteration(s) {dropped} at the start or end of the trace: not every stage "
                "logged them completely"
            )
            _keep(c, ~np.isin(c["iteration"], iterations[cut]))
        middle = [int(iterations[k]) for k in bad[~edge[bad]]]
        if middle:  # dropping them would leave a hole in the throughput window: kept, and said
            report.incomplete_iterations = middle
            report.notes.append(
                f"iteration(s) {middle} miss events on some stage (dropped lines) and are kept: "
                "the run's utilization and bubble read them as idle time"
            )
        return
    k = int(bad[0])
    stage = int(np.flatnonzero(~complete[:, k])[0])
    iteration = int(iterations[k])
    path = run.path_of_stage(stage)
    split_backward = bool(counts[stage, :, _BB].any())
    found = {
        name: int(counts[stage, k, phase])
        for name, phase in (
            ("FORWARD", _F),
            ("BACKWARD", _B),
            ("BACKWARD_B", _BB),
            ("BACKWARD_W", _BW),
            ("OPTIMIZER", _OPT),
        )
    }
    shown = ", ".join(
        f"{n} {name}"
        for name, n in found.items()
        if n or name in ("FORWARD", "BACKWARD_B" if split_backward else "BACKWARD")
    )
    wanted = (
        f"{expected} FORWARD and {expected} {'BACKWARD_B (each with its BACKWARD_W, when W is logged)' if split_backward else 'BACKWARD'}"
        f" ({microbatches} microbatch(es) x {vp} chunk(s))"
        + (", and one OPTIMIZER as in its other iterations" if logs_optimizer[stage, 0] else "")
    )
    missing = [
        m
        for m in [
            _missing(c, compute, stage, iteration, microbatches=microbatches, vp=vp, split_backward=split_backward),
            "OPTIMIZER" if logs_optimizer[stage, 0] and not found["OPTIMIZER"] else "",
        ]
        if m
    ]
    if split_backward and found["BACKWARD_W"] not in (0, found["BACKWARD_B"]) and not missing:
        missing.append(f"{found['BACKWARD_W']} BACKWARD_W for {found['BACKWARD_B']} BACKWARD_B")
    detail = f"; missing: {'; '.join(missing)}" if missing else ""
    everywhere = not whole.any() and len(set(forward.ravel().tolist())) == 1 and int(forward[stage, k]) != expected
    if everywhere:
        hint = (
            f"every iteration of every stage has {int(forward[stage, k])} FORWARD events: the microbatch count "
            f"in {config_source} (--global-batch-size / (--micro-batch-size x data-parallel size)) or its "
            "virtual pipeline setting is wrong; fix the configuration"
        )
    elif not whole.any():
        hint = "no iteration is complete on every stage: re-copy the logs from the job"
    elif edge[k]:
        hint = (
            "the log looks cut short (the job died, or the copy is incomplete): re-copy this rank's log, or "
            "ingest with --lenient to keep only the iterations every stage logged in full"
        )
    else:
        hint = "events of an iteration between complete ones are missing: re-copy this rank's log from the job"
    logged = locate_all(path, iteration=iteration) if any(found.values()) else []
    line = logged[-1] if logged else None
    where = f"the last event it logged for it is on line {line}" if line else "it logged no event for it"
    raise TraceError(
        path,
        f"stage {stage} logged {shown} event(s) of iteration {iteration}, expected {wanted}{detail}; {where}",
        line=line,
        field="iteration",
        hint=hint,
    )


def _check_iteration_order(run: _Run, *, pp: int) -> None:
    c = run.columns
    compute = np.flatnonzero(c["kind"] == _COMPUTE)
    for stage in range(pp):
        rows = compute[c["stage"][compute] == stage]
        if len(rows) == 0:
            continue
        its = c["iteration"][rows]
        iterations, inverse = np.unique(its, return_inverse=True)
        if len(iterations) < 2:
            continue
        first_start = np.full(len(iterations), np.iinfo(np.int64).max)
        last_end = np.full(len(iterations), np.iinfo(np.int64).min)
        np.minimum.at(first_start, inverse, c["start_ns"][rows])
        np.maximum.at(last_end, inverse, c["end_ns"][rows])
        early = np.flatnonzero(first_start[1:] < last_end[:-1])
        if len(early):
            k = int(early[0])
            nxt = int(iterations[k + 1])
            starts = rows[its == nxt]
            first = int(starts[np.argmin(c["start_ns"][starts])])
            gap_ms = (last_end[k] - first_start[k + 1]) / 1e6
            raise run.fail(
                first,
                f"iteration {nxt} on stage {stage} starts {gap_ms:.3f} ms before iteration "
                f"{int(iterations[k])} ends: the timestamps go backwards",
                "start_wall_ns",
                "a stage runs its iterations one after another; the host clock jumped or lines were "
                "edited: re-trace the run, or remove the bad iteration's lines",
            )


def _check_causality(run: _Run, *, pp: int, vp: int, skew_ms: float) -> None:
    """A stage's forward starts after the feeding virtual stage's forward ends; backward the other way."""
    c = run.columns
    if pp * vp < 2:
        return
    compute = c["kind"] == _COMPUTE
    skew_ns = int(skew_ms * 1e6)
    for phases, step, what in (((_F,), -1, "forward"), ((_B, _BB), +1, "backward")):
        rows = np.flatnonzero(compute & np.isin(c["phase"], phases))
        if len(rows) == 0:
            continue
        virtual = c["chunk"][rows].astype(np.int64) * pp + c["stage"][rows]
        # (iteration, microbatch) -> position; every virtual stage has each pair once after the checks above
        pair = c["iteration"][rows].astype(np.int64) << 20 | c["microbatch"][rows].astype(np.int64)
        pairs, slot = np.unique(pair, return_inverse=True)
        n_virtual = pp * vp
        start = np.full((len(pairs), n_virtual), -1, dtype=np.int64)
        end = np.full((len(pairs), n_virtual), -1, dtype=np.int64)
        row_at = np.full((len(pairs), n_virtual), -1, dtype=np.int64)
        start[slot, virtual] = c["start_ns"][rows]
        end[slot, virtual] = c["end_ns"][rows]
        row_at[slot, virtual] = rows
        if step < 0:  # forward: v needs v - 1
            consumer_start, producer_end = start[:, 1:], end[:, :-1]
            consumer_rows, producer_v = row_at[:, 1:], np.arange(n_virtual - 1)
        else:  # backward: v needs v + 1
            consumer_start, producer_end = start[:, :-1], end[:, 1:]
            consumer_rows, producer_v = row_at[:, :-1], np.arange(1, n_virtual)
        present = (consumer_start >= 0) & (producer_end >= 0)
        early = present & (consumer_start < producer_end - skew_ns)
        if not early.any():
            continue
        p, q = (int(x[0]) for x in np.nonzero(early))
        first = int(consumer_rows[p, q])
        lead_ms = (producer_end[p, q] - consumer_start[p, q]) / 1e6
        producer = int(producer_v[q]) % pp
        raise run.fail(
            first,
            f"stage {int(c['stage'][first])} starts the {what} of iteration "
            f"{int(c['iteration'][first])} microbatch {int(c['microbatch'][first])} {lead_ms:.3f} ms "
            f"before stage {producer}, which feeds it, finished its own",
            "start_wall_ns",
            f"the nodes' clocks disagree by more than --clock-skew-ms {skew_ms:g}: synchronize them "
            "(chrony/NTP) before tracing, or pass a larger --clock-skew-ms (hop and idle times then "
            "carry the skew)",
        )
