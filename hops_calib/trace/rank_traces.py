"""Trace room: which per-rank traces a job directory holds, and reading one into event columns.

Three sources, the first one present wins (docs/traces.md):

- `megatron_trace/rank<r>.jsonl`: the event logs (events.py);
- `torch_profile/*.json[.gz]`: PyTorch profiler (Kineto) traces, one per rank (kineto.py), the rank from the
  trace's `distributedInfo.rank`, else from the file's name (`rank-<r>`);
- `nsys/*.sqlite`: Nsight Systems SQLite exports, one per rank (nsys.py), the rank from the name (`rank<r>`).

A profiler trace also gives kernel rows (`profile.KernelRows`), the per-kernel truth's input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.events import RankLogReport, read_rank_events
from hops_calib.trace.job import TRACE_DIR, rank_files

EVENT_LOG, KINETO, NSYS = "event_log", "kineto", "nsys"
NSYS_DIR = "nsys"


def _numbered(paths: list[Path], rank_of: Callable[[Path], int | None], folder: Path, what: str) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for path in paths:
        rank = rank_of(path)
        if rank is None:
            raise TraceError(path, f"names no rank: neither the {what} nor its file name (rank-<r>) says which rank "
                             "it traced", hint="name each rank's file rank-<r> (Megatron's trace handler does)")
        if rank in files:
            raise TraceError(folder, f"holds two traces of rank {rank}: {files[rank].name} and {path.name}",
                             field="rank", hint="keep one trace per rank (one profiled window of the run)")
        files[rank] = path
    return dict(sorted(files.items()))


def _kineto_rank(path: Path) -> int | None:
    from hops_calib.trace.kineto import rank_of_name, read_head

    info = read_head(path).get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    return rank if type(rank) is int and rank >= 0 else rank_of_name(path)


def find_rank_traces(job_dir: Path) -> tuple[str, dict[int, Path]]:
    """(source kind, rank -> file) of a job directory; TraceError (the event logs' message) when it holds none."""
    if (job_dir / TRACE_DIR).is_dir():
        return EVENT_LOG, rank_files(job_dir)
    from hops_calib.trace.kineto import PROFILE_DIR, kineto_files, rank_of_name

    kineto = kineto_files(job_dir)
    if kineto:
        return KINETO, _numbered(kineto, _kineto_rank, job_dir / PROFILE_DIR, "trace's distributedInfo")
    folder = job_dir / NSYS_DIR
    nsys = sorted(p for p in folder.iterdir() if p.suffix == ".sqlite") if folder.is_dir() else []
    if nsys:
        return NSYS, _numbered(nsys, rank_of_name, folder, "export")
    return EVENT_LOG, rank_files(job_dir)  # (raises: no per-rank traces of any kind)


def read_rank_trace(kind: str, path: Path, *, rank: int, stage: int, pp: int, vp: int, microbatches: int,
                    device_stage: Mapping[str, int], lenient: bool = False,
                    pass_order: Callable[[int, int], list[tuple[bool, int]]] | None = None,
                    ) -> tuple[dict[str, np.ndarray], RankLogReport, Any]:
    """Event columns, read report and kernel rows (None for an event log) of one rank's trace."""
    if kind == EVENT_LOG:
        columns, report = read_rank_events(path, rank=rank, pp=pp, device_stage=device_stage, lenient=lenient,
                                           stage=stage)
        return columns, report, None
    from hops_calib.trace.profile import assemble

    if kind == KINETO:
        from hops_calib.trace.kineto import read_kineto

        profile = read_kineto(path)
    else:
        from hops_calib.trace.nsys import read_nsys

        profile = read_nsys(path)
    if profile.rank is not None and profile.rank != rank:
        raise TraceError(path, f"traced rank {profile.rank}, but it stands as rank {rank}'s trace", field="rank",
                         hint="one trace per rank, named by its rank")
    return assemble(profile, rank=rank, stage=stage, pp=pp, vp=vp, microbatches=microbatches,
                    pass_order=pass_order)
