"""Capture room: `hops-calib bench`, a microbenchmark of this machine's component tables (needs torch).

Three tables, in one run bounded by a time budget (docs/bench.md says how to run it on GPUs and what it costs):

- **GEMMs** (`gemm.csv`: `device,dtype,m,n,k,time_s`): the median time of one `(m, k) x (k, n)` matmul, over the
  shapes a job's layer runs (`job_gemm_shapes`: Megatron's column- and row-parallel linears under its t, micro
  batch, s, h, FFN size, GQA and SwiGLU, forward, input gradient and weight gradient, and the output layer) or a
  standard grid;
- **memory-bound kernels** (`memory.csv`: `device,kernel,bytes,time_s`): copy, add, layernorm, softmax and gelu
  over sizes, `bytes` read plus written;
- **collectives** (`collectives/`): all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over group
  sizes and message sizes, with `torch.distributed` in local processes (NCCL on GPUs, gloo on the CPU), one file
  per op and group size in nccl-tests' output format (`size(B),count,type,time(ns),busbw(GB/s),time(ns),
  busbw(GB/s)`, out-of-place then in-place, `AR_GPU<n>_bench` for all-reduce as `trace.collective_bench` reads
  it; `AG_`, `RS_`, `A2A_`, `SR_` for the others). torch.distributed has no out-of-place all-reduce and no
  in-place all-to-all or send/recv: both columns of those are the same operation, timed apart.

Each time is a median over `repeats` repeats of a timed loop (CUDA events on a GPU, the host clock on the CPU;
a collective's repeat is the slowest rank's). Nothing here prints: the command layer shows progress and results.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.files import atomic_write

GEMM_COLUMNS = ("device", "dtype", "m", "n", "k", "time_s")
MEMORY_COLUMNS = ("device", "kernel", "bytes", "time_s")
MEMORY_KERNELS = ("copy", "add", "layernorm", "softmax", "gelu")
COLLECTIVES = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "send_recv": "SR"}
# nccl-tests' bus bandwidth factors (its PERFORMANCE.md): busbw = algbw x factor on n ranks
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
NCCL_HEADER = ("size(B)", "count", "type", "time(ns)", "busbw(GB/s)", "time(ns)", "busbw(GB/s)")
DTYPES = ("bf16", "fp16", "fp32")
STANDARD_GRID = tuple(
    (m, n, k) for m in (1024, 2048, 4096, 8192) for n in (1024, 4096, 8192, 16384) for k in (1024, 4096, 8192)
)
# bytes moved per kernel call (read + written) = factor x elements x element size
_MEMORY_FACTOR = {"copy": 2, "add": 3, "layernorm": 2, "softmax": 2, "gelu": 2}
ROW = 1024  # the last dimension of the layernorm and softmax inputs (a job's hidden size with --job)


@dataclass(frozen=True)
class BenchPlan:
    """What one bench run measures."""

    device: str  # the catalog's device type the tables are for (the rows' `device`)
    dtypes: tuple[str, ...]
    gemm_shapes: tuple[tuple[int, int, int], ...]
    memory_bytes: tuple[int, ...]  # target bytes moved per kernel call
    message_bytes: tuple[int, ...]
    group_sizes: tuple[int, ...]
    ops: tuple[str, ...] = tuple(COLLECTIVES)
    kernels: tuple[str, ...] = MEMORY_KERNELS
    row: int = ROW
    repeats: int = 5
    budget_s: float = 300.0

    def items(self) -> int:
        return (
            len(self.gemm_shapes) * len(self.dtypes)
            + len(self.memory_bytes) * len(self.kernels)
            + len(self.message_bytes) * len(self.ops) * len(self.group_sizes)
        )


@dataclass
class BenchResult:
    out: Path
    files: list[Path] = field(default_factory=list)
    measured: int = 0
    skipped: int = 0  # items left out when the budget ran out
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            "hops-calib bench needs torch: install the [capture] extra (pip install "
            "'hops-calib[capture]'), or torch built for this machine's GPUs"
        ) from None
    return torch


def _dtype(torch: Any, name: str) -> Any:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def job_gemm_shapes(job_dir: Path | str) -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], str]:
    """((hidden size, the GEMM shapes (m, n, k) one layer and the output layer run), words) of a job's launch.

    Megatron's layer (megatron/core/transformer: `ColumnParallelLinear` for QKV and FC1, `RowParallelLinear` for
    the projection and FC2, in tensor_parallel/layers.py) runs on T = s x micro batch tokens (sequence parallel
    gathers them before the column-parallel GEMMs): QKV (T, h) x (h, (h + 2 g d) / t) with g query groups of
    head size d, proj (T, h/t) x (h/t, h), FC1 (T, h) x (h, f/t) (2f/t under SwiGLU), FC2 (T, f/t) x (f/t, h);
    each backward runs the input gradient (T, out) x (out, in) and the weight gradient (out, T) x (T, in); the
    output layer (T, h) x (h, V/t) likewise. The attention core is its own kernel and is not a GEMM row here."""
    from hops_calib.spec import build_spec

    spec = build_spec(job_dir)
    shape = spec.model
    t = shape.tensor_parallel
    h, f, heads = shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads
    groups = shape.num_query_groups or heads
    head = h // heads
    tokens = shape.seq_length * shape.micro_batch_size
    linears = [(h, (h + 2 * groups * head) // t), (h // t, h), (h, (2 if shape.swiglu else 1) * f // t), (f // t, h)]
    if shape.vocab_size:
        linears.append((h, -(-shape.vocab_size // t)))
    shapes: list[tuple[int, int, int]] = []
    for into, out in linears:
        for gemm in ((tokens, out, into), (tokens, into, out), (out, into, tokens)):  # forward, dgrad, wgrad
            if gemm not in shapes:
                shapes.append(gemm)
    words = (
        f"{spec.run_id}: t {t}, micro batch {shape.micro_batch_size}, s {shape.seq_length}, h {h}, ffn {f}"
        f"{', GQA ' + str(groups) if groups != heads else ''}{', SwiGLU' if shape.swiglu else ''}"
    )
    return (h, tuple(shapes)), words


class _Clock:
    """Times a callable: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def per_call_s(self, call: Callable[[], Any], repeats: int, min_s: float = 2e-3, max_inner: int = 200) -> float:
        call()  # warm-up (allocation, kernel selection)
        inner = 1
        first = self._loop(call, 1)
        if first < min_s:
            inner = min(max_inner, max(1, int(min_s / max(first, 1e-9))))
        return statistics.median(self._loop(call, inner) / inner for _ in range(repeats))

    def _loop(self, call: Callable[[], Any], inner: int) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                call()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        for _ in range(inner):
            call()
        return time.perf_counter() - begin


def _csv_text(columns: Sequence[str], rows: list[tuple]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    return buffer.getvalue()


def run_bench(plan: BenchPlan, out: Path | str, *, advance: Callable[[str], None] = lambda what: None) -> BenchResult:
    """Measure `plan` into `out` (gemm.csv, memory.csv, collectives/); stops starting new items once the budget
    is spent (what was measured is written, the rest counted as skipped). `advance` is called per item."""
    torch = _torch()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = BenchResult(out=out)
    began = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    clock = _Clock(torch, cuda)
    # each phase may use the budget up to its share, what an earlier one leaves flowing on
    deadlines = [began + plan.budget_s * share for share in (0.4, 0.6, 1.0)]

    gemms = [(dtype, m, n, k) for dtype in plan.dtypes for m, n, k in plan.gemm_shapes]
    _table(
        out / "gemm.csv",
        GEMM_COLUMNS,
        gemms,
        deadlines[0],
        result,
        advance,
        lambda item: (
            (plan.device, *item),
            _gemm(torch, item[1], item[2], item[3], _dtype(torch, item[0]), device),
            clock,
            plan.repeats,
        ),
    )
    dtype = _dtype(torch, plan.dtypes[0])
    size = torch.empty((), dtype=dtype).element_size()

    def kernel_item(item: tuple[str, int]) -> tuple[tuple, Callable[[], Any], _Clock, int]:
        kernel, target = item
        elements = max(plan.row, target // (_MEMORY_FACTOR[kernel] * size) // plan.row * plan.row)
        return (
            (plan.device, kernel, _MEMORY_FACTOR[kernel] * elements * size),
            _memory_kernel(torch, kernel, elements, plan.row, dtype, device),
            clock,
            plan.repeats,
        )

    kernels = [(kernel, target) for kernel in plan.kernels for target in plan.memory_bytes]
    _table(out / "memory.csv", MEMORY_COLUMNS, kernels, deadlines[1], result, advance, kernel_item)

    folder = out / "collectives"
    for n in plan.group_sizes:
        items = len(plan.ops) * len(plan.message_bytes)
        remaining = deadlines[2] - time.monotonic()
        if remaining <= 0:
            result.skipped += items
            continue
        tables = run_collectives(n, plan.ops, plan.message_bytes, plan.repeats, remaining, cuda)
        for op, points in tables.items():
            if not points:
                continue
            folder.mkdir(exist_ok=True)
            path = folder / f"{COLLECTIVES[op]}_GPU{n}_bench"
            atomic_write(path, nccl_table(op, n, points))
            result.files.append(path)
            result.measured += len(points)
        done = sum(len(points) for points in tables.values())
        result.skipped += items - done
        for _ in range(done):
            advance(f"collectives on {n}")
    if result.skipped:
        result.notes.append(
            f"the budget of {plan.budget_s:g} s ran out: {result.skipped} of {plan.items()} items "
            "left out (give --budget-s more, or fewer shapes and sizes)"
        )
    result.seconds = time.monotonic() - began
    return result


def _table(
    path: Path,
    columns: Sequence[str],
    items: list[tuple],
    deadline: float,
    result: BenchResult,
    advance: Callable[[str], None],
    prepare: Callable[[tuple], tuple],
) -> None:
    """Time each item (`prepare(item)`: its row's leading cells, the call, the clock, the repeats) until the
    deadline, and write the table of those measured (none: no file)."""
    rows = []
    for item in items:
        if time.monotonic() > deadline:
            result.skipped += 1
            continue
        cells, call, clock, repeats = prepare(item)
        rows.append((*cells, f"{clock.per_call_s(call, repeats):.9g}"))
        del call
        result.measured += 1
        advance(" ".join(map(str, item)))
    if rows:
        atomic_write(path, _csv_text(columns, rows))
        result.files.append(path)


def _gemm(torch: Any, m: int, n: int, k: int, dtype: Any, device: Any) -> Callable[[], Any]:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b)


def _memory_kernel(torch: Any, kernel: str, elements: int, row: int, dtype: Any, device: Any) -> Callable[[], Any]:
    """One call of a memory-bound kernel on `elements` elements (rows of `row` for the norm and the softmax)."""
    x = torch.randn(elements, device=device, dtype=dtype)
    y, z = torch.empty_like(x), torch.empty_like(x)
    matrix = x.view(-1, row)
    return {
        "copy": lambda: y.copy_(x),
        "add": lambda: torch.add(x, y, out=z),
        "layernorm": lambda: torch.nn.functional.layer_norm(matrix, (row,)),
        "softmax": lambda: torch.softmax(matrix, dim=-1),
        "gelu": lambda: torch.nn.functional.gelu(x),
    }[kernel]


def nccl_table(op: str, n: int, points: list[tuple[int, int, float, float]]) -> str:
    """nccl-tests' table of one op on n ranks: (bytes, elements, out-of-place s, in-place s) per size."""
    factor = BUS_FACTOR[op](n)
    rows = []
    for nbytes, count, out_s, in_s in sorted(points):
        rows.append(
            (
                nbytes,
                count,
                "float",
                f"{out_s * 1e9:.0f}",
                f"{nbytes / out_s / 1e9 * factor:.2f}",
                f"{in_s * 1e9:.0f}",
                f"{nbytes / in_s / 1e9 * factor:.2f}",
            )
        )
    return _csv_text(NCCL_HEADER, rows)


def run_collectives(
    n: int, ops: Sequence[str], message_bytes: Sequence[int], repeats: int, budget_s: float, cuda: bool
) -> dict[str, list[tuple[int, int, float, float]]]:
    """Each op's (bytes, elements, out-of-place s, in-place s) per message size on n local ranks (spawned
    processes; NCCL on GPUs, gloo on the CPU), as far as `budget_s` reaches."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hops-bench-") as scratch:
        deadline = time.time() + budget_s
        mp.spawn(
            _collective_worker,
            args=(n, list(ops), list(message_bytes), repeats, deadline, cuda, scratch),
            nprocs=n,
            join=True,
        )
        path = Path(scratch) / "result.json"
        found = json.loads(path.read_text()) if path.is_file() else {}
    return {op: [tuple(point) for point in found.get(op, [])] for op in ops}


def _collective_worker(
    rank: int, n: int, ops: list[str], message_bytes: list[int], repeats: int, deadline: float, cuda: bool, scratch: str
) -> None:
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=n
    )
    clock = _Clock(torch, cuda)
    found: dict[str, list[list[float]]] = {op: [] for op in ops}
    stop = torch.zeros(1, device=device)
    try:
        for op in ops:
            for nbytes in message_bytes:
                stop.fill_(1.0 if time.time() > deadline else 0.0)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same item
                if stop.item() > 0:
                    break
                count = max(n, nbytes // 4 // n * n)
                times = [
                    _agreed_per_call_s(dist, device, clock, call, repeats)
                    for call in _calls(torch, dist, op, count, n, rank, device)
                ]
                found[op].append([count * 4, count, times[0], times[1]])
        if rank == 0:
            atomic_write(Path(scratch) / "result.json", json.dumps(found))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _agreed_per_call_s(
    dist: Any,
    device: Any,
    clock: _Clock,
    call: Callable[[], Any],
    repeats: int,
    min_s: float = 2e-3,
    max_inner: int = 200,
) -> float:
    """The median over repeats of the slowest rank's time per call; every rank runs the same number of calls
    (the loop length comes from the slowest rank's first call)."""
    call()
    first = _slowest(dist, device, clock._loop(call, 1))
    inner = min(max_inner, max(1, int(min_s / max(first, 1e-9))))
    return statistics.median(_slowest(dist, device, clock._loop(call, inner) / inner) for _ in range(repeats))


def _slowest(dist: Any, device: Any, seconds: float) -> float:
    import torch

    value = torch.tensor([seconds], device=device, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _calls(torch: Any, dist: Any, op: str, count: int, n: int, rank: int, device: Any) -> tuple[Callable, Callable]:
    """(out-of-place, in-place) calls of `op` on a buffer of `count` float32 elements (nccl-tests' size: the
    all-reduce's buffer, the all-gather's output, the reduce-scatter's input, the all-to-all's buffer, one
    message of send/recv)."""
    whole = torch.ones(count, device=device)
    part = torch.ones(count // n, device=device)
    other = torch.empty_like(whole)
    if op == "all_reduce":

        def call():  # torch has no out-of-place all-reduce
            dist.all_reduce(whole)

        return call, call
    if op == "all_gather":
        return (
            lambda: dist.all_gather_into_tensor(other, part),
            lambda: dist.all_gather_into_tensor(whole, whole[rank * (count // n) : (rank + 1) * (count // n)]),
        )
    if op == "reduce_scatter":
        if device.type == "cpu":  # gloo has no reduce-scatter: NCCL's ring as gloo can run it

            def scatter():
                dist.all_reduce(whole)
                part.copy_(whole[rank * (count // n) : (rank + 1) * (count // n)])

            return scatter, scatter
        return (
            lambda: dist.reduce_scatter_tensor(part, whole),
            lambda: dist.reduce_scatter_tensor(whole[rank * (count // n) : (rank + 1) * (count // n)], whole),
        )
    if op == "all_to_all":

        def call():  # no in-place all-to-all
            dist.all_to_all_single(other, whole)

        return call, call

    # send/recv: each rank sends one message to the next rank and receives one from the previous (nccl-tests'
    # sendrecv_perf)
    def exchange():
        work = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, whole, (rank + 1) % n), dist.P2POp(dist.irecv, other, (rank - 1) % n)]
        )
        for request in work:
            request.wait()

    return exchange, exchange


def default_plan(
    *,
    device: str,
    cuda: bool,
    dtypes: Sequence[str] = (),
    shapes: Sequence[tuple[int, int, int]] = (),
    row: int = ROW,
    group_sizes: Sequence[int] = (),
    budget_s: float = 300.0,
    quick: bool = False,
    repeats: int = 5,
) -> BenchPlan:
    """The plan of one bench run: a job's shapes or the standard grid, memory sizes and message sizes for a GPU
    (64 KiB-1 GiB; 1 KiB-1 GiB messages) or the CPU (smaller), or `quick`'s tiny ones (a few seconds)."""
    memory: tuple[int, ...]
    messages: tuple[int, ...]
    if quick:
        memory = (1 << 16, 1 << 20)
        messages = (1 << 12, 1 << 16)
        shapes = tuple(shapes)[:4] or ((64, 64, 64), (128, 256, 64))
        repeats = min(repeats, 3)
    elif cuda:
        memory = tuple(1 << p for p in range(16, 31, 2))
        messages = tuple(1 << p for p in range(10, 31, 2))
    else:
        memory = tuple(1 << p for p in range(12, 27, 2))
        messages = tuple(1 << p for p in range(10, 25, 2))
    if not group_sizes:
        available = __import__("torch").cuda.device_count() if cuda else os.cpu_count() or 2
        group_sizes = tuple(g for g in (2, 4, 8) if g <= max(2, available))
    return BenchPlan(
        device=device,
        dtypes=tuple(dtypes) or (("bf16",) if cuda else ("fp32",)),
        gemm_shapes=tuple(shapes) or STANDARD_GRID,
        memory_bytes=memory,
        message_bytes=messages,
        group_sizes=tuple(group_sizes),
        row=row,
        repeats=repeats,
        budget_s=budget_s,
    )


def device_type_of(torch: Any) -> str:
    """The catalog device type of this machine's first GPU by its name (an H100 is the DGX/HGX H100's GPU: a
    GEMM or kernel table does not depend on the node), else "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).upper()
    for key, device in (
        ("H200", "h200"),
        ("H100", "h100_dgx"),
        ("B200", "b200"),
        ("A100", "a100"),
        ("A10G", "a10g"),
        ("L4", "l4"),
    ):
        if key in name:
            return "a100_40gb" if device == "a100" and "40GB" in name else device
    return name.split()[-1].lower()
