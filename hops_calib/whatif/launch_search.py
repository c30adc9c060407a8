"""The launch search's search: a seeded optuna (TPE) study over a space too large to price whole, then coordinate
ascent from its best and from the job's own launch, under a budget of simulated tasks. See
`hops_calib.whatif.job_plan`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hops_calib.progress import QUIET, Progress
from hops_calib.spec import Spec
from hops_calib.whatif.launch_pricing import Outcome
from hops_calib.whatif.launch_space import Launch, Space

# Launches searched one by one (about 1 ms each); more, and a seeded optuna study samples them.
EXHAUSTIVE_LIMIT = 10000


def _splits(space: Space) -> list[tuple[int | None, int | None, tuple[bool, bool]]]:
    """The split as one dimension: the space's first/last settings, then the even split's accounted variants."""
    return [(first, last, (False, False)) for first, last in space.splits] + [
        (None, None, accounted) for accounted in ((True, False), (False, True), (True, True)) if space.accounting
    ]


def _schedules(space: Space) -> list[tuple[str, int]]:
    return sorted({(schedule, chunks) for _, _, _, schedule, chunks, _ in space.shapes()})


def _study_devices(space: Space) -> tuple[str, ...]:
    """The devices whose stage order the study searches (a key each): none with one distinct order."""
    if space.orders_count() <= 1:
        return ()
    return space.devices if space.devices is not None else space.current_order


def study_dimensions(space: Space) -> int:
    """The parameters a trial of the study over `space` asks for: a key per device of a searched order, the
    micro-batch size, the schedule and the split."""
    return len(_study_devices(space)) + 3


def study_launch(space: Space, params: dict[str, Any], shapes: set | None = None) -> Launch | None:
    """The launch of a trial's parameters (`study_objective`), None when the combination is outside the space (an
    interleaved launch Megatron refuses)."""
    devices = _study_devices(space)
    if devices:
        keys = [params[f"key {device}"] for device in devices]
        order = space.canonical(devices[k] for k in sorted(range(len(keys)), key=keys.__getitem__))
    else:
        order = space.current_order
    size = params["micro_batch_size"]
    schedule, chunks = _schedules(space)[params["schedule"]]
    first, last, accounted = _splits(space)[params["split"]]
    if chunks > 1:
        first = last = None
    if (size, first, last, schedule, chunks, accounted) not in (shapes if shapes is not None else set(space.shapes())):
        return None
    return Launch(order, first, last, schedule, chunks, size, accounted, space.levers)


def study_objective(
    space: Space, score: Callable[[Launch], Outcome | None], progress: Progress = QUIET
) -> Callable[[Any], float]:
    """The study's objective over the space's dimensions: the stage order as a random key per device (sorting the
    keys gives the order, so TPE can learn that a device belongs early or late), the micro-batch size, the schedule
    (with its chunks) and the split; the value is the launch's samples per second. A combination outside the
    space, a candidate that cannot run and one that does not fit memory score 0."""
    devices = _study_devices(space)
    sizes = list(space.sizes)
    schedules = list(range(len(_schedules(space))))
    splits = list(range(len(_splits(space))))
    shapes = set(space.shapes())
    names = [schedule for schedule, _ in _schedules(space)]

    def objective(trial: Any) -> float:
        params: dict[str, Any] = {f"key {device}": trial.suggest_float(f"key {device}", 0.0, 1.0) for device in devices}
        params["micro_batch_size"] = trial.suggest_categorical("micro_batch_size", sizes)
        params["schedule"] = trial.suggest_categorical("schedule", schedules)
        params["split"] = trial.suggest_categorical("split", splits)
        launch = study_launch(space, params, shapes)
        progress.advance(names[params["schedule"]])
        if launch is None:
            return 0.0
        outcome = score(launch)
        return outcome.samples_per_s if outcome is not None and outcome.fits else 0.0

    return objective


def _optuna_search(
    space: Space, score: Callable[[Launch], Outcome | None], trials: int, seed: int, progress: Progress
) -> None:
    """A seeded TPE study in memory (`study_objective`), its launches priced by `score` (which prunes by what the
    search has seen so far)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    progress.start(trials)
    study.optimize(study_objective(space, score, progress), n_trials=trials)


def _local_search(
    space: Space,
    score: Callable[[Launch], Outcome | None],
    starts: Sequence[Outcome],
    known: Callable[[Launch], bool],
    budget: int,
    progress: Progress = QUIET,
    done: int = 0,
    max_steps: int = 50,
) -> tuple[int, AscentStop | None]:
    """Coordinate ascent from each start that fits: evaluate every launch that differs from the current one in the
    order only (every distinct order up to `ALL_ORDERS` of them, else every swap of two stages) or in the shape only
    (every split, schedule and micro-batch size of the space), nearest first (the fewest of schedule, micro-batch
    size, order and split changed, in that order), and move to the fastest while it is faster. At most `budget`
    launches not priced before (`known`) are priced, shown on `progress` after `done` units. Returns the steps taken
    (moves to a faster neighbour) and, when the budget stopped the ascent, where (`AscentStop`)."""
    shapes = space.shapes()
    every_order = space.devices is not None and space.orders_count() <= ALL_ORDERS
    steps = spent = 0

    def nearness(a: Launch, b: Launch) -> tuple[int, tuple[bool, ...]]:
        """How many of the schedule, the micro-batch size, the order and the split differ, then which: the
        schedule's changes first, the split's last."""
        changed = (
            (a.schedule, a.chunks) != (b.schedule, b.chunks),
            a.micro_batch_size != b.micro_batch_size,
            a.order != b.order,
            (a.first, a.last, a.accounted) != (b.first, b.last, b.accounted),
        )
        return sum(changed), tuple(not flag for flag in changed)

    for index, start in enumerate(starts):
        if not start.fits:
            continue
        current = start
        for step in range(1, max_steps + 1):
            launch = current.launch
            if every_order:
                orders = [tuple(o) for o in space.orders()]
            elif space.devices is not None:
                orders = []
                for i, j in itertools.combinations(range(len(launch.order)), 2):
                    order = list(launch.order)
                    order[i], order[j] = order[j], order[i]
                    orders.append(space.canonical(order))  # a swap of two devices of one kind changes nothing
                orders = list(dict.fromkeys(orders))
            else:
                orders = []
            neighbours = [replace(launch, order=order) for order in orders]
            neighbours += [
                Launch(launch.order, first, last, schedule, chunks, size, accounted, launch.levers)
                for size, first, last, schedule, chunks, accounted in shapes
            ]
            # each once, the launch itself not its own neighbour (its order and its shape are among the candidates)
            neighbours = [n for n in dict.fromkeys(neighbours) if n != launch]
            # nearest first (one change: the schedule, the micro-batch size, the order, the split; then two, ...):
            # what a budget leaves unpriced is the farthest
            neighbours.sort(key=lambda n: nearness(n, launch))
            better = current
            already = 0  # neighbours scanned that were priced before (the study's, an earlier step's)
            for scanned, neighbour in enumerate(neighbours):
                if known(neighbour):
                    already += 1
                else:
                    if spent >= budget:
                        return steps, AscentStop(index, step, scanned, len(neighbours), already)
                    spent += 1
                    progress.update(done + spent, done + budget)
                outcome = score(neighbour)
                if outcome is not None and outcome.fits and outcome.samples_per_s > better.samples_per_s:
                    better = outcome
            if better is current:
                break
            current = better
            steps += 1
    return steps, None


@dataclass(frozen=True)
class AscentStop:
    """Where the coordinate ascent's budget ran out: scanning the neighbours of step `step` (1: the start's own
    neighbourhood) from start `start` (an index of the starts), `scanned` of its `neighbours` looked at, `known` of
    them priced before (the rest priced new, against the budget)."""

    start: int
    step: int
    scanned: int
    neighbours: int
    known: int = 0


# The coordinate ascent after a study prices at most this many simulated tasks' worth of launches, counted at the
# job's own launch's size: a 512-GPU launch of 192 microbatches on 8 stages (3072 tasks, about 60 ms to price) gets
# 651 launches, a 6-stage cluster run's thousands (about 1 ms each).
ASCENT_TASKS = 2_000_000


def _tasks(spec: Spec) -> int:
    """The compute tasks of one iteration of `spec` (a forward and a backward per microbatch, stage and chunk)."""
    return 2 * spec.microbatches * spec.pp * spec.vp


def ascent_budget(spec: Spec, trials: int, tasks: int = ASCENT_TASKS) -> int:
    """The launches the coordinate ascent may price on the job of `spec` (its own launch): `tasks` simulated tasks'
    worth at its size, and at least `trials`."""
    return max(trials, tasks // max(_tasks(spec), 1))


ALL_ORDERS = 5040  # up to 7 stages, a step of local search tries every order
