"""Store room: what ingest reads and what it says of it: the job directories a list of sources holds (the
search, `_job_dirs`), that the store lies apart from them, and each run's outcome (`RunOutcome`, `IngestReport`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hops_calib.store.digests import StoreError
from hops_calib.store.measured_ingest import is_measured_source
from hops_calib.trace import TraceError, find_job_dirs


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
            report.outcomes.append(
                RunOutcome(
                    source=source,
                    error=f"{source}: not a source ingest reads (a job "
                    "directory, a folder of them, a run table .csv/.parquet, or a "
                    "Megatron training log)",
                )
            )
            continue
        try:
            found = find_job_dirs(Path(source), report.notes)
        except TraceError as err:
            report.outcomes.append(RunOutcome(source=Path(source), error=str(err)))
            continue
        if not found:
            # a folder of logs or run tables (the vTrain folder: its table beside its licence) is no folder of runs
            tables = sorted(p.name for p in _first_files(Path(source)) if is_measured_source(p))
            report.outcomes.append(
                RunOutcome(
                    source=Path(source),
                    error=f"{source}: no job directories found "
                    "(a job directory holds megatron_trace/, hops_trace_map.json or "
                    "megatron_args.txt)"
                    + (
                        f"; it holds run tables or training logs: ingest them by name "
                        f"({', '.join(str(Path(source) / t) for t in tables)})"
                        if tables
                        else ""
                    ),
                )
            )
        for job_dir in found:
            seen.setdefault(job_dir.resolve(), job_dir)
    return list(seen.values())


def _check_apart(store_root: Path, job_dirs: list[Path]) -> None:
    """StoreError when the store and a job directory overlap: a fixture folder would replace the job's own files
    (its raw traces), or the store would be written inside a job that is read as input."""
    root = store_root.resolve()
    for job_dir in job_dirs:
        job = job_dir.resolve()
        if job == root or root in job.parents or job in root.parents:
            where = "the same folder as" if job == root else "inside" if job in root.parents else "a folder that holds"
            raise StoreError(
                f"the fixture store {store_root} is {where} the job directory {job_dir}: ingest "
                "would write fixtures over (or into) the traces it reads. Pass a --fixtures folder "
                "outside the job directories, e.g. --fixtures fixtures"
            )
