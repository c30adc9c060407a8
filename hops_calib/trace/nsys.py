"""Trace room: reader of a rank's Nsight Systems SQLite export (`nsys export --type sqlite`), with sqlite3.

The tables and columns are NVIDIA's as the exporter documents them for nsys 2024.6-2026.2 (schema 3.16-3.25;
../shared/docs/profiler-traces.md §2, from the Nsight Systems User Guide's exporter schema reference,
https://docs.nvidia.com/nsight-systems/UserGuide/index.html#exporter-sqlite-schema, and real 2026.1/2026.2 exports):

- `CUPTI_ACTIVITY_KIND_KERNEL`: start, end (ns), correlationId, globalPid, demangledName / shortName (StringIds);
- `CUPTI_ACTIVITY_KIND_RUNTIME`: the launching API call, joined on correlationId and the process
  (`globalPid = globalTid & ~0xFFFFFF`, as NVIDIA's report scripts join them);
- `CUPTI_ACTIVITY_KIND_MEMCPY` / `_MEMSET`: copies and fills (`copyKind` through `ENUM_CUDA_MEMCPY_OPER`);
- `NVTX_EVENTS`: ranges (`end` not NULL), the name `COALESCE(text, StringIds.value of textId)`; push/pop and
  start/end event types looked up by name in `ENUM_NSYS_EVENT_TYPE`;
- `TARGET_INFO_SESSION_START_TIME`: `utcEpochNs`, and from 2026 `systemClockNs`: times on the session clock
  become Unix ns as utcEpochNs + t - systemClockNs; an export without systemClockNs keeps times relative to the
  capture start (utcEpochNs + t).

Every table is optional and has no index: the reader asks `sqlite_master` and `PRAGMA table_info` first, and
reads rows with a cursor (bounded memory). No real report has been checked: there is no GPU here; the tests
read exports GENERATED to the documented schema (tests/profiler_synth.py).

Megatron marks no iteration or microbatch in an nsys capture: the schedule steps come from NVTX ranges named
`...schedules.forward_step` / `backward_step` (the hops-calib tracer's, docs/traces.md), the iterations from
ranges `iteration N` / `ProfilerStep#N`, else one iteration ends at each optimizer range (numbered 1, 2, ...).
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.profile import RankProfile, is_optimizer_range, is_zero_grad_range, profiler_step, schedule_step
from hops_calib.trace.reading import open_regular

_ITERATION = re.compile(r"iteration[ #_]?(\d+)$")
_SENDS = frozenset({"ncclSend"})
_BATCH = 1 << 16
_PROCESS_MASK = ~0xFFFFFF
_COPY_KINDS = {1: "Memcpy HtoD", 2: "Memcpy DtoH", 8: "Memcpy DtoD", 10: "Memcpy PtoP"}


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f'PRAGMA table_info("{table}")')}


def _bad(path: Path, problem: str, field: str | None = None, hint: str = "") -> TraceError:
    return TraceError(
        path,
        problem,
        field=field,
        hint=hint
        or "export the report again with `nsys export --type sqlite` (this file is damaged, "
        "or not an Nsight Systems export)",
    )


def read_nsys(path: Path) -> RankProfile:
    """A rank's export reduced to a RankProfile (module docstring); TraceError naming the file and table."""
    with open_regular(path) as handle:
        if handle.read(16) != b"SQLite format 3\x00":
            raise _bad(path, "is not an SQLite database")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as err:
        raise _bad(path, f"cannot be opened ({err})") from None
    try:
        return _read(db, path)
    except sqlite3.DatabaseError as err:
        raise _bad(path, f"cannot be read ({err})") from None
    finally:
        db.close()


def _read(db: sqlite3.Connection, path: Path) -> RankProfile:
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "NVTX_EVENTS" not in tables:
        raise _bad(
            path,
            "has no NVTX_EVENTS table: no range names the schedule steps",
            "NVTX_EVENTS",
            hint="profile with `-t nvtx,cuda` and load the hops-calib tracer, whose NVTX ranges name the "
            "schedule steps (docs/traces.md)",
        )
    offset = _utc_offset(db, tables, path)
    profile = RankProfile(path=path, source="nsys")
    strings: dict[int, str] = {}
    if "StringIds" in tables:
        strings = dict(db.execute("SELECT id, value FROM StringIds"))
    range_types = None
    if "ENUM_NSYS_EVENT_TYPE" in tables:
        range_types = {
            row[0]
            for row in db.execute(
                "SELECT id FROM ENUM_NSYS_EVENT_TYPE WHERE name IN ('NvtxPushPopRange', 'NvtxStartEndRange')"
            )
        }
    nvtx = _columns(db, "NVTX_EVENTS")
    text_id = "textId" if "textId" in nvtx else "NULL"
    iterations: list[tuple[int, int, int]] = []
    for start, end, event_type, text, name_id in db.execute(
        f"SELECT start, end, eventType, text, {text_id} FROM NVTX_EVENTS WHERE end IS NOT NULL"
    ):
        if range_types is not None and event_type not in range_types:
            continue
        name = text if text is not None else strings.get(name_id, "")
        if not isinstance(name, str) or not name:
            continue
        start, end = start + offset, end + offset
        step = profiler_step(name)
        match = _ITERATION.match(name)
        if step is not None or match:
            iterations.append((step if step is not None else int(match.group(1)), start, end))  # type: ignore[union-attr]
        elif is_optimizer_range(name):
            profile.optimizer.append((start, end))
        elif is_zero_grad_range(name):
            profile.zero_grad.append((start, end))
        elif name in _SENDS:
            profile.sends.append((start, end))
        elif name.endswith("_step") and (kind := schedule_step(name)):
            profile.spans.append((kind, start, end))
    kernels = _kernels(db, tables, strings, offset, profile)
    if iterations:
        profile.steps = iterations
    elif profile.optimizer:  # one iteration ends at each optimizer range
        first = min([s for _k, s, _e in profile.spans] + [s for s, _e in profile.optimizer])
        ends = sorted(end for _s, end in profile.optimizer)
        starts = [first] + [end + 1 for end in ends[:-1]]
        profile.steps = [(k + 1, s, e) for k, (s, e) in enumerate(zip(starts, ends))]
        profile.notes.append(
            f"{path.name}: no iteration ranges; {len(ends)} iterations, each ending at an "
            "optimizer range, numbered from 1"
        )
    profile.kernels = kernels
    return profile


def _utc_offset(db: sqlite3.Connection, tables: set[str], path: Path) -> int:
    """What to add to the export's times for Unix-epoch ns (module docstring)."""
    table = "TARGET_INFO_SESSION_START_TIME"
    if table not in tables:
        raise _bad(
            path,
            f"has no {table} table: its times cannot be put on the wall clock (nor beside the other ranks')",
            table,
        )
    has_clock = "systemClockNs" in _columns(db, table)
    row = db.execute(f"SELECT utcEpochNs{', systemClockNs' if has_clock else ''} FROM {table} LIMIT 1").fetchone()
    if row is None or not isinstance(row[0], int):
        raise _bad(path, f"holds no utcEpochNs in {table}", table)
    return int(row[0]) - (int(row[1]) if has_clock and isinstance(row[1], int) else 0)


def _kernels(
    db: sqlite3.Connection, tables: set[str], strings: dict[int, str], offset: int, profile: RankProfile
) -> dict[str, np.ndarray]:
    """Kernels, copies and fills with their launch times (Unix ns), as RankProfile.kernels."""
    launches: dict[tuple[int, int], int] = {}
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for correlation, global_tid, start in db.execute(
            "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId IS NOT NULL"
        ):
            launches.setdefault((correlation, (global_tid or 0) & _PROCESS_MASK), start + offset)
    rows: dict[str, list[int]] = {"start": [], "end": [], "name": [], "shape": [], "launch": []}

    def add(cursor: Any, name_of: Any) -> None:
        while batch := cursor.fetchmany(_BATCH):
            for start, end, correlation, global_pid, name in batch:
                rows["start"].append(start + offset)
                rows["end"].append(end + offset)
                rows["name"].append(profile.names(name_of(name)))
                rows["shape"].append(-1)
                rows["launch"].append(launches.get((correlation, (global_pid or 0) & _PROCESS_MASK), -1))

    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        names = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_column = "demangledName" if "demangledName" in names else "shortName"
        add(
            db.execute(f"SELECT start, end, correlationId, globalPid, {name_column} FROM CUPTI_ACTIVITY_KIND_KERNEL"),
            lambda name_id: strings.get(name_id, f"kernel {name_id}"),
        )
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        kinds = dict(_COPY_KINDS)
        if "ENUM_CUDA_MEMCPY_OPER" in tables:
            kinds.update(
                {k: f"Memcpy {label}" for k, label in db.execute("SELECT id, label FROM ENUM_CUDA_MEMCPY_OPER")}
            )
        add(
            db.execute("SELECT start, end, correlationId, globalPid, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"),
            lambda kind: kinds.get(kind, f"Memcpy {kind}"),
        )
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        add(
            db.execute("SELECT start, end, correlationId, globalPid, 0 FROM CUPTI_ACTIVITY_KIND_MEMSET"),
            lambda _kind: "Memset (Device)",
        )
    if not rows["start"]:
        return {}
    out = {name: np.array(values, dtype=np.int64) for name, values in rows.items()}
    out["name"] = out["name"].astype(np.int32)
    out["shape"] = out["shape"].astype(np.int32)
    return out
