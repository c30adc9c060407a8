"""Store room: one run's reading, for ingest: a job directory's spec and truth, its events normalized into the
fixture's Parquet file (`read_run`), timed by the pacing pipeline, with the per-kernel truth of its profiler traces
where it has them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.spec import Spec, build_spec, coordinates_of
from hops_calib.store.digests import events_fingerprint
from hops_calib.store.writer import write_events
from hops_calib.trace import TraceError, read_manifest
from hops_calib.trace.events import EVENT_DTYPES
from hops_calib.trace.job import TRACE_DIR
from hops_calib.trace.rank_traces import EVENT_LOG, TracePlan, plan_traces, read_rank_trace
from hops_calib.trace.structure import DEFAULT_SKEW_MS, check_structure
from hops_calib.truth import Truth, compact_timeline, compute_truth, kernel_truth, megatron_interleaved_order


@dataclass
class RunData:
    """Everything a fixture holds, read from one job directory."""

    spec: Spec
    truth: Truth
    quality: dict[str, Any]
    hostnames: list[str]
    warnings: list[str]
    fingerprint: str = ""  # `events_fingerprint`: what the run measured, whatever its name or clocks


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate rank columns into preallocated arrays, freeing each rank's piece once copied."""
    total = sum(len(part["start_ns"]) for part in parts)
    out = {}
    for name, dtype in EVENT_DTYPES.items():
        column = np.empty(total, dtype=dtype)
        offset = 0
        for part in parts:
            piece = part.pop(name)
            column[offset : offset + len(piece)] = piece
            offset += len(piece)
            del piece
        out[name] = column
    return out


def _pacing_pipeline(spec: Spec, ends: dict[int, int]) -> dict[int, int]:
    """stage -> rank of the pipeline that paces the run: of the tp x dp pipelines (the ranks with one tensor- and
    one data-parallel index, one per stage, which exchange activations with each other), the one whose traced
    window ends last (`ends`: each rank's last event end), ties to the lowest indices. Measured, not assumed; one
    whole pipeline, so every hop's sender and receiver are the ranks that really exchanged."""
    best: tuple[int, dict[int, int]] | None = None
    for dp_rank in range(spec.dp):
        for tp_rank in range(spec.tp):
            ranks = {stage: spec.rank(tp_rank, dp_rank, stage) for stage in range(spec.pp)}
            end = max(ends[rank] for rank in ranks.values())
            if best is None or end > best[0]:
                best = (end, ranks)
    assert best is not None
    return best[1]


def _collective_summary(
    pacing: dict[int, tuple[int, dict[str, np.ndarray]]], collectives: dict[int, list], spec: Spec
) -> list[dict]:
    """Per stage, what its pacing rank's `collective` lines say (`trace.collectives.summarize`)."""
    from hops_calib.trace.collectives import summarize

    return [
        {
            "stage": stage,
            "rank": rank,
            **summarize(collectives.get(rank, []), columns, spec.iterations, spec.microbatches),
        }
        for stage, (rank, columns) in sorted(pacing.items())
    ]


def read_run(
    job_dir: Path,
    events_path: Path,
    lenient: bool = False,
    skew_ms: float = DEFAULT_SKEW_MS,
    plan: TracePlan | None = None,
) -> RunData:
    """Spec and truth of one job directory, its normalized events written to `events_path` (Parquet); `plan`:
    which traces give the timing and the per-kernel truth (default: `plan_traces`' auto choice).

    Raises TraceError on bad input (see `hops_calib.trace`). Memory stays near
    the compact event columns (~35 bytes per event), so a 2 GB trace fits in
    well under 1 GB.
    """
    notes: list[str] = []
    spec = build_spec(job_dir, notes, simulable=True)
    plan = plan_traces(job_dir) if plan is None else plan
    source, files = plan.timing, plan.files
    ranks = spec.gpus
    if sorted(files) != list(range(ranks)):
        logs = sorted(files)
        shown = f"{logs}" if len(logs) <= 16 else f"[{', '.join(map(str, logs[:16]))}, ...] ({len(logs)} logs)"
        raise TraceError(
            job_dir / TRACE_DIR,
            f"has logs of ranks {shown} but the configuration has "
            f"{ranks} ranks ({spec.pp} pipeline stages x tp {spec.tp} x dp {spec.dp}: 0..{ranks - 1})",
            field="rank<r>.jsonl",
            hint="stage counts of configuration and trace disagree: copy every rank's log, or fix "
            "--pipeline-model-parallel-size (and the tensor and data parallel sizes)",
        )
    device_stage = {device: stage for stage, device in enumerate(spec.device_ids)}
    parts: dict[int, list[tuple[int, dict[str, np.ndarray]]]] = {}  # per stage: (rank, its columns)
    hostnames: list[str] = []
    dropped: dict[str, dict[str, int]] = {}
    collectives: dict[int, list] = {}
    kernel_rows: dict[int, Any] = {}  # rank -> its profiler trace's kernel rows
    for rank, path in files.items():
        # Megatron's rank order says which stage a rank runs (rank r runs stage r with t = d = 1)
        stage = coordinates_of(rank, spec.rank_order, {"tp": spec.tp, "dp": spec.dp, "pp": spec.pp})["pp"]
        columns, report, kernels = read_rank_trace(
            source,
            path,
            rank=rank,
            stage=stage,
            pp=spec.pp,
            vp=spec.vp,
            microbatches=spec.microbatches,
            device_stage=device_stage,
            lenient=lenient,
            pass_order=_pass_order(spec),
        )
        if kernels is not None:
            kernel_rows[rank] = kernels
        if report.events == 0:
            after = f" after dropping {sum(report.dropped.values())} bad lines" if report.dropped else ""
            raise TraceError(
                path,
                f"rank {rank} has no events{after}",
                hint="every pipeline stage must log its events; re-copy this rank's log from the job",
            )
        if report.dropped:
            dropped[path.name] = dict(report.dropped)
        hostnames.append(report.hostname)
        if report.collectives:
            collectives[rank] = report.collectives
        order = np.lexsort((columns["end_ns"], columns["start_ns"]))  # lines are not in time order
        parts.setdefault(stage, []).append((rank, {name: values[order] for name, values in columns.items()}))
        del columns, order
    by_rank = {rank: columns for group in parts.values() for rank, columns in group}
    ends = {rank: int(columns["end_ns"].max()) if len(columns["end_ns"]) else -1 for rank, columns in by_rank.items()}
    pacing = {stage: (rank, by_rank[rank]) for stage, rank in _pacing_pipeline(spec, ends).items()}
    if ranks > spec.pp:
        last = {stage: max(group, key=lambda item: ends[item[0]])[0] for stage, group in parts.items()}
        notes.append(
            "the timeline is the pacing pipeline's (of the tp x dp pipelines, the one whose window ends "
            "last): ranks "
            + ", ".join(f"{rank} (stage {stage})" for stage, (rank, _c) in sorted(pacing.items()))
            + "; the rank of each stage whose window ends last: "
            + ", ".join(f"{rank} (stage {stage})" for stage, rank in sorted(last.items()))
        )
    files = {rank: files[rank] for rank, _c in pacing.values()}
    collective_summary = _collective_summary(pacing, collectives, spec) if collectives else None
    columns = _concat([columns for _stage, (_rank, columns) in sorted(pacing.items())])
    del parts
    stages_seen = np.unique(columns["stage"])
    if stages_seen.tolist() != list(range(spec.pp)):
        raise TraceError(
            job_dir / TRACE_DIR,
            f"events name stages {stages_seen.tolist()} but the configuration has {spec.pp} pipeline stages",
            field="stage",
            hint="stage counts of configuration and trace disagree; check the rank logs and "
            "--pipeline-model-parallel-size",
        )
    structure = check_structure(
        columns,
        pp=spec.pp,
        vp=spec.vp,
        microbatches=spec.microbatches,
        rank_paths=files,
        trace_dir=job_dir / TRACE_DIR,
        lenient=lenient,
        skew_ms=skew_ms,
    )
    if structure.dropped:
        dropped["(run)"] = dict(structure.dropped)
    notes.extend(structure.notes)
    # Ranks are time-sorted and come in rank order: that is (stage, start) order when rank r runs stage r.
    stages = columns["stage"]
    if len(stages) > 1 and not (np.all(stages[1:] >= stages[:-1]) and _starts_sorted_within_stage(columns)):
        order = np.lexsort((columns["end_ns"], columns["start_ns"], stages))
        for name in columns:
            columns[name] = columns[name][order]
        del order
    n_events = len(stages)
    del stages
    write_events(columns, events_path)
    fingerprint = events_fingerprint(columns, json.loads(spec.to_json()))
    t0_ns = int(columns["start_ns"].min())
    timeline = compact_timeline(columns, t0_ns)
    del columns
    truth = compute_truth(timeline, spec.pp, t0_ns)
    del timeline
    if kernel_rows:  # the pacing pipeline's ranks, one per stage, as the timeline
        truth = replace(
            truth,
            kernels=kernel_truth(
                [kernel_rows[rank] for rank, _c in pacing.values() if rank in kernel_rows],
                max(len(truth.iterations), 1),
            ),
        )
    elif plan.kernels:
        truth = replace(truth, kernels=_beside_kernels(plan, spec, truth, pacing, notes))
    elif plan.note:
        notes.append(f"no per-kernel truth: {plan.note}")

    warnings = list(notes)
    generated = read_manifest(job_dir).get("generated")
    if generated:
        warnings.insert(
            0,
            f"GENERATED, not a real run (manifest.yaml: generated: {str(generated)[:120]}): its "
            "timings show that the readers work, not what a device does; keep it out of calibration",
        )
    if len(truth.iterations) != spec.iterations:
        warnings.append(f"the trace has {len(truth.iterations)} iterations; --train-iters implies {spec.iterations}")
    if truth.microbatches != spec.microbatches:
        warnings.append(
            f"the trace has {truth.microbatches} microbatches per iteration; the configuration implies "
            f"{spec.microbatches}"
        )
    # (with one microbatch per iteration GPipe's order and 1F1B's are the same: nothing to tell apart)
    alike = spec.microbatches == 1 and {truth.observed_schedule, spec.schedule} <= {"1f1b", "gpipe"}
    if truth.observed_schedule != spec.schedule and not alike:
        warnings.append(f"observed schedule {truth.observed_schedule} but the configuration asks for {spec.schedule}")
    if spec.declared_schedule and spec.declared_schedule != truth.observed_schedule:
        warnings.append(
            f"declared schedule {spec.declared_schedule!r} disagrees with the observed "
            f"{truth.observed_schedule!r} (the observed order is recorded; the label is kept as "
            "declared_schedule)"
        )
    missing_optimizer = [s for s, v in enumerate(truth.optimizer_ms_per_stage) if v is None]
    if missing_optimizer:
        warnings.append(f"no OPTIMIZER events on stages {missing_optimizer}")
    quality = {
        "lenient": lenient,
        "dropped_lines": sum(sum(reasons.values()) for reasons in dropped.values()),
        "dropped": dropped,
        "schedule_agreement": truth.schedule_agreement,
        "declared_schedule_disagrees": bool(
            spec.declared_schedule and spec.declared_schedule != truth.observed_schedule
        ),
        "missing_optimizer_stages": missing_optimizer,
        "dropped_iterations": structure.dropped_iterations,
        "incomplete_iterations": structure.incomplete_iterations,
        "events": int(n_events),
        "warnings": warnings,
    }
    if source != EVENT_LOG:  # (event-log fixtures stay as they were)
        quality["trace_source"] = source
    if plan.kernels and truth.kernels:
        quality["kernel_source"] = plan.kernels
    if collective_summary is not None:  # only runs whose logs have collective lines (old fixtures stay as they were)
        quality["collectives"] = collective_summary
    return RunData(
        spec=spec, truth=truth, quality=quality, hostnames=hostnames, warnings=warnings, fingerprint=fingerprint
    )


def _beside_kernels(
    plan: TracePlan, spec: Spec, truth: Truth, pacing: dict[int, tuple[int, Any]], notes: list[str]
) -> tuple[Any, ...]:
    """The per-kernel truth of the profiler traces beside the event logs (`plan.kernels`), of the pacing
    pipeline's ranks, on the iterations the event logs' truth holds (both number them by Megatron's iteration:
    ProfilerStep#N, the log's `iteration`); () with a note saying why where the traces cannot give it."""
    from hops_calib.trace.rank_traces import describe_source

    kind = plan.kernels
    assert kind is not None, "a plan without a kernel source has no kernels beside its event logs"
    shown = describe_source(kind)
    device_stage = {device: stage for stage, device in enumerate(spec.device_ids)}
    rows, covered = [], set(truth.iterations)
    for stage, (rank, _columns) in sorted(pacing.items()):
        path = plan.kernel_files.get(rank)
        if path is None:
            notes.append(
                f"no per-kernel truth: {shown} holds no trace of rank {rank} (stage {stage}), which the "
                "timeline's pipeline runs; profile every rank (--profile-ranks) to get it"
            )
            return ()
        try:
            columns, _report, kernels = read_rank_trace(
                kind,
                path,
                rank=rank,
                stage=stage,
                pp=spec.pp,
                vp=spec.vp,
                microbatches=spec.microbatches,
                device_stage=device_stage,
                pass_order=_pass_order(spec),
            )
        except TraceError as error:
            notes.append(
                f"no per-kernel truth (the timing is the event logs'): {error}; fix or remove the "
                f"trace, or ingest with --source events to leave it out"
            )
            return ()
        if kernels is None or not len(kernels.duration_ns):
            notes.append(f"no per-kernel truth: {path} holds no kernels or operators in its profiled steps")
            return ()
        covered &= set(np.unique(columns["iteration"]).tolist())
        rows.append(kernels)
    if not covered:
        notes.append(
            f"no per-kernel truth: the profiler traces ({shown}) and the event logs share no iteration "
            f"(the logs hold {list(truth.iterations)}); profile the logged iterations "
            "(--profile-step-start/--profile-step-end)"
        )
        return ()
    if covered != set(truth.iterations):
        notes.append(
            f"the per-kernel truth covers iterations {sorted(covered)} of the event logs' "
            f"{list(truth.iterations)} (the profiled ones)"
        )
    keep = np.array(sorted(covered), dtype=np.int64)
    aligned = [
        replace(
            part,
            **{
                name: getattr(part, name)[np.isin(part.iteration, keep)]
                for name in ("name_id", "shape_id", "phase", "iteration", "duration_ns")
            },
        )
        for part in rows
    ]
    return kernel_truth(aligned, len(covered))


def _pass_order(spec: Spec) -> Callable[[int, int], list[tuple[bool, int]]]:
    """(is_forward, chunk) of each pass of an iteration on a stage, for a profiler trace's schedule steps."""
    return lambda stage, microbatches: megatron_interleaved_order(spec.pp, stage, microbatches, spec.vp)


def _starts_sorted_within_stage(columns: dict[str, np.ndarray]) -> bool:
    """Whether (start, end) never decrease between neighbours of the same stage."""
    stage, start, end = columns["stage"], columns["start_ns"], columns["end_ns"]
    same = stage[1:] == stage[:-1]
    later = (start[1:] > start[:-1]) | ((start[1:] == start[:-1]) & (end[1:] >= end[:-1]))
    return bool(np.all(later | ~same))
