"""Trace room: a machine's component tables (GEMM and memory-bound kernel times), as `hops-calib bench` writes them.

Two CSV formats, fixed (one row per measured shape, its median over repeats):

    GEMM table    device,dtype,m,n,k,time_s      C[m, n] = A[m, k] B[k, n] in dtype (bf16, fp16, fp32, tf32, fp8)
    memory table  device,kernel,bytes,time_s     a memory-bound kernel (copy, add, layernorm, softmax, gelu, ...)
                                                 moving `bytes` (read + written)

A folder (a job directory's `calibration/components/`) holds GEMM tables named `gemm*.csv` and memory tables named
`memory*.csv`; `read_component_tables` gives one `ComponentTables` per device named in them. They are measured apart
from any run, like the collective benchmark (`collective_bench`), and price the kernels of
`hops_calib.model.kernels` (`hops_calib.model.kernel_pricing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.trace.errors import TraceError
from hops_calib.trace.reading import MAX_TABLE_ROWS, csv_rows

COMPONENTS_DIR = "calibration/components"
GEMM_HEADER = ("device", "dtype", "m", "n", "k", "time_s")
MEMORY_HEADER = ("device", "kernel", "bytes", "time_s")
DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")
MAX_DIMENSION = 1 << 24  # a GEMM side above 16.7M elements is a damaged cell (the largest LLM GEMM side is ~1M tokens)
MAX_TIME_S = 3600.0  # a kernel timed over an hour is a mis-scaled number


@dataclass(frozen=True)
class ComponentTables:
    """One device's measured component times: GEMMs by (dtype, m, n, k) and memory-bound kernels by (kernel, bytes).

    `gemm` rows are (dtype, m, n, k, seconds), `memory` rows (kernel, bytes, seconds), each sorted; `source` names the
    files they came from."""

    device: str
    gemm: tuple[tuple[str, int, int, int, float], ...] = ()
    memory: tuple[tuple[str, float, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:  # JSON round trips give lists
        object.__setattr__(
            self, "gemm", tuple(sorted((str(d), int(m), int(n), int(k), float(t)) for d, m, n, k, t in self.gemm))
        )
        object.__setattr__(self, "memory", tuple(sorted((str(kind), float(b), float(t)) for kind, b, t in self.memory)))

    def gemm_rows(self, dtype: str) -> tuple[tuple[int, int, int, float], ...]:
        """(m, n, k, seconds) of the GEMMs measured in `dtype`."""
        return tuple((m, n, k, t) for d, m, n, k, t in self.gemm if d == dtype)

    def memory_points(self, kernel: str) -> tuple[tuple[float, float], ...]:
        """(bytes, ms) of `kernel` by increasing size (the form `link_bench.interpolate_ms` reads)."""
        return tuple((b, t * 1e3) for kind, b, t in self.memory if kind == kernel)

    def memory_kernels(self) -> tuple[str, ...]:
        return tuple(sorted({kind for kind, _, _ in self.memory}))


def _cell(
    path: Path, row: list[str], header: tuple[str, ...], column: str, line: int, *, integer: bool = False
) -> float:
    text = row[header.index(column)].strip()
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = math.nan
    limit = MAX_DIMENSION if integer else MAX_TIME_S if column == "time_s" else math.inf
    if not 0 < value <= limit or value == math.inf:
        kind = "a whole number" if integer else "a number"
        raise TraceError(
            path,
            f"is {text!r}, expected {kind} above 0" + (f" and at most {limit:g}" if limit < math.inf else ""),
            line=line,
            field=column,
            hint="re-run `hops-calib bench` or delete the row",
        )
    return value


def _rows(path: Path, header: tuple[str, ...]):
    """(line, device, cells) of a component table after its header; TraceError naming the line for anything else."""
    for number, row in csv_rows(path, header, "`hops-calib bench`'s", MAX_TABLE_ROWS):
        device = row[0].strip()
        if not device:
            raise TraceError(
                path,
                "names no device",
                line=number,
                field="device",
                hint="give the device type the table was measured on (e.g. h100, a100, cpu)",
            )
        yield number, device, row


def read_gemm_table(path: Path) -> dict[str, list[tuple[str, int, int, int, float]]]:
    """A GEMM table: rows (dtype, m, n, k, seconds) by device. TraceError for a bad row or a repeated shape."""
    path = Path(path)
    found: dict[str, list[tuple[str, int, int, int, float]]] = {}
    seen: dict[tuple[str, str, int, int, int], int] = {}
    for line, device, row in _rows(path, GEMM_HEADER):
        dtype = row[1].strip().lower()
        if dtype not in DTYPES:
            raise TraceError(path, f"is {row[1]!r}", line=line, field="dtype", hint=f"one of {', '.join(DTYPES)}")
        m, n, k = (int(_cell(path, row, GEMM_HEADER, c, line, integer=True)) for c in ("m", "n", "k"))
        key = (device, dtype, m, n, k)
        if key in seen:
            raise TraceError(
                path,
                f"repeats the {dtype} GEMM {m} x {n} x {k} on {device} (line {seen[key]})",
                line=line,
                hint="one row per shape, the median of its repeats: delete the repeat",
            )
        seen[key] = line
        found.setdefault(device, []).append((dtype, m, n, k, _cell(path, row, GEMM_HEADER, "time_s", line)))
    return found


def read_memory_table(path: Path) -> dict[str, list[tuple[str, float, float]]]:
    """A memory table: rows (kernel, bytes, seconds) by device. TraceError for a bad row or a repeated size."""
    path = Path(path)
    found: dict[str, list[tuple[str, float, float]]] = {}
    seen: dict[tuple[str, str, float], int] = {}
    for line, device, row in _rows(path, MEMORY_HEADER):
        kernel = row[1].strip().lower()
        if not kernel:
            raise TraceError(
                path,
                "names no kernel",
                line=line,
                field="kernel",
                hint="name the kernel measured (copy, add, layernorm, softmax, gelu, ...)",
            )
        nbytes = _cell(path, row, MEMORY_HEADER, "bytes", line)
        key = (device, kernel, nbytes)
        if key in seen:
            raise TraceError(
                path,
                f"repeats {kernel} at {nbytes:g} bytes on {device} (line {seen[key]})",
                line=line,
                hint="one row per size, the median of its repeats: delete the repeat",
            )
        seen[key] = line
        found.setdefault(device, []).append((kernel, nbytes, _cell(path, row, MEMORY_HEADER, "time_s", line)))
    return found


def read_component_tables(folder: Path) -> tuple[ComponentTables, ...]:
    """Every device's tables in a folder (`gemm*.csv`, `memory*.csv`), by device; empty without the folder.
    TraceError for a bad table, or a device measured twice over the same shape in two files."""
    folder = Path(folder)
    if not folder.is_dir():
        return ()
    gemm: dict[str, list] = {}
    memory: dict[str, list] = {}
    sources: dict[str, list[str]] = {}
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".csv")
    for path in files:
        tables: dict[str, list[Any]]
        into: dict[str, list[Any]]
        if path.name.startswith("gemm"):
            tables, into, label = read_gemm_table(path), gemm, "GEMM"
        elif path.name.startswith("memory"):
            tables, into, label = read_memory_table(path), memory, "memory"
        else:
            continue
        for device, rows in tables.items():
            keys = {row[:-1] for row in into.get(device, [])}
            clash = next((row for row in rows if row[:-1] in keys), None)
            if clash is not None:
                raise TraceError(
                    path,
                    f"measures {clash[:-1]} on {device} again (another file of {folder} has it)",
                    field="device",
                    hint="keep one row per shape and device across the folder's tables",
                )
            into.setdefault(device, []).extend(rows)
            sources.setdefault(device, []).append(f"{path.name} ({label}, {len(rows)} rows)")
    return tuple(
        ComponentTables(
            device=device,
            gemm=tuple(gemm.get(device, ())),
            memory=tuple(memory.get(device, ())),
            source="; ".join(sources[device]),
        )
        for device in sorted(sources)
    )
