"""Trace room: streaming reader of the per-rank event logs (`megatron_trace/rank<r>.jsonl`).

A raw log can be gigabytes, so it is read line by line and kept as compact
numpy columns (about 30 bytes per event), never as one string or a list of
dicts. Every line is checked; a bad line stops the read with a `TraceError`
naming file, line and field, or, when lenient, is dropped and counted.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.timeline import COMPUTE, KINDS, PHASES, TRANSFER
from hops_calib.trace.errors import TraceError
from hops_calib.trace.reading import MAX_HOSTNAME, MAX_LINE_BYTES, bounded_lines, long_line, open_regular

try:  # orjson parses a line about 3x faster than the standard library; both give the same objects.
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    _JSONError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is a dependency, the fallback keeps a bare install working
    _loads = json.loads
    _JSONError = json.JSONDecodeError

PHASE_CODE = {name: code for code, name in enumerate(PHASES)}
KIND_CODE = {name: code for code, name in enumerate(KINDS)}
_COMPUTE, _TRANSFER = KIND_CODE[COMPUTE], KIND_CODE[TRANSFER]
_OPTIMIZER = PHASE_CODE["OPTIMIZER"]

# Normalized event columns and their in-memory dtypes (compact: a 2 GB log is ~6 M events).
EVENT_DTYPES: dict[str, str] = {
    "stage": "int32",
    "rank": "int32",
    "chunk": "int32",
    "iteration": "int32",
    "microbatch": "int32",  # -1 where there is none (OPTIMIZER)
    "kind": "int8",  # code into timeline.KINDS
    "phase": "int8",  # code into timeline.PHASES
    "start_ns": "int64",  # host wall clock, Unix epoch ns
    "end_ns": "int64",
    "peer_stage": "int32",  # transfers: receiving stage; -1 for compute
}
_FLUSH_ROWS = 1 << 16

# A collective a rank took part in (schema extension of issue #19, written by `hops-calib capture`; the tracing
# fork's logs have none): `collective` all_reduce | reduce_scatter | all_gather | all_to_all, `group` tp | dp | ep |
# edp, `phase` the phase
# that issued it (FORWARD, BACKWARD), `microbatch` (null for the gradient reduction after the backwards), `bytes`.
# Kept apart from the timeline's columns (`RankLogReport.collectives`), so every reader of events sees what it saw.
COLLECTIVE = "collective"
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
# ep: Megatron-core's expert-parallel group (the MoE layer's token all-to-alls); edp: its expert-data-parallel
# group (the experts' gradient all-reduce)
COLLECTIVE_GROUPS = ("tp", "dp", "ep", "edp")
# The steps of an MoE layer (megatron/core/transformer/moe/moe_layer.py, MoELayer.forward: route, preprocess,
# dispatch, routed_experts_compute, combine) a line names in `moe_step`, with the 1-based decoder `layer`:
# collective lines the exchanges (preprocess's all-gather of the split sizes, the dispatch and combine all-to-alls),
# `event_type: moe` lines the router's and the experts' compute. Kept apart from the timeline, as collectives are.
MOE = "moe"
MOE_COMPUTE_STEPS = ("router", "experts")
MOE_EXCHANGE_STEPS = ("preprocess", "dispatch", "combine")


@dataclass(frozen=True)
class CollectiveEvent:
    iteration: int
    phase: str
    microbatch: int | None
    op: str
    group: str
    nbytes: int
    start_ns: int
    end_ns: int
    moe_step: str | None = None  # an MoE layer's exchange: preprocess | dispatch | combine (MOE_EXCHANGE_STEPS)
    layer: int | None = None  # its 1-based decoder layer


@dataclass(frozen=True)
class MoEEvent:
    """An `event_type: moe` line: the router's or the experts' compute in one MoE layer's forward or backward."""

    iteration: int
    phase: str
    microbatch: int
    step: str  # router | experts (MOE_COMPUTE_STEPS)
    layer: int
    start_ns: int
    end_ns: int


_FIX = "fix the line, or drop it with --lenient"
_REQUIRED = ("rank", "stage", "iteration", "event_type", "phase", "start_wall_ns", "end_wall_ns")


@dataclass
class RankLogReport:
    """What reading one rank log found, for the fixture's quality flags."""

    rank: int
    path: Path
    lines: int = 0
    events: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> lines dropped (lenient only)
    hostname: str = ""
    collectives: list[CollectiveEvent] = field(default_factory=list)  # its `collective` lines, in file order
    moe: list[MoEEvent] = field(default_factory=list)  # its `moe` lines, in file order


# Per-event values in the order the reader collects them (rank is constant per log, added at the end).
_ROW_FIELDS = ("stage", "chunk", "iteration", "microbatch", "kind", "phase", "start_ns", "end_ns", "peer_stage")


class _Columns:
    """Append-only column store: one tuple per event in a short list, flushed into numpy chunks."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.chunks: dict[str, list[np.ndarray]] = {name: [] for name in _ROW_FIELDS}

    def flush(self) -> None:
        if self.rows:
            table = np.array(self.rows, dtype=np.int64)
            for k, name in enumerate(_ROW_FIELDS):
                self.chunks[name].append(table[:, k].astype(EVENT_DTYPES[name]))
            self.rows.clear()

    def finish(self, rank: int) -> dict[str, np.ndarray]:
        self.flush()
        out = {}
        for name in _ROW_FIELDS:
            parts = self.chunks.pop(name)
            out[name] = np.concatenate(parts) if parts else np.empty(0, dtype=EVENT_DTYPES[name])
            del parts
        out["rank"] = np.full(len(out["start_ns"]), rank, dtype=EVENT_DTYPES["rank"])
        return {name: out[name] for name in EVENT_DTYPES}


def _is_int(value: Any) -> bool:
    return type(value) is int


# Values past these wrap in the compact int32 columns (or in the structure checks' packed keys): refused as lines.
MAX_ITERATION = (1 << 24) - 1
MAX_INDEX = (1 << 15) - 1  # microbatch, model chunk
MAX_NS = (1 << 62) - 1  # wall clock in Unix-epoch ns (the year 2116): the checks add allowances without overflow


def check_record(
    record: Any, *, rank: int, pp: int, device_stage: Mapping[str, int], stage: int | None = None
) -> tuple[str, str, str] | None:
    """(field, problem, what to do) for the first thing wrong with one parsed event, or None when it is fine."""
    if not isinstance(record, dict):
        return "(event)", f"is a JSON {type(record).__name__}, not an object", "each line must be one event object"
    for name in _REQUIRED:
        if name not in record:
            return name, "is missing", "every event needs " + ", ".join(_REQUIRED)
    kind = record["event_type"]
    if kind not in KIND_CODE:
        return "event_type", f"unknown value {kind!r}", f"expected one of {list(KINDS)}: {_FIX}"
    phase = record["phase"]
    if phase not in PHASE_CODE:
        return "phase", f"unknown value {phase!r}", f"expected one of {list(PHASES)}: {_FIX}"
    for name in ("rank", "stage", "iteration", "start_wall_ns", "end_wall_ns"):
        if not _is_int(record[name]) or record[name] < 0:
            return name, f"is {record[name]!r}, expected a non-negative integer", _FIX
    if record["rank"] != rank:
        return "rank", f"is {record['rank']} in the log of rank {rank}", "each rank<r>.jsonl holds only rank r's events"
    if record["stage"] >= pp:
        return (
            "stage",
            f"is {record['stage']} but the configuration has {pp} pipeline stages",
            "check --pipeline-model-parallel-size and the stage map",
        )
    if stage is not None and record["stage"] != stage:
        return (
            "stage",
            f"is {record['stage']} in the log of rank {rank}, which runs stage {stage}",
            (
                "with tensor and data parallel size 1 rank r runs stage r: the line belongs to another rank's log, or "
                "was edited; " + _FIX
            ),
        )
    for name in ("start_wall_ns", "end_wall_ns"):
        if record[name] > MAX_NS:
            return name, f"is {record[name]}, past 2^62 ns (the year 2116): not a wall clock in Unix-epoch ns", _FIX
    hostname = record.get("hostname")
    if hostname is not None and (type(hostname) is not str or len(hostname) > MAX_HOSTNAME):
        shown = f"a {type(hostname).__name__}" if type(hostname) is not str else f"{len(hostname)} characters long"
        return "hostname", f"is {shown}, expected a host name of at most {MAX_HOSTNAME} characters", _FIX
    if record["iteration"] > MAX_ITERATION:
        return "iteration", f"is {record['iteration']}, more than a trace can number (<= {MAX_ITERATION})", _FIX
    if record["end_wall_ns"] < record["start_wall_ns"]:
        return (
            "end_wall_ns",
            f"{record['end_wall_ns']} is before start_wall_ns {record['start_wall_ns']}",
            "the event ends before it starts: " + _FIX,
        )
    microbatch = record.get("microbatch")
    if microbatch is not None and (not _is_int(microbatch) or not 0 <= microbatch <= MAX_INDEX):
        return "microbatch", f"is {microbatch!r}, expected an integer 0..{MAX_INDEX} or null", _FIX
    if phase != "OPTIMIZER" and microbatch is None:
        return "microbatch", f"is null on a {phase} event", "only OPTIMIZER events may omit the microbatch: " + _FIX
    chunk = record.get("model_chunk", 0)
    if not _is_int(chunk) or not 0 <= chunk <= MAX_INDEX:
        return "model_chunk", f"is {chunk!r}, expected an integer 0..{MAX_INDEX}", _FIX
    if kind == TRANSFER:
        dst = record.get("dst_device")
        if dst not in device_stage:
            return (
                "dst_device",
                f"{dst!r} is not a device of the stage map",
                "a transfer must name its receiving device as in hops_trace_map.json",
            )
    return None


def check_collective(record: dict[str, Any], *, rank: int, pp: int, stage: int | None) -> tuple[str, str, str] | None:
    """(field, problem, what to do) for the first thing wrong with a `collective` line, or None."""
    for name in ("rank", "stage", "iteration", "start_wall_ns", "end_wall_ns", "bytes"):
        if not _is_int(record.get(name)) or record[name] < 0:
            return name, f"is {record.get(name)!r}, expected a non-negative integer", _FIX
    if record["rank"] != rank:
        return "rank", f"is {record['rank']} in the log of rank {rank}", "each rank<r>.jsonl holds only rank r's events"
    if record["stage"] >= pp or (stage is not None and record["stage"] != stage):
        return "stage", f"is {record['stage']}; rank {rank} runs stage {stage}", _FIX
    if record.get("collective") not in COLLECTIVE_OPS:
        return "collective", f"is {record.get('collective')!r}", f"expected one of {list(COLLECTIVE_OPS)}: {_FIX}"
    if record.get("group") not in COLLECTIVE_GROUPS:
        return "group", f"is {record.get('group')!r}", f"expected one of {list(COLLECTIVE_GROUPS)}: {_FIX}"
    if record.get("phase") not in ("FORWARD", "BACKWARD"):
        return "phase", f"is {record.get('phase')!r} on a collective", f"expected FORWARD or BACKWARD: {_FIX}"
    microbatch = record.get("microbatch")
    if microbatch is not None and (not _is_int(microbatch) or not 0 <= microbatch <= MAX_INDEX):
        return "microbatch", f"is {microbatch!r}, expected an integer 0..{MAX_INDEX} or null", _FIX
    if record["end_wall_ns"] < record["start_wall_ns"]:
        return "end_wall_ns", "is before start_wall_ns", "the event ends before it starts: " + _FIX
    if "moe_step" in record or "layer" in record:
        return _check_moe_fields(record, MOE_EXCHANGE_STEPS)
    return None


def _check_moe_fields(record: dict[str, Any], steps: tuple[str, ...]) -> tuple[str, str, str] | None:
    if record.get("moe_step") not in steps:
        return "moe_step", f"is {record.get('moe_step')!r}", f"expected one of {list(steps)}: {_FIX}"
    layer = record.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= MAX_INDEX:
        return "layer", f"is {layer!r}, expected a decoder layer number 1..{MAX_INDEX}", _FIX
    return None


def check_moe(record: dict[str, Any], *, rank: int, pp: int, stage: int | None) -> tuple[str, str, str] | None:
    """(field, problem, what to do) for the first thing wrong with an `event_type: moe` line, or None."""
    for name in ("rank", "stage", "iteration", "start_wall_ns", "end_wall_ns"):
        if not _is_int(record.get(name)) or record[name] < 0:
            return name, f"is {record.get(name)!r}, expected a non-negative integer", _FIX
    if record["rank"] != rank:
        return "rank", f"is {record['rank']} in the log of rank {rank}", "each rank<r>.jsonl holds only rank r's events"
    if record["stage"] >= pp or (stage is not None and record["stage"] != stage):
        return "stage", f"is {record['stage']}; rank {rank} runs stage {stage}", _FIX
    if record.get("phase") not in ("FORWARD", "BACKWARD"):
        return "phase", f"is {record.get('phase')!r} on an MoE step", f"expected FORWARD or BACKWARD: {_FIX}"
    microbatch = record.get("microbatch")
    if not isinstance(microbatch, int) or isinstance(microbatch, bool) or not 0 <= microbatch <= MAX_INDEX:
        return "microbatch", f"is {microbatch!r}, expected an integer 0..{MAX_INDEX}", _FIX
    if record["end_wall_ns"] < record["start_wall_ns"]:
        return "end_wall_ns", "is before start_wall_ns", "the event ends before it starts: " + _FIX
    return _check_moe_fields(record, MOE_COMPUTE_STEPS)


def _collective_event(record: dict[str, Any]) -> CollectiveEvent:
    return CollectiveEvent(
        record["iteration"],
        record["phase"],
        record.get("microbatch"),
        record["collective"],
        record["group"],
        record["bytes"],
        record["start_wall_ns"],
        record["end_wall_ns"],
        record.get("moe_step"),
        record.get("layer"),
    )


def _moe_event(record: dict[str, Any]) -> MoEEvent:
    return MoEEvent(
        record["iteration"],
        record["phase"],
        record["microbatch"],
        record["moe_step"],
        record["layer"],
        record["start_wall_ns"],
        record["end_wall_ns"],
    )


# The lines kept beside the timeline, by event_type: their check, their event, and the RankLogReport list they join
SIDE_LINES: dict[str, tuple[Callable[..., tuple[str, str, str] | None], Callable[[dict[str, Any]], Any], str]] = {
    COLLECTIVE: (check_collective, _collective_event, "collectives"),
    MOE: (check_moe, _moe_event, "moe"),
}


def read_rank_events(
    path: Path, *, rank: int, pp: int, device_stage: Mapping[str, int], lenient: bool = False, stage: int | None = None
) -> tuple[dict[str, np.ndarray], RankLogReport]:
    """Normalized event columns (EVENT_DTYPES) of one rank log, and what the read found.

    A last line without its newline that does not parse is a truncated write
    (the job died while logging); it is reported as such.
    """
    report = RankLogReport(rank=rank, path=path)
    columns = _Columns()
    rows = columns.rows
    number = 0

    def reject(field_name: str | None, problem: str, hint: str, reason: str = "") -> None:
        if not lenient:
            raise TraceError(path, problem, line=number, field=field_name, hint=hint)
        report.dropped[reason or f"bad {field_name}"] += 1

    with open_regular(path) as handle:
        for number, raw in bounded_lines(handle):
            if raw is None:
                if not lenient:
                    raise long_line(path, number)
                report.dropped[f"line longer than {MAX_LINE_BYTES >> 10} KiB"] += 1
                continue
            if not raw.strip():
                continue
            try:
                record = _loads(raw)
            except _JSONError as err:
                if not raw.endswith(b"\n"):
                    reject(
                        None,
                        "truncated last line: the record is cut off (the job probably died while writing)",
                        "drop the partial line, or ingest with --lenient",
                        "truncated last line",
                    )
                else:
                    reject(
                        None,
                        f"not valid JSON ({err})",
                        "fix the line, or ingest with --lenient to drop it",
                        "malformed JSON",
                    )
                continue
            line_type = record.get("event_type") if type(record) is dict else None
            side = (
                SIDE_LINES.get(line_type) if type(line_type) is str else None
            )  # (a list or dict is no key: check_record says)
            if side is not None:  # a collective or MoE line: checked, kept beside the timeline
                check, build, kept = side
                problem = check(record, rank=rank, pp=pp, stage=stage)
                if problem is not None:
                    reject(*problem)
                else:
                    getattr(report, kept).append(build(record))
                continue
            # Fast path for the common, valid event; anything unusual goes through check_record.
            try:
                kind = KIND_CODE[record["event_type"]]
                phase = PHASE_CODE[record["phase"]]
                start = record["start_wall_ns"]
                end = record["end_wall_ns"]
                event_stage = record["stage"]
                iteration = record["iteration"]
                microbatch = record["microbatch"]
                chunk = record.get("model_chunk", 0)
                peer = device_stage[record["dst_device"]] if kind == _TRANSFER else -1
                hostname = record.get("hostname")
                ok = (
                    type(start) is int
                    and type(end) is int
                    and 0 <= start <= end <= MAX_NS
                    and record["rank"] == rank
                    and type(record["rank"]) is int
                    and type(event_stage) is int
                    and 0 <= event_stage < pp
                    and (stage is None or event_stage == stage)
                    and type(iteration) is int
                    and 0 <= iteration <= MAX_ITERATION
                    and type(chunk) is int
                    and 0 <= chunk <= MAX_INDEX
                    and (
                        (type(microbatch) is int and 0 <= microbatch <= MAX_INDEX)
                        or (microbatch is None and phase == _OPTIMIZER)
                    )
                    and (hostname is None or (type(hostname) is str and len(hostname) <= MAX_HOSTNAME))
                )
            except (KeyError, TypeError):
                ok = False
            if not ok:
                problem = check_record(record, rank=rank, pp=pp, device_stage=device_stage, stage=stage)
                if problem is None:  # the fast path was stricter than the full check; trust the full check
                    problem = ("(event)", "could not be read as an event", "check the event schema")
                reject(*problem)
                continue
            if not report.hostname and hostname:
                report.hostname = hostname
            rows.append(
                (
                    event_stage,
                    chunk,
                    iteration,
                    -1 if phase == _OPTIMIZER else microbatch,
                    kind,
                    phase,
                    start,
                    end,
                    peer,
                )
            )
            if len(rows) >= _FLUSH_ROWS:
                columns.flush()
    report.lines = number
    out = columns.finish(rank)
    report.events = len(out["start_ns"])
    return out, report
