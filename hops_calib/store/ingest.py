"""Store room: ingest job directories into the fixture store (spec + events + truth per run).

One bad run never stops the others: it is rejected with the reader's message
(file, line, field, what to do) and nothing of it is written. An unchanged run
(same content hash) is skipped without touching a file.

The names live by concept: `ingest_sources` (the search for job directories, and each run's outcome),
`run_data` (one run's reading: spec, truth and events) and this module (the store's update: splits, copies and
clashes, what is written), which gathers them under one name.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hops_calib import __version__
from hops_calib.errors import DiskFull
from hops_calib.store.digests import (
    DEFAULT_LOCK_TIMEOUT_S,
    EVENTS_FILE,
    FILE_DIGESTS,
    FINGERPRINT,
    INDEX,
    StoreError,
    file_digest,
)
from hops_calib.store.fixture import check_fixture_id, recorded_source, source_path
from hops_calib.store.guard import stored_content_hash
from hops_calib.store.ingest_sources import IngestReport, RunOutcome, _check_apart, _job_dirs
from hops_calib.store.measured_ingest import expected_runs, ingest_measured, is_measured_source, read_context
from hops_calib.store.run_data import RunData, read_run
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
from hops_calib.store.writer import FixtureStore
from hops_calib.trace import TraceError, read_manifest, run_id_of
from hops_calib.trace.dgxc import dgxc_table_in
from hops_calib.trace.measured import RunHardware
from hops_calib.trace.megatron_log import DEFAULT_WARMUP_ITERATIONS
from hops_calib.trace.rank_traces import AUTO, EVENT_LOG, SOURCE_CHOICES, plan_traces
from hops_calib.trace.reading import open_regular
from hops_calib.trace.structure import DEFAULT_SKEW_MS

__all__ = [
    "INGEST_VERSION",
    "SPLIT_CHOICES",
    "IngestReport",
    "RunData",
    "RunOutcome",
    "content_hash",
    "ingest",
    "read_run",
]

# Bump when the fixture content for the same input changes (new columns, new truth fields, ...):
# it is part of the content hash, so a new version re-ingests every run once.
INGEST_VERSION = 3
SPLIT_CHOICES = (STATED, "auto") + SPLITS


def content_hash(job_dir: Path, lenient: bool, skew_ms: float = DEFAULT_SKEW_MS, plan_key: str = "") -> str:
    """sha256 over every file of the job directory (relative names and bytes), the ingest version and mode
    (a clock-skew allowance other than the default, and what is read of a directory holding two trace sources,
    `TracePlan.key`, are part of the mode)."""
    mode = (
        f"lenient={lenient}"
        + (f" skew_ms={skew_ms!r}" if skew_ms != DEFAULT_SKEW_MS else "")
        + (f" {plan_key}" if plan_key else "")
    )
    outer = hashlib.sha256(f"hops-calib ingest v{INGEST_VERSION} {mode}\n".encode())
    files = sorted(p for p in job_dir.rglob("*") if p.is_file())  # (rglob never walks into a linked folder)
    for path in files:
        outer.update(os.fsencode(path.relative_to(job_dir).as_posix()) + b"\0")  # (UTF-8, or the name's own bytes)
        with open_regular(path) as handle:
            outer.update(hashlib.file_digest(handle, "sha256").digest())
    return outer.hexdigest()


def ingest(
    sources: Iterable[Path | str],
    store: FixtureStore,
    *,
    split: str = STATED,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    lenient: bool = False,
    skew_ms: float = DEFAULT_SKEW_MS,
    on_run: Callable[[RunOutcome], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    hardware: RunHardware | None = None,
    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
    device_types: Collection[str] | None = None,
    lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT_S,
    on_wait: Callable[[str], None] | None = None,
    source: str = AUTO,
) -> IngestReport:
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
        raise StoreError(
            f"--clock-skew-ms {skew_ms} is not between 0 and 60000 ms; give the clock offset the nodes "
            "may have, in ms (default 2)"
        )
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
                changed |= _ingest_one(
                    job_dir,
                    store,
                    outcome,
                    stored,
                    group_split,
                    batch_sources,
                    copies,
                    split=asked,
                    forced=forced,
                    test_fraction=fraction,
                    lenient=lenient,
                    stated=groups,
                    skew_ms=skew_ms,
                    stored_groups=context.stored_groups,
                    source=source,
                    measured=context.table_runs.keys() | context.tables.keys(),
                )
            except DiskFull:
                raise  # no run after it could be written either: the ingest stops, its half-written run removed
            except Exception as err:  # noqa: BLE001 - one run's failure, whatever it is, is that run's rejection
                outcome.status = "rejected"
                outcome.error = (
                    str(err)
                    if isinstance(err, (TraceError, StoreError))
                    else (
                        f"{job_dir}: internal error while reading this run: {type(err).__name__}: {err} (a bug in "
                        "hops-calib, not necessarily in the run: please report it; the other runs are ingested)"
                    )
                )
                if isinstance(err, TraceError) and outcome.run_id in stored:
                    # an earlier ingest of these (now bad) files stays in the store and is still scored: say so
                    scored_by = "evaluate" if stored[outcome.run_id].get("split") == "train" else "report"
                    outcome.error += (
                        f" (the store keeps the fixture an earlier ingest made of {outcome.run_id}, and "
                        f"{scored_by} still scores it: fix the files and ingest again, or delete "
                        f"{store.root / outcome.run_id} and ingest again to drop it)"
                    )
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
                changed |= ingest_measured(
                    path,
                    store,
                    context,
                    RunOutcome,
                    split=table_split,
                    forced=forced,
                    test_fraction=fraction,
                    hardware=hardware,
                    warmup=warmup_iterations,
                    emit=runs.append,
                    stated_groups=groups.groups if groups else None,
                )
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


def _named_group(group: str, kept: str | None, stated: Stated | None, why: str | None) -> tuple[str | None, str | None]:
    """Why a run goes to its split where its source's file names its group (`[groups]`), and a warning where the
    store keeps the group (`kept`: its split in the store before this ingest) in the other split (a stored split
    never moves)."""
    named = stated.groups.get(group) if stated else None
    if named is None or stated is None:
        return why, None
    if kept is None:
        return stated.groups_why, None
    if kept != named:
        return why, (
            f"the source's {SOURCE_FILE} puts group {group!r} in {named}, but this store keeps it in "
            f"{kept} (a stored split never moves): the store stays as it is; ingest into a new store to "
            f"have the file's split, or change the file's entry to {kept!r}"
        )
    return why, None


def _refuse_clash(store: FixtureStore, run_id: str, previous: dict[str, Any], job_dir: Path, events_sha: str) -> None:
    """StoreError when the stored fixture of `run_id` is another job's: not ingested from this folder, and other
    measurements (events). A re-ingest of the same job (same folder, or the same events from a moved copy) updates."""
    same_source = bool(previous.get("source")) and source_path(previous["source"], store.root) == job_dir.resolve()
    same_events = (previous.get(FILE_DIGESTS) or {}).get(EVENTS_FILE) == events_sha
    if same_source or same_events:
        return
    raise StoreError(
        f"run id {run_id!r} of {job_dir} is already in the store for another job: "
        f"{store.root / run_id} holds the measurements ingested from "
        f"{source_path(previous['source'], store.root) if previous.get('source') else '?'}, "
        f"and {job_dir} measured something else (its events differ); two jobs must not share an id, "
        "so the stored run is kept. Give this job its own id (rename its folder, or set its manifest "
        f"run_id), or delete {store.root / run_id} first to replace the stored run"
    )


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
            raise StoreError(
                f"run {run_id!r} of {job_dir} is a copy of run {holder!r} of this store"
                + (f" ({split} split)" if split else "")
                + ": the same configuration and events, up to "
                "the name and a shift of the clocks; a copy would count one measurement twice (and a "
                "test run's, under a new name, could land in train). Ingest one copy of a job; to keep "
                f"it under the new id instead, delete {self.store.root / holder} first"
            )
        self.holders[fingerprint] = run_id


def _ingest_one(
    job_dir: Path,
    store: FixtureStore,
    outcome: RunOutcome,
    stored: dict[str, dict[str, Any]],
    group_split: dict[str, str],
    batch_sources: dict[str, Path],
    copies: _Copies,
    *,
    split: str,
    test_fraction: float,
    lenient: bool,
    skew_ms: float = DEFAULT_SKEW_MS,
    forced: bool = True,
    stored_groups: Collection[str] = frozenset(),
    measured: Any = frozenset(),
    source: str = AUTO,
    stated: Stated | None = None,
) -> bool:
    """Ingest one job directory; returns whether the store changed. `measured`: the ids of the store's
    iteration-level runs and table folders, which a run with events may not take."""
    manifest = read_manifest(job_dir)
    run_id = run_id_of(job_dir, manifest)
    outcome.run_id = run_id
    check_fixture_id(store.root, run_id, origin=str(job_dir))
    if run_id in measured:
        raise StoreError(
            f"run id {run_id!r} of {job_dir} is already a run (or the folder of runs) this store holds "
            "from a training log or run table; give the job another run_id in its manifest.yaml"
        )
    if run_id in batch_sources:
        raise StoreError(
            f"run id {run_id!r} comes from two job directories ({batch_sources[run_id]} and {job_dir}); "
            "ingest one of them, or give one a different manifest run_id"
        )
    batch_sources[run_id] = job_dir
    group = group_of(run_id)
    kept = stored.get(run_id, {}).get("split") or group_split.get(group)
    if forced and split != "auto" and kept and kept != split:
        raise StoreError(
            f"run {run_id} belongs to group {group!r}, which is stored in the {kept} split; "
            f"--split {split} would make the group straddle train and test. Leave out --split, or "
            f"remove the group's fixtures from {store.root} first"
        )
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
        previous and "fixture_sha256" in previous and previous.get("content_hash") == digest
    ):
        outcome.warnings.append(
            "the stored fixture's files were changed or damaged after an ingest wrote them: "
            f"written again from the job (split {chosen})"
        )
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
