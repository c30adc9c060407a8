"""Calibration coverage: where a configuration lies outside the runs a model's parameters were learned on.

A calibrated model interpolates well and extrapolates as well as its physics: a hidden size, a device pair or a
schedule that no train run had is priced by parameters nothing pinned for it. Before trusting a what-if, a user
should know which of its features are new. The features are the ones the cost terms read: device types, the
device pairs a hop crosses, the pair of end devices the embedding all-reduce joins, the schedule and
interleaving, the precision of the linear GEMMs (fp8 for an FP8 launch), attention kernel, recomputation, sequence parallelism, distributed optimizer, a
mixture of experts and whether a tensor- or data-parallel group spans nodes, and the ranges of the model shape, the message a hop
carries, the microbatches (also per stage: fewer than the stages never fill the pipeline), the pipeline depth, the
layers on a stage and the tensor- and data-parallel sizes. Only
configurations are compared (specs, known before a run); no result of any run is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hops_calib.model import gpt
from hops_calib.spec import Spec, fsdp_strategy


def _pair(a: str, b: str) -> str:
    return "-".join(sorted((a, b)))


def _numbers(spec: Spec) -> dict[str, float]:
    shape = spec.model
    return {
        "hidden size": shape.hidden_size,
        "sequence length": shape.seq_length,
        "micro batch size": shape.micro_batch_size,
        "hop message MiB": gpt.boundary_activation_bytes(shape) / 2**20,
        "microbatches": spec.microbatches,
        "pipeline depth": spec.pp,
        # Fewer microbatches than stages never fills the pipeline: another regime of the schedule.
        "microbatches per stage": round(spec.microbatches / spec.pp, 3),
        "layers on a stage": max(spec.layers_per_stage),
        "model chunks per stage": spec.vp,
        "tensor parallel size": spec.tp,
        "data parallel size": spec.dp,
    }


def _sets(spec: Spec) -> dict[str, set[str]]:
    return {
        "device type": set(spec.devices),
        "hop device pair": {_pair(a, b) for a, b in zip(spec.devices, spec.devices[1:])},
        "end device pair": {_pair(spec.devices[0], spec.devices[-1])} if spec.pp > 1 else set(),
        "schedule": {spec.schedule},
        "precision": {_precision(spec)},
        "attention kernel": {spec.model.attention_kernel},
        "recomputation": {spec.model.recompute_granularity or "none"},
        "sequence parallelism": {"on" if spec.model.sequence_parallel else "off"},
        "distributed optimizer": {"on" if spec.distributed_optimizer else "off"},
        "mixture of experts": {"on" if spec.model.moe else "off"},
        "Megatron-FSDP sharding": {fsdp_strategy(spec.megatron_args) or "none"},
        "tensor or data parallel group across nodes": {"yes" if _group_across_nodes(spec) else "no"},
    }


def _precision(spec: Spec) -> str:
    """The linear GEMMs' precision (`terms.roofline.linear_gemm_precision`: fp8 for an FP8 launch, whose 16-bit
    weights are bf16 or fp16, else the training dtype): what the roofline and kernel terms price the GEMMs at."""
    from hops_calib.model.terms.roofline import linear_gemm_precision

    return linear_gemm_precision(spec)


def _group_across_nodes(spec: Spec) -> bool:
    """Whether a tensor- or data-parallel group of the launch spans nodes (its collectives then cross the NICs)."""
    return any((spec.group_nodes(group) or (1, 0))[0] > 1 for group in ("tp", "dp"))


@dataclass(frozen=True)
class Coverage:
    """What a set of (train) configurations spans: a range per number, the values seen per category."""

    runs: int
    ranges: dict[str, tuple[float, float]]
    seen: dict[str, frozenset[str]]


@dataclass(frozen=True)
class Extrapolation:
    feature: str
    value: str
    calibrated: str  # what the calibration runs had

    def sentence(self) -> str:
        return f"{self.feature} {self.value} (calibrated: {self.calibrated})"

    def to_dict(self) -> dict[str, Any]:
        return {"feature": self.feature, "value": self.value, "calibrated": self.calibrated}


def coverage(specs: Iterable[Spec]) -> Coverage:
    specs = list(specs)
    if not specs:
        raise ValueError("no configurations to span")
    numbers = [_numbers(s) for s in specs]
    sets = [_sets(s) for s in specs]
    return Coverage(
        runs=len(specs),
        ranges={k: (min(n[k] for n in numbers), max(n[k] for n in numbers)) for k in numbers[0]},
        seen={k: frozenset().union(*(s[k] for s in sets)) for k in sets[0]},
    )


def _number(value: float) -> str:
    return f"{value:g}"


def extrapolations(spec: Spec, span: Coverage) -> list[Extrapolation]:
    """The features of `spec` outside `span`, numbers first, in a fixed order."""
    found = []
    for feature, value in _numbers(spec).items():
        low, high = span.ranges[feature]
        if not low <= value <= high:
            calibrated = _number(low) if low == high else f"{_number(low)}-{_number(high)}"
            found.append(Extrapolation(feature, _number(value), calibrated))
    for feature, values in _sets(spec).items():
        for name in sorted(values - span.seen[feature]):
            found.append(Extrapolation(feature, name, ", ".join(sorted(span.seen[feature])) or "none"))
    return found


def outside_counts(specs: Iterable[Spec], span: Coverage) -> dict[str, Any]:
    """How many of `specs` lie outside `span` in at least one feature, and how many in each feature."""
    specs = list(specs)
    features: dict[str, int] = {}
    outside = 0
    for spec in specs:
        found = {e.feature for e in extrapolations(spec, span)}
        outside += bool(found)
        for feature in found:
            features[feature] = features.get(feature, 0) + 1
    return {"runs": outside, "of": len(specs), "features": dict(sorted(features.items()))}


def outside_sentence(counts: dict[str, Any]) -> str:
    text = f"{counts['runs']} of {counts['of']} configurations lie outside the train runs"
    if counts["features"]:
        text += " (" + ", ".join(f"{feature}: {n}" for feature, n in counts["features"].items()) + ")"
    return text
