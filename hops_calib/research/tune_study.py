"""Tune's study: the optuna storage (in memory, sqlite or any RDB URL), its samplers (TPE, or a scrambled Sobol
sequence that any number of workers share), creating or joining a study that records its problem, and running its
trials in one process or several. `hops_calib.research.tune` describes the whole tune."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from hops_calib.errors import InputError
from hops_calib.progress import warn
from hops_calib.research.tune_problem import TuneProblem, load_problem, objectives_of, store_dirs

SQLITE_TIMEOUT_S = 60  # concurrent workers wait for sqlite's write lock instead of failing
PROBLEM_ATTR = "hops_calib_tune"  # the study's record of its problem (TuneProblem.identity) and its sampler
SAMPLERS = ("tpe", "sobol")
JOIN_WAIT_S = 30.0  # how long a joining process waits for the creating one to write that record


def default_study_name(problem: TuneProblem) -> str:
    mode = ("" if problem.objective == "suite" else f"-{problem.objective}") + "".join(f"-{n}" for n in problem.only)
    return f"tune-{problem.term}{mode}-{problem.model.sha256[:8]}-{problem.suite.sha256[:8]}"


def make_storage(url: str | None):
    """An optuna storage: in memory for None, else an RDB storage (sqlite waits for its write lock)."""
    import optuna

    if url is None:
        return optuna.storages.InMemoryStorage()
    from sqlalchemy.exc import DBAPIError

    engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    last_error: Exception | None = None
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except DBAPIError as error:  # processes starting together on a new sqlite file race to create its tables
            last_error = error
            time.sleep(0.2 * (attempt + 1))
        except Exception as error:  # noqa: BLE001 - a malformed URL or a missing driver: retrying cannot help
            last_error = error
            break
    raise InputError(
        "--storage",
        f"cannot open optuna storage {url!r}: {last_error}",
        field="storage",
        hint="use sqlite:///path/to/study.db locally, or an optuna RDB URL such as "
        "postgresql://user@host/db (its driver must be installed)",
    )


def shown_storage(url: str | None) -> str:
    """A storage URL as output and candidate files show it: its password hidden; "memory" for none."""
    if url is None:
        return "memory"
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL sqlalchemy parses: make_storage refuses it, naming it
        return url


def make_sampler(kind: str, seed: int):
    """The optuna sampler of `kind` (`SAMPLERS`) seeded with `seed`."""
    import optuna

    if kind not in SAMPLERS:
        raise InputError("tune", f"unknown sampler {kind!r}", field="sampler", hint=f"one of {', '.join(SAMPLERS)}")
    return optuna.samplers.TPESampler(seed=seed) if kind == "tpe" else sobol_sampler(seed)


def sobol_sampler(seed: int):
    """A sampler that gives trial number k the k-th point of one scrambled Sobol sequence over the study's
    parameters (in the order the trial asks for them; a log-scaled parameter uniform in its log), whatever process
    asks: so any number of workers sharing an RDB storage run the same trials as one does."""
    import math

    import optuna
    from scipy.stats import qmc  # type: ignore[import-untyped]  # (scipy ships no stubs)

    class SobolSampler(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self._points: dict[int, list[list[float]]] = {}  # dimension -> the sequence's points so far
            self._engines: dict[int, Any] = {}
            self.dimensions = 8  # enough for any term's parameters (a term has at most a handful)

        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def _point(self, number: int) -> list[float]:
            engine = self._engines.setdefault(self.dimensions, qmc.Sobol(d=self.dimensions, scramble=True, seed=seed))
            points = self._points.setdefault(self.dimensions, [])
            if number >= len(points):
                import warnings

                with warnings.catch_warnings():  # balance properties want powers of 2; any prefix is still fixed
                    warnings.simplefilter("ignore")
                    points.extend(engine.random(number + 1 - len(points)).tolist())
            return points[number]

        def sample_independent(self, study, trial, param_name, param_distribution):
            index = len(trial.distributions)  # the parameters in the order the trial asks for them
            if index >= self.dimensions:
                raise ValueError(f"the Sobol sampler draws at most {self.dimensions} parameters")
            u = self._point(trial.number)[index]
            if isinstance(param_distribution, optuna.distributions.CategoricalDistribution):
                choices = param_distribution.choices
                return choices[min(int(u * len(choices)), len(choices) - 1)]
            low, high = param_distribution.low, param_distribution.high
            if getattr(param_distribution, "log", False):
                return min(high, max(low, math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
            return min(high, max(low, low + u * (high - low)))

    return SobolSampler()


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
    deadline = time.monotonic() + JOIN_WAIT_S
    while PROBLEM_ATTR not in study.user_attrs and time.monotonic() < deadline:
        time.sleep(0.1)  # created a moment ago by a process that has not written its record yet
    recorded = study.user_attrs.get(PROBLEM_ATTR)
    if recorded is None:
        raise InputError(
            "--study",
            f"study {study_name!r} has no hops-calib tune record (user attribute "
            f"{PROBLEM_ATTR!r}); it was not created by `hops-calib tune`",
            field="study",
            hint="choose another --study name",
        )
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


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


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


def shares(trials: int, workers: int) -> list[int]:
    """Trials per worker, adding up to `trials`."""
    return [trials // workers + (1 if k < trials % workers else 0) for k in range(workers)]


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


def _finished(study) -> int:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


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
    for process in processes:
        process.start()
    try:
        while any(p.is_alive() for p in processes):
            if progress:
                progress(_finished(study) - before, trials)
            for process in processes:
                process.join(timeout=0.5)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        raise InputError(
            "tune",
            f"{len(failed)} of {len(processes)} worker processes failed (exit codes "
            f"{failed}); their messages are above",
            field="workers",
        )
    return study
