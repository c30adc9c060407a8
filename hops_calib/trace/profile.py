"""Trace room: a GPU profiler's trace of one rank (PyTorch profiler / Kineto, Nsight Systems) as pipeline events.

The readers (`kineto.py`, `nsys.py`) reduce a rank's trace to a `RankProfile`:
the iteration windows, the host spans of Megatron's schedule steps and of the
optimizer step, the p2p sends and collectives, and the compute operators and
kernels with their shapes. `assemble` turns it into the event columns of the
event-log reader (`events.EVENT_DTYPES`: the same structure checks, timeline and
truth follow), and into kernel rows for the per-kernel truth.

How the pieces map (../shared/docs/profiler-traces.md §3):

- iteration: the `ProfilerStep#N` window that holds the interval's start; N is Megatron's iteration (its
  training loop calls `prof.step()` at the top of each pass) plus `step_offset` (a resumed run);
- FORWARD / BACKWARD: a span of Megatron-core's `schedules.forward_step` / `backward_step` (the Python
  stack's `.../pipeline_parallel/schedules.py(N): forward_step`, or a range of that name); the k-th forward
  (backward) of an iteration is microbatch k (Megatron's 1F1B runs backwards in forward order), and with
  model chunks the k-th pass follows Megatron's interleaved order (`pass_order`, handed in by the caller);
- a span's interval is the device time of the kernels it launched (first start to last end) where the trace
  has kernels, else the host span (a CPU run), as the event logs time compute with CUDA events on the device;
- OPTIMIZER: from the first optimizer-step range (`Optimizer.step#<Class>.step`, Megatron's `optimizer`) to the
  end of the last optimizer range of the iteration, a `zero_grad` that follows it included;
- a transfer: each p2p send (`c10d::send`, `record_param_comms` send, `nccl:send a->b`), host dispatch time as
  in the event logs, labelled with the step that produced what it sends: after a forward, the activation to
  the next stage; after a backward, the input gradient to the previous stage. Megatron posts a combined
  exchange's send to the next stage first (p2p_communication._p2p_ops), so where two sends follow one step the
  first is the forward's and the second the backward's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hops_calib.timeline import COMPUTE, KINDS, PHASES, TRANSFER
from hops_calib.trace.errors import TraceError
from hops_calib.trace.events import EVENT_DTYPES, CollectiveEvent, RankLogReport

_F, _B, _OPT = (PHASES.index(name) for name in ("FORWARD", "BACKWARD", "OPTIMIZER"))
OTHER_PHASE = "OTHER"  # kernel rows outside every schedule step and optimizer step (reductions, loss, logging)

# Megatron-core's schedule steps as the Python tracer names them (with_stack), or as a range names them.
_STEP_PATTERN = re.compile(r"(?:pipeline_parallel/schedules\.py\(\d+\): |(?:^|\.))(forward_step|backward_step)$")
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")


def schedule_step(name: str) -> str | None:
    """'F' or 'B' for a span of Megatron's forward_step / backward_step, else None."""
    match = _STEP_PATTERN.search(name)
    if match is None:
        return None
    return "F" if match.group(1) == "forward_step" else "B"


def profiler_step(name: str) -> int | None:
    match = _PROFILER_STEP.match(name)
    return int(match.group(1)) if match else None


def is_optimizer_range(name: str) -> bool:
    return name.startswith("Optimizer.step#") or name == "optimizer"


def is_zero_grad_range(name: str) -> bool:
    return name.startswith("Optimizer.zero_grad#")


# Kernel (or operator) classes, by name; the first match wins. NCCL names follow NCCL's generators (profiler-traces
# §1.6); GEMM names cover cuBLAS/CUTLASS kernels (`sm90_xmma_gemm`, `ampere_sgemm`, `cutlass::Kernel`, `gemv`) and
# ATen's matrix products.
KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("communication", r"nccl|^c10d::|gloo|record_param_comms|SendRecv|AllReduce|AllGather|ReduceScatter"),
        ("memcpy", r"^Memcpy|^Memset|memcpy|memset|^aten::copy_$|^aten::_to_copy$"),
        ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product"),
        ("gemm", r"gemm|gemv|cublas|cutlass|xmma|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addbmm)$"),
        ("softmax", r"softmax"),
        ("norm", r"layer_?norm|rms_?norm|batch_norm|group_norm"),
        ("optimizer", r"adam|multi_tensor|lerp|addcdiv|addcmul|fused_sgd|_foreach"),
        ("embedding", r"embedding|index_select|gather|scatter"),
        ("reduction", r"reduce|^aten::(sum|mean|max|min|norm|cumsum)$|argmax|topk"),
        (
            "elementwise",
            (
                r"elementwise|vectorized|unrolled|^aten::(add|add_|mul|mul_|div|div_|sub|gelu|relu|silu|dropout|"
                r"masked_fill_|fill_|zero_|sqrt|exp|tanh|neg|rsqrt|pow|where|clamp)"
            ),
        ),
    )
)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


@dataclass
class Interned:
    """Strings as small integer ids (kernel and operator names, shapes), shared by a rank's rows."""

    ids: dict[str, int] = field(default_factory=dict)

    def __call__(self, text: str) -> int:
        found = self.ids.get(text)
        if found is None:
            found = self.ids[text] = len(self.ids)
        return found

    @property
    def values(self) -> list[str]:
        return list(self.ids)


@dataclass
class RankProfile:
    """What a rank's profiler trace holds that the pipeline needs (times in Unix-epoch ns)."""

    path: Path
    rank: int | None = None  # as the trace says (distributedInfo.rank); None when it does not
    world_size: int | None = None
    hostname: str = ""
    source: str = "kineto"  # or "nsys"
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (N of ProfilerStep#N, start, end)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # ("F"|"B", host start, host end)
    optimizer: list[tuple[int, int]] = field(default_factory=list)
    zero_grad: list[tuple[int, int]] = field(default_factory=list)
    sends: list[tuple[int, int]] = field(default_factory=list)  # host dispatch (start, end)
    collectives: list[tuple[str, int, int, int, str]] = field(default_factory=list)  # (op, start, end, bytes, group)
    names: Interned = field(default_factory=Interned)
    shapes: Interned = field(default_factory=Interned)
    # Compute operators (CPU runs: the kernel level is the operator's self time) and device kernels, as arrays:
    # ops: start, end, tid, name, shape, external id; kernels: start, end, name, shape (-1: unknown), launch ts
    ops: dict[str, np.ndarray] = field(default_factory=dict)
    kernels: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class KernelRows:
    """Per-kernel (or per-operator) durations of one rank, each with the phase and iteration it ran in."""

    stage: int
    rank: int
    names: list[str]
    shapes: list[str]
    name_id: np.ndarray
    shape_id: np.ndarray  # -1: no shape recorded
    phase: np.ndarray  # code into PHASES, -1 for OTHER
    iteration: np.ndarray
    duration_ns: np.ndarray
    device: bool  # GPU kernels (device time) rather than CPU operators (self time)


def self_times(ops: dict[str, np.ndarray]) -> np.ndarray:
    """Self time (ns) of each operator: its duration less that of the operators it directly encloses on its
    thread (the profiler's `self_cpu_time`)."""
    start, end, tid = ops["start"], ops["end"], ops["tid"]
    order = np.lexsort((-(end - start), start, tid))
    own = (end - start).astype(np.int64)
    children = np.zeros(len(start), dtype=np.int64)
    stack: list[tuple[int, int]] = []  # (operator, end) of the enclosing operators
    last_tid = None
    s, e, t = start[order].tolist(), end[order].tolist(), tid[order].tolist()
    for k, index in enumerate(order.tolist()):
        if t[k] != last_tid:
            stack.clear()
            last_tid = t[k]
        while stack and stack[-1][1] <= s[k]:
            stack.pop()
        if stack:
            children[stack[-1][0]] += e[k] - s[k]
        stack.append((index, e[k]))
    return np.maximum(own - children, 0)


_Label = tuple[int, int, int, int, int]  # a schedule step: (window, phase code, microbatch, chunk, span index)


def _window_of(starts: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Index of the ProfilerStep window (rows of `steps`: start, end, sorted by start) holding each start; -1."""
    slot = np.searchsorted(steps[:, 0], starts, side="right") - 1
    inside = (slot >= 0) & (starts <= steps[np.maximum(slot, 0), 1])
    return np.where(inside, slot, -1)


def assemble(
    profile: RankProfile,
    *,
    rank: int,
    stage: int,
    pp: int,
    vp: int,
    microbatches: int,
    pass_order: Callable[[int, int], list[tuple[bool, int]]] | None = None,
    step_offset: int = 0,
) -> tuple[dict[str, np.ndarray], RankLogReport, KernelRows | None]:
    """Event columns (EVENT_DTYPES) of one rank's profile, what the read found, and its kernel rows.

    `pass_order(stage, microbatches)`: (is_forward, chunk) of each pass of an iteration when vp > 1.
    """
    path = profile.path
    report = RankLogReport(rank=rank, path=path, hostname=profile.hostname)
    if not profile.steps:
        raise TraceError(
            path,
            "has no ProfilerStep#N range: the iterations cannot be told apart",
            field="traceEvents",
            hint="record with a torch.profiler schedule (Megatron's --profile "
            "--use-pytorch-profiler with --profile-step-start/--profile-step-end does)",
        )
    if not profile.spans:
        raise TraceError(
            path,
            "has no span of Megatron's forward_step / backward_step: the microbatches cannot be told apart",
            field="traceEvents",
            hint="record the Python call stack (Megatron's --pytorch-profiler-collect-callstack, "
            "with_stack=True), or load the hops-calib tracer (docs/traces.md), whose ranges name "
            "the steps",
        )
    steps = sorted(profile.steps, key=lambda step: step[1])
    windows = np.array([(start, end) for _n, start, end in steps], dtype=np.int64).reshape(-1, 2)
    iterations = [n + step_offset for n, _s, _e in steps]
    spans = sorted(profile.spans, key=lambda span: span[1])
    span_start = np.array([s for _k, s, _e in spans], dtype=np.int64)
    span_end = np.array([e for _k, _s, e in spans], dtype=np.int64)
    span_window = _window_of(span_start, windows)
    device_start, device_end = _device_intervals(profile, span_start, span_end)

    rows: list[tuple[int, ...]] = []
    labels: list[_Label] = []  # per span: (window, phase, microbatch, chunk, is device)
    for window in range(len(steps)):
        inside = np.flatnonzero(span_window == window)
        kinds = [spans[k][0] for k in inside]
        if not kinds:
            continue
        passes = len(kinds)
        if vp > 1:
            if pass_order is None:
                raise TraceError(path, "holds an interleaved run, and no pass order was given", field="vp")
            order = pass_order(stage, passes // (2 * vp))
            expected = ["F" if forward else "B" for forward, _c in order]
            if kinds != expected:
                raise _order_error(path, iterations[window], kinds, expected)
            chunks = [chunk for _f, chunk in order]
        else:
            chunks = [0] * passes
        seen: dict[tuple[str, int], int] = {}
        for k, kind, chunk in zip(inside.tolist(), kinds, chunks):
            microbatch = seen.get((kind, chunk), 0)
            seen[(kind, chunk)] = microbatch + 1
            phase = _F if kind == "F" else _B
            labels.append((window, phase, microbatch, chunk, k))
            rows.append(
                (
                    stage,
                    chunk,
                    iterations[window],
                    microbatch,
                    KINDS.index(COMPUTE),
                    phase,
                    int(device_start[k]),
                    int(device_end[k]),
                    -1,
                )
            )

    # OPTIMIZER: first optimizer range to the end of the last optimizer (or following zero_grad) range, per window
    optimizer_rows = _optimizer_rows(profile, windows)
    if optimizer_rows:
        opt_windows = sorted(optimizer_rows)
        host = np.array([optimizer_rows[w] for w in opt_windows], dtype=np.int64)
        opt_start, opt_end = _device_intervals(profile, host[:, 0], host[:, 1])
        for k, window in enumerate(opt_windows):
            rows.append(
                (
                    stage,
                    0,
                    iterations[window],
                    -1,
                    KINDS.index(COMPUTE),
                    _OPT,  # (-1: as events.py)
                    int(opt_start[k]),
                    int(opt_end[k]),
                    -1,
                )
            )

    rows += _send_rows(profile, windows, iterations, labels, span_start, stage, pp, vp)
    for op, start, end, nbytes, group in profile.collectives:
        window = int(_window_of(np.array([start], dtype=np.int64), windows)[0])
        if window < 0:
            continue
        holding = [label for label in labels if span_start[label[4]] <= start <= span_end[label[4]]]
        if holding:
            _w, phase, microbatch, _chunk, _k = holding[-1]
            phase_name, mb, kind_group = PHASES[phase], microbatch, group or "tp"
        else:
            phase_name, mb, kind_group = "BACKWARD", None, group or "dp"
        if kind_group in ("tp", "dp"):
            report.collectives.append(
                CollectiveEvent(iterations[window], phase_name, mb, op, kind_group, nbytes, start, end)
            )
    columns = _columns(rows, rank)
    report.events = len(columns["start_ns"])
    report.lines = report.events
    kernels = _kernel_rows(profile, windows, iterations, labels, span_start, span_end, optimizer_rows, stage, rank)
    return columns, report, kernels


def _order_error(path: Path, iteration: int, kinds: list[str], expected: list[str]) -> TraceError:
    return TraceError(
        path,
        f"iteration {iteration} runs its steps in the order {''.join(kinds)}, not Megatron's "
        f"interleaved order {''.join(expected)}",
        field="traceEvents",
        hint="check --num-layers-per-virtual-pipeline-stage and the batch sizes of the configuration against the run",
    )


def _device_intervals(profile: RankProfile, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per host span, the device interval of the kernels launched inside it (first start, last end); the host span
    where it launched none (or the trace has no kernels)."""
    device_start, device_end = start.copy(), end.copy()
    kernels = profile.kernels
    if not kernels or not len(kernels.get("start", ())) or not len(start):
        return device_start, device_end
    launch = kernels["launch"]
    known = launch >= 0
    slot = np.searchsorted(start, launch, side="right") - 1
    inside = known & (slot >= 0) & (launch <= end[np.maximum(slot, 0)])
    first = np.full(len(start), np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(len(start), np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, slot[inside], kernels["start"][inside])
    np.maximum.at(last, slot[inside], kernels["end"][inside])
    launched = last > np.iinfo(np.int64).min
    device_start[launched], device_end[launched] = first[launched], last[launched]
    return device_start, device_end


def _optimizer_rows(profile: RankProfile, windows: np.ndarray) -> dict[int, tuple[int, int]]:
    found: dict[int, tuple[int, int]] = {}
    for start, end in sorted(profile.optimizer):
        window = int(_window_of(np.array([start], dtype=np.int64), windows)[0])
        if window >= 0:
            first, last = found.get(window, (start, end))
            found[window] = (min(first, start), max(last, end))
    for start, end in profile.zero_grad:  # a zero_grad right after the step belongs to it (the event logs' OPTIMIZER)
        window = int(_window_of(np.array([start], dtype=np.int64), windows)[0])
        if window in found and start >= found[window][1] - 1 and start <= windows[window, 1]:
            found[window] = (found[window][0], max(found[window][1], end))
    return found


def _send_rows(
    profile: RankProfile,
    windows: np.ndarray,
    iterations: list[int],
    labels: list[_Label],
    span_start: np.ndarray,
    stage: int,
    pp: int,
    vp: int,
) -> list[tuple[int, ...]]:
    rows: list[tuple[int, ...]] = []
    if not profile.sends or not labels:
        return rows
    sends = sorted(profile.sends)
    label_start = np.array([span_start[label[4]] for label in labels], dtype=np.int64)
    by_step: dict[int, list[tuple[int, int]]] = {}
    for start, end in sends:
        after = int(np.searchsorted(label_start, start, side="right")) - 1
        if after >= 0:
            by_step.setdefault(after, []).append((start, end))
    for after, group in by_step.items():
        window = labels[after][0]
        if int(_window_of(np.array([group[0][0]], dtype=np.int64), windows)[0]) != window:
            continue
        latest = {
            phase: next(
                (labels[k] for k in range(after, -1, -1) if labels[k][1] == phase and labels[k][0] == window), None
            )
            for phase in (_F, _B)
        }
        phases = [_F, _B] if len(group) >= 2 else [labels[after][1]]
        for (start, end), phase in zip(group, phases):
            label = latest[phase]
            if label is None:
                continue
            _w, _p, microbatch, chunk, _k = label
            if phase == _F:
                if vp == 1 and stage == pp - 1:
                    continue
                peer = (stage + 1) % pp
            else:
                if vp == 1 and stage == 0:
                    continue
                peer = (stage - 1) % pp
            rows.append((stage, chunk, iterations[window], microbatch, KINDS.index(TRANSFER), phase, start, end, peer))
    return rows


def _columns(rows: list[tuple[int, ...]], rank: int) -> dict[str, np.ndarray]:
    names = ("stage", "chunk", "iteration", "microbatch", "kind", "phase", "start_ns", "end_ns", "peer_stage")
    table = np.array(rows, dtype=np.int64).reshape(-1, len(names))
    order = np.lexsort((table[:, 7], table[:, 6])) if len(table) else np.arange(0)
    table = table[order]
    out = {name: table[:, k].astype(EVENT_DTYPES[name]) for k, name in enumerate(names)}
    out["rank"] = np.full(len(table), rank, dtype=EVENT_DTYPES["rank"])
    return {name: out[name] for name in EVENT_DTYPES}


def _phase_of(
    times: np.ndarray,
    windows: np.ndarray,
    labels: list[_Label],
    span_start: np.ndarray,
    span_end: np.ndarray,
    optimizer: dict[int, tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """(phase code or -1, window or -1) of each host time: the schedule step or optimizer step holding it."""
    window = _window_of(times, windows)
    phase = np.full(len(times), -1, dtype=np.int8)
    if labels:
        starts = np.array([span_start[label[4]] for label in labels], dtype=np.int64)
        ends = np.array([span_end[label[4]] for label in labels], dtype=np.int64)
        codes = np.array([label[1] for label in labels], dtype=np.int8)
        order = np.argsort(starts)
        starts, ends, codes = starts[order], ends[order], codes[order]
        slot = np.searchsorted(starts, times, side="right") - 1
        inside = (slot >= 0) & (times <= ends[np.maximum(slot, 0)])
        phase[inside] = codes[slot[inside]]
    for w, (start, end) in optimizer.items():
        phase[(window == w) & (times >= start) & (times <= end)] = _OPT
    return phase, window


def _kernel_rows(
    profile: RankProfile,
    windows: np.ndarray,
    iterations: list[int],
    labels: list[_Label],
    span_start: np.ndarray,
    span_end: np.ndarray,
    optimizer: dict[int, tuple[int, int]],
    stage: int,
    rank: int,
) -> KernelRows | None:
    kernels = profile.kernels
    iteration_of = np.array(iterations + [-1], dtype=np.int32)
    if kernels and len(kernels.get("start", ())):
        launch = kernels["launch"]
        phase, window = _phase_of(
            np.where(launch >= 0, launch, kernels["start"]), windows, labels, span_start, span_end, optimizer
        )
        keep = window >= 0
        return KernelRows(
            stage=stage,
            rank=rank,
            names=profile.names.values,
            shapes=profile.shapes.values,
            name_id=kernels["name"][keep],
            shape_id=kernels["shape"][keep],
            phase=phase[keep],
            iteration=iteration_of[window[keep]],
            duration_ns=(kernels["end"] - kernels["start"])[keep],
            device=True,
        )
    ops = profile.ops
    if ops and len(ops.get("start", ())):
        self_ns = self_times(ops)
        phase, window = _phase_of(ops["start"], windows, labels, span_start, span_end, optimizer)
        keep = window >= 0
        return KernelRows(
            stage=stage,
            rank=rank,
            names=profile.names.values,
            shapes=profile.shapes.values,
            name_id=ops["name"][keep],
            shape_id=ops["shape"][keep],
            phase=phase[keep],
            iteration=iteration_of[window[keep]],
            duration_ns=self_ns[keep],
            device=False,
        )
    return None
