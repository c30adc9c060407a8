"""Research room: runs measured at iteration level, decomposed into the layer's, the microbatch's and the iteration's
own times, measured against predicted.

A table of measured runs often times one configuration at several layer counts, global batches and data-parallel
sizes (vTrain's does). Within such a family (every launch setting alike but `num_layers`, `global_batch_size`,
`data_parallel_size` and `micro_batch_size`), an iteration of m microbatches per pipeline, p stages and L layers is
1F1B's

    T = a(d) + b(d) L + (m + p - 1) (c(mb) + x(mb) L / p)

(a stage's m microbatches plus the p - 1 slots of the fill and drain, (p - 1) / v interleaved over v chunks, each a
stage's time: its L / p layers and its work outside them), where x is one layer's forward and backward (with its
recomputed forward where the launch recomputes) per microbatch, c the slowest stage's work per microbatch outside
the layers (the batch fetch and embedding, the output layer and loss, the hops), and a, b the iteration's own work
(the optimizer step, the gradient reduction, the host between iterations), which depend on d and L but not on the
micro batch. Least squares over a family's runs gives every coefficient the runs identify; the same fit on the
model's predictions of the same runs gives the model's, so a term's error is read where it lives (the layer, the
microbatch, the iteration) rather than from iteration totals, where one term's error hides another's. The form is
exact for any model whose layers cost the same and whose stages are balanced; the fit's residual says how well it
holds (stages the embedding and the loss unbalance depart from it).

Two readings follow from the measured side alone:
- `residual_max_pct`: a source whose iterations fit the form to within microseconds was composed from per-component
  timings (a real run's repeats differ by a percent or so); its rows are then not independent measurements.
- `bound_ms`: one layer's kernels (`hops_calib.model.kernels`, as megatron-core launches them for the launch) each
  at the datasheet's peak FLOP/s or bandwidth, with no launch gap and free collectives, is the least time that
  layer can take on that device; with and without the recomputed forward. A measured layer at or below the bound
  with recomputation disproves that the run recomputed.

Pure: specs and iteration times in, families out (`decompose`); the caller scores the runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hops_calib.model.devices import DeviceSpec
from hops_calib.model.kernel_types import Kernel
from hops_calib.progress import QUIET, Progress
from hops_calib.spec import Spec

# A family whose measured runs depart from the form by more than this (%) is not read as layer and microbatch times:
# about a real run's repeat-to-repeat spread (the cluster runs' 2.2 % mean is a bound on it from above).
FORM_TOLERANCE_PCT = 1.0
# The launch settings a family's runs may differ in: the form's variables, and what follows from them.
VARIABLE_ARGS = frozenset({"num_layers", "global_batch_size", "data_parallel_size", "micro_batch_size", "world_size"})


@dataclass(frozen=True)
class Sample:
    """One run: its spec and its measured and predicted iteration times (ms)."""

    run_id: str
    spec: Spec
    real_ms: float
    predicted_ms: float


@dataclass(frozen=True)
class LayerBound:
    """The least time one layer's kernels can take on a device (each at peak FLOP/s or bandwidth), ms."""

    forward_ms: float
    backward_ms: float

    @property
    def without_recompute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def with_recompute_ms(self) -> float:
        return 2.0 * self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class MicroBatchRow:
    """The per-microbatch times of one micro batch size within a family, measured and predicted (ms)."""

    micro_batch: int
    runs: int
    layer_ms: float  # x: one layer's forward and backward per microbatch, measured
    predicted_layer_ms: float
    microbatch_ms: float  # c: a microbatch's work outside the layers, measured
    predicted_microbatch_ms: float
    bound_without_recompute_ms: float | None = None
    bound_with_recompute_ms: float | None = None

    @property
    def layer_error_pct(self) -> float:
        return (self.predicted_layer_ms / self.layer_ms - 1.0) * 100.0 if self.layer_ms > 0 else math.nan

    @property
    def physical(self) -> bool:
        """Both fitted times non-negative: a negative one says the family's runs do not pin it (too few, or the form
        does not hold there), not that the work takes negative time."""
        return self.layer_ms >= 0 and self.microbatch_ms >= 0

    @property
    def over_recompute_bound(self) -> float | None:
        """Measured layer time over its bound with recomputation: at or below 1, recomputation is impossible."""
        bound = self.bound_with_recompute_ms
        return self.layer_ms / bound if bound else None

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["layer_error_pct"] = self.layer_error_pct
        out["over_recompute_bound"] = self.over_recompute_bound
        out["physical"] = self.physical
        return out


@dataclass(frozen=True)
class Family:
    """Runs alike but for layers, global batch, data parallelism and micro batch, decomposed."""

    label: str
    runs: int
    recomputes: bool  # the launch (as stored) recomputes its layers' forward
    residual_max_pct: float  # the measured iterations' largest departure from the fitted form
    predicted_residual_max_pct: float
    rows: tuple[MicroBatchRow, ...]

    @property
    def form_holds(self) -> bool:
        """The measured runs within FORM_TOLERANCE_PCT of the fitted form: its x and c mean what they say."""
        return self.residual_max_pct <= FORM_TOLERANCE_PCT

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["rows"] = [row.to_dict() for row in self.rows]
        out["form_holds"] = self.form_holds
        return out


@dataclass(frozen=True)
class Decomposition:
    families: tuple[Family, ...]
    not_identified: tuple[str, ...]  # families too small to separate the form's coefficients
    model_sha256: str = ""
    iteration_runs: int = 0  # the runs measured at iteration level decomposed (runs with events are not)

    def to_dict(self) -> dict[str, object]:
        return {
            "model_sha256": self.model_sha256,
            "iteration_runs": self.iteration_runs,
            "families": [family.to_dict() for family in self.families],
            "not_identified": list(self.not_identified),
        }


def layer_bound(spec: Spec, device: DeviceSpec) -> LayerBound:
    """One layer of `spec`'s launch as megatron-core's kernels (`hops_calib.model.kernels`), each at `device`'s
    datasheet peak for its dtype (GEMMs, fused attention) or its bandwidth (the rest), collectives free."""
    from hops_calib.model.kernel_pricing import peak_flops_per_s
    from hops_calib.model.kernels import ATTENTION, COLLECTIVE, GEMM, layer_backward, layer_forward
    from hops_calib.model.terms.decoder_kernels import kernel_settings

    settings = kernel_settings(spec)

    def least_ms(kernels: Sequence[Kernel]) -> float:
        total = 0.0
        for kernel in kernels:
            if kernel.op == COLLECTIVE:
                continue
            flops = (
                kernel.flops / peak_flops_per_s(device, kernel.dtype or "bf16") if kernel.op in (GEMM, ATTENTION) else 0
            )
            total += max(flops, kernel.bytes / device.memory_bandwidth_bytes_per_s)
        return total * 1e3

    return LayerBound(least_ms(layer_forward(spec.model, settings)), least_ms(layer_backward(spec.model, settings)))


def family_key(spec: Spec) -> str:
    """What a family's runs share: the launch settings but the form's variables, and the devices."""
    args = {k: v for k, v in sorted(spec.megatron_args.items()) if k not in VARIABLE_ARGS}
    return repr((tuple(spec.devices), tuple(args.items())))


def family_label(spec: Spec) -> str:
    model = spec.model
    label = f"t{spec.tp} p{spec.pp} h{model.hidden_size} s{model.seq_length} a{model.num_attention_heads}"
    if spec.megatron_args.get("context_parallel_size", 1) not in (None, 1):
        label += f" cp{spec.megatron_args['context_parallel_size']}"
    return f"{label} {'+'.join(sorted(set(spec.devices)))}"


def why_not_identified(members: Sequence[Sample]) -> str:
    """What a family lacks for the form: a second layer count for each d, a second microbatch count for each micro
    batch (so that a(d) + b(d) L and (m + p - 1) (c + x L / p) separate), or more runs than coefficients."""
    lacking = []
    for d in sorted({s.spec.dp for s in members}):
        if len({s.spec.model.num_layers for s in members if s.spec.dp == d}) < 2:
            lacking.append(f"one layer count at d {d}")
    for mb in sorted({s.spec.model.micro_batch_size for s in members}):
        if len({s.spec.microbatches for s in members if s.spec.model.micro_batch_size == mb}) < 2:
            lacking.append(f"one microbatch count at micro batch {mb}")
    return "; ".join(lacking) or "its layer counts, microbatch counts and d do not separate the coefficients"


def _design(samples: Sequence[Sample]) -> tuple[np.ndarray, list[int], list[int]]:
    dps = sorted({s.spec.dp for s in samples})
    mbs = sorted({s.spec.model.micro_batch_size for s in samples})
    rows = []
    for s in samples:
        d, mb, layers, m = s.spec.dp, s.spec.model.micro_batch_size, s.spec.model.num_layers, s.spec.microbatches
        # 1F1B: a stage's m microbatches plus the p - 1 of the fill and drain (interleaved over v chunks: (p - 1) / v)
        slots = m + (s.spec.pp - 1) / max(1, s.spec.vp)
        row = []
        for value in dps:
            row += [float(d == value), float(layers) * (d == value)]
        for value in mbs:
            row += [float(slots) * (mb == value), float(slots * layers) * (mb == value)]
        rows.append(row)
    return np.array(rows, dtype=float), dps, mbs


def _fit(design: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, float]:
    coef = np.linalg.lstsq(design, times, rcond=None)[0]
    residual = float(np.max(np.abs(design @ coef - times) / times)) * 100.0
    return coef, residual


def decompose(
    samples: Iterable[Sample], bound: Callable[[Spec], LayerBound | None] | None = None, model_sha256: str = ""
) -> Decomposition:
    """Every family of `samples` with the runs to identify its coefficients, decomposed; `bound(spec)` (a
    `LayerBound` or None) gives each row's layer bound."""
    families: dict[str, list[Sample]] = {}
    samples = list(samples)
    for sample in samples:
        if sample.real_ms > 0 and sample.predicted_ms > 0:
            families.setdefault(family_key(sample.spec), []).append(sample)
    out, not_identified = [], []
    for members in families.values():
        label = family_label(members[0].spec)
        design, dps, mbs = _design(members)
        if design.shape[0] <= design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
            not_identified.append(f"{label} ({len(members)} runs: {why_not_identified(members)})")
            continue
        real, real_residual = _fit(design, np.array([s.real_ms for s in members]))
        predicted, predicted_residual = _fit(design, np.array([s.predicted_ms for s in members]))
        rows = []
        for i, mb in enumerate(mbs):
            j = 2 * len(dps) + 2 * i
            example = next(s.spec for s in members if s.spec.model.micro_batch_size == mb)
            least = bound(example) if bound is not None else None
            pp = example.pp  # each rank runs L / p layers: the m L coefficient is a layer's time over p
            rows.append(
                MicroBatchRow(
                    micro_batch=mb,
                    runs=sum(1 for s in members if s.spec.model.micro_batch_size == mb),
                    layer_ms=float(real[j + 1]) * pp,
                    predicted_layer_ms=float(predicted[j + 1]) * pp,
                    microbatch_ms=float(real[j]),
                    predicted_microbatch_ms=float(predicted[j]),
                    bound_without_recompute_ms=least.without_recompute_ms if least else None,
                    bound_with_recompute_ms=least.with_recompute_ms if least else None,
                )
            )
        out.append(
            Family(
                label=label,
                runs=len(members),
                recomputes=members[0].spec.model.recompute_granularity == "full",
                residual_max_pct=real_residual,
                predicted_residual_max_pct=predicted_residual,
                rows=tuple(rows),
            )
        )
    out.sort(key=lambda f: f.label)
    return Decomposition(tuple(out), tuple(sorted(not_identified)), model_sha256, iteration_runs=len(samples))


def decompose_store(
    fixtures_dir: Path | str, *, model_path: Path | str | None = None, split: str = "train", progress: Progress = QUIET
) -> Decomposition:
    """The train runs of a store measured at iteration level, decomposed measured and as `model_path` (default: the
    shipped model) predicts them; each layer's bound on the device of its first stage."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.suite import load_suite, refuse_test_split, score_model

    refuse_test_split(split, "decompose")
    model = load_model(Path(model_path) if model_path is not None else None)
    suite = load_suite(fixtures_dir, split)
    progress.start(len(suite.ids))
    scores = score_model(suite, model, origin="decompose", progress=progress).runs
    samples = [
        # throughput is microbatches of one pipeline per second (hops_calib.metrics): iteration = m / throughput
        Sample(
            score.run_id,
            spec,
            spec.microbatches * 1e3 / score.real_throughput_per_s,
            spec.microbatches * 1e3 / score.predicted_throughput_per_s,
        )
        for score, spec, events in zip(scores, suite.specs, suite.has_events)
        if not events and score.real_throughput_per_s > 0 and score.predicted_throughput_per_s > 0
    ]

    def bound(spec: Spec) -> LayerBound | None:
        try:
            return layer_bound(spec, model.device(spec.devices[0]))
        except (KeyError, ValueError, AttributeError):  # a device without peaks in the catalog: no bound
            return None

    return decompose(samples, bound=bound, model_sha256=model.sha256)
