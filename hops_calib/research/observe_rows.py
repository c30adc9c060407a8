"""Observe's rows: what is compared for each run (its groups, its stages' per-microbatch times, the parts of its
iteration, its hops and its slowest stage), real against predicted. See `hops_calib.research.observe`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.loop.score import RunScore, score_prediction
from hops_calib.metrics import IterationParts, TimelineMetrics, timeline_iteration_part_series, timeline_iteration_parts
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
    # the terms of a predicted iteration on runs without events (`research.observe_iteration`)
    "compute": "compute (less recomputation)",
    "recompute": "recomputation (the forward again, its collectives included)",
    "tp_comm": "tensor-parallel collectives",
    "ep_comm": "expert-parallel collectives (MoE token dispatch)",
    "cp_comm": "context-parallel exchanges (exposed)",
    "dp_reduce": "exposed data-parallel reduction",
    "p2p": "pipeline p2p",
    "ends_allreduce": "ends all-reduce",
    "host": "host time",
    "bubble": "bubble (idle on the busiest rank)",
}


# The terms of a predicted iteration, in the breakdown's order; they add up to the predicted iteration time.
ITERATION_QUANTITIES = (
    "compute",
    "recompute",
    "tp_comm",
    "ep_comm",
    "cp_comm",
    "dp_reduce",
    "p2p",
    "ends_allreduce",
    "optimizer",
    "host",
    "bubble",
)


def iteration_terms(breakdown: list[dict[str, float]], iteration_ms: float) -> dict[str, float]:
    """The predicted iteration of a run cut into `ITERATION_QUANTITIES` (ms), on the pipeline rank with the most
    work: its breakdown (compute less recomputation, the exposed DP reduction with the distributed optimizer's
    all-gather) and the bubble, the iteration time less that work."""

    def work(parts: dict[str, float]) -> dict[str, float]:
        return {
            "compute": parts["compute"] - parts.get("recompute", 0.0),
            "recompute": parts.get("recompute", 0.0),
            "tp_comm": parts["tp_comm"],
            "ep_comm": parts.get("ep_comm", 0.0),
            "cp_comm": parts.get("cp_comm", 0.0),
            "dp_reduce": parts["dp_reduce_exposed"],
            "p2p": parts["p2p"],
            "ends_allreduce": parts["ends_allreduce"],
            "optimizer": parts["optimizer"],
            "host": parts["host"],
        }

    ranks = [work(parts) for parts in breakdown]
    busiest = max(ranks, key=lambda parts: sum(parts.values()))
    return {**busiest, "bubble": iteration_ms - sum(busiest.values())}


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
    # The predicted iteration by term (`research.observe_iteration.iteration_terms`), ms
    breakdown_ms: dict[str, float] | None = None

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
            "predicted_terms_ms": self.breakdown_ms,
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
    terms = iteration_terms(model.breakdown(spec), prediction.metrics.iteration_time_ms)
    if fixture.kind != "events":
        stages = tuple(
            StageRow(
                stage=row.stage,
                device=row.device,
                position=stage_position(row.stage, spec.pp),
                layers=spec.layers_per_stage[row.stage],
                real_forward_ms=None,
                predicted_forward_ms=row.forward_ms,
                real_backward_ms=None,
                predicted_backward_ms=row.backward_ms,
            )
            for row in prediction.stage_phase_ms(spec)
        )
        return RunRow(
            id=fixture.id,
            spec=spec,
            score=score_prediction(fixture.id, truth.metrics, prediction, group=fixture.group),
            real_metrics=truth.metrics,
            real_parts=None,
            predicted_parts=prediction.result.iteration_parts(),
            stages=stages,
            prediction=prediction,
            breakdown_ms=terms,
        )
    stages = tuple(
        StageRow(
            stage=row.stage,
            device=row.device,
            position=stage_position(row.stage, spec.pp),
            layers=spec.layers_per_stage[row.stage],
            real_forward_ms=truth.phase_median_ms(row.stage, FORWARD),
            predicted_forward_ms=row.forward_ms,
            real_backward_ms=truth.backward_median_ms(row.stage),
            predicted_backward_ms=row.backward_ms,
        )
        for row in prediction.stage_phase_ms(spec)
    )
    timeline = fixture.timeline()
    series = timeline_iteration_part_series(timeline)
    return RunRow(
        id=fixture.id,
        spec=spec,
        score=score_prediction(fixture.id, truth.metrics, prediction, series, fixture.group),
        real_metrics=truth.metrics,
        real_parts=timeline_iteration_parts(timeline),
        predicted_parts=prediction.result.iteration_parts(),
        stages=stages,
        prediction=prediction,
        measured_replay_error_pct=measured_replay_error_pct(fixture, prediction.pipeline, series=series),
        hops=hop_gaps(spec, timeline),
        predicted_hops=hop_gaps(spec, prediction.result.timeline),
        breakdown_ms=terms,
    )


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
    return tuple(
        ("-".join(sorted((spec.devices[p], spec.devices[c]))), mib, float(start - ready))
        for p, c, start, ready in zip(hops["producer"], hops["stage"], hops["start_ms"], hops["ready_ms"])
    )


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
        stages.append(
            replace(
                cost, forward_ms=measured[f"forward/{k % ranks}"], backward_ms=backward, weight_grad_ms=share * backward
            )
        )
    replay = replace(
        pipeline,
        stages=tuple(stages),
        optimizer_ms=tuple(measured[f"optimizer/{rank}"] for rank in range(ranks)),
        pre_optimizer_ms=measured["silent"],
        post_optimizer_ms=measured["rest"],
        post_optimizer_rank_ms=(),
        stall_ms=0.0,
        stall_probability=0.0,
    )  # the measured silent stretch is a mean: stalls included
    real = fixture.truth.metrics.throughput_per_s
    return (simulate(replay, fixture.spec.schedule).metrics().throughput_per_s - real) / real * 100.0


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
    return tuple(
        HopRow(
            devices=d,
            mib=m,
            n_runs=len(runs_of[(d, m)]),
            n_hops=len(real[(d, m)]),
            real_ms=float(np.median(real[(d, m)])),
            n_predicted_hops=len(predicted.get((d, m), [])),
            predicted_ms=float(np.median(predicted[(d, m)])) if predicted.get((d, m)) else math.nan,
        )
        for d, m in sorted(real)
    )


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
        return (
            self.predicted_stage != self.real_stage
            and self.real_ms_of_predicted < (1.0 - BOTTLENECK_MARGIN) * self.real_ms
        )

    @property
    def mispriced(self) -> bool:
        return abs(self.predicted_ms_of_real / self.real_ms - 1.0) > BOTTLENECK_MARGIN

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "misplaced": self.misplaced, "mispriced": self.mispriced}


def bottleneck(run: RunRow) -> BottleneckRow | None:
    """The run's slowest stage on both sides; None when a stage has no real forward or backward time."""
    stages = run.stages
    real = [
        s.real_forward_ms + s.real_backward_ms
        for s in stages
        if s.real_forward_ms is not None and s.real_backward_ms is not None
    ]
    if not stages or len(real) < len(stages):
        return None
    predicted = [s.predicted_forward_ms + s.predicted_backward_ms for s in stages]
    r, p = int(np.argmax(real)), int(np.argmax(predicted))
    return BottleneckRow(
        run_id=run.id,
        real_stage=stages[r].stage,
        real_device=stages[r].device,
        real_ms=real[r],
        predicted_stage=stages[p].stage,
        predicted_device=stages[p].device,
        predicted_ms=predicted[p],
        real_ms_of_predicted=real[p],
        predicted_ms_of_real=predicted[r],
        throughput_error_pct=run.score.throughput_error_pct,
    )
