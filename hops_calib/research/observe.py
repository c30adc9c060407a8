"""Observe: where the prediction error comes from, ranked by how much throughput MAPE each quantity carries.

The step an agent starts each iteration with, on the train split only. For every
run, both sides are cut the same way:

- the iteration into four parts by one function for the real and the simulated
  timeline (`hops_calib.metrics.column_iteration_parts`): pipeline span, silent
  stretch, optimizer step, rest; they add up to the median iteration period;
- each stage's per-microbatch forward and backward: the model's task cost
  against the truth's median duration.

A contributor is one quantity within one group: of runs (device types present,
device types at the two pipeline ends, model shape, microbatches, pipeline
depth) or of stages (device type, position first / middle / last, the stage's
shape, and the run-level groups). Its contribution is the throughput MAPE
(window definition, the gate's) that would disappear if the model predicted
that quantity exactly on the group's members, everything else unchanged:

- forward or backward of some stages: the run is simulated again with those
  stages' costs set to the real medians (exact);
- a part of the iteration: the predicted window shrinks by the part's residual
  once per traced iteration holding it (the span `iterations` times, the others
  `iterations - 1`), and the predicted period by the residual once (first order
  for the window, exact for steady throughput). The simulator has no input that
  is "the span": the stage times and transfers are its inputs.

A negative contribution means fixing that quantity alone makes MAPE worse: its
error currently offsets another one. Runs whose trace has no optimizer events
are left out of the silent, optimizer and rest contributors (their silent
stretch holds the untraced optimizer step).

The measured replay feeds the simulator every part the trace measures at once
(each stage's forward and backward median, each rank's optimizer step, the
silent stretch and the rest, as means over iterations) and keeps only what the
model prices that no trace event times: the hops, the untraced host time, the
schedule. Its error is the simulator's structural residual; a bias there (all
runs slow, say) is one no cost term of the measured parts can fix honestly.
Runs without optimizer events have no replay.

The hops, which no trace event times, show where their consumer was idle: the
consumer (the next stage for a forward, the previous one for a backward) had
finished its previous step before the producer's step ended, so the gap from the
producer's end to the consumer's start is the hop plus the host work after the
receive (and any wait the blocking calls add), measured alike on the simulated
timeline. Grouped by the device types at the hop's two ends and the message size; the median over
forward and backward hops, which cross a pair in opposite directions, cancels
most of an offset between the two hosts' clocks. Interleaved runs are left out
(a rank's chunks make a step's producer ambiguous in the trace).

The slowest stage (forward plus backward per microbatch, which paces a
pipeline's steady state) is compared per run: a run is flagged where the model
calls another stage the slowest (one the traces show more than 5 % faster) or
prices the real slowest more than 5 % off. A right throughput on such a run
rests on errors that make up for each other, which is what a what-if about that
stage's device would inherit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.loop.score import RunScore, SuiteScore, aggregate, score_prediction
from hops_calib.metrics import IterationParts, TimelineMetrics, timeline_iteration_part_series, timeline_iteration_parts
from hops_calib.progress import QUIET, Progress
from hops_calib.spec import Spec
from hops_calib.timeline import BACKWARD, BACKWARD_B, COMPUTE, FORWARD

PART_QUANTITIES = IterationParts.NAMES
STAGE_QUANTITIES = ("forward", "backward")
LABELS = {
    "span": "pipeline span",
    "silent": "silent stretch",
    "optimizer": "optimizer step",
    "rest": "rest to next iteration",
    "forward": "forward per microbatch",
    "backward": "backward per microbatch",
}
# How each group reads in a sentence ("... on runs whose ends are a10g..l4").
RUN_PHRASES = {
    "all": "all runs",
    "devices": "runs on {}",
    "ends": "runs whose ends are {}",
    "shape": "runs of shape {}",
    "microbatches": "runs with {} microbatches",
    "pp": "runs of pipeline depth {}",
    "parallel": "runs at tensor x data parallel {}",
    "micro_batch": "runs of micro batch {}",
}
STAGE_PHRASES = {
    "all": "all stages",
    "device": "{} stages",
    "position": "{} stages",
    "shape": "stages of shape {}",
    "microbatches": "stages of runs with {} microbatches",
    "pp": "stages of runs of pipeline depth {}",
    "ends": "stages of runs whose ends are {}",
}
DOMINANT_RUNS = 3
CARRIED = 0.8  # groupings whose contribution these same runs carry (this share of it) are one finding


# --- what is compared ------------------------------------------------------------------------------

def run_groups(spec: Spec) -> dict[str, str]:
    """The run-level groups a run belongs to, by dimension."""
    return {
        "devices": "+".join(sorted(set(spec.devices))),
        "ends": f"{spec.devices[0]}..{spec.devices[-1]}",
        "shape": f"h{spec.model.hidden_size} s{spec.model.seq_length} L{'-'.join(map(str, spec.layers_per_stage))}",
        "microbatches": str(spec.microbatches),
        "pp": str(spec.pp),
        "parallel": f"t{spec.tp} d{spec.dp}",
        "micro_batch": str(spec.model.micro_batch_size),
    }


def stage_position(stage: int, pp: int) -> str:
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def stage_groups(spec: Spec, stage: int) -> dict[str, str]:
    """The stage-level groups stage `stage` of a run belongs to, by dimension."""
    run = run_groups(spec)
    return {
        "device": spec.devices[stage],
        "position": stage_position(stage, spec.pp),
        "shape": f"h{spec.model.hidden_size} s{spec.model.seq_length} L{spec.layers_per_stage[stage]}",
        "microbatches": run["microbatches"],
        "pp": run["pp"],
        "ends": run["ends"],
    }


@dataclass(frozen=True)
class StageRow:
    """One stage of one run: per-microbatch compute times, real (median) and predicted (task cost), ms."""

    stage: int
    device: str
    position: str
    layers: int
    real_forward_ms: float | None
    predicted_forward_ms: float
    real_backward_ms: float | None
    predicted_backward_ms: float

    def real(self, quantity: str) -> float | None:
        return getattr(self, f"real_{quantity}_ms")

    def predicted(self, quantity: str) -> float:
        return getattr(self, f"predicted_{quantity}_ms")

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class RunRow:
    id: str
    spec: Spec
    score: RunScore
    real_metrics: TimelineMetrics
    real_parts: IterationParts | None
    predicted_parts: IterationParts | None
    stages: tuple[StageRow, ...]
    prediction: Any = field(repr=False, compare=False)  # hops_calib.model.predict.Prediction
    measured_replay_error_pct: float | None = None  # throughput error with every measured part from the trace
    # (devices, MiB, gap ms) of every hop whose consumer waited (`hop_gaps`), real and simulated; not in to_dict
    hops: tuple[tuple[str, float, float], ...] = field(default=(), repr=False, compare=False)
    predicted_hops: tuple[tuple[str, float, float], ...] = field(default=(), repr=False, compare=False)

    @property
    def stall_free_error_pct(self) -> float | None:
        """Throughput error with the stalls taken out of both sides (`RunScore.stall_free_error_pct`)."""
        return self.score.stall_free_error_pct

    def part_residual_ms(self, part: str) -> float | None:
        """Predicted minus real ms of one part of the median iteration; None where it cannot be compared."""
        if self.real_parts is None or self.predicted_parts is None:
            return None
        if part != "span" and not self.real_parts.optimizer_traced:
            return None
        return self.predicted_parts.as_dict()[part] - self.real_parts.as_dict()[part]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run_id": self.id,  # the name evaluate's runs and observe's bottlenecks use
            "groups": run_groups(self.spec),
            "throughput_error_pct": self.score.throughput_error_pct,
            "steady_throughput_error_pct": self.score.steady_throughput_error_pct,
            "bubble_error_pp": self.score.bubble_error_pp,
            "util_spearman_rho": self.score.util_spearman_rho,
            "real_parts": self.real_parts.to_dict() if self.real_parts else None,
            "predicted_parts": self.predicted_parts.to_dict() if self.predicted_parts else None,
            "stages": [s.to_dict() for s in self.stages],
            "measured_replay_error_pct": self.measured_replay_error_pct,
            "stall_free_error_pct": self.stall_free_error_pct,
            "stall_noise_ape_pct": self.score.stall_noise_ape_pct,
        }


def observe_run(fixture, model) -> RunRow:
    """Real and predicted parts and stage times of one fixture (its events are read for the real parts; a run
    measured at iteration level has none: its row holds the scores and the predicted side only)."""
    from hops_calib.model.predict import predict

    spec, truth = fixture.spec, fixture.truth
    try:
        prediction = predict(spec, model)
    except ValueError as error:
        raise InputError(f"model {model.name}", f"cannot predict fixture {fixture.id}: {error}") from None
    if fixture.kind != "events":
        stages = tuple(StageRow(stage=row.stage, device=row.device, position=stage_position(row.stage, spec.pp),
                                layers=spec.layers_per_stage[row.stage], real_forward_ms=None,
                                predicted_forward_ms=row.forward_ms, real_backward_ms=None,
                                predicted_backward_ms=row.backward_ms) for row in prediction.stage_phase_ms(spec))
        return RunRow(id=fixture.id, spec=spec, score=score_prediction(fixture.id, truth.metrics, prediction,
                                                                        group=fixture.group),
                      real_metrics=truth.metrics, real_parts=None, predicted_parts=prediction.result.iteration_parts(),
                      stages=stages, prediction=prediction)
    stages = tuple(
        StageRow(stage=row.stage, device=row.device, position=stage_position(row.stage, spec.pp),
                 layers=spec.layers_per_stage[row.stage],
                 real_forward_ms=truth.phase_median_ms(row.stage, FORWARD), predicted_forward_ms=row.forward_ms,
                 real_backward_ms=truth.backward_median_ms(row.stage), predicted_backward_ms=row.backward_ms)
        for row in prediction.stage_phase_ms(spec))
    timeline = fixture.timeline()
    series = timeline_iteration_part_series(timeline)
    return RunRow(id=fixture.id, spec=spec, score=score_prediction(fixture.id, truth.metrics, prediction, series,
                                                                    fixture.group),
                  real_metrics=truth.metrics, real_parts=timeline_iteration_parts(timeline),
                  predicted_parts=prediction.result.iteration_parts(), stages=stages, prediction=prediction,
                  measured_replay_error_pct=measured_replay_error_pct(fixture, prediction.pipeline, series=series),
                  hops=hop_gaps(spec, timeline), predicted_hops=hop_gaps(spec, prediction.result.timeline))


def hop_gaps(spec: Spec, timeline) -> tuple[tuple[str, float, float], ...]:
    """(device types of the two ends, MiB, ms) of each hop of a run's timeline whose consumer waited.

    The consumer's step starts that long after the producer's step ended, the consumer's previous step
    having ended before that: the hop and the host work after the receive, plus any wait the blocking p2p
    calls add. Measured alike on the real and on the simulated timeline. Empty for interleaved runs.
    """
    from hops_calib.model import gpt

    if spec.vp != 1 or spec.pp < 2:
        return ()
    steps = timeline[timeline["kind"] == COMPUTE].sort_values(["stage", "start_ms"])
    steps = steps.assign(previous_end=steps.groupby("stage")["end_ms"].shift(1))
    steps = steps[steps["phase"].isin((FORWARD, BACKWARD, BACKWARD_B))]
    steps = steps.assign(step=np.where(steps["phase"] == FORWARD, "F", "B"))
    key = ["iteration", "microbatch", "step"]
    producers = steps[key + ["stage", "end_ms"]].rename(columns={"stage": "producer", "end_ms": "ready_ms"})
    producers = producers.assign(stage=producers["producer"] + np.where(producers["step"] == "F", 1, -1))
    hops = steps.merge(producers, on=key + ["stage"])
    hops = hops[hops["previous_end"] < hops["ready_ms"]]  # NaN (a stage's first step) compares False
    mib = round(gpt.boundary_activation_bytes(spec.model) / 2**20, 2)
    return tuple(("-".join(sorted((spec.devices[p], spec.devices[c]))), mib, float(start - ready))
                 for p, c, start, ready in zip(hops["producer"], hops["stage"], hops["start_ms"], hops["ready_ms"]))


def measured_replay_error_pct(fixture, pipeline, timeline=None, series=None) -> float | None:
    """Window throughput error of `pipeline` with every part the trace measures replaced by the measurement.

    `timeline` or `series`: the fixture's timeline or its iteration part series, when the caller has it.

    None when the trace lacks a part (no optimizer events), or when the run has no optimizer barrier (each
    rank steps after its own last backward, as in CPU captures without tied embeddings): the silent stretch is
    then measured from the last rank's backward and can be negative, so it is no barrier's pre-optimizer work.
    """
    from hops_calib.research.components import real_components
    from hops_calib.sim import simulate

    measured = real_components(fixture, timeline, series).values
    ranks = pipeline.ranks
    needed = [f"{kind}/{rank}" for kind in ("forward", "backward", "optimizer") for rank in range(ranks)]
    if any(name not in measured for name in needed + ["silent", "rest"]) or not pipeline.optimizer_ms:
        return None
    if not pipeline.optimizer_barrier or measured["silent"] < 0 or measured["rest"] < 0:
        return None
    stages = []
    for k, cost in enumerate(pipeline.stages):
        backward = measured[f"backward/{k % ranks}"]
        share = cost.weight_grad_ms / cost.backward_ms if cost.backward_ms > 0 else 0.0
        stages.append(replace(cost, forward_ms=measured[f"forward/{k % ranks}"], backward_ms=backward,
                              weight_grad_ms=share * backward))
    replay = replace(pipeline, stages=tuple(stages),
                     optimizer_ms=tuple(measured[f"optimizer/{rank}"] for rank in range(ranks)),
                     pre_optimizer_ms=measured["silent"], post_optimizer_ms=measured["rest"], post_optimizer_rank_ms=(),
                     stall_ms=0.0, stall_probability=0.0)  # the measured silent stretch is a mean: stalls included
    real = fixture.truth.metrics.throughput_per_s
    return (simulate(replay, fixture.spec.schedule).metrics().throughput_per_s - real) / real * 100.0


# --- counterfactuals: the errors a run would have with one quantity predicted exactly ----------------

def _errors_pct(run: RunRow, throughput_per_s: float, steady_per_s: float) -> tuple[float, float]:
    real = run.real_metrics
    return ((throughput_per_s - real.throughput_per_s) / real.throughput_per_s * 100.0,
            (steady_per_s - real.steady_throughput_per_s) / real.steady_throughput_per_s * 100.0)


def part_fixed_errors(run: RunRow, part: str, shift_ms: float | None = None) -> tuple[float, float] | None:
    """Throughput and steady-throughput error % of `run` with part `part` of its iteration predicted exactly (or,
    with `shift_ms`, predicted `shift_ms` shorter: a group's bias taken out)."""
    residual = run.part_residual_ms(part) if shift_ms is None else shift_ms
    if residual is None:
        return None
    predicted = run.prediction.metrics
    repeats = run.spec.iterations if part == "span" else run.spec.iterations - 1
    window = predicted.window_ms - repeats * residual
    period = predicted.iteration_time_ms - residual
    if not (window > 0 and period > 0):
        return None
    return _errors_pct(run, predicted.throughput_per_s * predicted.window_ms / window,
                       predicted.steady_throughput_per_s * predicted.iteration_time_ms / period)


def stages_fixed_errors(run: RunRow, quantity: str, stages: frozenset[int], shift_ms: float | None = None
                        ) -> tuple[float, float] | None:
    """Errors of `run` simulated again with `quantity` (forward / backward) of `stages` at the real medians (or,
    with `shift_ms`, at the predicted value less `shift_ms`: a group's bias taken out).

    Each of a rank's model chunks is scaled by target / predicted, so their mean is the target.
    """
    from hops_calib.sim import simulate

    pipeline = run.prediction.pipeline
    costs = list(pipeline.stages)
    changed = False
    for k, cost in enumerate(costs):
        row = run.stages[k % pipeline.ranks]
        real = row.real(quantity)
        if row.stage not in stages or real is None:
            continue
        predicted = row.predicted(quantity)
        if shift_ms is not None:
            real = max(predicted - shift_ms, 0.0)
        factor = real / predicted if predicted > 0 else None
        if quantity == "forward":
            costs[k] = replace(cost, forward_ms=cost.forward_ms * factor if factor is not None
                               else real / pipeline.chunks)
        else:
            costs[k] = replace(cost, backward_ms=cost.backward_ms * factor if factor is not None
                               else real / pipeline.chunks,
                               weight_grad_ms=cost.weight_grad_ms * factor if factor is not None else 0.0)
        changed = True
    if not changed:
        return None
    metrics = simulate(replace(pipeline, stages=tuple(costs)), run.prediction.schedule).metrics()
    return _errors_pct(run, metrics.throughput_per_s, metrics.steady_throughput_per_s)


# --- contributors -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Contributor:
    """One quantity within one group, and the MAPE it carries (pp over the whole suite)."""

    quantity: str
    level: str  # "run" (a part of the iteration) or "stage" (a per-microbatch time)
    dimension: str
    group: str
    aliases: tuple[tuple[str, str], ...]  # other (dimension, group) pairs with exactly the same members
    n_runs: int
    n_stages: int | None
    real_ms_mean: float
    predicted_ms_mean: float
    residual_ms_mean: float  # predicted - real, signed
    residual_pct: float  # residual_ms_mean / real_ms_mean x 100: the same sign as residual_ms_mean (nan: real <= 0)
    contribution_pp: float  # throughput MAPE (window) removed if predicted exactly
    steady_contribution_pp: float  # the same on steady-throughput MAPE
    dominant_runs: tuple[dict[str, Any], ...]  # {id, contribution_pp, throughput_error_pct}
    # Bias against noise: the residual's spread over the members, and the spread of the real quantity between
    # repeats of one configuration (None without repeats), ms.
    residual_spread_ms: float = math.nan
    noise_ms: float | None = None
    # The throughput MAPE (window, pp of the suite) that taking the bias out would save: every member's quantity
    # predicted `residual_ms_mean` shorter (what one term shifting the quantity can do), the runs scored again as
    # for the contribution. Negative only where errors cancel: the bias offsets another error of those runs.
    fixable_mape_pp: float = math.nan
    noise_mape_pp: float = 0.0  # the contribution's share that the repeat noise explains (no term can fix it)
    members: tuple[tuple[str, int | None], ...] = ()  # (run id, stage) of the members; stage None for a part
    terms: tuple[dict[str, Any], ...] = ()  # research.pricing.terms_of: the parameters pricing it, and applies
    same_runs: tuple[str, ...] = ()  # other groupings of this quantity carried by the same runs, merged into this one
    noise_from: str | None = None  # "repeats in the group", "the suite's repeats (relative)", or None (no repeats)
    carriers: tuple[str, ...] = ()  # the fewest runs carrying >= CARRIED of the contribution (merge key)

    @property
    def where(self) -> str:
        phrases = RUN_PHRASES if self.level == "run" else STAGE_PHRASES
        text = phrases[self.dimension].format(self.group)
        if self.aliases:
            text += " (= " + " = ".join(phrases[d].format(g) for d, g in self.aliases) + ")"
        return text

    def sentence(self) -> str:
        direction = "over" if self.residual_ms_mean > 0 else "under"
        members = f"{self.n_runs} runs" + (f", {self.n_stages} stages" if self.n_stages is not None else "")
        text = (f"{LABELS[self.quantity]} {direction}-predicted by {abs(self.residual_ms_mean):.1f} ms "
                f"({_signed(self.residual_pct, '%')} of real) on {self.where}; {members}; ")
        if self.contribution_pp >= 0:
            text += f"predicting it exactly removes {self.contribution_pp:.1f} pp of throughput MAPE"
        else:
            text += (f"predicting it exactly alone adds {-self.contribution_pp:.1f} pp of throughput MAPE "
                     "(its error offsets another)")
        text += f" (steady {self.steady_contribution_pp:+.1f} pp)"
        if self.dominant_runs:
            text += "; mostly " + ", ".join(f"{r['id']} ({r['contribution_pp']:.1f} pp)" for r in self.dominant_runs)
        if math.isfinite(self.fixable_mape_pp):
            text += (f"; fixable {self.fixable_mape_pp:.2f} pp, repeat noise {self.noise_mape_pp:.2f} pp (bias "
                     f"{self.residual_ms_mean:+.1f} ms, spread {self.residual_spread_ms:.1f} ms, between repeats "
                     + (f"{self.noise_ms:.1f} ms" + (", the suite's" if self.noise_from and "suite" in self.noise_from
                                                     else "") + ")" if self.noise_ms is not None
                        else "n/a: no repeats)"))
        if self.terms:
            applies = [f"{t['term']}.{t['param']}" for t in self.terms if t["applies"]]
            inert = [f"{t['term']}.{t['param']}" for t in self.terms if not t["applies"]]
            text += ("; priced by " + (", ".join(applies) or "none of its runs' parameters")
                     + (f" (inert here: {', '.join(inert)})" if inert else ""))
        if self.same_runs:
            text += "; the same runs as " + "; ".join(self.same_runs)
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k not in ("dominant_runs", "aliases", "members", "carriers")},
                "carried_by": list(self.carriers),
                "bias_ms": self.residual_ms_mean,
                "terms": [dict(t) for t in self.terms], "same_runs": list(self.same_runs),
                "aliases": [{"dimension": d, "group": g} for d, g in self.aliases],
                "label": LABELS[self.quantity], "where": self.where,
                "dominant_runs": [dict(r) for r in self.dominant_runs], "sentence": self.sentence()}


def _signed(value: float, unit: str) -> str:
    """Signed, one decimal below 10 (so that a small residual does not read "-0 %"), none above."""
    if not math.isfinite(value):
        return "n/a"
    return f"{value:+.1f} {unit}" if abs(value) < 9.95 else f"{value:+.0f} {unit}"


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else float("nan")


@dataclass(frozen=True)
class _Member:
    """One run's share of a contributor: its residuals and its counterfactual errors."""

    run: RunRow
    real_ms: list[float]
    predicted_ms: list[float]
    fixed: tuple[float, float]
    stages: tuple[int | None, ...] = (None,)  # the stage of each value (None: a part of the iteration)


def _contributor(quantity: str, level: str, dimension: str, group: str, aliases: list[tuple[str, str]],
                 members: list[_Member], n_suite: int, n_stages: int | None) -> Contributor:
    now = np.array([[abs(m.run.score.throughput_error_pct), abs(m.run.score.steady_throughput_error_pct)]
                    for m in members])
    fixed = np.abs(np.array([m.fixed for m in members]))
    per_run = (now - fixed) / n_suite
    real = [v for m in members for v in m.real_ms]
    predicted = [v for m in members for v in m.predicted_ms]
    bias = _mean(p - r for p, r in zip(predicted, real))
    unbiased = np.abs(np.array([_unbiased_errors(m, quantity, level, bias) for m in members]))
    fixable = float(((now - unbiased) / n_suite)[:, 0].sum())
    order = np.argsort(-per_run[:, 0], kind="stable")
    dominant = tuple({"id": members[i].run.id, "run_id": members[i].run.id, "contribution_pp": float(per_run[i, 0]),
                      "throughput_error_pct": members[i].run.score.throughput_error_pct}
                     for i in order[:DOMINANT_RUNS] if per_run[i, 0] > 0)
    return Contributor(
        quantity=quantity, level=level, dimension=dimension, group=group, aliases=tuple(aliases),
        n_runs=len(members), n_stages=n_stages,
        real_ms_mean=_mean(real), predicted_ms_mean=_mean(predicted),
        residual_ms_mean=_mean(p - r for p, r in zip(predicted, real)),
        residual_pct=(_mean(p - r for p, r in zip(predicted, real)) / _mean(real) * 100.0
                      if real and _mean(real) > 0 else math.nan),
        contribution_pp=float(per_run[:, 0].sum()), steady_contribution_pp=float(per_run[:, 1].sum()),
        dominant_runs=dominant, carriers=_carriers(members, per_run[:, 0]),
        **_bias_and_noise(members, float(per_run[:, 0].sum()), fixable))


def _unbiased_errors(member: _Member, quantity: str, level: str, bias_ms: float) -> tuple[float, float]:
    """A member run's throughput and steady errors % with the group's bias taken out of its quantity (its errors as
    they are where that cannot be computed)."""
    run = member.run
    if level == "run":
        errors = part_fixed_errors(run, quantity, shift_ms=bias_ms)
    else:
        errors = stages_fixed_errors(run, quantity, frozenset(s for s in member.stages if s is not None),
                                     shift_ms=bias_ms)
    return errors if errors is not None else (run.score.throughput_error_pct, run.score.steady_throughput_error_pct)


def _carriers(members: list[_Member], per_run: np.ndarray) -> tuple[str, ...]:
    """The fewest runs whose contributions add up to CARRIED of the group's positive contribution (empty when the
    group removes nothing)."""
    positive = np.clip(per_run, 0.0, None)
    total = float(positive.sum())
    if total <= 0:
        return ()
    order = np.argsort(-positive, kind="stable")
    carried, out = 0.0, []
    for i in order:
        out.append(members[i].run.id)
        carried += float(positive[i])
        if carried >= CARRIED * total:
            break
    return tuple(sorted(out))


def _bias_and_noise(members: list[_Member], contribution_pp: float, fixable_pp: float) -> dict[str, Any]:
    """The residual's mean (bias) and spread over the members, the real quantity's spread between repeats of one
    configuration (pooled over configurations run more than once: noise; a configuration is the runs' stored
    group), and the contribution's share the noise explains, by the residual's mean square:
    min(repeat spread^2, residual spread^2) / (bias^2 + spread^2).
    `fixable_pp`: the MAPE taking the bias out saves (`_unbiased_errors`)."""
    residuals = np.array([p - r for m in members for p, r in zip(m.predicted_ms, m.real_ms)])
    bias, spread = float(np.mean(residuals)), float(np.std(residuals))
    repeats: dict[tuple[str, int | None], list[float]] = {}
    for m in members:
        for stage, real in zip(m.stages, m.real_ms):
            repeats.setdefault((m.run.score.group, stage), []).append(real)
    groups = [np.array(v) for v in repeats.values() if len(v) > 1]
    noise = (float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)))
             if groups else None)
    square = bias ** 2 + spread ** 2
    noise_share = min(noise ** 2, spread ** 2) / square if noise is not None and square > 0 else 0.0
    return {"residual_spread_ms": spread, "noise_ms": noise, "noise_mape_pp": contribution_pp * noise_share,
            "fixable_mape_pp": fixable_pp,
            "noise_from": "repeats in the group" if noise is not None else None,
            "members": tuple((m.run.id, stage) for m in members for stage in m.stages)}


def with_suite_noise(contributor: Contributor, relative_noise: float | None) -> Contributor:
    """A group without repeats of its own takes the suite's repeat spread of its quantity, relative to the real
    value (the `all` grouping's noise over its mean), scaled to the group's mean real value."""
    if contributor.noise_ms is not None or relative_noise is None or not math.isfinite(contributor.real_ms_mean):
        return contributor
    noise = relative_noise * abs(contributor.real_ms_mean)
    square = contributor.residual_ms_mean ** 2 + contributor.residual_spread_ms ** 2
    share = min(noise ** 2, square) / square if square > 0 else 0.0
    return replace(contributor, noise_ms=noise, noise_from="the suite's repeats (relative)",
                   noise_mape_pp=contributor.contribution_pp * share)


def _groupings(keys: list[dict[str, str]]) -> dict[tuple[str, str], tuple[list[int], list[tuple[str, str]]]]:
    """(dimension, group) -> (indices of the items in it, other groups with exactly these items).

    'all' comes first; a group holding every item is 'all' again and is dropped, and groups with the same
    items are reported once, under the first dimension, naming the others as aliases.
    """
    groups: dict[tuple[str, str], list[int]] = {("all", "all"): list(range(len(keys)))}
    for index, item in enumerate(keys):
        for dimension, value in item.items():
            groups.setdefault((dimension, value), []).append(index)
    by_members: dict[tuple[int, ...], tuple[tuple[str, str], list[tuple[str, str]]]] = {}
    for key, members in groups.items():
        if key != ("all", "all") and len(members) == len(keys):
            continue
        first = by_members.setdefault(tuple(members), (key, []))
        if first[0] != key:
            first[1].append(key)
    return {key: (list(members), aliases) for members, (key, aliases) in by_members.items()}


def part_contributors(runs: list[RunRow]) -> list[Contributor]:
    contributors = []
    for part in PART_QUANTITIES:
        fixed = {run.id: part_fixed_errors(run, part) for run in runs}
        for (dimension, group), (indices, aliases) in _groupings([run_groups(r.spec) for r in runs]).items():
            members = []
            for run in (runs[i] for i in indices):
                # (a run without parts has no residual: its fixed errors are None)
                errors, real, predicted = fixed[run.id], run.real_parts, run.predicted_parts
                if errors is not None and real is not None and predicted is not None:
                    members.append(_Member(run, [real.as_dict()[part]], [predicted.as_dict()[part]], errors))
            if members:
                contributors.append(_contributor(part, "run", dimension, group, aliases, members, len(runs), None))
    return contributors


def stage_contributors(runs: list[RunRow]) -> list[Contributor]:
    places = [(run, row) for run in runs for row in run.stages]
    keys = [stage_groups(run.spec, row.stage) for run, row in places]
    cache: dict[tuple[str, str, frozenset[int]], tuple[float, float] | None] = {}
    contributors = []
    for quantity in STAGE_QUANTITIES:
        for (dimension, group), (indices, aliases) in _groupings(keys).items():
            by_run: dict[str, list[StageRow]] = {}
            for i in indices:
                run, row = places[i]
                if row.real(quantity) is not None:
                    by_run.setdefault(run.id, []).append(row)
            members = []
            for run in runs:
                rows = by_run.get(run.id)
                if not rows:
                    continue
                key = (run.id, quantity, frozenset(r.stage for r in rows))
                if key not in cache:
                    cache[key] = stages_fixed_errors(run, quantity, key[2])
                errors = cache[key]
                if errors is not None:  # (each row kept has a real value: by_run keeps only those)
                    members.append(_Member(run, [real for r in rows if (real := r.real(quantity)) is not None],
                                           [r.predicted(quantity) for r in rows], errors,
                                           tuple(r.stage for r in rows)))
            if members:
                contributors.append(_contributor(quantity, "stage", dimension, group, aliases, members, len(runs),
                                                 sum(len(m.real_ms) for m in members)))
    return contributors


@dataclass(frozen=True)
class HopRow:
    """The hops of one kind (device types at the two ends, message size) whose consumer waited, over all runs."""

    devices: str
    mib: float
    n_runs: int
    n_hops: int  # in the traces
    real_ms: float  # median gap from the producer's end to the consumer's start, in the traces
    n_predicted_hops: int  # in the simulated timelines
    predicted_ms: float  # the same median in the simulated timelines (nan: no such hop waited there)

    @property
    def residual_ms(self) -> float:
        return self.predicted_ms - self.real_ms

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "residual_ms": self.residual_ms}


def hop_rows(runs: Iterable[RunRow]) -> tuple[HopRow, ...]:
    """`RunRow.hops` and `RunRow.predicted_hops` of all runs, by device types and message size."""
    real: dict[tuple[str, float], list[float]] = {}
    predicted: dict[tuple[str, float], list[float]] = {}
    runs_of: dict[tuple[str, float], set[str]] = {}
    for run in runs:
        for devices, mib, gap in run.hops:
            real.setdefault((devices, mib), []).append(gap)
            runs_of.setdefault((devices, mib), set()).add(run.id)
        for devices, mib, gap in run.predicted_hops:
            predicted.setdefault((devices, mib), []).append(gap)
    return tuple(HopRow(devices=d, mib=m, n_runs=len(runs_of[(d, m)]), n_hops=len(real[(d, m)]),
                        real_ms=float(np.median(real[(d, m)])), n_predicted_hops=len(predicted.get((d, m), [])),
                        predicted_ms=float(np.median(predicted[(d, m)])) if predicted.get((d, m)) else math.nan)
                 for d, m in sorted(real))


BOTTLENECK_MARGIN = 0.05  # misplaced: the model's slowest stage is really this much faster than the real slowest;
# mispriced: the real slowest stage's predicted time is off by more than this fraction


@dataclass(frozen=True)
class BottleneckRow:
    """A run's slowest stage (forward plus backward per microbatch, which paces a pipeline's steady state), in the
    traces and in the prediction. `misplaced`: the stage the model calls slowest is really more than
    BOTTLENECK_MARGIN faster than the real slowest one, so a right throughput there rests on compensating errors
    (the wrong stage paces the simulated pipeline) and a what-if about either stage's device is not to be trusted.
    `mispriced`: the real slowest stage's predicted time is off by more than BOTTLENECK_MARGIN: where the throughput
    is right nonetheless, other parts of the prediction make up for the stage that paces the run."""

    run_id: str
    real_stage: int
    real_device: str
    real_ms: float  # the real slowest stage's real forward + backward
    predicted_stage: int
    predicted_device: str
    predicted_ms: float  # the predicted slowest stage's predicted forward + backward
    real_ms_of_predicted: float  # the real forward + backward of the stage the model calls slowest
    predicted_ms_of_real: float  # the predicted forward + backward of the real slowest stage
    throughput_error_pct: float

    @property
    def misplaced(self) -> bool:
        return (self.predicted_stage != self.real_stage
                and self.real_ms_of_predicted < (1.0 - BOTTLENECK_MARGIN) * self.real_ms)

    @property
    def mispriced(self) -> bool:
        return abs(self.predicted_ms_of_real / self.real_ms - 1.0) > BOTTLENECK_MARGIN

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "misplaced": self.misplaced, "mispriced": self.mispriced}


def bottleneck(run: RunRow) -> BottleneckRow | None:
    """The run's slowest stage on both sides; None when a stage has no real forward or backward time."""
    stages = run.stages
    real = [s.real_forward_ms + s.real_backward_ms for s in stages
            if s.real_forward_ms is not None and s.real_backward_ms is not None]
    if not stages or len(real) < len(stages):
        return None
    predicted = [s.predicted_forward_ms + s.predicted_backward_ms for s in stages]
    r, p = int(np.argmax(real)), int(np.argmax(predicted))
    return BottleneckRow(run_id=run.id, real_stage=stages[r].stage, real_device=stages[r].device, real_ms=real[r],
                         predicted_stage=stages[p].stage, predicted_device=stages[p].device, predicted_ms=predicted[p],
                         real_ms_of_predicted=real[p], predicted_ms_of_real=predicted[r],
                         throughput_error_pct=run.score.throughput_error_pct)


# --- the whole observation --------------------------------------------------------------------------

@dataclass(frozen=True)
class Observation:
    split: str
    fixtures_dir: Path
    model_path: Path
    model_name: str
    model_sha256: str
    fixture_set_sha256: str
    suite: SuiteScore
    runs: tuple[RunRow, ...]
    overall: tuple[Contributor, ...]  # each quantity over all runs / stages
    ranked: tuple[Contributor, ...]  # every quantity within every group, largest contribution first
    # The split's runs the model does not price, left out (`hops_calib.loop.suite.left_out_summary`).
    left_out: dict[str, Any] = field(default_factory=lambda: {"count": 0, "reasons": []})
    # Measured against predicted kernel time by class, over the runs with kernel truth
    # (`hops_calib.research.kernel_truth.kernel_section`); None when no run has any.
    kernel_classes: dict[str, Any] | None = None

    @property
    def iteration_level_runs(self) -> int:
        """Runs measured at iteration level: scored on throughput, and outside every analysis that needs events."""
        return sum(not r.real_metrics.has_events for r in self.runs)

    @property
    def by_configuration(self) -> tuple[dict[str, Any], ...]:
        """`error_by_configuration` of every run."""
        return error_by_configuration(self.runs)

    @property
    def measured_replay(self) -> dict[str, float] | None:
        """MAPE and mean signed error of the measured replay over the runs that have one."""
        return _error_summary([r.measured_replay_error_pct for r in self.runs])

    @property
    def stall_free(self) -> dict[str, float] | None:
        """MAPE and mean signed error with the stalls taken out of both sides, over the runs that allow it."""
        return _error_summary([r.stall_free_error_pct for r in self.runs])

    @property
    def hops(self) -> tuple[HopRow, ...]:
        """The hops whose consumer waited, real against predicted, by device types and message size."""
        return hop_rows(self.runs)

    @property
    def bottlenecks(self) -> tuple[BottleneckRow, ...]:
        """Every run's slowest stage, real and predicted (runs with a stage the traces do not time are left out)."""
        return tuple(row for row in map(bottleneck, self.runs) if row is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "fixtures": str(self.fixtures_dir), "model": str(self.model_path),
                "model_name": self.model_name, "model_sha256": self.model_sha256,
                "fixture_set_sha256": self.fixture_set_sha256, **self.suite.to_dict(),
                "measured_replay": self.measured_replay, "stall_free": self.stall_free,
                "hops": [h.to_dict() for h in self.hops],
                "bottlenecks": [b.to_dict() for b in self.bottlenecks],
                "overall": [c.to_dict() for c in self.overall], "ranked": [c.to_dict() for c in self.ranked],
                "iteration_level_runs": self.iteration_level_runs, "left_out": self.left_out,
                "by_configuration": list(self.by_configuration), "kernel_classes": self.kernel_classes,
                # the same list as ranked, under the name AGENTS.md reads: ranked by fixable_mape_pp
                "contributors": [c.to_dict() for c in self.ranked],
                "fields": CONTRIBUTOR_FIELDS,
                "runs": [r.to_dict() for r in self.runs]}


# What a contributor's numbers mean, in observe --json (`fields`), as AGENTS.md says.
CONTRIBUTOR_FIELDS = {
    "bias_ms": "the residual's mean over the members: predicted minus real, ms (positive: the model predicts the "
               "quantity too long, so too low a throughput; negative: too short)",
    "residual_pct": "bias_ms over the real mean, % (the same sign)",
    "mean_error_pct": "the mean throughput error, predicted minus real throughput over real, % (by_configuration, "
                      "stall_free, runs[]: throughput_error_pct): the opposite sign of bias_ms (positive: the model "
                      "predicts the runs too fast, their quantities too short)",
    "contribution_pp": "throughput MAPE (window, pp of the suite) removed if the quantity were predicted exactly on "
                       "the members; negative where its error offsets another",
    "fixable_mape_pp": "throughput MAPE (pp of the suite) that taking the bias out would save: every member's quantity "
                       "predicted bias_ms shorter, the runs scored again; negative only where errors cancel (the bias "
                       "offsets another error of those runs: removing it alone makes MAPE worse)",
    "noise_mape_pp": "the contribution's share explained by the spread between repeats of one configuration (no term "
                     "can fix it)",
    "terms": "every parameter of the terms pricing the quantity (found by nudging each); applies false: nudging it "
             "moves the quantity of none of the members (tuning it there is in vain)",
}


def error_by_configuration(runs: Sequence[RunRow]) -> tuple[dict[str, Any], ...]:
    """The throughput error by configuration group (`run_groups`: devices, pipeline ends, shape, microbatches,
    depth), largest share of the suite's MAPE first: the runs, their MAPE and mean signed error, and the pp of the
    suite MAPE they carry (what it would lose were they exact). Needs no events, so it covers every run."""
    if not runs:
        return ()
    groups: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for dimension, group in run_groups(run.spec).items():
            groups.setdefault((dimension, group), []).append(run.score.throughput_error_pct)
    rows = [{"dimension": dimension, "group": group, "n_runs": len(errors),
             "throughput_mape_pct": float(np.mean(np.abs(errors))), "mean_error_pct": float(np.mean(errors)),
             "contribution_pp": float(np.sum(np.abs(errors)) / len(runs))}
            for (dimension, group), errors in groups.items() if len(errors) < len(runs)]
    return tuple(sorted(rows, key=lambda row: -row["contribution_pp"]))


def _error_summary(values: list[float | None]) -> dict[str, float] | None:
    """Runs, MAPE and mean signed error (%) of the runs that have a value; None when none has."""
    errors = [v for v in values if v is not None]
    if not errors:
        return None
    return {"n_runs": len(errors), "throughput_mape_pct": float(np.mean(np.abs(errors))),
            "mean_error_pct": float(np.mean(errors))}


def _fixable(contributor: Contributor) -> float:
    return contributor.fixable_mape_pp if math.isfinite(contributor.fixable_mape_pp) else contributor.contribution_pp


def merge_same_runs(ranked: list[Contributor]) -> list[Contributor]:
    """One finding per quantity and set of runs carrying it: a grouping of a quantity whose contribution the same
    runs carry (`carriers`: the fewest runs holding CARRIED of it) as one ranked above it (the same runs sliced
    another way: by shape, depth, ends, ...) is merged into it, named in its `same_runs`. Groupings that remove
    nothing are kept apart by their members."""
    kept: dict[tuple[str, frozenset], int] = {}
    out: list[Contributor] = []
    for contributor in ranked:
        key = (contributor.quantity, frozenset(contributor.carriers) if contributor.carriers
               else frozenset(contributor.members))
        if key in kept:
            first = out[kept[key]]
            out[kept[key]] = replace(first, same_runs=first.same_runs + (contributor.where,))
            continue
        kept[key] = len(out)
        out.append(contributor)
    return out


def observe(fixtures_dir: Path | str, *, model_path: Path | str | None = None, split: str = "train",
            progress: Progress = QUIET, with_terms: bool = True) -> Observation:
    """Compare every run of the train split with its prediction, and rank where the throughput error comes from."""
    from hops_calib.loop.model_files import default_model, load_model
    from hops_calib.loop.suite import fixture_set_digest, open_store, refuse_test_split
    from hops_calib.research.kernel_truth import kernel_section

    refuse_test_split(split, "observe")
    model_path = Path(model_path) if model_path is not None else default_model()
    model = load_model(model_path)
    from hops_calib.loop.suite import left_out_summary, priced

    store = open_store(fixtures_dir)
    ids = store.ids(split)
    if not ids:
        raise InputError(fixtures_dir, f"the fixture store has no {split} fixtures",
                         hint=f"ingest runs into it (hops-calib ingest SRC --fixtures {fixtures_dir})")
    fixtures, left_out = priced(store.load_many(ids))
    if not fixtures:
        raise InputError(fixtures_dir, f"none of the {len(left_out)} {split} fixtures is priced by the cost model",
                         field="split", hint="ingest runs the model prices (one GPU per pipeline stage)")
    ids = [f.id for f in fixtures]
    runs, content_hashes = [], []
    progress.start(len(ids))
    for fixture in fixtures:
        runs.append(observe_run(fixture, model))
        content_hashes.append(fixture.content_hash)
        progress.advance(fixture.id)
    contributors = part_contributors(runs) + stage_contributors(runs)
    if with_terms and contributors:  # (the parts and stages come from events: no run with events, nothing to price)
        from hops_calib.research.pricing import pricing, terms_of

        found = pricing(runs, model)
        contributors = [replace(c, terms=tuple(terms_of(found, c.quantity, c.members))) for c in contributors]
    relative = {c.quantity: c.noise_ms / abs(c.real_ms_mean) for c in contributors
                if c.dimension == "all" and c.noise_ms is not None and abs(c.real_ms_mean) > 0}
    contributors = [with_suite_noise(c, relative.get(c.quantity)) for c in contributors]
    overall = tuple(c for c in contributors if c.dimension == "all")
    ranked = merge_same_runs(sorted((c for c in contributors if c.dimension != "all"),
                                    key=lambda c: (-_fixable(c), -c.contribution_pp)))
    return Observation(split=split, fixtures_dir=Path(fixtures_dir), model_path=model_path, model_name=model.name,
                       model_sha256=model.sha256, fixture_set_sha256=fixture_set_digest(ids, content_hashes),
                       suite=aggregate(r.score for r in runs), runs=tuple(runs),
                       overall=overall, ranked=tuple(ranked), left_out=left_out_summary(left_out),
                       kernel_classes=kernel_section(fixtures, model))
