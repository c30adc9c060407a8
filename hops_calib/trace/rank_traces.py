"""Trace room: which per-rank traces a job directory holds, which of them ingest reads, and reading one.

Three sources (docs/traces.md):

- `megatron_trace/rank<r>.jsonl`: the event logs (events.py);
- `torch_profile/*.json[.gz]`: PyTorch profiler (Kineto) traces, one per rank (kineto.py), the rank from the
  trace's `distributedInfo.rank`, else from the file's name (`rank-<r>`);
- `nsys/*.sqlite`: Nsight Systems SQLite exports, one per rank (nsys.py), the rank from the name (`rank<r>`).

A profiler trace also gives kernel rows (`profile.KernelRows`), the per-kernel truth's input. `plan_traces` says
what is read for what: by default (`auto`) the timing from the first source present in the order above, and the
per-kernel truth from a profiler trace beside an event log (a job directory that holds both, as a
`capture --profile` writes); `events`, `kineto` or `nsys` read that source alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.events import RankLogReport, read_rank_events
from hops_calib.trace.job import TRACE_DIR, rank_files

EVENT_LOG, KINETO, NSYS = "event_log", "kineto", "nsys"
NSYS_DIR = "nsys"
AUTO = "auto"
SOURCE_CHOICES = (AUTO, "events", KINETO, NSYS)  # ingest --source
_ASKED = {"events": EVENT_LOG, KINETO: KINETO, NSYS: NSYS}
_CHOICE = {kind: choice for choice, kind in _ASKED.items()}
_SHOWN = {
    EVENT_LOG: f"event logs ({TRACE_DIR}/)",
    KINETO: "Kineto (torch_profile/)",
    NSYS: f"Nsight Systems ({NSYS_DIR}/)",
}


def _numbered(paths: list[Path], rank_of: Callable[[Path], int | None], folder: Path, what: str) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for path in paths:
        rank = rank_of(path)
        if rank is None:
            raise TraceError(
                path,
                f"names no rank: neither the {what} nor its file name (rank-<r>) says which rank it traced",
                hint="name each rank's file rank-<r> (Megatron's trace handler does)",
            )
        if rank in files:
            raise TraceError(
                folder,
                f"holds two traces of rank {rank}: {files[rank].name} and {path.name}",
                field="rank",
                hint="keep one trace per rank (one profiled window of the run)",
            )
        files[rank] = path
    return dict(sorted(files.items()))


def _kineto_rank(path: Path) -> int | None:
    from hops_calib.trace.kineto import rank_of_name, read_head

    info = read_head(path).get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    return rank if type(rank) is int and rank >= 0 else rank_of_name(path)


def describe_source(kind: str) -> str:
    """A source as ingest names it, e.g. 'Kineto (torch_profile/)'."""
    return _SHOWN[kind]


def present_sources(job_dir: Path) -> tuple[str, ...]:
    """The trace sources a job directory holds, in the order `auto` prefers them for the timing."""
    from hops_calib.trace.kineto import kineto_files

    folder = job_dir / NSYS_DIR
    found = [
        ((job_dir / TRACE_DIR).is_dir(), EVENT_LOG),
        (bool(kineto_files(job_dir)), KINETO),
        (folder.is_dir() and any(p.suffix == ".sqlite" for p in folder.iterdir()), NSYS),
    ]
    return tuple(kind for present, kind in found if present)


def _source_files(job_dir: Path, kind: str) -> dict[int, Path]:
    if kind == EVENT_LOG:
        return rank_files(job_dir)
    from hops_calib.trace.kineto import PROFILE_DIR, kineto_files, rank_of_name

    if kind == KINETO:
        return _numbered(kineto_files(job_dir), _kineto_rank, job_dir / PROFILE_DIR, "trace's distributedInfo")
    folder = job_dir / NSYS_DIR
    return _numbered(sorted(p for p in folder.iterdir() if p.suffix == ".sqlite"), rank_of_name, folder, "export")


@dataclass(frozen=True)
class TracePlan:
    """What ingest reads of a job directory: the timing (events, truth) from `timing`'s files, and the per-kernel
    truth from the same files (a profiler trace) or from `kernels`' (a profiler trace beside an event log)."""

    timing: str
    files: dict[int, Path]
    kernels: str | None = None  # the kernel truth's source, where it is another than the timing's
    kernel_files: dict[int, Path] = field(default_factory=dict)
    present: tuple[str, ...] = ()  # every source the job directory holds
    asked: str = AUTO
    note: str = ""  # why a profiler trace beside the event logs gives no kernel truth (its files are unusable)

    @property
    def key(self) -> str:
        """The plan as part of ingest's mode (content hash): '' for a directory with one source, whose plan the
        files alone decide."""
        if len(self.present) < 2:
            return ""
        return f"source={self.asked}:{self.timing}" + (f"+{self.kernels}" if self.kernels else "")

    def describe(self) -> str:
        """Which source gave what, e.g. 'timing from event logs (megatron_trace/), per-kernel truth from Kineto
        (torch_profile/)'."""
        if self.kernels:
            said = f"timing from {_SHOWN[self.timing]}, per-kernel truth from {_SHOWN[self.kernels]}"
        elif self.timing == EVENT_LOG:
            said = f"timing from {_SHOWN[EVENT_LOG]}, no per-kernel truth"
        else:
            said = f"timing and per-kernel truth from {_SHOWN[self.timing]}"
        unread = [kind for kind in self.present if kind not in (self.timing, self.kernels)]
        if not unread:
            return said
        why = (
            f"as --source {self.asked} asks"
            if self.asked != AUTO
            else "unusable: the run's warning says why"
            if self.note
            else "; ".join(f"--source {_CHOICE[kind]} reads it alone" for kind in unread)
        )
        return said + f" (not read: {', '.join(_SHOWN[kind] for kind in unread)}, {why})"


def plan_traces(job_dir: Path, source: str = AUTO) -> TracePlan:
    """What to read of a job directory for `ingest --source SOURCE` (SOURCE_CHOICES). TraceError when it holds no
    per-rank traces (the event logs' message), or not the source asked for (naming those it holds)."""
    if source not in SOURCE_CHOICES:
        raise TraceError(
            job_dir,
            f"--source {source!r} is not a trace source",
            field="--source",
            hint=f"give one of {', '.join(SOURCE_CHOICES)}",
        )
    present = present_sources(job_dir)
    if not present:
        rank_files(job_dir)  # (raises: no per-rank traces of any kind)
    note, kernel_files = "", {}
    if source == AUTO:
        timing = present[0]
        kernels = next((kind for kind in present if kind != EVENT_LOG), None) if timing == EVENT_LOG else None
        if kernels:
            try:
                kernel_files = _source_files(job_dir, kernels)
            except TraceError as error:  # the event logs still time the run
                note = (
                    f"{error}; the timing is the event logs', with no per-kernel truth: fix the traces, or "
                    "ingest with --source events to leave them out"
                )
                kernels = None
    else:
        timing, kernels = _ASKED[source], None
        if timing not in present:
            held = ", ".join(_SHOWN[kind] for kind in present)
            raise TraceError(
                job_dir,
                f"holds no {_SHOWN[timing]} for --source {source}; it holds {held}",
                field="--source",
                hint="leave out --source (auto reads what the directory holds), or give one of the sources it holds",
            )
    return TracePlan(
        timing=timing,
        files=_source_files(job_dir, timing),
        kernels=kernels,
        kernel_files=kernel_files,
        present=present,
        asked=source,
        note=note,
    )


def find_rank_traces(job_dir: Path) -> tuple[str, dict[int, Path]]:
    """(source kind, rank -> file) of the traces that time a job directory (`plan_traces`' auto choice)."""
    plan = plan_traces(job_dir)
    return plan.timing, plan.files


def read_rank_trace(
    kind: str,
    path: Path,
    *,
    rank: int,
    stage: int,
    pp: int,
    vp: int,
    microbatches: int,
    device_stage: Mapping[str, int],
    lenient: bool = False,
    pass_order: Callable[[int, int], list[tuple[bool, int]]] | None = None,
) -> tuple[dict[str, np.ndarray], RankLogReport, Any]:
    """Event columns, read report and kernel rows (None for an event log) of one rank's trace."""
    if kind == EVENT_LOG:
        columns, report = read_rank_events(
            path, rank=rank, pp=pp, device_stage=device_stage, lenient=lenient, stage=stage
        )
        return columns, report, None
    from hops_calib.trace.profile import assemble

    if kind == KINETO:
        from hops_calib.trace.kineto import read_kineto

        profile = read_kineto(path)
    else:
        from hops_calib.trace.nsys import read_nsys

        profile = read_nsys(path)
    if profile.rank is not None and profile.rank != rank:
        raise TraceError(
            path,
            f"traced rank {profile.rank}, but it stands as rank {rank}'s trace",
            field="rank",
            hint="one trace per rank, named by its rank",
        )
    return assemble(profile, rank=rank, stage=stage, pp=pp, vp=vp, microbatches=microbatches, pass_order=pass_order)
