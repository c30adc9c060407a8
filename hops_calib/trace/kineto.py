"""Trace room: streaming reader of a rank's PyTorch profiler (Kineto) Chrome-trace JSON, `.json` or `.json.gz`.

A rank's trace is often 1-5 GB, one JSON object: it is never loaded whole. The
metadata before `traceEvents` (`baseTimeNanoseconds`, `distributedInfo`,
`host_name`; Kineto writes them first, output_json.cpp `handleTraceStart`) is read
from the head of the file, then ijson (the yajl C parser; HTA streams these files
the same way) yields one event at a time and only what the pipeline needs is
kept, in compact arrays (operators and kernels about 40 bytes each). Gzip is
recognized by its magic bytes, whatever the name.

What is read (../shared/docs/profiler-traces.md §1): `ProfilerStep#N` ranges;
Megatron's schedule steps (Python stack `.../pipeline_parallel/schedules.py(N):
forward_step`, or ranges named so); the optimizer ranges (`Optimizer.step#...`,
`Optimizer.zero_grad#...`, `optimizer`); p2p sends (`c10d::send` with the peer in
`Concrete Inputs`, `record_param_comms` with `Collective name` send, the
`nccl:send a->b` range); collectives (`record_param_comms` all-reduce, all-gather,
reduce-scatter with message size and `Process Group Description`, or gloo's
`c10d::allreduce_`); CPU operators with `Input Dims`; device kernels (`kernel`,
`gpu_memcpy`, `gpu_memset`) with their `correlation` / `External id`, joined to the
launching runtime call (`cuda_runtime` / `cuda_driver`) and operator.

Times: `ts`/`dur` are microseconds with nanosecond decimals; since kineto #910 `ts` is relative to
`baseTimeNanoseconds` (Unix ns = base + ts x 1000), older files carry absolute epoch microseconds.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from orjson import dumps as _dumps

from hops_calib.trace.errors import TraceError
from hops_calib.trace.profile import (
    RankProfile,
    is_optimizer_range,
    is_zero_grad_range,
    profiler_step,
    schedule_step,
)
from hops_calib.trace.reading import open_regular

HEAD_BYTES = 16 << 20  # the metadata before traceEvents (real: a few KB; distributedInfo lists every group)
_CHUNK = 1 << 20
_FLUSH = 1 << 16
# ts of an absolute epoch-µs trace (old Kineto) is past 1e15 (2001); relative ts are run-time offsets
_EPOCH_US = 1e15
_DTYPE_BYTES = {
    "float": 4,
    "Float": 4,
    "float32": 4,
    "c10::Half": 2,
    "Half": 2,
    "c10::BFloat16": 2,
    "BFloat16": 2,
    "double": 8,
    "Double": 8,
    "long int": 8,
    "Long": 8,
    "int": 4,
    "Int": 4,
    "bool": 1,
    "Bool": 1,
    "unsigned char": 1,
    "Byte": 1,
    "signed char": 1,
    "Char": 1,
    "short int": 2,
    "Short": 2,
}
_COLLECTIVES = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}
_GLOO_COLLECTIVES = {
    "c10d::allreduce_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
}
_GROUPS = {"TENSOR_MODEL_PARALLEL_GROUP": "tp", "DATA_PARALLEL_GROUP": "dp", "DATA_PARALLEL_GROUP_WITH_CP": "dp"}
_NCCL_SEND = re.compile(r"nccl:send \d+->\d+$")
_DEVICE_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "gpu_memset"})
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime"})
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)

PROFILE_DIR = "torch_profile"  # where Megatron-LM's trace handler writes `rank-<r>.json.gz`
_SUFFIXES = (".json", ".json.gz")


def _ijson() -> Any:
    try:
        import ijson
    except ImportError:  # pragma: no cover - a dependency; named so a bare install says what to add
        raise TraceError(
            PROFILE_DIR,
            "needs the ijson package to stream PyTorch profiler traces",
            hint="pip install ijson (a dependency of hops-calib)",
        ) from None
    return ijson


class _Counting:
    """A binary stream that counts the bytes and lines handed out, so a parse error can name its line."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.bytes, self.lines = raw, 0, 1

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(_CHUNK if size is None or size < 0 else size)
        self.bytes += len(data)
        self.lines += data.count(b"\n")
        return data


def _open(path: Path) -> BinaryIO:
    handle = open_regular(path)
    magic = handle.read(2)
    handle.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    return handle


def _bad(path: Path, problem: str, line: int | None = None, hint: str = "") -> TraceError:
    return TraceError(
        path,
        problem,
        line=line,
        field="traceEvents",
        hint=hint or "copy the rank's trace from the run again (this one is damaged or cut short)",
    )


def read_head(path: Path) -> dict[str, Any]:
    """The top-level keys written before `traceEvents` ({} when the file puts none there)."""
    with _open(path) as handle:
        try:
            head = handle.read(HEAD_BYTES)
        except (OSError, EOFError, gzip.BadGzipFile) as err:
            raise _bad(path, f"cannot be decompressed ({err})") from None
    position = head.find(b'"traceEvents"')
    if position < 0:
        return {}
    text = head[:position].rstrip()
    if text.endswith(b","):
        text = text[:-1]
    try:
        data = json.loads(text + b"}") if text.lstrip().startswith(b"{") else {}
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _later_key(path: Path, key: str) -> Any:
    """A top-level key written after `traceEvents` (a second streaming pass; only when the head lacks it)."""
    ijson = _ijson()
    with _open(path) as handle:
        try:
            for value in ijson.items(handle, key, use_float=True):
                return value
        except (ijson.JSONError, OSError, EOFError):
            return None
    return None


def _shape(args: dict[str, Any]) -> str:
    dims = args.get("Input Dims")
    if not dims:
        return ""
    try:
        return _dumps(dims).decode()
    except (TypeError, ValueError):  # (orjson refuses an integer past 64 bits: a damaged field, kept as text)
        return json.dumps(dims, separators=(",", ":"))


def _bytes_of(args: dict[str, Any]) -> int:
    """Message bytes of a collective: `In msg nelems` x the dtype's size (record_param_comms), or the first input's
    dims (gloo's c10d ops, with `Input Dims`)."""
    nelems = args.get("In msg nelems")
    dtype = args.get("dtype") or ""
    if isinstance(nelems, (int, float)) and nelems >= 0:
        return int(nelems) * _DTYPE_BYTES.get(str(dtype), 4)
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    first = dims[0] if dims else []
    while first and isinstance(first[0], list):  # a TensorList: its first tensor
        first = first[0]
    if not first or not all(isinstance(d, (int, float)) for d in first):
        return 0
    size = _DTYPE_BYTES.get(str(types[0]) if types else "float", 4)
    return int(np.prod(first)) * size


class _Rows:
    """Append-only columns (Python lists flushed into numpy chunks)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.rows: list[tuple[Any, ...]] = []
        self.chunks: dict[str, list[np.ndarray]] = {name: [] for name in names}

    def add(self, *values: Any) -> None:
        self.rows.append(values)
        if len(self.rows) >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            for name, values in zip(self.names, zip(*self.rows)):
                self.chunks[name].append(np.array(values, dtype=np.float64 if name in ("ts", "dur") else np.int64))
            self.rows.clear()

    def finish(self) -> dict[str, np.ndarray]:
        self.flush()
        return {
            name: (
                np.concatenate(parts) if parts else np.empty(0, dtype=np.float64 if name in ("ts", "dur") else np.int64)
            )
            for name, parts in self.chunks.items()
        }


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _events(path: Path) -> Iterator[dict[str, Any]]:
    ijson = _ijson()
    with _open(path) as raw:
        handle = _Counting(raw)
        try:
            yield from ijson.items(handle, "traceEvents.item", use_float=True)
        except ijson.JSONError as err:
            if "premature EOF" in str(err) or "Incomplete JSON" in str(err):
                raise _bad(path, f"ends inside the JSON (cut short?): {_first_line(err)}", handle.lines) from None
            raise _bad(path, f"is not valid JSON near this line ({_first_line(err)})", handle.lines) from None
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as err:
            raise _bad(path, f"cannot be read ({type(err).__name__}: {err})", handle.lines) from None


def read_kineto(path: Path) -> RankProfile:
    """A rank's trace reduced to a RankProfile (module docstring); TraceError naming the file (and the line near a
    parse error) when it is not a Kineto trace."""
    head = read_head(path)
    profile = RankProfile(path=path, source="kineto")
    info = head.get("distributedInfo")
    if isinstance(info, dict):
        rank, world = info.get("rank"), info.get("world_size")
        profile.rank = rank if type(rank) is int and rank >= 0 else None
        profile.world_size = world if type(world) is int and world > 0 else None
    host = head.get("host_name")
    profile.hostname = host[:255] if isinstance(host, str) else ""
    base = head.get("baseTimeNanoseconds")
    if "traceEvents" not in head and not head and base is None:
        base = _later_key(path, "baseTimeNanoseconds")

    steps, spans, optimizer, zero_grad = [], [], [], []
    # A send (collective) can show three times, nested: c10d's operator, its record_param_comms, NCCL's range.
    # The first kind the trace has is read.
    sends_by: dict[str, list[tuple[float, float]]] = {"c10d": [], "record_param_comms": [], "nccl": []}
    collectives_by: dict[str, list[tuple[str, float, float, int, str]]] = {"record_param_comms": [], "c10d": []}
    ops = _Rows("ts", "dur", "tid", "name", "shape", "external")
    kernels = _Rows("ts", "dur", "name", "correlation", "external")
    runtime = _Rows("ts", "correlation")
    names, shapes = profile.names, profile.shapes
    events = 0
    for event in _events(path):
        events += 1
        if type(event) is not dict or event.get("ph") != "X":
            continue
        try:
            ts = float(event["ts"])
            dur = float(event.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        if not (dur >= 0.0 and math.isfinite(ts)):
            continue
        category = event.get("cat")
        name = event.get("name")
        if not isinstance(name, str):
            continue
        if category == "python_function":
            kind = schedule_step(name) if name.endswith("_step") else None
            if kind:
                spans.append((kind, ts, ts + dur))
            continue
        args = event.get("args")
        args = args if isinstance(args, dict) else {}
        if category == "user_annotation":
            step = profiler_step(name)
            if step is not None:
                steps.append((step, ts, ts + dur))
            elif is_optimizer_range(name):
                optimizer.append((ts, ts + dur))
            elif is_zero_grad_range(name):
                zero_grad.append((ts, ts + dur))
            elif _NCCL_SEND.match(name):
                sends_by["nccl"].append((ts, ts + dur))
            elif name.endswith("_step") and (kind := schedule_step(name)):
                spans.append((kind, ts, ts + dur))
            continue
        if category == "cpu_op":
            if name == "record_param_comms":
                collective = str(args.get("Collective name", ""))
                if collective == "send":
                    sends_by["record_param_comms"].append((ts, ts + dur))
                elif collective in _COLLECTIVES:
                    group = _GROUPS.get(str(args.get("Process Group Description", "")), "")
                    collectives_by["record_param_comms"].append(
                        (_COLLECTIVES[collective], ts, ts + dur, _bytes_of(args), group)
                    )
            elif name == "c10d::send":
                sends_by["c10d"].append((ts, ts + dur))
            elif name in _GLOO_COLLECTIVES:
                collectives_by["c10d"].append((_GLOO_COLLECTIVES[name], ts, ts + dur, _bytes_of(args), ""))
            external = args.get("External id")
            tid = event.get("tid")
            ops.add(
                ts,
                dur,
                tid if type(tid) is int else -1,
                names(name),
                shapes(_shape(args)),
                external if type(external) is int else -1,
            )
        elif category in _DEVICE_CATS:
            correlation = args.get("correlation")
            external = args.get("External id")
            kernels.add(
                ts,
                dur,
                names(name),
                correlation if type(correlation) is int else -1,
                external if type(external) is int else -1,
            )
        elif category in _RUNTIME_CATS:
            correlation = args.get("correlation")
            if type(correlation) is int:
                runtime.add(ts, correlation)
    if events == 0:
        raise _bad(
            path,
            "holds no traceEvents: not a PyTorch profiler trace",
            hint="give the rank's Chrome-trace JSON that torch.profiler wrote (export_chrome_trace or the "
            "tensorboard trace handler)",
        )

    sends = next((found for found in sends_by.values() if found), [])
    collectives = next((found for found in collectives_by.values() if found), [])
    op_cols, kernel_cols, runtime_cols = ops.finish(), kernels.finish(), runtime.finish()
    starts = [values for values in (op_cols["ts"], kernel_cols["ts"]) if len(values)]
    starts += [np.array([s for _k, s, _e in spans] + [s for _n, s, _e in steps], dtype=np.float64)]
    earliest = min((float(values.min()) for values in starts if len(values)), default=0.0)
    if base is None or not isinstance(base, (int, float)) or isinstance(base, bool):
        if earliest < _EPOCH_US:
            raise _bad(
                path,
                "has run-relative timestamps and no baseTimeNanoseconds: its ranks cannot be put on one clock",
                hint="record with torch >= 2.4 (kineto writes baseTimeNanoseconds), or export the trace again",
            )
        base = 0
    base = int(base)

    def ns(us: Any) -> Any:
        if isinstance(us, np.ndarray):
            return base + np.rint(us * 1000.0).astype(np.int64)
        return base + round(us * 1000.0)

    profile.steps = [(n, ns(s), ns(e)) for n, s, e in steps]
    profile.spans = [(k, ns(s), ns(e)) for k, s, e in spans]
    profile.optimizer = [(ns(s), ns(e)) for s, e in optimizer]
    profile.zero_grad = [(ns(s), ns(e)) for s, e in zero_grad]
    profile.sends = [(ns(s), ns(e)) for s, e in sends]
    profile.collectives = [(op, ns(s), ns(e), nbytes, group) for op, s, e, nbytes, group in collectives]
    op_start = ns(op_cols["ts"])
    profile.ops = {
        "start": op_start,
        "end": op_start + np.rint(op_cols["dur"] * 1000.0).astype(np.int64),
        "tid": op_cols["tid"],
        "name": op_cols["name"].astype(np.int32),
        "shape": op_cols["shape"].astype(np.int32),
        "external": op_cols["external"],
    }
    if len(kernel_cols["ts"]):
        kernel_start = ns(kernel_cols["ts"])
        launch = _launch_times(kernel_cols, runtime_cols, op_cols, ns)
        shape = _launch_shapes(kernel_cols["external"], op_cols)
        profile.kernels = {
            "start": kernel_start,
            "end": kernel_start + np.rint(kernel_cols["dur"] * 1000.0).astype(np.int64),
            "name": kernel_cols["name"].astype(np.int32),
            "shape": shape.astype(np.int32),
            "launch": launch,
        }
    return profile


def _join(keys: np.ndarray, table_keys: np.ndarray, table_values: np.ndarray, missing: Any) -> np.ndarray:
    """table_values at the row of table_keys equal to each key (the first such row); `missing` where none."""
    if not len(table_keys):
        return np.full(len(keys), missing, dtype=table_values.dtype)
    order = np.argsort(table_keys, kind="stable")
    sorted_keys = table_keys[order]
    slot = np.searchsorted(sorted_keys, keys)
    slot = np.minimum(slot, len(sorted_keys) - 1)
    found = (sorted_keys[slot] == keys) & (keys >= 0)
    return np.where(found, table_values[order][slot], missing)


def _launch_times(
    kernels: dict[str, np.ndarray], runtime: dict[str, np.ndarray], ops: dict[str, np.ndarray], ns: Any
) -> np.ndarray:
    """Host time of each kernel's launch (Unix ns): its runtime call's (same `correlation`), else its launching
    operator's start (same `External id`); -1 when the trace links it to neither."""
    missing = np.float64(np.nan)
    launch_us = _join(kernels["correlation"], runtime["correlation"], runtime["ts"], missing)
    by_op = _join(kernels["external"], ops["external"], ops["ts"], missing)
    launch_us = np.where(np.isnan(launch_us), by_op, launch_us)
    out = np.full(len(launch_us), -1, dtype=np.int64)
    known = ~np.isnan(launch_us)
    out[known] = ns(launch_us[known])
    return out


def _launch_shapes(external: np.ndarray, ops: dict[str, np.ndarray]) -> np.ndarray:
    """The input shape (id) of the operator that launched each kernel; -1 where unknown or unrecorded."""
    shape = ops["shape"]
    return _join(external, ops["external"], shape, -1)


def rank_of_name(path: Path) -> int | None:
    match = _RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def kineto_files(job_dir: Path) -> list[Path]:
    """The PyTorch profiler traces of a job directory: `torch_profile/*.json[.gz]` (Megatron-LM's trace handler
    writes rank-<r>.json.gz there; torch's tensorboard handler `<worker>.<ns>.pt.trace.json[.gz]`)."""
    folder = job_dir / PROFILE_DIR
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if path.name.endswith(_SUFFIXES) and not path.name.startswith("."))
