"""Trace room: the collective benchmark of a machine, nccl-tests all-reduce tables, and the p2p link they imply.

A table (`AR_GPU<n>_<anything>`, as `../shared/public-runs/vtrain/allreduce-a100/` holds them; a job directory
keeps them in `calibration/allreduce/`) is CSV with nccl-tests' columns:
`size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)`, out-of-place then in-place, one row per message
size, measured on n GPUs of one node. It is the intra-node counterpart of the link benchmark.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.link_bench import LinkFit, interpolate_ms, sorted_points
from hops_calib.trace.reading import csv_rows

ALLREDUCE_DIR = "calibration/allreduce"
_TABLE_FILE = re.compile(r"AR_GPU(\d+)_")
HEADER = ("size(B)", "count", "type", "time(ns)", "busbw(GB/s)", "time(ns)", "busbw(GB/s)")
# torch.distributed.all_reduce (Megatron's gradient and embedding all-reduces) reduces in place: the in-place
# time column is the one that prices them.
IN_PLACE_TIME = 5


@dataclass(frozen=True)
class CollectiveTable:
    """A collective benchmark of the machine (nccl-tests style), measured apart from any run: the median time of one
    collective `op` over `gpus` GPUs of one node, by message size.

    The intra-node counterpart of the link benchmark. `points` are (bytes, ms) by increasing size; `source` names
    the file. Times between and beyond the measured sizes as `interpolate_ms`.
    """

    op: str  # "all_reduce"
    gpus: int
    points: tuple[tuple[float, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", sorted_points(self.points))

    def measured_ms(self, nbytes: float) -> float:
        return interpolate_ms(self.points, nbytes)


def gpus_of(path: Path) -> int | None:
    """The GPU count a table's name gives (AR_GPU<n>_...), or None for a file that is not such a table."""
    match = _TABLE_FILE.match(path.name)
    return int(match.group(1)) if match else None


def read_allreduce_table(path: Path) -> CollectiveTable:
    """One nccl-tests all-reduce table: the in-place median time (ms) by message size (bytes); a regular file in
    its folder (no link out of it) of at most MAX_COLLECTIVE_TABLE_BYTES."""
    from hops_calib.trace.reading import MAX_COLLECTIVE_TABLE_BYTES, quoted, refuse_large, refuse_link_out

    path = Path(path)
    refuse_link_out(path, path.parent)
    refuse_large(
        path,
        MAX_COLLECTIVE_TABLE_BYTES,
        "an all-reduce table",
        "give the benchmark's own table (nccl-tests prints one row per message size)",
    )
    gpus = gpus_of(path)
    if gpus is None or gpus < 2:
        raise TraceError(
            path,
            "does not name its GPU count",
            field="file name",
            hint="name an all-reduce table AR_GPU<n>_..., n >= 2 the GPUs it was measured on",
        )
    points: dict[float, float] = {}
    for number, row in csv_rows(path, HEADER, "nccl-tests'"):
        for column in (0, IN_PLACE_TIME):
            try:
                value = float(row[column])
            except ValueError:
                value = float("nan")
            if not value > 0 or value == float("inf"):
                raise TraceError(
                    path,
                    f"is {quoted(row[column])}, expected a positive number",
                    line=number,
                    field=HEADER[column] + (" (in-place)" if column == IN_PLACE_TIME else ""),
                    hint="re-run the benchmark or delete the row",
                )
        size = float(row[0])
        if size in points:
            raise TraceError(
                path,
                f"repeats message size {row[0]}",
                line=number,
                field=HEADER[0],
                hint="one row per message size: delete the repeat",
            )
        points[size] = float(row[IN_PLACE_TIME]) / 1e6
    if len(points) < 2:
        raise TraceError(
            path,
            f"has {len(points)} measured sizes",
            field=HEADER[0],
            hint="a table needs rows of at least two message sizes",
        )
    return CollectiveTable(
        op="all_reduce",
        gpus=gpus,
        points=tuple(points.items()),
        source=f"{path.name}: nccl-tests in-place all-reduce on {gpus} GPUs, {len(points)} sizes",
    )


def read_collective_tables(folder: Path) -> tuple[CollectiveTable, ...]:
    """Every all-reduce table in a folder (AR_GPU<n>_...), by GPU count; empty when there is no folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return ()
    tables = [
        read_allreduce_table(path) for path in sorted(folder.iterdir()) if path.is_file() and gpus_of(path) is not None
    ]
    seen: dict[int, str] = {}
    for table in tables:
        if table.gpus in seen:
            raise TraceError(
                folder / table.source.split(":")[0],
                f"is a second table for {table.gpus} GPUs (beside {seen[table.gpus]})",
                field="file name",
                hint="keep one table per GPU count",
            )
        seen[table.gpus] = table.source.split(":")[0]
    return tuple(sorted(tables, key=lambda t: t.gpus))


@lru_cache(maxsize=1024)  # pure; a table's 1,024 sizes make a fit worth keeping (one per hop of every spec)
def ring_link(table: CollectiveTable, src_stage: int, dst_stage: int) -> LinkFit:
    """The p2p link between two GPUs of the table's node, from its all-reduce times by the ring formula.

    Assumption: NCCL's ring all-reduce of S bytes on n GPUs sends 2(n - 1)/n x S bytes over each GPU's link to
    its ring neighbour, all links at once (nccl-tests' bus bandwidth is that traffic over the time), so a one-way
    send of S bytes over such a link takes the all-reduce's time x n / (2(n - 1)); on an NVSwitch node every GPU
    pair has the same path, so one table prices every intra-node hop. This leaves out that the all-reduce also
    reduces (a kernel pass over the data, hidden under the transfer at these rates) and counts its 2(n - 1)
    latency steps as transfer time, so it over-prices small messages a little. The fit: least squares of
    latency (>= 0) + bytes / bandwidth over the implied sends; `points` keep them for the measured reading.
    """
    scale = table.gpus / (2.0 * (table.gpus - 1))
    points = tuple((size, ms * scale) for size, ms in table.points)
    x = np.array([size for size, _ in points])
    y = np.array([ms for _, ms in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:
        slope, intercept = float(x @ y / (x @ x)), 0.0
    return LinkFit(
        src_stage=src_stage,
        dst_stage=dst_stage,
        latency_ms=float(intercept),
        bytes_per_ms=float(1.0 / slope),
        intra_node=True,
        points=points,
        source=f"ring formula on {table.source} (one link's send = time x n / (2(n - 1)))",
    )
