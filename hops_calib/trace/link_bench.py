"""Trace room: the point-to-point link benchmark, fitted as latency + size / bandwidth per stage pair.

`calibration/link_bench/pair_<i>_<j>.jsonl` holds one JSON row per (rank,
message size) between stages i (rank 0, the sender) and j (rank 1, the
receiver), with NCCL's own log lines interleaved. The fit uses the sender's p50:
the send call's CUDA-event time is what a pipeline stage waits for.

The file may say the transport the pair ran over (`LinkFit.transport`): a row's
`transport` field, or NCCL's own line `NCCL INFO Using network <name>` (printed
under NCCL_DEBUG=INFO: `Socket` for its TCP socket transport, `IB` for verbs,
InfiniBand or RoCE, or a plugin's name such as `AWS Libfabric`).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.reading import bounded_lines, long_line, open_regular, positive_number

# The benchmark's message sizes are in MiB (torch tensors of size_mb * 2**20 bytes).
BYTES_PER_MB = 1 << 20
SENDER_RANK = 0
_PAIR_FILE = re.compile(r"pair_(\d+)_(\d+)\.jsonl")


def sorted_points(points) -> tuple[tuple[float, float], ...]:
    """(bytes, ms) points as floats by increasing size (JSON round trips give lists)."""
    return tuple((float(b), float(ms)) for b, ms in sorted(points))


def tail_slope_ms_per_byte(points: tuple[tuple[float, float], ...]) -> float:
    """A benchmark's cost per byte at its largest sizes, from (bytes, ms) points by increasing size (at least two):
    the slope of its last doubling, from the largest size at or below half the largest (or the first) to the
    largest. Two sizes 1 MiB apart (nccl-tests' steps up to 1 GiB) differ by their medians' noise; a doubling's
    span does not. On a link benchmark of sizes 1, 2, 4, 16 and 64 MiB it is the last two points'."""
    last = points[-1]
    k = bisect.bisect_right(points, last[0] / 2, key=lambda point: point[0])
    before = points[max(k - 1, 0)]
    return (last[1] - before[1]) / (last[0] - before[0])


def interpolate_ms(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """A benchmark's median time at a message size, from its (bytes, ms) medians by increasing size: piecewise
    linear between measured sizes. Below the smallest size, that point's time scaled by size (no extrapolated
    latency can go negative); above the largest, the slope of the table's last doubling (from the largest
    measured size at or below half the largest, or the first, to the largest; never negative): the marginal cost
    of a byte where the transfer is bandwidth-bound. Not the last segment's: an nccl-tests table measures sizes
    1 MiB apart up to 1 GiB, and two medians 1 MiB apart differ by their noise (vTrain's 4-GPU all-reduce: 18 us
    over its last MiB, 58 GB/s, where its last doubling runs at 151 GB/s)."""
    first, last = points[0], points[-1]
    if nbytes <= first[0]:
        return first[1] * nbytes / first[0]
    if len(points) >= 2 and nbytes >= last[0]:
        return last[1] + max(tail_slope_ms_per_byte(points), 0.0) * (nbytes - last[0])
    # np.interp's formula, found by bisection (a table has a thousand sizes: no lists built per call)
    k = bisect.bisect_right(points, nbytes, key=lambda point: point[0])
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return float((y1 - y0) / (x1 - x0) * (nbytes - x0) + y0)


@dataclass(frozen=True)
class LinkFit:
    """Point-to-point link between two stages: time(bytes) = latency + bytes / bandwidth.

    Fitted from the sender's p50 in the link benchmark. Bandwidth in bytes per
    millisecond keeps the cost formula unit-free: ms = latency_ms + bytes / bytes_per_ms.
    """

    src_stage: int
    dst_stage: int
    latency_ms: float
    bytes_per_ms: float
    # Provenance: which benchmark rows made the fit (file name, sizes used).
    source: str = ""
    # The benchmark's own medians, (bytes, ms) by increasing size: what `measured_ms` reads.
    points: tuple[tuple[float, float], ...] = ()
    # A link within one node (NVLink/NVSwitch), priced from the node's collective benchmark: never shaped like an
    # instance's network allowance, so no burst reading applies.
    intra_node: bool = False
    # The transport NCCL ran the link over, as the benchmark or the launch says (`transport_name`): "socket" (TCP
    # sockets, NCCL_NET=Socket), "ib" (verbs: InfiniBand or RoCE), another network's name, or "" when nothing said.
    transport: str = ""

    def __post_init__(self) -> None:
        # JSON round trips give lists; keep the value hashable and equal to what was written.
        object.__setattr__(self, "points", sorted_points(self.points))

    @property
    def bandwidth_gbit_s(self) -> float:
        return self.bytes_per_ms * 8 * 1e3 / 1e9

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms

    def _last_slope_ms_per_byte(self) -> float | None:
        """The benchmark's cost per byte at its largest sizes (`tail_slope_ms_per_byte`; None with fewer than two
        points)."""
        return tail_slope_ms_per_byte(self.points) if len(self.points) >= 2 else None

    def measured_ms(self, nbytes: float) -> float:
        """The benchmark's median at this message size: piecewise linear between measured sizes.

        Below the smallest size, that point's time scaled by size (no extrapolated latency can go
        negative); above the largest, the slope of its last doubling. Without points, the fit.
        """
        if not self.points:
            return self.transfer_ms(nbytes)
        return interpolate_ms(self.points, nbytes)

    def burst_ms(self, nbytes: float, burst_bytes: float) -> float:
        """A message sent now and then rather than back to back: its first `burst_bytes` at the benchmark's
        smallest message's rate, the rest at its largest messages' rate.

        A shaped network (an instance's bandwidth allowance) lets a short burst through faster than it lets
        a stream through; the benchmark's back-to-back medians show the stream from the second size on,
        its smallest message the burst. The rates are the smallest point's ms per byte and the slope of its
        last doubling (`tail_slope_ms_per_byte`; never below the burst's cost). Without points, the fit.
        """
        if not self.points:
            return self.transfer_ms(nbytes)
        (small, small_ms) = self.points[0]
        burst = small_ms / small
        stream = max(self._last_slope_ms_per_byte() or burst, burst)
        fast = min(nbytes, burst_bytes)
        return fast * burst + (nbytes - fast) * stream


# NCCL's log line naming the network it chose (net.cc: "Using network %s"), behind its "host:pid:tid NCCL INFO" prefix.
_NCCL_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")


def transport_name(name: str) -> str:
    """A transport as `LinkFit.transport` spells it: NCCL's network names (`Socket`, `IB`; NCCL_NET's values) and
    the plain words for them, lower-cased: "socket" for TCP sockets, "ib" for verbs (InfiniBand, RoCE), else the
    name itself ("" for none)."""
    name = " ".join(name.split()).lower()
    return {"sockets": "socket", "tcp": "socket", "infiniband": "ib", "roce": "ib", "verbs": "ib"}.get(name, name)


def read_sender_p50(path: Path) -> list[tuple[float, float]]:
    """(bytes, p50_ms) of the sender's rows; lines that are not JSON objects (NCCL logs) are skipped."""
    return read_pair(path)[0]


def read_pair(path: Path) -> tuple[list[tuple[float, float]], str]:
    """(bytes, p50_ms) of the sender's rows, and the transport the file says (`transport_name`; "" when it says
    none): from its rows' `transport` field or NCCL's `Using network` line. Two different ones are refused."""
    points: list[tuple[float, float]] = []
    transport, said = "", 0

    def say(name: object, number: int, field: str) -> None:
        nonlocal transport, said
        if not isinstance(name, str) or not transport_name(name):
            raise TraceError(
                path,
                f"is {name!r}, expected a transport's name",
                line=number,
                field=field,
                hint="socket, ib, or NCCL's network name (NCCL_NET)",
            )
        if transport and transport_name(name) != transport:
            raise TraceError(
                path,
                f"says transport {transport_name(name)!r}, line {said} said {transport!r}",
                line=number,
                field=field,
                hint="one pair file holds one benchmark over one transport: "
                "a file pasted together from two runs? keep one",
            )
        transport, said = transport_name(name), said or number

    with open_regular(path) as handle:
        for number, raw in bounded_lines(handle):
            if raw is None:
                raise long_line(path, number)
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("{"):
                network = _NCCL_NETWORK.search(line)
                if network:
                    say(network.group(1), number, "NCCL INFO Using network")
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as err:  # (JSONDecodeError, an integer too long, nesting too deep)
                if not line.startswith('{"'):
                    continue  # a log line that happens to start with '{': not a measurement
                # a row the benchmark began to write (a JSON object's first key) and did not finish, or mangled
                what = (
                    f"{err.msg} at column {err.colno}"
                    if isinstance(err, json.JSONDecodeError)
                    else "nested too deeply"
                    if isinstance(err, RecursionError)
                    else str(err)
                )
                raise TraceError(
                    path,
                    f"is not valid JSON ({what})",
                    line=number,
                    hint="a torn or edited measurement row: re-run the link benchmark, or delete the line",
                ) from None
            if row.get("mode", "p2p") != "p2p":
                continue
            if "transport" in row:
                say(row["transport"], number, "transport")
            for field in ("size_mb", "p50_ms"):  # the receiver's rows too: a bad one means a damaged file
                value = row.get(field)
                if not positive_number(value):
                    raise TraceError(
                        path,
                        f"is {value!r}, expected a positive number",
                        line=number,
                        field=field,
                        hint="re-run the link benchmark or delete the row",
                    )
            if row.get("rank") != SENDER_RANK:
                continue
            points.append((float(row["size_mb"]) * BYTES_PER_MB, float(row["p50_ms"])))
    return points, transport


def read_pair_hosts(path: Path) -> tuple[str, str]:
    """The hosts a pair file measured between: the `hostname` of its sender (rank 0) and receiver (rank 1) rows;
    "" for a side whose rows name none (an older benchmark)."""
    hosts = {SENDER_RANK: "", 1 - SENDER_RANK: ""}
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.startswith('{"'):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # read_sender_p50 names a torn row; a host is only provenance
            if row.get("rank") in hosts and isinstance(row.get("hostname"), str) and not hosts[row["rank"]]:
                hosts[row["rank"]] = row["hostname"]
            if all(hosts.values()):
                break
    return hosts[SENDER_RANK], hosts[1 - SENDER_RANK]


def fit_link(path: Path, src_stage: int, dst_stage: int) -> LinkFit:
    """Least-squares ms = latency + bytes / bandwidth (latency >= 0) over the sender's p50 rows of one pair file, with
    the transport the file says."""
    points, transport = read_pair(path)
    fit = fit_points(points, src_stage, dst_stage, path.name, path)
    return replace(fit, transport=transport) if transport else fit


def fit_points(
    points: list[tuple[float, float]], src_stage: int, dst_stage: int, label: str, origin: Path | str
) -> LinkFit:
    """The latency + bandwidth fit of (bytes, ms) measurements (`label` names them in the fit's source, `origin`
    in errors): least squares, latency held at 0 when the unconstrained fit goes below it."""
    sizes = {size for size, _ in points}
    if len(sizes) < 2:
        raise TraceError(
            origin,
            f"has {len(sizes)} distinct message sizes for the sender (rank {SENDER_RANK})",
            field="size_mb",
            hint="a latency + bandwidth fit needs rows of at least two sizes",
        )
    x = np.array([size for size, _ in points])
    y = np.array([ms for _, ms in points])
    slope, intercept = np.polyfit(x, y, 1)
    note = ""
    if intercept < 0:
        # A link cannot cost less than nothing at zero bytes. On these benchmarks the smallest
        # messages ride socket buffers and look faster than the line rate, which drags the
        # unconstrained intercept below zero; the least-squares fit under latency >= 0 is then
        # the fit through the origin.
        note = f"; latency held at 0 (unconstrained fit {intercept:.3f} ms)"
        slope, intercept = float(x @ y / (x @ x)), 0.0
    if not slope > 0:
        raise TraceError(
            origin,
            f"time does not grow with message size (slope {slope:.3g} ms/byte)",
            field="p50_ms",
            hint="the benchmark is too noisy to fit a bandwidth; re-run it with more iterations",
        )
    medians = tuple((size, float(np.median([ms for s, ms in points if s == size]))) for size in sorted(sizes))
    return LinkFit(
        src_stage=src_stage,
        dst_stage=dst_stage,
        latency_ms=float(intercept),
        bytes_per_ms=float(1.0 / slope),
        source=f"{label}: sender p50 at {len(sizes)} sizes{note}",
        points=medians,
    )


def pair_files(bench_dir: Path) -> list[tuple[int, int, Path]]:
    """(i, j, path) of every pair_<i>_<j>.jsonl in the folder, by stage pair (empty when there is no folder)."""
    if not bench_dir.is_dir():
        return []
    return sorted(
        (int(m.group(1)), int(m.group(2)), path)
        for path in bench_dir.iterdir()
        if (m := _PAIR_FILE.fullmatch(path.name))
    )


def read_link_fits(bench_dir: Path, pp: int | None = None, notes: list[str] | None = None) -> tuple[LinkFit, ...]:
    """One fit per `pair_<i>_<j>.jsonl` in the folder, ordered by stage pair (empty when there is no folder).

    With `pp`, a pair file must name two neighbouring stages of the pipeline (i, i + 1, or the last and the
    first, the interleaved schedule's wrap-around); other files in the folder, and neighbouring pairs with no
    file, are listed in `notes`.
    """
    if not bench_dir.is_dir():
        return ()
    pairs, ignored = [], []
    for path in sorted(bench_dir.iterdir()):
        match = _PAIR_FILE.fullmatch(path.name)
        if match:
            pairs.append((int(match.group(1)), int(match.group(2)), path))
        elif path.is_file():
            ignored.append(path.name)
    if pp is not None:
        neighbours = {frozenset((k, k + 1)) for k in range(pp - 1)} | ({frozenset((pp - 1, 0))} if pp > 2 else set())
        for i, j, path in pairs:
            if max(i, j) >= pp or frozenset((i, j)) not in neighbours:
                problem = (
                    f"names stage {max(i, j)} but the configuration has {pp} pipeline stages (0..{pp - 1})"
                    if max(i, j) >= pp
                    else f"benchmarks stages {i} and {j}, which are not neighbours in the pipeline"
                )
                raise TraceError(
                    path,
                    problem,
                    field="pair_<i>_<j>",
                    hint="a link benchmark file measures one hop, pair_<i>_<i+1>.jsonl between "
                    "neighbouring stages: remove or rename it (a file from another job?)",
                )
        if notes is not None:
            have = {frozenset((i, j)) for i, j, _ in pairs}
            missing = [f"{k}-{k + 1}" for k in range(pp - 1) if frozenset((k, k + 1)) not in have]
            if ignored:
                shown = ", ".join(ignored[:8]) + (f", ... ({len(ignored)} files)" if len(ignored) > 8 else "")
                notes.append(f"{bench_dir}: ignored {shown} (a link benchmark file is named pair_<i>_<j>.jsonl)")
            if pairs and missing:
                notes.append(
                    f"{bench_dir}: no benchmark for the hop(s) {', '.join(missing)}: they are priced "
                    "as the slowest benchmarked link"
                )
    return tuple(fit_link(path, i, j) for i, j, path in sorted(pairs))
