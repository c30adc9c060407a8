"""The planner: which schedule to run on balanced stages within a per-device activation budget.

`plan` simulates each schedule (and, for GPipe, the flush size) on balanced stages,
keeps those whose peak in-flight activations fit the budget, and picks the lowest
bubble (ties: less memory, then the simpler schedule). Activation memory is counted
in stage microbatches (`SimResult.peak_stage_activations`): one unit holds one
microbatch's activations of one stage; an interleaved model chunk holds 1/v of that. Bubble and utilization come from the shared metrics
function, as for real runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hops_calib.sim import simulate
from hops_calib.sim.schedules import check_shape
from hops_calib.sim.theory import (
    balanced_makespan,
    balanced_pipeline,
    bubble_fraction,
    closed_form_holds,
    microbatches_for_bubble,
    peak_activations,
)

# Among equal bubbles and memory, the schedule a user would rather run.
PREFERENCE = ("1f1b", "zb_h1", "interleaved_1f1b", "gpipe")


@dataclass(frozen=True)
class Candidate:
    schedule: str
    flushes: int  # pipeline drains per iteration (GPipe flushes; 1 otherwise)
    flush_size: int  # microbatches per flush (the largest one)
    peak_activations: float  # stage microbatches on the fullest device (JSON: peak_activations_stage_microbatches)
    makespan: float  # in the cost unit of --forward-cost / --backward-cost
    bubble: float
    utilization: float  # mean per-stage utilization = 1 - bubble

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data[PEAK_KEY] = data.pop("peak_activations")
        return data


# The JSON key of peak activations, in stage microbatches (the what-if's too): the unit is in the name.
PEAK_KEY = "peak_activations_stage_microbatches"
PEAK_UNIT = (
    "microbatches of a whole stage's activations (an interleaved model chunk, 1/v of the stage's layers, counts 1/v)"
)


@dataclass(frozen=True)
class Rejected:
    schedule: str
    reason: str


@dataclass(frozen=True)
class Plan:
    chosen: Candidate
    candidates: tuple[Candidate, ...]  # those within the budget, best first
    rejected: tuple[Rejected, ...]  # schedules that do not fit, and why
    closed_form: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return {
            "chosen": self.chosen.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [asdict(r) for r in self.rejected],
            "closed_form": self.closed_form,
        }


# Shapes with more compute tasks than this take the closed forms where they hold (`theory.closed_form_holds`,
# checked against the simulator in the tests) instead of a simulation: 64 stages x 1024 microbatches x 4 chunks
# is half a million tasks per schedule, seconds of simulation each, for numbers known exactly.
SIMULATE_UP_TO_TASKS = 20_000
# Where no closed form holds, the tasks a candidate's simulation may have: 64 stages x 2 chunks x 4096 microbatches
# (2^19 stage-chunk-microbatches, 2^20 tasks) took about 25 s and 1.7 GB; twice that 85 s and 6.5 GB, 10^11 never ends.
MAX_SIMULATED_TASKS = 1 << 20


def _evaluate(
    schedule: str,
    stages: int,
    microbatches: int,
    forward: float,
    backward: float,
    weight_grad: float,
    chunks: int = 1,
    flush: int | None = None,
) -> Candidate:
    size = flush or microbatches
    tasks = (3 if schedule == "zb_h1" else 2) * stages * chunks * microbatches
    if tasks > SIMULATE_UP_TO_TASKS and closed_form_holds(
        schedule, stages, microbatches, forward, backward, weight_grad, chunks
    ):
        makespan = balanced_makespan(schedule, stages, microbatches, forward, backward, weight_grad, chunks, flush)
        peak = max(peak_activations(schedule, stages, microbatches, chunks, flush)) / chunks
        bubble = 1.0 - microbatches * (forward + backward) / makespan
    else:
        if tasks > MAX_SIMULATED_TASKS:
            raise ValueError(
                f"{schedule} on --stages {stages} x --chunks {chunks} x --microbatches {microbatches} "
                f"has {tasks} tasks, and its closed form does not hold there; the planner simulates at "
                f"most {MAX_SIMULATED_TASKS} (about 25 s and 2 GB at the limit): plan a smaller "
                "pipeline, or fewer microbatches (the bubble depends on their ratio to the stages)"
            )
        result = simulate(
            balanced_pipeline(stages, microbatches, forward, backward, weight_grad, chunks=chunks),
            schedule,
            gpipe_flush=flush,
        )
        makespan, peak = result.makespan_ms, max(result.peak_stage_activations)
        bubble = result.metrics().bubble_ratio
    return Candidate(
        schedule=schedule,
        flushes=math.ceil(microbatches / size),
        flush_size=min(size, microbatches),
        peak_activations=peak,
        makespan=makespan,
        bubble=bubble,
        utilization=1.0 - bubble,
    )


def plan(
    stages: int,
    microbatches: int,
    memory_budget: float,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_grad_cost: float = 0.0,
    chunks: int = 1,
    target_bubble: float | None = None,
) -> Plan:
    """Enumerate the schedules that fit `memory_budget` stage microbatches of activations per device; choose the
    lowest bubble.

    ZB-H1 is considered when the backward has a weight-gradient part (`weight_grad_cost` > 0),
    interleaved 1F1B when `chunks` > 1.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1 (got {value})")
    if not math.isfinite(memory_budget) or memory_budget < 1:
        raise ValueError(
            f"--memory-budget must be a finite number of stage microbatches, at least 1 (got "
            f"{memory_budget}); a budget of --microbatches or more means no memory limit"
        )
    costs_given = (forward_cost, backward_cost, weight_grad_cost)
    if (
        not all(math.isfinite(c) for c in costs_given)
        or forward_cost < 0
        or backward_cost < 0
        or not 0 <= weight_grad_cost <= backward_cost
        or forward_cost + backward_cost == 0
    ):
        raise ValueError(
            "costs must be finite and >= 0, forward + backward > 0 (a pipeline with no work has no "
            "bubble to compare), and --weight-grad-cost must not exceed --backward-cost "
            f"(got forward {forward_cost}, backward {backward_cost}, weight grad {weight_grad_cost})"
        )
    costs = (stages, microbatches, forward_cost, backward_cost, weight_grad_cost)
    evaluated = [_evaluate("1f1b", *costs), _evaluate("gpipe", *costs)]
    # GPipe within the budget: the fewest flushes, split as evenly as the flush size allows.
    fewest_flushes = math.ceil(microbatches / min(int(memory_budget), microbatches))
    even_flush = math.ceil(microbatches / fewest_flushes)
    if even_flush < microbatches:
        evaluated.append(_evaluate("gpipe", *costs, flush=even_flush))
    rejected = []
    if weight_grad_cost > 0:
        evaluated.append(_evaluate("zb_h1", *costs))
    if chunks > 1:
        try:
            check_shape("interleaved_1f1b", stages, chunks, microbatches)
            evaluated.append(_evaluate("interleaved_1f1b", *costs, chunks=chunks))
        except ValueError as refusal:
            rejected.append(Rejected("interleaved_1f1b", str(refusal)))
    fitting = []
    for candidate in evaluated:
        if candidate.peak_activations <= memory_budget + 1e-12:
            fitting.append(candidate)
        else:
            label = candidate.schedule + (f" (flush {candidate.flush_size})" if candidate.schedule == "gpipe" else "")
            rejected.append(
                Rejected(
                    label,
                    f"needs {candidate.peak_activations:g} stage microbatches of activations "
                    f"on its fullest device; the budget is {memory_budget:g}",
                )
            )
    fitting.sort(key=lambda c: (round(c.bubble, 12), c.peak_activations, PREFERENCE.index(c.schedule)))
    closed_form = {"bubble_1f1b": bubble_fraction(stages, microbatches)}
    if chunks > 1:
        closed_form["bubble_interleaved"] = bubble_fraction(stages, microbatches, chunks)
    if target_bubble is not None:
        closed_form["target_bubble"] = target_bubble
        closed_form["microbatches_for_target_bubble"] = microbatches_for_bubble(stages, target_bubble)
    return Plan(chosen=fitting[0], candidates=tuple(fitting), rejected=tuple(rejected), closed_form=closed_form)
