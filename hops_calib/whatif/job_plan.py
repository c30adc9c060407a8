"""What-if room: the planner for a real job, every lever Megatron has searched together - the layout (t, p, cp,
d, and under a mixture of experts ep and etp), recomputation, sequence parallelism, the distributed optimizer, FP8 or 16-bit GEMMs (where `precision`
allows), which device runs which stage, how many layers each holds, which schedule, which micro-batch size - for a
job directory's model and global batch, on its GPUs, priced by a calibrated model, within each GPU's memory less a
headroom.

A candidate is a `Launch`: its levers (`Levers`: None, the job's own t, p, cp, recomputation, SP, distributed
optimizer, precision and, for a mixture of experts, ep and etp: `JobPlanner.expert_layouts`), a stage order (device id per stage; ranks placed by torchrun on a layout of its own), Megatron's layer
split (even, or the first and/or last stage pinned with --decoder-first/last-pipeline-num-layers, the rest even, or
even with the embedding and/or the loss counted as a layer, --account-for-embedding/loss-in-pipeline-split), a
schedule (1F1B or interleaved 1F1B with v model chunks per rank; with `any_runtime` also ZB-H1, GPipe, or `auto`,
the HopsHetero rule choosing 1F1B or ZB-H1) and a micro-batch size (the microbatch count follows from the global
batch). Each is turned into the launch's arguments and built into a spec exactly as a job directory's would be
(`spec_from_args`: a split or shape Megatron refuses is refused here too), its hops priced by the hosts at their
ends (`link_book.LinkBook`: the job's own benchmark of a host pair, else the cluster's) or from torchrun's
placement, bounded by closed forms (memory, throughput: `JobPlanner.memory_fits`, `bound_samples_per_s`) and
simulated only when it can still rank, checked against each device's memory (`model.memory`). Ranked by
predicted samples per second over the traced window.

Small spaces are searched exhaustively, in the order of their bounds; larger ones by coordinate ascent over the
levers from the job's own launch, a seeded optuna (TPE) study of `trials` candidates where the stage order is
searched, and coordinate ascent over orders and splits. Under stragglers and failures (`Perturbations`), the
nominal best `rerank` candidates are simulated again `samples` times with drawn stragglers and failures, and
ranked by the mean or the 5th percentile of their throughput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress
from hops_calib.whatif.cluster import Cluster
from hops_calib.whatif.job import cp_exchange_unpriced

# The search's space, pricing, search and agreement live in their own modules; their names stay importable from here.
from hops_calib.whatif.launch_agreement import (
    GroupAgreement,
    auto_rule_agreement,
    pairwise_agreement,
    train_group_agreement,
)
from hops_calib.whatif.launch_pricing import MAX_TASKS, NO_MEGATRON_FLAG, JobPlanner, Outcome, Refusal
from hops_calib.whatif.launch_search import (
    ALL_ORDERS,
    ASCENT_TASKS,
    EXHAUSTIVE_LIMIT,
    AscentStop,
    _local_search,
    _optuna_search,
    _tasks,
    ascent_budget,
)
from hops_calib.whatif.launch_space import (
    ACCOUNTING_FLAGS,
    MAX_SPLIT_LAYERS,
    MEGATRON_SCHEDULES,
    PRECISIONS,
    SCHEDULES,
    Launch,
    Space,
    accounted_splits,
    divisors,
    layer_splits,
)
from hops_calib.whatif.launch_study import StudyResult, StudyRun, TrialsProgress, run_study, study_setting
from hops_calib.whatif.lever_ascent import _interchangeable, _lever_ascent, _Looked, _memory_seeds
from hops_calib.whatif.perturbations import Perturbations

__all__ = [
    "ACCOUNTING_FLAGS",
    "ALL_ORDERS",
    "ASCENT_TASKS",
    "EXHAUSTIVE_LIMIT",
    "MAX_SPLIT_LAYERS",
    "MAX_TASKS",
    "MEGATRON_SCHEDULES",
    "NO_MEGATRON_FLAG",
    "SCHEDULES",
    "AscentStop",
    "GroupAgreement",
    "JobPlan",
    "JobPlanner",
    "Launch",
    "Outcome",
    "Refusal",
    "Space",
    "accounted_splits",
    "ascent_budget",
    "auto_rule_agreement",
    "divisors",
    "layer_splits",
    "pairwise_agreement",
    "plan_job",
    "train_group_agreement",
]


@dataclass(frozen=True)
class JobPlan:
    job: str
    model: str
    search: str  # "exhaustive" or "optuna TPE, seed S, N trials"
    space: int  # candidates in the space
    evaluated: int
    best: tuple[Outcome, ...]  # the best K that fit, best first
    current: Outcome | None  # the job's own launch, for comparison
    refused: dict[str, int]  # why candidates could not run or be priced, counted
    over_memory: int
    rank_by: str
    notes: tuple[str, ...] = ()
    auto_agreement: tuple[int, int] = (0, 0)  # (auto's pick was the faster of 1f1b/zb_h1, pairs compared)
    best_megatron: Outcome | None = None  # the best launch Megatron-LM runs as it is (1F1B or interleaved 1F1B)
    cluster: str = ""  # the cluster file used and where it was set ("": none)
    store: str = ""  # the fixture store whose train split the launches were checked against ("": not checked)
    orders: int = 1  # distinct stage orders in the space (orders of kinds of interchangeable devices)
    simulated: int = 0  # launches simulated (the rest of `evaluated` were refused or left out by a bound)
    bounded: int = 0  # launches a closed-form throughput bound showed could not rank, left unsimulated
    headroom_bytes: dict[str, float] | None = None  # per device type, left out of its memory for every pick
    capacity_bytes: dict[str, float] | None = None  # per device type, its memory before the headroom
    any_runtime: bool = False  # schedules Megatron-LM lacks were searched too
    band_source: str = ""  # where the throughputs' band comes from ("": none given)
    study: dict[str, Any] | None = None  # the shared study the search ran on (--storage): name, storage, trials

    @property
    def status(self) -> str:
        """ "ok", or "no_candidate" when no launch runs, is priced and fits in memory (exit 1, as a rejection)."""
        return "ok" if self.best else "no_candidate"

    @property
    def exit_code(self) -> int:
        return 0 if self.best else 1

    def refusal_kinds(self) -> list[tuple[int, int, str]]:
        """The refusals grouped by kind (a reason with its numbers taken out): for each, most launches first, the
        launches refused, how many different reasons (numbers) it holds and the commonest as its example."""
        import re

        kinds: dict[str, list[tuple[int, str]]] = {}
        for reason, count in self.refused.items():
            kinds.setdefault(re.sub(r"\d+(?:\.\d+)?", "#", reason), []).append((count, reason))
        grouped = [(sum(c for c, _ in reasons), len(reasons), max(reasons)[1]) for reasons in kinds.values()]
        return sorted(grouped, key=lambda kind: (-kind[0], kind[2]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "job": self.job,
            "model": self.model,
            "cluster": self.cluster or None,
            "fixtures": self.store or None,
            "search": self.search,
            "space": self.space,
            "orders": self.orders,
            "evaluated": self.evaluated,
            "rank_by": self.rank_by,
            "best": [o.to_dict() for o in self.best],
            "current": self.current.to_dict() if self.current else None,
            "refused": self.refused,
            "over_memory": self.over_memory,
            "notes": list(self.notes),
            "auto_rule_agreement": {"faster_picked": self.auto_agreement[0], "compared": self.auto_agreement[1]},
            "best_megatron": self.best_megatron.to_dict() if self.best_megatron else None,
            "simulated": self.simulated,
            "bounded": self.bounded,
            "memory_headroom_bytes": self.headroom_bytes,
            "memory_capacity_bytes": self.capacity_bytes,
            "any_runtime": self.any_runtime,
            "throughput_band_source": self.band_source or None,
            "study": self.study,
        }


LAYOUTS_ASCENDED = 1000


def plan_job(
    job_dir: Path | str,
    model: Model,
    *,
    cluster: Cluster | None = None,
    top: int = 5,
    memory_bytes: dict[str, float] | None = None,
    schedules: Sequence[str] | None = None,
    orders: bool = True,
    splits: bool = True,
    micro_batch_sizes: bool = True,
    trials: int = 400,
    seed: int = 0,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    perturbations: Perturbations | None = None,
    rank_by: str = "throughput",
    rerank: int = 20,
    progress: Progress = QUIET,
    calibration: Any = None,
    store: str = "",
    ascent_tasks: int | None = None,
    levers: bool = True,
    any_runtime: bool = False,
    headroom_bytes: float | None = None,
    band: float = 0.0,
    study_trials: int | None = None,
    study_run: StudyRun | None = None,
    precision: str | None = None,
) -> JobPlan:
    """The best `top` launches of the job's model and global batch (see the module's docstring). `precision`: the
    precisions a pick may run in, bf16 (16-bit GEMMs), fp8 (Transformer Engine's FP8 GEMMs), any; None: the job's
    own."""
    if schedules is None:
        schedules = SCHEDULES if any_runtime else MEGATRON_SCHEDULES
    if rank_by not in ("throughput", "expected", "p5"):
        raise InputError(
            "plan",
            f"unknown ranking {rank_by!r}",
            field="--rank-by",
            hint="throughput (nominal), expected or p5 (under --slow-device/--stragglers/--failure)",
        )
    if rank_by != "throughput" and perturbations is None:
        raise InputError(
            "plan",
            f"--rank-by {rank_by} ranks under stragglers or failures, and none were given",
            field="--rank-by",
            hint="add --slow-device, --stragglers or --failure-rate",
        )
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise InputError(
            "plan",
            f"unknown schedule {unknown[0]!r}",
            field="--schedule",
            hint=f"expected one of {', '.join(SCHEDULES)}",
        )
    for flag, value, most in (
        ("--top", top, 1000),
        ("--trials", trials, 100_000),
        ("--exhaustive-limit", exhaustive_limit, 10_000_000),
    ):
        if not 1 <= value <= most:
            raise InputError("plan", f"{flag} {value} is outside 1..{most}", field=flag)
    if headroom_bytes is not None and not 0 <= headroom_bytes < math.inf:
        raise InputError(
            "plan",
            f"--memory-headroom {headroom_bytes / 1e9:g} GB is not a size of 0 or more",
            field="--memory-headroom",
            hint="e.g. --memory-headroom 2 (GB)",
        )
    if precision is not None and precision not in PRECISIONS:
        raise InputError(
            "plan", f"unknown precision {precision!r}", field="--precision", hint=f"one of {', '.join(PRECISIONS)}"
        )
    planner = JobPlanner(job_dir, model, cluster, memory_bytes, headroom_bytes)
    planner.band = band
    own_fp8 = planner.own_levers().fp8
    precisions = _precisions(planner, precision, own_fp8)
    slowed = (
        ()
        if perturbations is None
        else (*(d for d, _ in perturbations.slow_devices), *(d for a, b, _ in perturbations.slow_links for d in (a, b)))
    )
    space = planner.space(schedules, orders, splits, micro_batch_sizes, distinct=slowed)
    if space.devices is not None and space.orders_count() < math.factorial(len(space.devices)):
        planner.notes.append(_interchangeable(space))
    families: list[tuple[Any, Space]] = []
    for setting in planner.families(precisions, levers)[1:]:
        family = planner.family_space(setting, schedules, splits, micro_batch_sizes)
        if family is not None and len(family):
            families.append((setting, family))
    if levers:
        why = planner.relayout()
        if why:
            planner.notes.append(
                f"tensor, pipeline and context parallel sizes kept at the job's t {planner.spec.tp} x p "
                f"{planner.spec.pp} x cp {planner.spec.cp}: {why}; recomputation, sequence parallelism"
                + (", the experts' ep and etp" if planner.spec.model.moe else "")
                + " and the distributed optimizer are searched"
            )

    def allowed(launch: Launch) -> bool:
        """Whether a launch runs in a precision the plan may pick (the job's own launch is priced all the same)."""
        return (launch.levers.fp8 if launch.levers is not None else own_fp8) in precisions

    if not len(space):
        raise InputError(
            str(job_dir),
            "no launch to search: the schedules asked for cannot run any split",
            field="--schedule",
            hint="allow more schedules, or the layer split",
        )
    total = len(space) + sum(len(s) for _, s in families)
    outcomes: dict[Launch, Outcome] = {}
    refusals: dict[Launch, str] = {}
    bounded: dict[Launch, str] = {}  # launches left unsimulated by a closed-form bound: "memory" or "throughput"
    # the best fitting throughputs so far: a launch whose bound is below the kept-th of them cannot rank
    # (on one stage 1F1B, GPipe, ZB-H1 and auto may price alike and show as one row: as many kept per row)
    keep = max(top, rerank if perturbations is not None else 0) * max(
        1, sum(s in ("1f1b", "gpipe", "zb_h1", "auto") for s in schedules)
    )
    best: list[float] = []
    best_megatron = [0.0]

    # progress counts one quantity, the distinct launches looked at (priced, refused or left out by a bound) of
    # the candidates, whatever the stage of the search reports; the stage names itself
    looked = _Looked(progress, total, lambda: len(outcomes) + len(refusals) + len(bounded))
    progress = looked

    def threshold(launch: Launch) -> float:
        kth = best[keep - 1] if len(best) >= keep else 0.0
        return min(kth, best_megatron[0]) if launch.schedule in MEGATRON_SCHEDULES else kth

    def record(outcome: Outcome) -> None:
        if outcome.fits and allowed(outcome.launch):
            best.append(outcome.samples_per_s)
            best.sort(reverse=True)
            del best[keep:]
            if outcome.resolved in MEGATRON_SCHEDULES and outcome.launch.schedule != "auto":
                best_megatron[0] = max(best_megatron[0], outcome.samples_per_s)

    def known(launch: Launch) -> bool:
        return launch in outcomes or launch in refusals or launch in bounded

    def bound(launch: Launch) -> float | None:
        """The launch's throughput bound, None when it cannot rank: it cannot run, does not fit by the closed
        form, or (with `prune`) its bound is below what ranks."""
        try:
            if not planner.memory_fits(launch):
                bounded[launch] = "memory"
                return None
            return planner.bound_samples_per_s(launch)
        except Refusal as refusal:
            refusals[launch] = str(refusal)
            return None

    def simulated(launch: Launch, prune: bool) -> Outcome | None:
        """`launch` simulated, unless (`prune`) its tight bound cannot rank; None when it cannot run or be
        priced."""
        try:
            if prune and planner.bound_samples_per_s(launch, tight=True) < threshold(launch):
                bounded[launch] = "throughput"
                return None
            outcome = planner.evaluate(launch)
        except Refusal as refusal:
            refusals[launch] = str(refusal)
            return None
        outcomes[launch] = outcome
        record(outcome)
        return outcome

    def score(launch: Launch) -> Outcome | None:
        if launch in outcomes:
            return outcomes[launch]
        if launch in refusals or launch in bounded:
            return None
        most = bound(launch)
        if most is None:
            return None
        if most < threshold(launch):
            bounded[launch] = "throughput"
            return None
        return simulated(launch, prune=True)

    def force(launch: Launch) -> Outcome | None:
        """`launch` simulated whatever its bound (the job's own launch, a start of the ascent)."""
        if launch in outcomes or launch in refusals:
            return outcomes.get(launch)
        bounded.pop(launch, None)
        return simulated(launch, prune=False)

    def best_first(launches: Sequence[Launch]) -> None:
        """Every launch's bound first, then simulated in the order of their bounds while a bound can still rank."""
        ranked = []
        for launch in launches:
            if not known(launch):
                most = bound(launch)
                if most is not None:
                    ranked.append((most, launch))
            progress.advance("bounds")
        ranked.sort(key=lambda pair: -pair[0])
        for most, launch in ranked:
            if most < threshold(launch):
                bounded[launch] = "throughput"
            else:
                score(launch)
            progress.advance(launch.schedule)

    shared: StudyResult | None = None
    if total <= exhaustive_limit:
        search = "exhaustive"
        everything = [*space, *(launch for _, family in families for launch in family)]
        looked.stage = "bounds, then simulating best first"
        best_first(everything)
    else:
        # coordinate ascent over the levers from the job's own launch: every launch one lever away (the layout with
        # each recomputation, the recomputation, SP, the distributed optimizer, the micro batch, the schedule), at
        # the even split, bounded before it is simulated; then the study and the ascent over orders and splits
        looked.stage = "ascent over the levers"
        moves = _lever_ascent(planner, space, families, score, best_first, outcomes) if families else 0
        seeded = len(outcomes) + len(refusals) + len(bounded)
        study = study_trials if study_trials is not None else (trials if space.orders_count() > 1 else 0)
        if study and study_run is None:
            looked.stage = "optuna study"
            _optuna_search(space, score, study, seed, progress)
        elif study and study_run is not None:
            # the study on a storage other processes share: every trial priced in full, so its best launch is the
            # same whoever ran which trial (launch_study); the ascent below starts from it
            planned = study_setting(planner, space, cluster, memory_bytes, headroom_bytes)
            shared = run_study(planned, study_run, study, seed, TrialsProgress(looked.inner, "optuna study (trials)"))
            if shared.best is not None:
                force(shared.best)
        looked.stage = "coordinate ascent"
        studied = len(outcomes) + len(refusals) + len(bounded)
        found = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)[:1]
        own_known = known(planner.current())
        own = force(planner.current())
        budget = ascent_budget(planner.spec, trials, ascent_tasks or ASCENT_TASKS)
        spaces = {None: space, **dict(families)}
        if not found and (own is None or not own.fits):
            # nothing fits yet (no lever ascent, or none found): start from each setting's most memory-saving launch
            best_first(_memory_seeds(planner, spaces))
            found = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)[:1]
        starts = found + ([own] if own is not None and [own] != found else [])
        steps, stopped, spent, stopped_at = 0, None, 0, 0
        for index, start in enumerate(starts):
            taken, stopped = _local_search(
                spaces[start.launch.levers], score, [start], known, budget - spent, progress, done=studied + spent
            )
            steps += taken
            spent = len(outcomes) + len(refusals) + len(bounded) - studied - (not own_known)
            if stopped is not None:
                stopped_at = index
                break
        # the best `top` settings of the levers (layouts): coordinate ascent from the best launch of each not
        # ascended from yet, until the best `top` settings hold none or the budget runs out, so that a setting's
        # rank is that of its best launch the ascent finds, not of the launch the lever ascent met it at
        ascended = {start.launch.levers for start in starts}
        kept_layouts = 0
        while stopped is None:
            layouts: dict[Any, Outcome] = {}
            for o in sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s):
                layouts.setdefault(o.launch.levers, o)
            fresh = next(
                (o for o in list(layouts.values())[: LAYOUTS_ASCENDED * top] if o.launch.levers not in ascended), None
            )
            if fresh is None:
                break
            ascended.add(fresh.launch.levers)
            before = len(outcomes) + len(refusals) + len(bounded)
            taken, stopped = _local_search(
                spaces[fresh.launch.levers], score, [fresh], known, budget - spent, progress, done=studied + spent
            )
            steps += taken
            spent += len(outcomes) + len(refusals) + len(bounded) - before
            kept_layouts += 1
            if stopped is not None:
                stopped_at = -1
        first = "the study's best" if study else "the best"
        # every count says what it counts: the study's trials repeat launches and fall outside the space, the job's
        # own launch is priced once, and the ascent's budget counts only launches not priced before
        search = (
            (
                f"coordinate ascent over the levers from the job's own launch ({moves} move(s) to a faster "
                f"launch one lever away; {seeded:,} launches bounded or simulated), then "
                if families
                else ""
            )
            + (
                f"optuna {shared.sampler} study {shared.name!r} on {shared.storage} ({shared.added:,} trials "
                f"added by {study_run.workers if study_run else 1} worker(s), seed {seed}; "
                f"{shared.trials_in_study:,} in the study over {len(space):,} candidates; its best launch priced "
                "here), "
                if shared is not None
                else f"optuna TPE, seed {seed}, {study} trials over {len(space):,} candidates ({studied - seeded:,} "
                "distinct launches priced: the others repeated one or fell outside the space), "
                if study
                else "(one distinct stage order: no study; --trials N runs one) "
            )
            + f"the job's own launch ({'priced before' if own_known else '1 more'}), then coordinate ascent "
            "(nearest launches first: schedule, micro-batch size, order, split) from "
            f"{first}, from the job's own launch"
            + (
                f" and from the best launch of each of the best {top} settings of the levers ({kept_layouts} more)"
                if kept_layouts
                else ""
            )
            + f": {steps} move(s) to a faster neighbour, {spent:,} new launches priced"
        )
        if stopped is not None:
            where = (
                f"one of the best {top} settings of the levers"
                if stopped_at < 0
                else "the job's own launch"
                if starts[stopped_at] is own
                else first
            )
            ran_out = (
                f"its budget of {budget:,} new launches ran out inside step {stopped.step}'s neighbourhood "
                f"scan (ascending from {where}): {stopped.scanned:,} of its {stopped.neighbours:,} "
                f"neighbours looked at ({stopped.scanned - stopped.known:,} priced new, {stopped.known:,} "
                "priced before)"
            )
            search += f"; {ran_out}"
            planner.notes.append(
                f"the coordinate ascent stopped: {ran_out} "
                f"(budget: {ascent_tasks or ASCENT_TASKS:,} simulated tasks at the job's own launch's "
                f"{_tasks(planner.spec):,} per iteration, or --trials if more): the best found, not "
                "proven best, and a pick whose layout (t, p, recomputation, SP, distributed optimizer) was not "
                "ascended from may be beaten in that layout; give more --trials, or keep a dimension "
                "(--keep-order, --keep-split, --keep-micro-batch, --schedule, --keep-levers)"
            )
    looked.stage = "done"
    looked.advance()  # the last count: every launch the plan says it looked at
    fitting = [o for o in outcomes.values() if o.fits and allowed(o.launch)]
    over_memory = sum(1 for o in outcomes.values() if not o.fits) + sum(
        1 for why in bounded.values() if why == "memory"
    )
    # best first; of launches that run the same (auto and the schedule it picks), the one naming the schedule;
    # launches of other levers (a recomputation, the distributed optimizer) are other launches, each ranked
    fitting.sort(key=lambda o: (-o.samples_per_s, o.launch.schedule == "auto", len(o.flags)))
    # on one stage the schedules order the same tasks alike where they price the same (one microbatch, or 1F1B,
    # GPipe and ZB-H1 at equal throughput and memory): one row, the schedule Megatron runs where it is one of them
    seen: dict[tuple, int] = {}
    unique: list[Outcome] = []
    for outcome in fitting:
        schedule: Any = outcome.resolved
        if len(outcome.layers_per_stage) == 1 and outcome.launch.chunks == 1:
            schedule = ("one stage", f"{outcome.samples_per_s:.9g}", f"{max(outcome.peak_memory_bytes):.9g}")
        same = (
            outcome.launch.levers,
            outcome.launch.order,
            outcome.layers_per_stage,
            schedule,
            outcome.launch.chunks,
            outcome.launch.micro_batch_size,
        )
        if same not in seen:
            seen[same] = len(unique)
            unique.append(outcome)
        elif outcome.resolved in MEGATRON_SCHEDULES and unique[seen[same]].resolved not in MEGATRON_SCHEDULES:
            unique[seen[same]] = outcome
    if perturbations is not None:
        head = [planner.perturbed_outcome(o, perturbations) for o in unique[: max(rerank, top)]]
        key = {
            "throughput": lambda o: -o.samples_per_s,
            "expected": lambda o: -o.expected_samples_per_s,
            "p5": lambda o: -o.p5_samples_per_s,
        }[rank_by]
        head.sort(key=lambda o: (key(o), len(o.flags)))
        unique = head
    if calibration is not None:  # where each shown launch lies outside the calibration runs (model.coverage)
        from hops_calib.model.coverage import extrapolations

        def checked(o: Outcome) -> Outcome:
            return replace(
                o, outside=tuple(e.sentence() for e in extrapolations(planner.priced(o.launch)[0], calibration))
            )

        unique = [checked(o) for o in unique[:top]] + unique[top:]
        megatron = next((o for o in unique if o.resolved in MEGATRON_SCHEDULES), None)
        megatron = checked(megatron) if megatron is not None else None
    else:
        megatron = next((o for o in unique if o.resolved in MEGATRON_SCHEDULES), None)
    try:
        current = planner.evaluate(planner.current())
        if perturbations is not None:
            current = planner.perturbed_outcome(current, perturbations)
    except Refusal:
        current = None
    notes = list(planner.notes)
    if study_run is not None and shared is None:
        notes.append(
            "--storage was not used: "
            + (
                f"the {total:,} launches were searched exhaustively (up to --exhaustive-limit)"
                if total <= exhaustive_limit
                else "the space has one distinct stage order, so no study ran (--trials N runs one)"
            )
        )
    notes += _context_parallel_caveat(model, unique[:top], sorted(set(planner.types.values())))
    refused: dict[str, int] = {}
    for reason in refusals.values():
        refused[reason] = refused.get(reason, 0) + 1
    if any(reason.startswith("no link") for reason in refused):
        notes.append(
            "orders with a hop no benchmark or declared link prices were left out (unpriced, not "
            "impossible): "
            + (
                f"declare the missing links in {planner.cluster.origin}"
                if planner.cluster is not None
                else "give --cluster (`hops-calib cluster` builds one from job directories) or declare the links"
            )
        )
    return JobPlan(
        job=str(job_dir),
        model=model.name,
        search=search,
        space=total,
        evaluated=len(outcomes) + len(refusals) + len(bounded),
        best=tuple(unique[:top]),
        current=current,
        refused=refused,
        over_memory=over_memory,
        rank_by=rank_by,
        notes=tuple(notes),
        auto_agreement=auto_rule_agreement(list(outcomes.values())),
        best_megatron=megatron,
        cluster=planner.cluster.named() if planner.cluster is not None else "",
        store=store,
        orders=space.orders_count(),
        simulated=len(outcomes),
        bounded=sum(1 for why in bounded.values() if why == "throughput"),
        headroom_bytes=dict(planner.headroom_bytes),
        capacity_bytes=dict(planner.capacity_bytes),
        any_runtime=any_runtime,
        study=None
        if shared is None
        else {
            "name": shared.name,
            "storage": shared.storage,
            "sampler": shared.sampler,
            "workers": study_run.workers if study_run is not None else 1,
            "trials_added": shared.added,
            "trials_in_study": shared.trials_in_study,
            "best_value_samples_per_s": shared.best_value,
        },
    )


def _precisions(planner: JobPlanner, precision: str | None, own: bool) -> tuple[bool, ...]:
    """The FP8 settings (True: Transformer Engine's FP8 GEMMs) a plan may pick under --precision: the job's own
    (None), bf16, fp8 (refused, exit 2, where the job cannot run FP8: `JobPlanner.fp8_refusal`), or any (both where
    FP8 can run, else the 16-bit launches with a note)."""
    if precision is None:
        return (own,)
    if precision == "bf16":
        return (False,)
    why = "" if own else planner.fp8_refusal()
    if precision == "fp8":
        if why:
            raise InputError(
                str(planner.job_dir),
                f"cannot run FP8: {why}",
                field="--precision",
                hint="plan it in bf16 (--precision bf16 or any)"
                + (", or on a device with FP8 tensor cores" if why.startswith("device type") else ""),
            )
        return (True,)
    if why:
        planner.notes.append(f"--precision any: FP8 not searched, {why}")
        return (own,)
    return (own, not own)


def throughput_band(specs: Sequence[Any], truths: Sequence[Any], model: Model) -> tuple[float, int]:
    """The model's mean absolute throughput error on calibration runs (their specs and measured metrics, the train
    split of a store), as a fraction, and the runs it averages: the uncertainty a predicted samples/s carries where
    nothing better says."""
    from hops_calib.model.predict import predict

    errors = []
    for spec, truth in zip(specs, truths):
        try:
            predicted = predict(spec, model).metrics.throughput_per_s
        except ValueError:
            continue
        if truth.throughput_per_s > 0:
            errors.append(abs(predicted - truth.throughput_per_s) / truth.throughput_per_s)
    return (sum(errors) / len(errors) if errors else 0.0), len(errors)


def _context_parallel_caveat(model: Model, best: Sequence[Outcome], device_types: Sequence[str]) -> list[str]:
    """A pick with cp > 1 is priced without its KV exchange where the model has no `context_parallel_comm` term
    and prices the layers by the roofline (`decoder_kernels` lists the ring itself:
    `model.layer_kernels._context_parallel_attention`): say so, since such a pick then ties with its cp = 1
    counterpart of the same tokens per GPU."""
    if not any(o.settings is not None and o.settings.cp > 1 for o in best):
        return []
    if not cp_exchange_unpriced(model, device_types):
        return []
    return [
        "context parallelism is priced without its KV exchange here: the shipped model has no context_parallel_comm "
        "term, since on every measured cp > 1 run (cp 2, s 8192) each exchange hides under its attention step and "
        "the loop could not judge it (ledger 186-187); a cp > 1 pick ties with the same tokens per GPU at cp 1, so "
        "read such ties as equal, or price the pick with the term (a copy of the model file with a "
        "[terms.context_parallel_comm] table added: `predict job DIR --model COPY`), which charges what outlasts "
        "each step"
    ]
