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
- `inversions`: a layer that takes less time with more work (its micro batch doubled in the same family, or its
  hidden size larger in a family alike but for it) by more than FORM_TOLERANCE_PCT. The same kernels with more
  FLOPs and bytes cannot take less time unless the work takes another path: Megatron's fused softmax falls back to
  unfused kernels below its batch condition (`hops_calib.model.terms.attention.softmax_fallback`), cuBLAS picks its
  kernel by shape. An inversion the model's predicted layers show too, by more than the same tolerance
  (`followed`), has such a mechanism in the model. One they do not show is the source's noise or a mechanism the
  model lacks; whichever of its two cells is off, a model without that mechanism errs on one of them by about the
  gap. Read before a fit is asked to follow it.

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
# Where an iteration's error lives, in the form's terms: the layers' (m + p - 1) x L / p, the microbatch's (m + p - 1)
# c, the iteration's own a(d) + b(d) L, and what the form does not hold (both fits' residuals).
PARTS = ("layers", "microbatch", "iteration", "outside the form")
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
    # the model's iteration-time error where it lives: PARTS -> the mean over the family's runs of that part's
    # predicted minus measured time, % of the measured iteration (negative: too fast there)
    error_by_part: tuple[tuple[str, float], ...] = ()
    # the mean |outside the form| part, %: least squares makes its signed mean about 0 in every family
    outside_form_abs_pct: float = 0.0

    @property
    def form_holds(self) -> bool:
        """The measured runs within FORM_TOLERANCE_PCT of the fitted form: its x and c mean what they say."""
        return self.residual_max_pct <= FORM_TOLERANCE_PCT

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["rows"] = [row.to_dict() for row in self.rows]
        out["form_holds"] = self.form_holds
        out["error_by_part"] = dict(self.error_by_part)
        return out


@dataclass(frozen=True)
class Cell:
    """One family's row: a layer's measured time at one micro batch."""

    family: str
    micro_batch: int
    runs: int
    layer_ms: float
    predicted_layer_ms: float


@dataclass(frozen=True)
class Inversion:
    """A cell with more work (`more`) whose measured layer takes less time than one with less (`less`)."""

    less: Cell
    more: Cell
    why: str  # what grows from `less` to `more`: "micro batch 1 -> 2", "hidden 1024 -> 2048"

    @property
    def shortfall_pct(self) -> float:
        """How much faster the cell with more work is, % of the other's time."""
        return (1.0 - self.more.layer_ms / self.less.layer_ms) * 100.0

    @property
    def predicted_shortfall_pct(self) -> float:
        """How much faster the model predicts the cell with more work, % of the other's predicted time (negative:
        slower, as the work would have it)."""
        return (1.0 - self.more.predicted_layer_ms / self.less.predicted_layer_ms) * 100.0

    @property
    def followed(self) -> bool:
        """The model's predicted layers invert too, by more than FORM_TOLERANCE_PCT: a mechanism of the model takes
        the cheaper path there."""
        return self.predicted_shortfall_pct > FORM_TOLERANCE_PCT

    def to_dict(self) -> dict[str, object]:
        return {
            "less": asdict(self.less),
            "more": asdict(self.more),
            "why": self.why,
            "shortfall_pct": self.shortfall_pct,
            "predicted_shortfall_pct": self.predicted_shortfall_pct,
            "followed": self.followed,
        }


@dataclass(frozen=True)
class Decomposition:
    families: tuple[Family, ...]
    not_identified: tuple[str, ...]  # families too small to separate the form's coefficients
    model_sha256: str = ""
    iteration_runs: int = 0  # the runs measured at iteration level decomposed (runs with events are not)
    inversions: tuple[Inversion, ...] = ()

    def inverted_runs(self, followed: bool | None = None) -> int:
        """The runs in a cell of an inversion (either side: the measurements alone do not say which is off); of those
        the model follows (`followed` True) or does not (False), or of any (None). A cell in inversions of both kinds
        counts under each."""
        cells = {
            (c.family, c.micro_batch): c.runs
            for i in self.inversions
            if followed is None or i.followed == followed
            for c in (i.less, i.more)
        }
        return sum(cells.values())

    @property
    def decomposed_runs(self) -> int:
        """The runs of the families decomposed (those of families not identified are not)."""
        return sum(f.runs for f in self.families)

    def _per_run(self, per_family: Sequence[float]) -> float:
        """Each family's mean over its runs (in `families` order), averaged over every decomposed run."""
        runs = self.decomposed_runs
        return sum(f.runs * value for f, value in zip(self.families, per_family)) / runs if runs else 0.0

    def error_by_part(self) -> dict[str, float]:
        """Over every decomposed run, the mean of each part's predicted minus measured time, % of the measured
        iteration: which part the model over- or under-prices, and how much one part's error offsets another's."""
        return {part: self._per_run([dict(f.error_by_part).get(part, 0.0) for f in self.families]) for part in PARTS}

    def outside_form_abs_pct(self) -> float:
        """Over every decomposed run, the mean |outside the form| part, % of the measured iteration."""
        return self._per_run([f.outside_form_abs_pct for f in self.families])

    def to_dict(self) -> dict[str, object]:
        return {
            "model_sha256": self.model_sha256,
            "iteration_runs": self.iteration_runs,
            "decomposed_runs": self.decomposed_runs,
            "error_by_part": self.error_by_part(),
            "outside_form_abs_pct": self.outside_form_abs_pct(),
            "families": [family.to_dict() for family in self.families],
            "not_identified": list(self.not_identified),
            "inversions": [inversion.to_dict() for inversion in self.inversions],
            "inverted_runs": self.inverted_runs(),
            "inverted_runs_not_followed": self.inverted_runs(followed=False),
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


def _settings_key(spec: Spec, varying: frozenset[str]) -> str:
    """The devices and the launch settings but `varying`, as one comparable key."""
    args = {k: v for k, v in sorted(spec.megatron_args.items()) if k not in varying}
    return repr((tuple(spec.devices), tuple(args.items())))


def family_key(spec: Spec) -> str:
    """What a family's runs share: the launch settings but the form's variables, and the devices."""
    return _settings_key(spec, VARIABLE_ARGS)


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


# The launch settings that make a family's layer wider: families alike but for these are compared at a micro batch.
WIDTH_ARGS = frozenset({"hidden_size", "ffn_hidden_size", "kv_channels"})


def sibling_key(spec: Spec) -> str:
    """What families alike but for their width share: `family_key` without the hidden size and what follows it."""
    return _settings_key(spec, VARIABLE_ARGS | WIDTH_ARGS)


def inversions(families: Sequence[tuple[Family, Spec]]) -> tuple[Inversion, ...]:
    """Every pair of cells whose measured layer takes less time with more work, by more than FORM_TOLERANCE_PCT:
    within a family a larger micro batch, across families alike but for width a larger hidden size at the same
    micro batch. Only families whose form holds, and rows whose times are physical, are read."""
    # each physical row of a family whose form holds, with its family's index, hidden size and sibling key
    cells: list[tuple[Cell, int, int, str]] = []
    for k, (family, spec) in enumerate(families):
        if family.form_holds:
            hidden, siblings = spec.model.hidden_size, sibling_key(spec)
            cells += [
                (
                    Cell(family.label, row.micro_batch, row.runs, row.layer_ms, row.predicted_layer_ms),
                    k,
                    hidden,
                    siblings,
                )
                for row in family.rows
                if row.physical
            ]
    pairs: list[tuple[Cell, Cell, str]] = []
    for cell, k, hidden, siblings in cells:
        for other, other_k, other_hidden, other_siblings in cells:
            if other_k == k and other.micro_batch > cell.micro_batch:
                pairs.append((cell, other, f"micro batch {cell.micro_batch} -> {other.micro_batch}"))
            elif other.micro_batch == cell.micro_batch and other_hidden > hidden and other_siblings == siblings:
                pairs.append((cell, other, f"hidden {hidden} -> {other_hidden}"))
    found = [
        Inversion(less, more, why)
        for less, more, why in pairs
        if less.layer_ms > 0 and more.layer_ms < less.layer_ms * (1.0 - FORM_TOLERANCE_PCT / 100.0)
    ]
    return tuple(sorted(found, key=lambda i: (i.less.family, i.less.micro_batch, i.more.family, i.more.micro_batch)))


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
        measured = np.array([s.real_ms for s in members])
        predicted_ms = np.array([s.predicted_ms for s in members])
        real, real_residual = _fit(design, measured)
        predicted, predicted_residual = _fit(design, predicted_ms)
        # each run's error cut by the form's columns: per d (a, b L), per micro batch (slots c, slots L / p x)
        delta = design * (predicted - real)
        first_mb = 2 * len(dps)
        parts = {
            "layers": delta[:, first_mb + 1 :: 2].sum(axis=1),
            "microbatch": delta[:, first_mb::2].sum(axis=1),
            "iteration": delta[:, :first_mb].sum(axis=1),
        }
        total = predicted_ms - measured
        parts["outside the form"] = total - sum(parts.values())
        error_by_part = tuple((part, float(np.mean(parts[part] / measured)) * 100.0) for part in PARTS)
        outside_abs = float(np.mean(np.abs(parts["outside the form"]) / measured)) * 100.0
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
            (
                Family(
                    label=label,
                    runs=len(members),
                    recomputes=members[0].spec.model.recompute_granularity == "full",
                    residual_max_pct=real_residual,
                    predicted_residual_max_pct=predicted_residual,
                    rows=tuple(rows),
                    error_by_part=error_by_part,
                    outside_form_abs_pct=outside_abs,
                ),
                members[0].spec,
            )
        )
    out.sort(key=lambda pair: pair[0].label)
    return Decomposition(
        tuple(f for f, _ in out),
        tuple(sorted(not_identified)),
        model_sha256,
        iteration_runs=len(samples),
        inversions=inversions(out),
    )


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
