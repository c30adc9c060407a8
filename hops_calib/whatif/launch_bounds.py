"""The launch search's closed-form bounds, before simulating: whether a launch fits each GPU's memory by the
schedule's closed form of the activations it holds, and an upper bound on its throughput from its priced stage
costs. `LaunchBounds` is a part of `launch_pricing.JobPlanner`, which prices the specs and pipelines they read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hops_calib.model.memory import stage_memory
from hops_calib.spec import Spec
from hops_calib.whatif.launch_outcome import Refusal, _step_samples
from hops_calib.whatif.launch_space import (
    Launch,
)


class LaunchBounds:
    """Closed-form bounds on a launch (a part of `JobPlanner`, which sets and prices these)."""

    memory_bytes: dict[str, float]
    spec_of: Callable[[Launch], Spec]
    priced: Callable[[Launch], tuple[Spec, Any]]

    def memory_fits(self, launch: Launch) -> bool:
        """Whether `launch` fits each GPU's memory (less the headroom) by the schedule's closed form of the
        activations it holds (`sim.theory.peak_activations`, in stage microbatches), without simulating it.
        Refusal when it cannot run or be priced."""
        from hops_calib.sim.theory import peak_activations

        spec = self.spec_of(launch)
        schedule = "1f1b" if launch.schedule == "auto" else launch.schedule
        try:
            peaks = peak_activations(schedule, spec.pp, spec.microbatches, spec.vp)
        except ValueError:
            return True  # no closed form: the simulation says
        caps = tuple(self.memory_bytes[t] for t in spec.devices)
        memory = stage_memory(spec, caps, tuple(p / spec.vp for p in peaks))
        return all(stage.total_bytes <= cap for stage, cap in zip(memory, caps))

    def bound_samples_per_s(self, launch: Launch, tight: bool = False) -> float:
        """An upper bound on `launch`'s simulated samples per second from its priced stage costs: in each
        iteration every rank runs each microbatch's forward and backward of its model chunks, one after another,
        then (`tight`) its gradient reduction's tail or the pre-optimizer work, its optimizer step and the host
        time after it, all within the window the throughput is measured over (from the first task to stage 0's
        last backward of the last iteration, so the last iteration's optimizer falls outside it); and (`tight`,
        with a barrier before the optimizer) rank r starts only after the first microbatch's forwards through the
        ranks before it and its last backward (chunk 0's) still runs back through them (1F1B, GPipe, interleaved
        1F1B). No schedule beats that (`tests/whatif/test_plan_levers.py` checks it on three captures' launches).
        Without `tight`, an interleaved launch at the even split is bounded by its one-chunk launch (its rank runs
        the same layers as v chunks, with more tasks' host time and hops: no less work), which prices in a tenth
        of the time; with full recomputation by blocks (k layers per chunk) not, as the chunks recompute more."""
        spec = None
        if (
            not tight
            and launch.chunks > 1
            and (launch.first, launch.last, launch.accounted) == (None, None, (False, False))
            and (launch.levers is None or launch.levers.recompute[1] != "block")
            and self.spec_of(launch).model.recompute_method != "block"
        ):
            try:
                spec, pipeline = self.priced(replace(launch, schedule="1f1b", chunks=1))
            except Refusal:
                spec = None
        if spec is None:
            spec, pipeline = self.priced(launch)
        p, v, m, n = spec.pp, spec.vp, spec.microbatches, max(pipeline.iterations, 1)
        stages = pipeline.stages
        work = [sum(stages[c * p + r].forward_ms + stages[c * p + r].backward_ms for c in range(v)) for r in range(p)]
        # under ZB-H1 (or auto) the last iteration's weight gradients may be deferred past the window's end
        deferred = launch.schedule in ("zb_h1", "auto")
        last = [
            w - (sum(stages[c * p + r].weight_grad_ms for c in range(v)) if deferred else 0.0)
            for r, w in enumerate(work)
        ]
        optimizer = list(pipeline.optimizer_ms) or [0.0] * p
        tails = list(pipeline.grad_reduce_tail_ms) or [0.0] * p
        after = [
            o + (max(t, pipeline.pre_optimizer_ms) + pipeline.post_ms(r) if tight else 0.0)
            for r, (o, t) in enumerate(zip(optimizer, tails))
        ]
        window = max((n - 1) * (m * w + a) + m * t for w, a, t in zip(work, after, last))
        if tight and pipeline.optimizer_barrier and launch.schedule in ("1f1b", "gpipe", "interleaved_1f1b"):
            forward = [stage.forward_ms for stage in stages[:p]]  # chunk 0's virtual stages, rank by rank
            backward = [stage.backward_ms for stage in stages[:p]]
            through = max(sum(forward[:r]) + m * work[r] + sum(backward[:r]) for r in range(p))
            window = max(window, (n - 1) * (through + after[0]) + through)
        return n * m * _step_samples(launch, spec) / window * 1e3 if window > 0 else float("inf")
