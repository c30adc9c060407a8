"""Kernel truth against the kernel model: a profiled run's measured kernel times (`Truth.kernels`, from a Kineto or
Nsight trace) beside the times `decoder_kernels` prices for the same kernels (`hops_calib.model.kernel_table`).

Measured and predicted kernels meet by stage (the pipeline rank), phase and kernel class: a measured FORWARD row
against the model's forward kernels, a BACKWARD row against its input-gradient, weight-gradient and recomputed
ones, summed per iteration (a predicted kernel: its time per launch x launches per microbatch x microbatches, over
the rank's model chunks). The model's kernels take the classes the trace reader gives kernel names
(`hops_calib.trace.profile.kernel_class`): a GEMM is `gemm`, a fused attention kernel `attention`, a collective
`communication`, a memory-bound kernel the class of its kind (`MEMORY_CLASSES`). GEMMs also meet by shape: an
ATen product's `Input Dims` (`aten::mm` [[M, K], [K, N]], `aten::bmm` / `aten::baddbmm` [[B, M, K], [B, K, N]],
`aten::addmm` [bias, [M, K], [K, N]]) name the same (batch, M, N, K) as the model's GEMM (`kernels.Kernel`: forward
Y[T, out] = X[T, in] W^T, input gradient dX = dY W, weight gradient dW[out, in] = dY^T X), so each measured shape
gets the model's kernels of that shape. Device kernels (a GPU trace) carry no shapes of their own; their classes
still meet.

`mispriced_kernel_pct` is what `tune decoder_kernels --objective components` minimizes on runs with kernel truth:
per run, the sum over (stage, phase, class) of |predicted - measured| over the measured time of the classes the
model prices at all, as a percentage, averaged over runs. Classes the model launches no kernel for, and the
trace's catch-all class `other` (on a CPU run: autograd nodes' and views' own host time), are left out of it and
reported as unpriced.

Per class, the section `observe --json` shows (`kernel_section`): measured and predicted ms per iteration summed
over the runs, their bias, the time mispriced, and what one scale factor per class (what a single efficiency of the
term does: `FIXED_BY`) would leave: `fixable_ms` is the mispriced time that scale removes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hops_calib.model.kernels import ATTENTION, COLLECTIVE, DGRAD, FORWARD, GEMM, RECOMPUTE, WGRAD

MEASURED_PHASES = {"FORWARD": (FORWARD,), "BACKWARD": (DGRAD, WGRAD, RECOMPUTE)}
# A memory-bound kernel's kind (`kernels.Kernel.kind`) as the class the trace reader gives the ATen operator or
# CUDA kernel that does it (`trace.profile.KERNEL_CLASSES`); kinds not named here are `elementwise`.
MEMORY_CLASSES = {
    "layernorm": "norm",
    "rmsnorm": "norm",
    "softmax": "softmax",
    "embedding": "embedding",
    "sum": "reduction",
    "copy": "memcpy",
    "cat": "other",
    "adam": "optimizer",
}
FIXED_BY = {
    "gemm": "decoder_kernels gemm_efficiency, gemm_k_half (or the machine's GEMM table)",
    "attention": "decoder_kernels flash_forward_efficiency, flash_backward_efficiency",
    "communication": "tensor_parallel_comm (the node's all-reduce table, else the ring)",
}
MEMORY_FIX = "decoder_kernels memory_efficiency, kernel_latency_us (or the machine's memory table)"
UNPRICED = (
    "no kernel of the model: unpriced (the trace's catch-all class `other`: on a CPU run the host time of "
    "autograd nodes and views; a collective the launch has no tensor-parallel group for)"
)
GEMM_OPS = {"aten::mm": 0, "aten::bmm": 0, "aten::baddbmm": 1, "aten::addmm": 1}  # index of the A operand


def model_class(op: str, kind: str) -> str:
    """The trace's kernel class of one of the model's kernels."""
    if op == GEMM:
        return "gemm"
    if op == ATTENTION:
        return "attention"
    if op == COLLECTIVE:
        return "communication"
    return MEMORY_CLASSES.get(kind, "elementwise")


def gemm_shape(name: str, shape: str | None) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of a measured ATen product from its `Input Dims`; None for another kernel or no shape."""
    if name not in GEMM_OPS or not shape:
        return None
    try:
        dims = json.loads(shape)
        a, b = dims[GEMM_OPS[name]], dims[GEMM_OPS[name] + 1]
    except (ValueError, IndexError, TypeError):
        return None
    if len(a) == 2 and len(b) == 2 and a[1] == b[0]:
        return (1, int(a[0]), int(b[1]), int(a[1]))
    if len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
        return (int(a[0]), int(a[1]), int(b[2]), int(a[2]))
    return None


@dataclass(frozen=True)
class RunKernels:
    """One run's kernel times per iteration (ms): by (stage, phase, class), and its GEMMs by (stage, phase, shape)."""

    run_id: str
    classes: Mapping[tuple[int, str, str], float]
    gemms: Mapping[tuple[int, str, tuple[int, int, int, int]], float]


def measured_kernels(fixture) -> RunKernels | None:
    """The run's measured kernel times in the phases the kernel model prices; None without kernel truth (a run
    measured at iteration level has none: its truth is an `IterationTruth`)."""
    rows = [k for k in getattr(fixture.truth, "kernels", ()) if k.phase in MEASURED_PHASES]
    if not rows:
        return None
    classes: dict[tuple[int, str, str], float] = defaultdict(float)
    gemms: dict[tuple[int, str, tuple[int, int, int, int]], float] = defaultdict(float)
    for k in rows:
        classes[(k.stage, k.phase, k.kernel_class)] += k.per_iteration_ms
        shape = gemm_shape(k.name, k.shape)
        if shape is not None:
            gemms[(k.stage, k.phase, shape)] += k.per_iteration_ms
    return RunKernels(fixture.id, dict(classes), dict(gemms))


def predicted_kernels(model, spec) -> RunKernels:
    """The kernel times per iteration `decoder_kernels` prices for the spec (with the model's values of the term, or
    its defaults where the model does not activate it), keyed as `measured_kernels`."""
    from hops_calib.model.kernel_table import kernel_table
    from hops_calib.model.terms import layout_of

    layout = layout_of(spec)
    phase_of = {phase: measured for measured, phases in MEASURED_PHASES.items() for phase in phases}
    classes: dict[tuple[int, str, str], float] = defaultdict(float)
    gemms: dict[tuple[int, str, tuple[int, int, int, int]], float] = defaultdict(float)
    for k in range(layout.virtual_stages):
        rank = layout.rank_of(k)
        for row, kernel_ms in ((r, r.ms * r.count * spec.microbatches) for r in kernel_table(model, spec, k).rows):
            phase = phase_of.get(row.phase)
            if phase is None:
                continue
            classes[(rank, phase, model_class(row.op, row.kind))] += kernel_ms
            if row.op == GEMM:
                gemms[(rank, phase, _row_shape(row.shape))] += kernel_ms
    return RunKernels(spec.run_id, dict(classes), dict(gemms))


def _row_shape(text: str) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a kernel table row's shape ('M x N x K', or 'B x M x N x K')."""
    numbers = [int(part) for part in text.replace(" ", "").split("x") if part]
    return tuple(numbers) if len(numbers) == 4 else (1, *numbers)  # type: ignore[return-value]


CATCH_ALL = "other"  # the trace reader's class of what no pattern names: no mechanism of the model prices it


def priced_classes(predicted: RunKernels) -> set[str]:
    """The classes the model launches kernels of (the trace's catch-all class never counts as priced)."""
    return {label for (_, _, label), ms in predicted.classes.items() if ms > 0 and label != CATCH_ALL}


def mispriced_kernel_share(measured: RunKernels, predicted: RunKernels) -> float | None:
    """One run's mispriced share of its priced kernel time (module docstring), in %; None where nothing is priced."""
    priced = priced_classes(predicted)
    total = mispriced = 0.0
    for key, value in measured.classes.items():
        if key[2] in priced and value > 0:
            total += value
            mispriced += abs(predicted.classes.get(key, 0.0) - value)
    return mispriced / total * 100.0 if total > 0 else None


def mispriced_kernel_pct(pairs: Iterable[tuple[RunKernels, RunKernels]]) -> float:
    shares = [s for s in (mispriced_kernel_share(m, p) for m, p in pairs) if s is not None]
    return sum(shares) / len(shares) if shares else float("nan")


def _fixable(pairs: list[tuple[float, float]]) -> tuple[float | None, float]:
    """(scale, mispriced ms it removes): the one factor on the predictions that makes their sum the measured one."""
    measured, predicted = sum(m for m, _ in pairs), sum(p for _, p in pairs)
    if predicted <= 0:
        return None, 0.0
    scale = measured / predicted
    before = sum(abs(p - m) for m, p in pairs)
    after = sum(abs(scale * p - m) for m, p in pairs)
    return scale, max(before - after, 0.0)


def kernel_section(fixtures: Sequence[Any], model) -> dict[str, Any] | None:
    """Measured against predicted kernel time by class over the runs with kernel truth (`observe --json`'s
    `kernel_classes`); None when no run has any."""
    runs = []
    for fixture in fixtures:
        measured = measured_kernels(fixture)
        if measured is not None:
            runs.append((measured, predicted_kernels(model, fixture.spec)))
    if not runs:
        return None
    by_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    priced = set().union(*(priced_classes(p) for _, p in runs))
    for measured, predicted in runs:
        for key in set(measured.classes) | set(predicted.classes):
            by_class[key[2]].append((measured.classes.get(key, 0.0), predicted.classes.get(key, 0.0)))
    classes: list[dict[str, Any]] = []
    for label, pairs in by_class.items():
        real, pred = sum(m for m, _ in pairs), sum(p for _, p in pairs)
        scale, fixable = _fixable(pairs)
        classes.append(
            {
                "kernel_class": label,
                "measured_ms": real,
                "predicted_ms": pred,
                "bias_ms": pred - real,
                "bias_pct": (pred - real) / real * 100.0 if real > 0 else None,
                "mispriced_ms": sum(abs(p - m) for m, p in pairs),
                "scale_to_fit": scale,
                "fixable_ms": fixable,
                "priced": label in priced,
                "fixed_by": UNPRICED if label not in priced else FIXED_BY.get(label, MEMORY_FIX),
            }
        )
    classes.sort(key=lambda row: -row["mispriced_ms"])
    gemms: list[dict[str, Any]] = []
    for measured, predicted in runs:
        for (stage, phase, shape), measured_ms in sorted(measured.gemms.items()):
            predicted_ms = predicted.gemms.get((stage, phase, shape))
            gemms.append(
                {
                    "run": measured.run_id,
                    "stage": stage,
                    "phase": phase,
                    "batch_m_n_k": list(shape),
                    "measured_ms": measured_ms,
                    "predicted_ms": predicted_ms,
                    "error_pct": (predicted_ms - measured_ms) / measured_ms * 100.0
                    if predicted_ms is not None and measured_ms > 0
                    else None,
                }
            )
    matched = [g for g in gemms if g["predicted_ms"] is not None]
    return {
        "runs": [m.run_id for m, _ in runs],
        "unit": "ms per iteration, summed over the runs' stages and the FORWARD and BACKWARD phases",
        "mispriced_kernel_pct": mispriced_kernel_pct(runs),
        "classes": classes,
        "gemm_shapes": {
            "matched": len(matched),
            "measured": len(gemms),
            "matched_measured_ms": sum(g["measured_ms"] for g in matched),
            "matched_predicted_ms": sum(g["predicted_ms"] for g in matched),
            "rows": gemms,
        },
    }
