"""Store room: ingest job directories into the fixture store (spec + events + truth per run).

One bad run never stops the others: it is rejected with the reader's message
(file, line, field, what to do) and nothing of it is written. An unchanged run
(same content hash) is skipped without touching a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib import __version__
from hops_calib.errors import DiskFull
from hops_calib.spec import Spec, build_spec, coordinates_of
from hops_calib.store.digests import (
    DEFAULT_LOCK_TIMEOUT_S,
    EVENTS_FILE,
    FILE_DIGESTS,
    FINGERPRINT,
    INDEX,
    StoreError,
    events_fingerprint,
    file_digest,
)
from hops_calib.store.fixture import check_fixture_id, recorded_source, source_path
from hops_calib.store.guard import stored_content_hash
from hops_calib.store.measured_ingest import expected_runs, ingest_measured, is_measured_source, read_context
from hops_calib.store.split import (
    DEFAULT_TEST_FRACTION,
    SOURCE_FILE,
    SPLITS,
    STATED,
    Stated,
    assigned_split,
    group_of,
    stated_split,
)
from hops_calib.store.writer import FixtureStore, write_events
from hops_calib.trace import TraceError, find_job_dirs, read_manifest, run_id_of
from hops_calib.trace.dgxc import dgxc_table_in
from hops_calib.trace.events import EVENT_DTYPES
from hops_calib.trace.job import TRACE_DIR
from hops_calib.trace.measured import RunHardware
from hops_calib.trace.megatron_log import DEFAULT_WARMUP_ITERATIONS
from hops_calib.trace.rank_traces import AUTO, EVENT_LOG, SOURCE_CHOICES, TracePlan, plan_traces, read_rank_trace
from hops_calib.trace.reading import open_regular
from hops_calib.trace.structure import DEFAULT_SKEW_MS, check_structure
from hops_calib.truth import Truth, compact_timeline, compute_truth, kernel_truth, megatron_interleaved_order

# Bump when the fixture content for the same input changes (new columns, new truth fields, ...):
# it is part of the content hash, so a new version re-ingests every run once.
INGEST_VERSION = 3
SPLIT_CHOICES = (STATED, "auto") + SPLITS


@dataclass
class RunOutcome:
    source: Path
    run_id: str | None = None
    status: str = "rejected"  # new, updated, unchanged, rejected
    split: str | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    kind: str = "events"  # or "iteration" (a run of a log or table)
    sources: str | None = None  # a run with events: which trace source gave what (`TracePlan.describe`)
    profiled: bool = False  # its job directory holds a profiler trace (Kineto, Nsight Systems)
    split_from: str | None = None  # why the run went to its split (kept, --split, the source's file, your own)
    not_priced: str | None = None  # an iteration-level run the cost model does not price: why

    @property
    def priced(self) -> bool | None:
        """Whether the cost model prices the run as ingested (None: a run with events, whose launch ingest checks)."""
        if self.kind != "iteration" or self.status == "rejected":
            return None
        return self.not_priced is None


@dataclass
class IngestReport:
    store: Path
    outcomes: list[RunOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the search skipped (hidden jobs, links not followed)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def rejected(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if o.status == "rejected"]

    @property
    def ok(self) -> bool:
        return not self.rejected

    @property
    def stored(self) -> bool:
        """Whether some run of the sources is in the store now (written, or there already)."""
        return any(o.status in ("new", "updated", "unchanged") for o in self.outcomes)


@dataclass
class RunData:
    """Everything a fixture holds, read from one job directory."""

    spec: Spec
    truth: Truth
    quality: dict[str, Any]
    hostnames: list[str]
    warnings: list[str]
    fingerprint: str = ""  # `events_fingerprint`: what the run measured, whatever its name or clocks


def content_hash(job_dir: Path, lenient: bool, skew_ms: float = DEFAULT_SKEW_MS, plan_key: str = "") -> str:
    """sha256 over every file of the job directory (relative names and bytes), the ingest version and mode
    (a clock-skew allowance other than the default, and what is read of a directory holding two trace sources,
    `TracePlan.key`, are part of the mode)."""
    mode = (f"lenient={lenient}" + (f" skew_ms={skew_ms!r}" if skew_ms != DEFAULT_SKEW_MS else "")
            + (f" {plan_key}" if plan_key else ""))
    outer = hashlib.sha256(f"hops-calib ingest v{INGEST_VERSION} {mode}\n".encode())
    files = sorted(p for p in job_dir.rglob("*") if p.is_file())  # (rglob never walks into a linked folder)
    for path in files:
        outer.update(os.fsencode(path.relative_to(job_dir).as_posix()) + b"\0")  # (UTF-8, or the name's own bytes)
        with open_regular(path) as handle:
            outer.update(hashlib.file_digest(handle, "sha256").digest())
    return outer.hexdigest()


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate rank columns into preallocated arrays, freeing each rank's piece once copied."""
    total = sum(len(part["start_ns"]) for part in parts)
    out = {}
    for name, dtype in EVENT_DTYPES.items():
        column = np.empty(total, dtype=dtype)
        offset = 0
        for part in parts:
            piece = part.pop(name)
            column[offset:offset + len(piece)] = piece
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


def _collective_summary(pacing: dict[int, tuple[int, dict[str, np.ndarray]]], collectives: dict[int, list],
                        spec: Spec) -> list[dict]:
    """Per stage, what its pacing rank's `collective` lines say (`trace.collectives.summarize`)."""
    from hops_calib.trace.collectives import summarize

    return [{"stage": stage, "rank": rank,
             **summarize(collectives.get(rank, []), columns, spec.iterations, spec.microbatches)}
            for stage, (rank, columns) in sorted(pacing.items())]


def read_run(job_dir: Path, events_path: Path, lenient: bool = False, skew_ms: float = DEFAULT_SKEW_MS,
             plan: TracePlan | None = None) -> RunData:
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
        raise TraceError(job_dir / TRACE_DIR, f"has logs of ranks {shown} but the configuration has "
                         f"{ranks} ranks ({spec.pp} pipeline stages x tp {spec.tp} x dp {spec.dp}: 0..{ranks - 1})",
                         field="rank<r>.jsonl",
                         hint="stage counts of configuration and trace disagree: copy every rank's log, or fix "
                              "--pipeline-model-parallel-size (and the tensor and data parallel sizes)")
    device_stage = {device: stage for stage, device in enumerate(spec.device_ids)}
    parts: dict[int, list[tuple[int, dict[str, np.ndarray]]]] = {}  # per stage: (rank, its columns)
    hostnames: list[str] = []
    dropped: dict[str, dict[str, int]] = {}
    collectives: dict[int, list] = {}
    kernel_rows: dict[int, Any] = {}  # rank -> its profiler trace's kernel rows
    for rank, path in files.items():
        # Megatron's rank order says which stage a rank runs (rank r runs stage r with t = d = 1)
        stage = coordinates_of(rank, spec.rank_order, {"tp": spec.tp, "dp": spec.dp, "pp": spec.pp})["pp"]
        columns, report, kernels = read_rank_trace(source, path, rank=rank, stage=stage, pp=spec.pp, vp=spec.vp,
                                                   microbatches=spec.microbatches, device_stage=device_stage,
                                                   lenient=lenient, pass_order=_pass_order(spec))
        if kernels is not None:
            kernel_rows[rank] = kernels
        if report.events == 0:
            after = f" after dropping {sum(report.dropped.values())} bad lines" if report.dropped else ""
            raise TraceError(path, f"rank {rank} has no events{after}",
                             hint="every pipeline stage must log its events; re-copy this rank's log from the job")
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
        notes.append("the timeline is the pacing pipeline's (of the tp x dp pipelines, the one whose window ends "
                     "last): ranks " + ", ".join(f"{rank} (stage {stage})" for stage, (rank, _c) in sorted(pacing.items()))
                     + "; the rank of each stage whose window ends last: "
                     + ", ".join(f"{rank} (stage {stage})" for stage, rank in sorted(last.items())))
    files = {rank: files[rank] for rank, _c in pacing.values()}
    collective_summary = _collective_summary(pacing, collectives, spec) if collectives else None
    columns = _concat([columns for _stage, (_rank, columns) in sorted(pacing.items())])
    del parts
    stages_seen = np.unique(columns["stage"])
    if stages_seen.tolist() != list(range(spec.pp)):
        raise TraceError(job_dir / TRACE_DIR, f"events name stages {stages_seen.tolist()} but the configuration has "
                         f"{spec.pp} pipeline stages", field="stage",
                         hint="stage counts of configuration and trace disagree; check the rank logs and "
                              "--pipeline-model-parallel-size")
    structure = check_structure(columns, pp=spec.pp, vp=spec.vp, microbatches=spec.microbatches, rank_paths=files,
                                trace_dir=job_dir / TRACE_DIR, lenient=lenient, skew_ms=skew_ms)
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
        truth = replace(truth, kernels=kernel_truth([kernel_rows[rank] for rank, _c in pacing.values()
                                                     if rank in kernel_rows], max(len(truth.iterations), 1)))
    elif plan.kernels:
        truth = replace(truth, kernels=_beside_kernels(plan, spec, truth, pacing, notes))
    elif plan.note:
        notes.append(f"no per-kernel truth: {plan.note}")

    warnings = list(notes)
    generated = read_manifest(job_dir).get("generated")
    if generated:
        warnings.insert(0, f"GENERATED, not a real run (manifest.yaml: generated: {str(generated)[:120]}): its "
                           "timings show that the readers work, not what a device does; keep it out of calibration")
    if len(truth.iterations) != spec.iterations:
        warnings.append(f"the trace has {len(truth.iterations)} iterations; --train-iters implies {spec.iterations}")
    if truth.microbatches != spec.microbatches:
        warnings.append(f"the trace has {truth.microbatches} microbatches per iteration; the configuration implies "
                        f"{spec.microbatches}")
    # (with one microbatch per iteration GPipe's order and 1F1B's are the same: nothing to tell apart)
    alike = spec.microbatches == 1 and {truth.observed_schedule, spec.schedule} <= {"1f1b", "gpipe"}
    if truth.observed_schedule != spec.schedule and not alike:
        warnings.append(f"observed schedule {truth.observed_schedule} but the configuration asks for {spec.schedule}")
    if spec.declared_schedule and spec.declared_schedule != truth.observed_schedule:
        warnings.append(f"declared schedule {spec.declared_schedule!r} disagrees with the observed "
                        f"{truth.observed_schedule!r} (the observed order is recorded; the label is kept as "
                        "declared_schedule)")
    missing_optimizer = [s for s, v in enumerate(truth.optimizer_ms_per_stage) if v is None]
    if missing_optimizer:
        warnings.append(f"no OPTIMIZER events on stages {missing_optimizer}")
    quality = {
        "lenient": lenient,
        "dropped_lines": sum(sum(reasons.values()) for reasons in dropped.values()),
        "dropped": dropped,
        "schedule_agreement": truth.schedule_agreement,
        "declared_schedule_disagrees": bool(spec.declared_schedule
                                            and spec.declared_schedule != truth.observed_schedule),
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
    return RunData(spec=spec, truth=truth, quality=quality, hostnames=hostnames, warnings=warnings,
                   fingerprint=fingerprint)


def _beside_kernels(plan: TracePlan, spec: Spec, truth: Truth, pacing: dict[int, tuple[int, Any]],
                    notes: list[str]) -> tuple[Any, ...]:
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
            notes.append(f"no per-kernel truth: {shown} holds no trace of rank {rank} (stage {stage}), which the "
                         "timeline's pipeline runs; profile every rank (--profile-ranks) to get it")
            return ()
        try:
            columns, _report, kernels = read_rank_trace(kind, path, rank=rank, stage=stage, pp=spec.pp,
                                                        vp=spec.vp, microbatches=spec.microbatches,
                                                        device_stage=device_stage, pass_order=_pass_order(spec))
        except TraceError as error:
            notes.append(f"no per-kernel truth (the timing is the event logs'): {error}; fix or remove the "
                         f"trace, or ingest with --source events to leave it out")
            return ()
        if kernels is None or not len(kernels.duration_ns):
            notes.append(f"no per-kernel truth: {path} holds no kernels or operators in its profiled steps")
            return ()
        covered &= set(np.unique(columns["iteration"]).tolist())
        rows.append(kernels)
    if not covered:
        notes.append(f"no per-kernel truth: the profiler traces ({shown}) and the event logs share no iteration "
                     f"(the logs hold {list(truth.iterations)}); profile the logged iterations "
                     "(--profile-step-start/--profile-step-end)")
        return ()
    if covered != set(truth.iterations):
        notes.append(f"the per-kernel truth covers iterations {sorted(covered)} of the event logs' "
                     f"{list(truth.iterations)} (the profiled ones)")
    keep = np.array(sorted(covered), dtype=np.int64)
    aligned = [replace(part, **{name: getattr(part, name)[np.isin(part.iteration, keep)]
                                for name in ("name_id", "shape_id", "phase", "iteration", "duration_ns")})
               for part in rows]
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


def _first_files(folder: Path, limit: int = 200) -> list[Path]:
    """The first `limit` regular files directly in `folder` (none when it cannot be read)."""
    import itertools

    try:
        return [p for p in itertools.islice(folder.iterdir(), limit) if p.is_file() and not p.is_symlink()]
    except OSError:
        return []


def _job_dirs(sources: Iterable[Path], report: IngestReport) -> list[Path]:
    seen: dict[Path, Path] = {}
    for source in sources:
        if source.is_file():
            report.outcomes.append(RunOutcome(source=source, error=f"{source}: not a source ingest reads (a job "
                                              "directory, a folder of them, a run table .csv/.parquet, or a "
                                              "Megatron training log)"))
            continue
        try:
            found = find_job_dirs(Path(source), report.notes)
        except TraceError as err:
            report.outcomes.append(RunOutcome(source=Path(source), error=str(err)))
            continue
        if not found:
            # a folder of logs or run tables (the vTrain folder: its table beside its licence) is no folder of runs
            tables = sorted(p.name for p in _first_files(Path(source)) if is_measured_source(p))
            report.outcomes.append(RunOutcome(source=Path(source), error=f"{source}: no job directories found "
                                              "(a job directory holds megatron_trace/, hops_trace_map.json or "
                                              "megatron_args.txt)" + (
                                                  f"; it holds run tables or training logs: ingest them by name "
                                                  f"({', '.join(str(Path(source) / t) for t in tables)})"
                                                  if tables else "")))
        for job_dir in found:
            seen.setdefault(job_dir.resolve(), job_dir)
    return list(seen.values())


def ingest(sources: Iterable[Path | str], store: FixtureStore, *, split: str = STATED,
           test_fraction: float = DEFAULT_TEST_FRACTION, lenient: bool = False, skew_ms: float = DEFAULT_SKEW_MS,
           on_run: Callable[[RunOutcome], None] | None = None,
           on_start: Callable[[int], None] | None = None, hardware: RunHardware | None = None,
           warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
           device_types: Collection[str] | None = None, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT_S,
           on_wait: Callable[[str], None] | None = None, source: str = AUTO) -> IngestReport:
    """Ingest every job directory under `sources`, and every run table or Megatron training log among them, into
    `store`; see the module docstring. `hardware` (--gpu/--gpus-per-node) and `warmup_iterations` are for logs and
    tables; `device_types` (the catalog's) refuses a log's or table's run on any other device type. Waits up to
    `lock_timeout` s (None: without end) for another writer's lock, telling `on_wait` whom it waits for.
    `split`: "source" (default): the split each source states (`split.SOURCE_FILE` beside it), else train (a user's
    own runs); "auto": the grouped, hashed split (what the calibration sets need); "train" / "test": all there. A
    group already stored keeps its split whatever is asked (a forced other one is refused).
    `source` (`rank_traces.SOURCE_CHOICES`): what a job directory's traces give (`rank_traces.plan_traces`): "auto"
    (default) the timing from its event logs, else its profiler traces, and the per-kernel truth from a profiler
    trace; "events", "kineto", "nsys": that source alone."""
    if split not in SPLIT_CHOICES:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLIT_CHOICES}")
    if source not in SOURCE_CHOICES:
        raise StoreError(f"unknown --source {source!r}; expected one of {', '.join(SOURCE_CHOICES)}")
    if not 0.0 <= test_fraction <= 1.0:
        raise StoreError(f"--test-fraction {test_fraction} is not between 0 and 1")
    if not 0.0 <= skew_ms <= 60_000.0:  # (NaN fails too)
        raise StoreError(f"--clock-skew-ms {skew_ms} is not between 0 and 60000 ms; give the clock offset the nodes "
                         "may have, in ms (default 2)")
    report = IngestReport(store=store.root)
    paths = [dgxc_table_in(Path(s)) or Path(s) for s in sources]  # the dgxc set's folder: its runs.csv
    is_measured = {s: is_measured_source(s) for s in paths}
    measured = list({s.resolve(): s for s in reversed(paths) if is_measured[s]}.values())[::-1]  # once each
    job_dirs = _job_dirs([s for s in paths if not is_measured[s]], report)
    store.check_writable()
    _check_apart(store.root, job_dirs)
    if on_start:
        on_start(len(job_dirs) + sum(expected_runs(path) for path in measured))
    for outcome in report.outcomes:  # sources that hold no job directory
        if on_run:
            on_run(outcome)
    if not job_dirs and not measured and not store.exists():
        return report  # nothing to write: no empty store is made for a source that holds no job
    if lock_timeout is not None and not 0.0 <= lock_timeout < math.inf:
        raise StoreError(f"--lock-timeout {lock_timeout} is not a number of seconds >= 0")
    with store.lock(timeout=lock_timeout, on_wait=on_wait, sources=paths):
        if store.unfinished():
            store.begin_writing()
        store.recover()
        stored: dict[str, dict[str, Any]] = {}
        index_splits: dict[str, str] | None = None  # read once, when a fixture.json cannot be trusted
        for folder in store.fixture_folders():
            try:
                stored[folder.name] = store.meta(folder.name)
                continue
            except StoreError:  # written again if its run is ingested now; an edited split is not trusted
                legacy = store.legacy_meta(folder.name)
            if legacy is None:
                index_splits = _index_splits(store) if index_splits is None else index_splits
                listed = index_splits.get(folder.name)  # the index's record of its split, if any
                legacy = {"split": listed, "group": group_of(folder.name)} if listed else {}
            stored[folder.name] = legacy
        context = read_context(store, stored)  # the table folders (iteration-level runs) beside the runs' folders
        context.device_types = frozenset(device_types) if device_types is not None else None
        group_split = context.group_split
        context.stored_groups = frozenset(group_split)
        changed = False
        batch_sources: dict[str, Path] = {}
        copies = _Copies(store, stored)
        for job_dir in job_dirs:
            outcome = RunOutcome(source=job_dir)
            try:
                asked, fraction, outcome.split_from, forced, groups = _asked_split(job_dir, split, test_fraction)
                changed |= _ingest_one(job_dir, store, outcome, stored, group_split, batch_sources, copies,
                                       split=asked, forced=forced, test_fraction=fraction, lenient=lenient,
                                       stated=groups,
                                       skew_ms=skew_ms, stored_groups=context.stored_groups, source=source,
                                       measured=context.table_runs.keys() | context.tables.keys())
            except DiskFull:
                raise  # no run after it could be written either: the ingest stops, its half-written run removed
            except Exception as err:  # noqa: BLE001 - one run's failure, whatever it is, is that run's rejection
                outcome.status = "rejected"
                outcome.error = str(err) if isinstance(err, (TraceError, StoreError)) else (
                    f"{job_dir}: internal error while reading this run: {type(err).__name__}: {err} (a bug in "
                    "hops-calib, not necessarily in the run: please report it; the other runs are ingested)")
                if isinstance(err, TraceError) and outcome.run_id in stored:
                    # an earlier ingest of these (now bad) files stays in the store and is still scored: say so
                    scored_by = "evaluate" if stored[outcome.run_id].get("split") == "train" else "report"
                    outcome.error += (f" (the store keeps the fixture an earlier ingest made of {outcome.run_id}, and "
                                      f"{scored_by} still scores it: fix the files and ingest again, or delete "
                                      f"{store.root / outcome.run_id} and ingest again to drop it)")
            report.outcomes.append(outcome)
            if on_run:
                on_run(outcome)
        context.event_ids |= set(batch_sources)

        if measured:
            store.begin_writing()  # (the tables and logs may change table folders)
        for path in measured:
            runs: list[RunOutcome] = []
            try:
                stated = _asked_split(path, split, test_fraction)
            except StoreError as err:
                runs.append(RunOutcome(source=path, error=str(err)))
                stated = None
            if stated is not None:
                table_split, fraction, why, forced, groups = stated
                changed |= ingest_measured(path, store, context, RunOutcome, split=table_split, forced=forced,
                                           test_fraction=fraction, hardware=hardware, warmup=warmup_iterations,
                                           emit=runs.append, stated_groups=groups.groups if groups else None)
                for outcome in runs:
                    outcome.split_from = outcome.split_from or why
            report.outcomes += runs
            for outcome in runs:
                if on_run:
                    on_run(outcome)
        index_file = store.root / INDEX
        # a fixture folder deleted by hand (or one the index does not list) is put right even when nothing changed
        known = set(stored) | set(context.table_runs)
        stale = index_file.is_file() and (set(store.ids()) != known or _index_outdated(index_file))
        if changed or stale or (known and not index_file.is_file()) or store.left_unfinished:
            store.begin_writing()
            store.write_index()
        store.finish()
    return report


def _asked_split(source: Path, split: str, test_fraction: float) -> tuple[str, float, str, bool, Stated | None]:
    """The split asked of a source's runs, its test fraction, why, whether it was forced (`--split` given, so a
    group stored in the other split is refused), and what the source states (`split.stated_split`: with the
    groups it names) where --split does not ask; its own runs go to train (a group already stored keeping its
    split: `_ingest_one`)."""
    if split != STATED:
        return split, test_fraction, f"--split {split}", True, None
    try:
        stated = stated_split(source, test_fraction)
    except ValueError as error:
        raise StoreError(str(error)) from None
    return stated.split, stated.test_fraction, stated.why, False, stated


def _named_group(group: str, kept: str | None, stated: Stated | None,
                 why: str | None) -> tuple[str | None, str | None]:
    """Why a run goes to its split where its source's file names its group (`[groups]`), and a warning where the
    store keeps the group (`kept`: its split in the store before this ingest) in the other split (a stored split
    never moves)."""
    named = stated.groups.get(group) if stated else None
    if named is None or stated is None:
        return why, None
    if kept is None:
        return stated.groups_why, None
    if kept != named:
        return why, (f"the source's {SOURCE_FILE} puts group {group!r} in {named}, but this store keeps it in "
                     f"{kept} (a stored split never moves): the store stays as it is; ingest into a new store to "
                     f"have the file's split, or change the file's entry to {kept!r}")
    return why, None


def _refuse_clash(store: FixtureStore, run_id: str, previous: dict[str, Any], job_dir: Path, events_sha: str) -> None:
    """StoreError when the stored fixture of `run_id` is another job's: not ingested from this folder, and other
    measurements (events). A re-ingest of the same job (same folder, or the same events from a moved copy) updates."""
    same_source = bool(previous.get("source")) and source_path(previous["source"], store.root) == job_dir.resolve()
    same_events = (previous.get(FILE_DIGESTS) or {}).get(EVENTS_FILE) == events_sha
    if same_source or same_events:
        return
    raise StoreError(f"run id {run_id!r} of {job_dir} is already in the store for another job: "
                     f"{store.root / run_id} holds the measurements ingested from "
                     f"{source_path(previous['source'], store.root) if previous.get('source') else '?'}, "
                     f"and {job_dir} measured something else (its events differ); two jobs must not share an id, "
                     "so the stored run is kept. Give this job its own id (rename its folder, or set its manifest "
                     f"run_id), or delete {store.root / run_id} first to replace the stored run")


def _index_outdated(index_file: Path) -> bool:
    """Whether the index lacks a column this version writes (it is rebuilt on every read until written again)."""
    import pyarrow.parquet as pq

    from hops_calib.store.digests import INDEX_COLUMNS

    try:
        return not set(INDEX_COLUMNS) <= set(pq.read_schema(index_file).names)
    except Exception:  # noqa: BLE001 - a damaged index: rewritten too
        return True


def _index_splits(store: FixtureStore) -> dict[str, str]:
    """id -> split as the store's index file records it (the second record of a split; {} without one)."""
    import pandas as pd

    try:
        index = pd.read_parquet(store.root / INDEX, columns=["id", "split"])
    except Exception:  # noqa: BLE001 - no index, or a damaged one: no second record
        return {}
    return dict(zip(index["id"], index["split"]))


def _check_apart(store_root: Path, job_dirs: list[Path]) -> None:
    """StoreError when the store and a job directory overlap: a fixture folder would replace the job's own files
    (its raw traces), or the store would be written inside a job that is read as input."""
    root = store_root.resolve()
    for job_dir in job_dirs:
        job = job_dir.resolve()
        if job == root or root in job.parents or job in root.parents:
            where = ("the same folder as" if job == root else "inside" if job in root.parents
                     else "a folder that holds")
            raise StoreError(f"the fixture store {store_root} is {where} the job directory {job_dir}: ingest "
                             "would write fixtures over (or into) the traces it reads. Pass a --fixtures folder "
                             "outside the job directories, e.g. --fixtures fixtures")


class _Copies:
    """The `events_fingerprint` of every run with events in the store (read once, when a run is first written) and
    in this ingest: a run whose fingerprint another id holds is a copy of that run."""

    def __init__(self, store: FixtureStore, stored: dict[str, dict[str, Any]]) -> None:
        self.store, self.stored = store, stored
        self.holders: dict[str, str] | None = None  # fingerprint -> run id

    def refuse(self, run_id: str, job_dir: Path, fingerprint: str) -> None:
        """StoreError when another run of the store (or of this ingest) measured exactly this: the same
        configuration and events, up to its name, folder and clocks; else remember it as `run_id`'s."""
        if self.holders is None:
            self.holders = {}
            for other in self.stored:
                try:
                    self.holders.setdefault(self.store.fingerprint(other), other)
                except (StoreError, OSError):  # a damaged fixture: rewritten when its own job is ingested
                    continue
        holder = self.holders.get(fingerprint)
        if holder is not None and holder != run_id:
            split = self.stored.get(holder, {}).get("split")
            raise StoreError(f"run {run_id!r} of {job_dir} is a copy of run {holder!r} of this store"
                             + (f" ({split} split)" if split else "") + ": the same configuration and events, up to "
                             "the name and a shift of the clocks; a copy would count one measurement twice (and a "
                             "test run's, under a new name, could land in train). Ingest one copy of a job; to keep "
                             f"it under the new id instead, delete {self.store.root / holder} first")
        self.holders[fingerprint] = run_id


def _ingest_one(job_dir: Path, store: FixtureStore, outcome: RunOutcome, stored: dict[str, dict[str, Any]],
                group_split: dict[str, str], batch_sources: dict[str, Path], copies: _Copies, *, split: str,
                test_fraction: float, lenient: bool, skew_ms: float = DEFAULT_SKEW_MS, forced: bool = True,
                stored_groups: Collection[str] = frozenset(),
                measured: Any = frozenset(), source: str = AUTO, stated: Stated | None = None) -> bool:
    """Ingest one job directory; returns whether the store changed. `measured`: the ids of the store's
    iteration-level runs and table folders, which a run with events may not take."""
    manifest = read_manifest(job_dir)
    run_id = run_id_of(job_dir, manifest)
    outcome.run_id = run_id
    check_fixture_id(store.root, run_id, origin=str(job_dir))
    if run_id in measured:
        raise StoreError(f"run id {run_id!r} of {job_dir} is already a run (or the folder of runs) this store holds "
                         "from a training log or run table; give the job another run_id in its manifest.yaml")
    if run_id in batch_sources:
        raise StoreError(f"run id {run_id!r} comes from two job directories ({batch_sources[run_id]} and {job_dir}); "
                         "ingest one of them, or give one a different manifest run_id")
    batch_sources[run_id] = job_dir
    group = group_of(run_id)
    kept = stored.get(run_id, {}).get("split") or group_split.get(group)
    if forced and split != "auto" and kept and kept != split:
        raise StoreError(f"run {run_id} belongs to group {group!r}, which is stored in the {kept} split; "
                         f"--split {split} would make the group straddle train and test. Leave out --split, or "
                         f"remove the group's fixtures from {store.root} first")
    stored_kept = kept if kept and (run_id in stored or group in stored_groups) else None
    if stored_kept:
        outcome.split_from = f"kept: its configuration group is stored in {kept}"
    outcome.split_from, note = _named_group(group, stored_kept, stated, outcome.split_from)
    if note:
        outcome.warnings.append(note)
    chosen = kept or assigned_split(group, split, test_fraction, stated.groups if stated else None)
    outcome.split = chosen
    plan = plan_traces(job_dir, source)
    outcome.sources, outcome.profiled = plan.describe(), plan.present != (EVENT_LOG,)
    plain = content_hash(job_dir, lenient, skew_ms, plan.key)
    digest = stored_content_hash(store.root, plain, chosen, create=False)  # (the secret is made when a run is written)
    previous = stored.get(run_id)
    if previous and previous.get("content_hash") == digest and store.intact(run_id):
        outcome.status = "unchanged"
        group_split.setdefault(group, chosen)
        return False
    # (a fixture from before digests were recorded, or of other files, is rewritten quietly)
    if (previous is not None and "content_hash" not in previous) or (
            previous and "fixture_sha256" in previous and previous.get("content_hash") == digest):
        outcome.warnings.append("the stored fixture's files were changed or damaged after an ingest wrote them: "
                                f"written again from the job (split {chosen})")
    store.begin_writing()
    with store.writing(run_id) as folder:
        data = read_run(job_dir, folder / EVENTS_FILE, lenient, skew_ms, plan)
        events_sha = file_digest(folder / EVENTS_FILE)  # (hashed once: the clash check and fixture.json's record)
        if previous and FILE_DIGESTS in previous:
            _refuse_clash(store, run_id, previous, job_dir, events_sha)
        copies.refuse(run_id, job_dir, data.fingerprint)
        outcome.warnings += data.warnings
        meta = {
            "id": run_id,
            "split": chosen,
            "group": group,
            "content_hash": digest or stored_content_hash(store.root, plain, chosen),
            "ingest_version": INGEST_VERSION,
            "hops_calib_version": __version__,
            "ingested_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": recorded_source(job_dir, store.root),
            "manifest": manifest,
            "hostnames": data.hostnames,
            "quality": data.quality,
            FINGERPRINT: data.fingerprint,
        }
        store.write_summary(folder, meta=meta, spec=data.spec, truth=data.truth, events_sha256=events_sha)
    group_split[group] = chosen
    outcome.status = "updated" if previous is not None else "new"
    return True
