"""The planner's study on a storage other processes share (`plan job --storage URL`): the launch search's optuna
study (`launch_search.study_objective`) run by any number of workers, on one machine (`--workers K`) or several
(the same command with the same `--study NAME` and `--storage URL` on each), over optuna's RDB storage
(`hops_calib.study`: SQLite for one machine, PostgreSQL for several).

Every worker prices a trial's launch in full (`PlanSetting.pricer`: the memory bound, then the simulation; no
pruning by what the worker has seen so far), so a trial's value is a function of its launch alone. With the Sobol
sampler trial k is the k-th point whatever process runs it, so N trials run by 1 or 40 workers are the same N
launches with the same values, and the study's best launch, from which the planner ascends, is the same: the plan
equals one worker's. With TPE each trial learns from those finished before it, so the study depends on the
workers' timing. The study records what it plans (the job's spec, the model, the space, the sampler) and refuses
a worker whose differ."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress
from hops_calib.study import joined_record
from hops_calib.whatif.cluster import Cluster
from hops_calib.whatif.launch_pricing import JobPlanner, Outcome, Refusal
from hops_calib.whatif.launch_search import study_dimensions, study_launch, study_objective
from hops_calib.whatif.launch_space import Launch, Space

PLAN_ATTR = "hops_calib_plan"  # the study's record of what it plans (`PlanSetting.identity`) and its sampler


@dataclass(frozen=True)
class StudyRun:
    """Where and how the planner's study runs: an optuna storage URL (RDB), the study's name, the worker processes
    this command starts, and the sampler (`hops_calib.study.SAMPLERS`)."""

    storage_url: str
    study_name: str | None = None  # None: named by what it plans (`PlanSetting.default_name`)
    workers: int = 1
    sampler: str = "tpe"


@dataclass(frozen=True)
class PlanSetting:
    """What a worker needs to price the launches of one plan's study as the planning process does: the job, the
    model, the cluster, the memory each GPU may use, the searched space."""

    job_dir: str
    model: Model
    cluster: Cluster | None
    memory_bytes: dict[str, float] | None
    headroom_bytes: float | None
    space: Space
    spec_digest: str = field(default="", compare=False)

    def planner(self) -> JobPlanner:
        return JobPlanner(self.job_dir, self.model, self.cluster, self.memory_bytes, self.headroom_bytes)

    def identity(self) -> dict[str, Any]:
        """What two processes must agree on to share the study (JSON-comparable)."""
        space = asdict(self.space)
        return {
            "spec": self.spec_digest,
            "model": self.model.sha256,
            "cluster": None if self.cluster is None else _digest(repr(self.cluster)),
            "memory_bytes": self.memory_bytes,
            "headroom_bytes": self.headroom_bytes,
            "space": _digest(json.dumps(space, sort_keys=True, default=str)),
        }

    def default_name(self, sampler: str, seed: int) -> str:
        ident = _digest(json.dumps(self.identity(), sort_keys=True, default=str))[:10]
        return f"plan-{Path(self.job_dir).name}-{ident}-{sampler}-{seed}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def pricer(planner: JobPlanner) -> Callable[[Launch], Outcome | None]:
    """A launch priced in full, unpruned by what this process has seen: None when it cannot run or be priced or
    the memory bound says it does not fit (its value is then 0, as for any launch that does not fit)."""

    def price(launch: Launch) -> Outcome | None:
        try:
            if not planner.memory_fits(launch):
                return None
            return planner.evaluate(launch)
        except Refusal:
            return None

    return price


def open_plan_study(setting: PlanSetting, storage_url: str, study_name: str, sampler: str, seed: int):
    """Create the study (recording what it plans and its sampler) or join it, checking it plans the same."""
    import optuna

    from hops_calib.study import make_sampler, make_storage

    storage = make_storage(storage_url)
    dimensions = study_dimensions(setting.space)
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=study_name,
            direction="maximize",
            sampler=make_sampler(sampler, seed, dimensions),
        )
        study.set_user_attr(PLAN_ATTR, {**setting.identity(), "sampler": {"kind": sampler, "seed": seed}})
        return study
    except optuna.exceptions.DuplicatedStudyError:
        pass
    study = optuna.load_study(study_name=study_name, storage=storage)
    recorded = joined_record(study, PLAN_ATTR, study_name, "plan job")
    expected = setting.identity()
    differ = [k for k in expected if json.dumps(recorded.get(k), default=str) != json.dumps(expected[k], default=str)]
    if differ:
        raise InputError(
            "--study",
            f"study {study_name!r} plans something else: its {', '.join(differ)} differ from this plan's",
            field="study",
            hint="choose another --study name (the default names the job and what is planned), or plan the same "
            "job with the same model, cluster, memory and search options",
        )
    kind = str((recorded.get("sampler") or {}).get("kind", "tpe"))
    study_seed = int((recorded.get("sampler") or {}).get("seed", 0))
    if kind != sampler:
        raise InputError(
            "--sampler",
            f"study {study_name!r} samples with {kind}; this process asks for {sampler}",
            field="sampler",
            hint=f"join it with --sampler {kind}, or choose another --study name",
        )
    return optuna.load_study(
        study_name=study_name,
        storage=storage,
        sampler=make_sampler(kind, study_seed if kind == "sobol" else seed, dimensions),
    )


def run_worker(setting: PlanSetting, storage_url: str, study_name: str, sampler: str, seed: int, trials: int) -> None:
    """One worker process (the entry point of --workers): join the study and price `trials` of its launches."""
    import sys

    from hops_calib.progress import warn
    from hops_calib.study import quiet_optuna

    quiet_optuna()
    try:
        study = open_plan_study(setting, storage_url, study_name, sampler, seed)
        study.optimize(study_objective(setting.space, pricer(setting.planner()), QUIET), n_trials=trials)
    except InputError as error:
        warn(f"error: plan worker (seed {seed}): {error}")
        sys.exit(2)


@dataclass(frozen=True)
class StudyResult:
    """The shared study after this command's trials: its name, the storage shown without a password, the trials it
    holds (complete), those this command added, and its best launch (None: no trial's launch fits)."""

    name: str
    storage: str
    sampler: str
    trials_in_study: int
    added: int
    best: Launch | None
    best_value: float


def run_study(setting: PlanSetting, run: StudyRun, trials: int, seed: int, progress: Progress = QUIET) -> StudyResult:
    """Run `trials` trials of the plan's study on `run.storage_url` with `run.workers` processes (this one alone for
    1), then read the whole study: its best launch, the lowest trial number first among equal values."""
    import multiprocessing

    import optuna

    from hops_calib.study import finished, quiet_optuna, run_processes, shares, shown_storage

    if run.workers < 1:
        raise InputError("plan", "--workers must be at least 1", field="--workers")
    quiet_optuna()
    name = run.study_name or setting.default_name(run.sampler, seed)
    study = open_plan_study(setting, run.storage_url, name, run.sampler, seed)
    before = finished(study)
    progress.start(trials)
    if run.workers == 1:
        study.optimize(
            study_objective(setting.space, pricer(setting.planner()), progress),
            n_trials=trials,
        )
    else:
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no database connection crosses a fork
        processes = [
            context.Process(
                target=run_worker,
                args=(setting, run.storage_url, name, run.sampler, seed + k, share),
                daemon=True,
            )
            for k, share in enumerate(shares(trials, run.workers))
            if share
        ]
        run_processes(processes, lambda: progress.update(finished(study) - before, trials), "plan")
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    ranked = sorted((t for t in complete if (t.value or 0.0) > 0.0), key=lambda t: (-(t.value or 0.0), t.number))
    best = study_launch(setting.space, ranked[0].params) if ranked else None
    return StudyResult(
        name=name,
        storage=shown_storage(run.storage_url),
        sampler=run.sampler,
        trials_in_study=len(complete),
        added=finished(study) - before,
        best=best,
        best_value=ranked[0].value or 0.0 if ranked else 0.0,
    )


def study_setting(
    planner: JobPlanner,
    space: Space,
    cluster: Cluster | None,
    memory_bytes: dict[str, float] | None,
    headroom_bytes: float | None,
) -> PlanSetting:
    """The setting of `planner`'s study over `space` (the spec's digest from its arguments)."""
    digest = _digest(json.dumps(asdict(planner.spec), sort_keys=True, default=str))
    return PlanSetting(
        str(planner.job_dir), planner.model, cluster, memory_bytes, headroom_bytes, space, spec_digest=digest
    )


__all__: Sequence[str] = (
    "PLAN_ATTR",
    "PlanSetting",
    "StudyResult",
    "StudyRun",
    "TrialsProgress",
    "open_plan_study",
    "pricer",
    "run_study",
    "run_worker",
    "study_setting",
)


class TrialsProgress:
    """A shared study's progress on `inner`: the trials this command's workers finished, named by `stage` (the
    planner's own count of launches cannot see what other processes price)."""

    def __init__(self, inner: Progress, stage: str) -> None:
        self.inner, self.stage = inner, stage

    def start(self, total: int) -> None:
        self.total, self.done = total, 0
        self.inner.update(0, total, self.stage)

    def advance(self, what: str = "") -> None:
        self.done += 1
        self.inner.update(self.done, self.total, self.stage)

    def update(self, completed: int, total: int, what: str = "") -> None:
        self.inner.update(completed, total, self.stage)
