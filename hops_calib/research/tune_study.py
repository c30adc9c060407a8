"""Tune's study: the optuna storage (in memory, sqlite or any RDB URL), its samplers (TPE, or a scrambled Sobol
sequence that any number of workers share), creating or joining a study that records its problem, and running its
trials in one process or several. `hops_calib.research.tune` describes the whole tune."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from hops_calib.errors import InputError
from hops_calib.progress import warn
from hops_calib.research.tune_problem import TuneProblem, load_problem, objectives_of, store_dirs
from hops_calib.study import finished as _finished
from hops_calib.study import (
    joined_record,
    make_sampler,
    make_storage,
    run_processes,
    shares,
)
from hops_calib.study import quiet_optuna as _quiet_optuna

PROBLEM_ATTR = "hops_calib_tune"  # the study's record of its problem (TuneProblem.identity) and its sampler


def default_study_name(problem: TuneProblem) -> str:
    mode = ("" if problem.objective == "suite" else f"-{problem.objective}") + "".join(f"-{n}" for n in problem.only)
    return f"tune-{problem.term}{mode}-{problem.model.sha256[:8]}-{problem.suite.sha256[:8]}"


def open_study(
    problem: TuneProblem, storage, study_name: str, seed: int, sampler_kind: str = "tpe", joined_by_hand: bool = True
):
    """Create the study (enqueueing the current values as its first trial) or join it; check it is this problem's.
    The study records its sampler and seed; a process joining it uses that sampler (for `sobol`, the study's seed:
    the same sequence; for `tpe`, its own `seed`). `joined_by_hand`: refuse a join asking for another sampler
    (a worker `optimize` starts follows the study's)."""
    import optuna

    directions: list[Literal["minimize", "maximize"]] = ["minimize"] * len(problem.objectives)
    try:
        study = optuna.create_study(
            storage=storage, study_name=study_name, directions=directions, sampler=make_sampler(sampler_kind, seed)
        )
        # One attribute, written at once: a process joining a moment later sees all of it or none.
        study.set_user_attr(PROBLEM_ATTR, {**problem.identity(), "sampler": {"kind": sampler_kind, "seed": seed}})
        study.enqueue_trial(problem.start_values())
        return study
    except optuna.exceptions.DuplicatedStudyError:
        pass
    study = optuna.load_study(study_name=study_name, storage=storage, sampler=make_sampler("tpe", seed))
    recorded = joined_record(study, PROBLEM_ATTR, study_name, "tune")
    expected = problem.identity()
    differ = [key for key in expected if json.dumps(recorded.get(key)) != json.dumps(expected[key])]
    if differ:
        raise InputError(
            "--study",
            f"study {study_name!r} belongs to another problem: its "
            + ", ".join(f"{key} is {recorded.get(key)!r}, here {expected[key]!r}" for key in differ),
            field="study",
            hint="choose another --study name (the default one names the term, the model and the fixture set)",
        )
    kind, study_seed = study_sampler(recorded)
    if joined_by_hand and kind != sampler_kind:
        raise InputError(
            "--sampler",
            f"study {study_name!r} samples with {kind}; this process asks for {sampler_kind}",
            field="sampler",
            hint=f"join it with --sampler {kind}, or choose another --study name",
        )
    if kind == "sobol" or seed != study_seed:
        study = optuna.load_study(
            study_name=study_name, storage=storage, sampler=make_sampler(kind, study_seed if kind == "sobol" else seed)
        )
    return study


def study_sampler(recorded: dict[str, Any]) -> tuple[str, int]:
    """The sampler kind and seed a study records (a study from before the record: tpe)."""
    sampler = recorded.get("sampler") or {}
    return str(sampler.get("kind", "tpe")), int(sampler.get("seed", 0))


def objective(problem: TuneProblem) -> Callable:
    def run(trial) -> tuple[float | None, ...]:
        values = {
            p.name: trial.suggest_categorical(p.name, p.choices)
            if p.choices
            else trial.suggest_float(p.name, p.low, p.high, log=p.log)
            for p in problem.params
        }
        model = problem.model_with(values)
        score = problem.score(model)
        for name, value in score.to_dict().items():
            trial.set_user_attr(name, value)
        if problem.objective == "components":
            component = problem.component_mape(model)
            trial.set_user_attr("component_mape_pct", component)
            return (component,)
        return objectives_of(score, problem.objectives)

    return run


def run_worker(
    term: str,
    fixtures_dir: str | list[str],
    model_path: str | None,
    storage_url: str,
    study_name: str,
    trials: int,
    seed: int,
    objective_mode: str = "suite",
    only: tuple[str, ...] = (),
    sampler_kind: str = "tpe",
) -> None:
    """One worker process: join the study and run `trials` trials (the entry point of --workers)."""
    _quiet_optuna()
    try:
        problem = load_problem(term, fixtures_dir, model_path, objective_mode, only)
        study = open_study(problem, make_storage(storage_url), study_name, seed, sampler_kind, joined_by_hand=False)
        study.optimize(objective(problem), n_trials=trials)
    except InputError as error:
        warn(f"error: tune worker (seed {seed}): {error}")
        sys.exit(2)


def check_run(trials: int, workers: int, storage_url: str | None) -> None:
    if trials < 1 or workers < 1:
        raise InputError("tune", "--trials and --workers must be at least 1", field="trials")
    if workers > 1 and storage_url is None:
        raise InputError(
            "tune",
            f"--workers {workers} needs a storage the processes share",
            field="storage",
            hint="pass --storage sqlite:///tune.db (or an optuna RDB URL)",
        )


def optimize(
    problem: TuneProblem,
    *,
    trials: int,
    storage_url: str | None,
    study_name: str,
    workers: int,
    seed: int,
    fixtures_dir: Path | str | Sequence[Path | str],
    progress: Callable[[int, int], None] | None = None,
    sampler: str = "tpe",
):
    """Run `trials` trials on the study with `workers` processes; return the study (reloaded with every trial)."""
    import multiprocessing

    _quiet_optuna()
    check_run(trials, workers, storage_url)
    storage = make_storage(storage_url)
    study = open_study(problem, storage, study_name, seed, sampler)
    before = _finished(study)
    if workers == 1:
        callback = (lambda study_, trial: progress(_finished(study_) - before, trials)) if progress else None
        study.optimize(objective(problem), n_trials=trials, callbacks=[callback] if callback else None)
        return study
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no database connection crosses a fork
    processes = [
        context.Process(
            target=run_worker,
            args=(
                problem.term,
                store_dirs(fixtures_dir),
                str(problem.model_path),
                storage_url,
                study_name,
                share,
                seed + k,
                problem.objective,
                problem.only,
                sampler,
            ),
            daemon=True,
        )
        for k, share in enumerate(shares(trials, workers))
        if share
    ]
    run_processes(
        processes, (lambda: progress(_finished(study) - before, trials)) if progress else (lambda: None), "tune"
    )
    return study
