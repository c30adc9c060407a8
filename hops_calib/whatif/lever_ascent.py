"""What-if room: the planner's ascent over the levers (`plan_job` drives it): where it starts (the job's own launch,
or, where that does not fit, each setting's most memory-saving launch the closed-form bound says fits:
`_memory_seeds`), how it moves (`_moved`, `_moved_up`: one lever, or one larger micro batch), the one count its
progress reports (`_Looked`), and the note on interchangeable devices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hops_calib.progress import Progress
from hops_calib.whatif.launch_pricing import JobPlanner, Outcome, Refusal
from hops_calib.whatif.launch_space import Launch, Space


class _Looked:
    """The search's progress as one count: the distinct launches looked at (`count()`) of the `total` candidates,
    shown on `inner` whenever a stage of the search reports a step, named by the current `stage`. The count stops
    short of the total where the search does not look at every launch."""

    def __init__(self, inner: Progress, total: int, count: Any) -> None:
        self.inner, self.total, self.count, self.stage = inner, total, count, ""
        inner.start(total)

    def start(self, total: int) -> None:
        pass  # the total is the candidates', set once

    def advance(self, what: str = "") -> None:
        self.inner.update(self.count(), self.total, self.stage)

    def update(self, completed: int, total: int, what: str = "") -> None:
        self.inner.update(self.count(), self.total, self.stage)


def _lever_ascent(
    planner: JobPlanner,
    space: Space,
    families: Sequence[tuple[Any, Space]],
    score: Any,
    best_first: Any,
    outcomes: dict[Launch, Outcome],
    max_steps: int = 20,
) -> int:
    """Moves from the job's own launch to the fastest fitting launch one lever away while one is faster; the
    steps taken. A launch whose micro batch no longer divides a replica's batch takes the largest that does."""
    spaces = {None: space, **dict(families)}
    own = planner.own_levers()
    current = score(planner.current())
    if current is None or not current.fits:
        fitting = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)
        if not fitting:  # the job's own launch does not fit: start from its settings at each recomputation
            best_first(
                [_moved(planner.current(), family) for setting, family in families if setting.layout == own.layout]
            )
            fitting = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)
        if not fitting:  # nor do those: start from every setting's most memory-saving launch the bound says fits
            best_first(_memory_seeds(planner, spaces))
            fitting = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)
            if not fitting:
                return 0
        current = fitting[0]
    steps = 0
    for _ in range(max_steps):
        launch = current.launch
        levers = launch.levers or own
        here = spaces[launch.levers]
        near = [
            Launch(launch.order, launch.first, launch.last, schedule, chunks, size, accounted, launch.levers)
            for size, first, last, schedule, chunks, accounted in here.shapes()
            if (first, last) == (launch.first, launch.last)
            and accounted == launch.accounted
            and (size == launch.micro_batch_size or (schedule, chunks) == (launch.schedule, launch.chunks))
        ]
        for setting, family in spaces.items():
            setting = setting or own
            changed = (
                setting.layout != levers.layout,
                setting.recompute != levers.recompute,
                setting.sequence_parallel != levers.sequence_parallel,
                setting.distributed_optimizer != levers.distributed_optimizer,
                setting.fp8 != levers.fp8,
                setting.experts != levers.experts,
            )
            # one lever changed; a new layout may take any recomputation with it (what lets it fit) or any layout
            # of the experts (ep, etp: a wider layout may leave the launch's own none, or too little memory), not
            # both (that would price every layout x recomputation x expert layout at each step)
            if sum(changed) == 1 or (changed[0] and sum(changed[2:5]) == 0 and changed[1] + changed[5] < 2):
                near += _moved_up(planner, launch, family)
        best_first([n for n in dict.fromkeys(near) if n != launch])
        better = max(
            (outcomes[n] for n in near if n in outcomes and outcomes[n].fits),
            key=lambda o: o.samples_per_s,
            default=current,
        )
        if better.samples_per_s <= current.samples_per_s:
            break
        current, steps = better, steps + 1
    return steps


SEED_SPLITS = 4  # the most memory-saving 1F1B splits of a setting whose memory `_memory_seeds` bounds, at most


def _memory_seeds(planner: JobPlanner, spaces: dict[Any, Space]) -> list[Launch]:
    """Of each setting of the levers, its launch that holds the least memory - the smallest micro batch, 1F1B
    (the fewest microbatches in flight), of its layer splits (even or first/last pinned) the first of the
    `SEED_SPLITS` with the least memory at their fullest stage (`_split_memory`) that the closed-form memory bound
    says fits: where the search starts when neither the job's own launch nor its settings at another
    recomputation fit."""
    seeds = []
    for family in spaces.values():
        size = min(family.sizes)
        if ("1f1b", 1) not in family.runs_at(size):
            continue
        splits = [split for split in family.splits if family.holds((size, *split, "1f1b", 1, (False, False)))]
        splits.sort(key=lambda split: (split[0] is not None) + (split[1] is not None))  # the even split first
        if not splits:
            continue
        launches = [
            Launch(family.current_order, first, last, "1f1b", 1, size, (False, False), family.levers)
            for first, last in splits
        ]
        try:
            ranked = _split_memory(planner, family, launches)
        except Refusal:
            continue
        for launch in ranked[:SEED_SPLITS]:
            try:
                if planner.memory_fits(launch):
                    seeds.append(launch)
                    break
            except Refusal:
                continue
    return seeds


def _split_memory(planner: JobPlanner, family: Space, launches: list[Launch]) -> list[Launch]:
    """`launches` (1F1B, one setting and micro batch, their splits differing) by the memory of their fullest
    stage, least first, from the first launch's memory count (`model.memory.stage_memory` at 1F1B's closed-form
    peak: stage k holds min(p - k, m) microbatches): a layer's weights, gradients and optimizer state and a
    microbatch's activations of a layer (a middle stage's, per layer), and what each stage holds besides (the
    embedding, the logits); a split's stage then holds its own layers' share on top. Refusal when the first
    launch cannot be priced."""
    from hops_calib.model.memory import stage_memory
    from hops_calib.sim.theory import peak_activations
    from hops_calib.spec import split_layers

    spec = planner.spec_of(launches[0])
    p, m = spec.pp, spec.microbatches
    if p < 2:
        return launches
    flight = peak_activations("1f1b", p, m)
    caps = tuple(planner.memory_bytes[t] for t in spec.devices)
    stages = stage_memory(spec, caps, tuple(float(f) for f in flight))
    layers = spec.layers_per_stage
    mid = max(range(p), key=lambda k: (0 < k < p - 1, layers[k]))
    if not layers[mid]:
        return launches
    held = stages[mid].weights_bytes + stages[mid].gradients_bytes + stages[mid].optimizer_bytes
    static = held / layers[mid]
    activation = stages[mid].activations_bytes / (layers[mid] * flight[mid])
    extra = [stage.total_bytes - (static + activation * f) * n for stage, f, n in zip(stages, flight, layers)]

    def fullest(launch: Launch) -> float:
        counts = split_layers(family.layers, p, launch.first, launch.last)
        return max(e + (static + activation * f) * n for e, f, n in zip(extra, flight, counts))

    return sorted(launches, key=fullest)


def _moved_up(planner: JobPlanner, launch: Launch, family: Space) -> list[Launch]:
    """`launch` moved to another setting of the levers (`_moved`), and at the next larger micro batch of that
    setting where the closed-form memory bound says it fits: a setting that holds less per GPU (a recomputation,
    the distributed optimizer, a wider layout) may run best at a larger one (the ascent climbs on from there)."""
    moved = [_moved(launch, family)]
    for size in sorted(s for s in family.sizes if s > moved[0].micro_batch_size):
        larger = _moved(launch, family, size)
        try:
            if planner.memory_fits(larger):
                moved.append(larger)
        except Refusal:
            continue
        break
    return moved


# The splits a launch moved to another setting of the levers tries, after its own: even, then the embedding and/or
# the loss counted as a layer (where the layers do not divide over the stages: a 126-layer model on 8)
_EVEN_SPLITS = (
    (None, None, (False, False)),
    (None, None, (True, True)),
    (None, None, (True, False)),
    (None, None, (False, True)),
)


def _moved(launch: Launch, family: Space, size: int | None = None) -> Launch:
    """`launch` in another setting of the levers: its schedule where that setting runs it (else 1F1B), micro batch
    `size`, else its own where it divides a replica's batch (else the largest that does); its own split where the
    setting runs it (the same stages), else the even split, else the even split with the embedding and/or the loss
    counted as a layer (`_EVEN_SPLITS`), else the first pinned split the setting runs."""
    if size is None:
        size = max((s for s in family.sizes if s <= launch.micro_batch_size), default=min(family.sizes))
    for schedule, chunks in dict.fromkeys([(launch.schedule, launch.chunks), ("1f1b", 1)]):
        for first, last, accounted in ((launch.first, launch.last, launch.accounted), *_EVEN_SPLITS):
            if family.holds((size, first, last, schedule, chunks, accounted)):
                return Launch(family.current_order, first, last, schedule, chunks, size, accounted, family.levers)
    pinned = next(
        (shape for shape in family.shapes() if shape[0] == size and shape[3:5] == ("1f1b", 1)),
        None,
    )
    if pinned is not None:
        _, first, last, schedule, chunks, accounted = pinned
        return Launch(family.current_order, first, last, schedule, chunks, size, accounted, family.levers)
    return Launch(family.current_order, None, None, "1f1b", 1, size, (False, False), family.levers)


def _interchangeable(space: Space) -> str:
    """The note naming the devices a plan took as interchangeable, and the orders that left to price."""
    alike = [", ".join(devices) for devices in space.by_kind()[1].values() if len(devices) > 1]
    return (
        f"interchangeable devices (same type, same links at every position: a launch prices the same with any "
        f"two swapped): {'; '.join(alike)}. {space.orders_count()} distinct stage order(s) searched of "
        f"{math.factorial(len(space.devices or space.current_order))}"
    )
