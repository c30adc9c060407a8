"""Tune: an optuna study over the parameters of one cost term, on the train split only, ending in a candidate file.

The search space is the term's `Param` bounds (log scale where the parameter
says so). A term the model does not activate is tuned as if added with the
sampled values. Each trial predicts every train fixture from its spec (loaded
once: spec and truth metrics, no events) and scores it with the loop's own
scoring, so a trial's numbers are those `evaluate` would print. Three
objectives, all minimized: throughput MAPE (window, %), bubble MAE (pp) and the
negative mean utilization rho.

The chosen point: the Pareto-front trials are ordered by throughput MAPE (ties:
bubble MAE, then higher rho, then the earlier trial), and the first one that
beats the current model on the gate's criteria is chosen: the gate accepts it
(default tolerances: no suite aggregate worse, no run's error grown by more than
the per-run allowance) and it improves at least one suite aggregate. When none
does, no candidate is written, and the output gives the gate's reasons against
the lowest-MAPE point. The chosen point is written as a one-term candidate (action "set" for an active
term, "add" otherwise) whose hypothesis and grounding are marked FILL IN: the
tuner found the values, a person or agent still has to say why they are
physically plausible, and the candidate must still pass `hops-calib evaluate`.

Objective `components` (`--objective components`) instead minimizes one number,
the share of measured time the model misprices among the quantities each trace
measures directly (per-stage forward, backward and optimizer medians, the silent stretch
and the rest of the iteration; `hops_calib.research.components`) against the costs the
model prices for them. A term is then fitted to the times it is about, not used
to soak up another term's error in the end-to-end throughput; the front is the
ten best trials by that error, the suite scores are still recorded, and the
choice still prefers a point the gate accepts. A term that prices each kernel
(`decoder_kernels`) is fitted, on the train runs that carry kernel truth (a
profiler trace's kernel times, `Truth.kernels`), to those kernels' times by class
(`hops_calib.research.kernel_truth`): GEMM parameters to GEMM kernels, not to
iteration totals; the other runs keep their components.

Storage: none keeps the study in memory (one process); `sqlite:///FILE` or any
optuna RDB URL (postgresql://, mysql://) lets several processes, here or on
other machines, work on one study. `--workers K` runs K processes on it, each
with its share of the trials. A study remembers its term, parameter space, base
model, fixture set and sampler, and refuses to be continued with different ones.

Samplers (`--sampler`): `tpe` (default) learns from the trials so far, so what a
worker tries depends on which trials the others finished first: each worker has its
own seed (seed + k; processes started by hand on one study should be given
different seeds, or their random start-up trials repeat), and the study is not
reproducible across worker counts. `sobol` draws trial k's values from the
study's scrambled Sobol sequence (its seed, recorded in the study): trial numbers
are unique in an RDB storage (optuna assigns them under a row lock), so N trials
run by any number of workers, on any machines, are the same N points as one
worker's, and the study, its front and the chosen candidate are the same.
docs/distributed-tuning.md says how to point workers at one PostgreSQL database.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hops_calib.errors import InputError
from hops_calib.loop.candidate import PLACEHOLDER
from hops_calib.loop.model_files import DEFAULT_MODEL, default_model
from hops_calib.loop.score import SuiteScore
from hops_calib.loop.suite import Suite, load_suites, score_model
from hops_calib.model import TERMS, Model, resolve_params, unknown_device_overrides
from hops_calib.progress import warn

OBJECTIVES = ("throughput_mape_pct", "bubble_mae_pp", "negative_util_spearman_mean")
COMPONENT_OBJECTIVES = ("component_mape_pct",)
OBJECTIVE_MODES = ("suite", "components")
KERNEL_TERMS = ("decoder_kernels",)  # terms that price each kernel: components mode fits them to kernel truth
COMPONENT_FRONT = 10  # trials shown and considered in components mode
DEFAULT_TRIALS = 60
SQLITE_TIMEOUT_S = 60  # concurrent workers wait for sqlite's write lock instead of failing
PROBLEM_ATTR = "hops_calib_tune"  # the study's record of its problem (TuneProblem.identity) and its sampler
SAMPLERS = ("tpe", "sobol")
JOIN_WAIT_S = 30.0  # how long a joining process waits for the creating one to write that record
CHOICE_RULE = ("the lowest-MAPE Pareto point (ties: bubble MAE, then higher rho) that beats the current model on the "
               "gate's criteria: the gate accepts it with default tolerances and it improves at least one suite "
               "aggregate; no candidate when none does")


@dataclass(frozen=True)
class TuneProblem:
    """What every trial of a study evaluates: one term's space, the base model, the train fixtures."""

    term: str
    model: Model
    model_path: Path
    suite: Suite
    objective: str = "suite"
    real_components: tuple = ()  # hops_calib.research.components.Components per fixture, in components mode
    # hops_calib.research.kernel_truth.RunKernels per fixture (None without kernel truth), in components mode for a
    # term that prices kernels (KERNEL_TERMS)
    real_kernels: tuple = ()
    only: tuple[str, ...] = ()  # search only these parameters (the others keep the model's values); () = all

    @property
    def objectives(self) -> tuple[str, ...]:
        """What the study minimizes. A suite without a run that has events (runs measured at iteration level) has
        no bubble or utilization to score: its one objective is the throughput MAPE."""
        if self.objective == "components":
            return COMPONENT_OBJECTIVES
        return OBJECTIVES if any(self.suite.has_events) else OBJECTIVES[:1]

    @property
    def kernel_runs(self) -> int:
        """Train runs whose kernel truth the components objective fits (a term of KERNEL_TERMS only)."""
        return sum(real is not None for real in self.real_kernels) if self.term in KERNEL_TERMS else 0

    def component_mape(self, model: Model) -> float:
        """Mean over runs of the share of measured time the model misprices: of a run with kernel truth, when the
        term prices kernels, its kernels' time (`kernel_truth.mispriced_kernel_share`); of the others, their
        components' (`components.mispriced_time_pct`)."""
        from hops_calib.research.components import mispriced_time_pct, predicted_components
        from hops_calib.research.kernel_truth import mispriced_kernel_share, predicted_kernels

        kernels = self.real_kernels if self.kernel_runs else (None,) * len(self.real_components)
        shares: list[float | None] = []
        for spec, real, measured in zip(self.suite.specs, self.real_components, kernels):
            if measured is not None:
                shares.append(mispriced_kernel_share(measured, predicted_kernels(model, spec)))
            elif real.values:  # a run that measured components (not one measured per iteration)
                predicted = predicted_components(model.pipeline(spec), spec.schedule)
                shares.append(mispriced_time_pct([real], [predicted], [spec.microbatches], [spec.pp]))
        finite = [s for s in shares if s is not None and math.isfinite(s)]
        return sum(finite) / len(finite) if finite else float("nan")

    @property
    def params(self):
        term = TERMS[self.term]
        return tuple(term.param(name) for name in self.only) if self.only else term.params

    def space(self) -> list[list[Any]]:
        return [[p.name, p.low, p.high, bool(p.log)] + ([list(p.choices)] if p.choices else []) for p in self.params]

    def identity(self) -> dict[str, Any]:
        """What a study records about itself, and must match when continued."""
        return {"term": self.term, "space": self.space(), "model_sha256": self.model.sha256,
                "fixture_set_sha256": self.suite.sha256, "objective": self.objective,
                "objectives": list(self.objectives),
                **({"kernel_truth_runs": self.kernel_runs} if self.kernel_runs else {})}

    def model_with(self, values: dict[str, float]) -> Model:
        base = self.model.active(self.term)
        return self.model.with_term(resolve_params(self.term, values, origin=f"tune {self.term}",
                                                   base=base.params() if base else None))

    def score(self, model: Model) -> SuiteScore:
        return score_model(self.suite, model, origin=f"tune {self.term}").suite

    def start_values(self) -> dict[str, float]:
        """The term's current values in the model, or its defaults: the first trial of a new study."""
        return term_values(self.model, self.term, [p.name for p in self.params])


def term_values(model: Model | None, term: str, names: list[str]) -> dict[str, float]:
    """Each named parameter of `term` as `model` has it (a NAME@TYPE without its own value takes NAME's), or the
    term's defaults where the model does not activate the term or no model is given."""
    active = model.active(term) if model is not None else None
    values = active.params() if active else TERMS[term].defaults()
    return {name: values.get(name, values[name.partition("@")[0]]) for name in names}


def objectives_of(score: SuiteScore, objectives: tuple[str, ...] = OBJECTIVES) -> tuple[float | None, ...]:
    """The suite's value of each objective: None for one it cannot score (no run with events), which the study is
    never asked to minimize (`TuneProblem.objectives`)."""
    values = {"throughput_mape_pct": score.throughput_mape_pct, "bubble_mae_pp": score.bubble_mae_pp,
              "negative_util_spearman_mean": None if score.util_spearman_mean is None else -score.util_spearman_mean}
    return tuple(values[name] for name in objectives)


def _number(value: float | None, digits: int) -> str:
    """A suite aggregate as printed: 'n/a' where no run has the metric (iteration-level runs: bubble, rho)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def store_dirs(fixtures_dir: Path | str | Sequence[Path | str]) -> list[str]:
    """The store(s) of a --fixtures given once or repeated, as strings (a worker process's arguments)."""
    return [str(fixtures_dir)] if isinstance(fixtures_dir, (str, Path)) else [str(d) for d in fixtures_dir]


def load_problem(term: str, fixtures_dir: Path | str | Sequence[Path | str], model_path: Path | str | None,
                 objective: str = "suite", only: tuple[str, ...] = (), command: str = "tune") -> TuneProblem:
    from hops_calib.loop.model_files import load_model

    if term not in TERMS:
        raise InputError(command, f"unknown term {term!r}", field="TERM",
                         hint=f"terms implemented in hops_calib.model.terms: {', '.join(sorted(TERMS))} "
                              "(`hops-calib terms` lists them with their parameters)")
    if not TERMS[term].params:
        raise InputError(command, f"term {term!r} has no parameters to tune", field="TERM",
                         hint="it is a measurement-driven term; tune a term that has parameters (`hops-calib terms`)")
    unknown = []
    for name in only:
        try:
            TERMS[term].param(name)
        except KeyError:
            unknown.append(name)
    if unknown:
        per_device = [p.name for p in TERMS[term].params if p.per_device]
        raise InputError(command, f"term {term!r} has no parameter {', '.join(map(repr, unknown))}", field="only",
                         hint=f"its parameters: {', '.join(p.name for p in TERMS[term].params)}"
                              + (f"; per device type (NAME@TYPE): {', '.join(per_device)}" if per_device else ""))
    if objective not in OBJECTIVE_MODES:
        raise InputError(command, f"unknown objective {objective!r}", field="objective",
                         hint=f"choose one of {', '.join(OBJECTIVE_MODES)}")
    model_path = Path(model_path) if model_path is not None else default_model()
    suite = load_suites(fixtures_dir, "train")
    reals: tuple = ()
    kernels: tuple = ()
    if objective == "components":
        from hops_calib.loop.suite import open_store
        from hops_calib.research.components import real_components
        from hops_calib.research.kernel_truth import measured_kernels

        loaded = [store.load(fixture_id) for part in suite.stores
                  for store in (open_store(part.fixtures_dir),) for fixture_id in part.ids]
        reals = tuple(real_components(fixture) for fixture in loaded)
        kernels = tuple(measured_kernels(fixture) for fixture in loaded) if term in KERNEL_TERMS else ()
    model = load_model(model_path)
    known = {d.type for d in model.devices}
    strangers = unknown_device_overrides(only, known)
    if strangers:
        raise InputError(command, f"{', '.join(map(repr, strangers))} names a device type the model does not know "
                         f"(known: {', '.join(sorted(known))})", field="only",
                         hint="a per-device parameter (NAME@TYPE) takes a device type of the model: a value for no "
                              "device changes nothing to search")
    return TuneProblem(term=term, model=model, model_path=model_path, suite=suite,
                       objective=objective, real_components=reals, real_kernels=kernels,
                       only=tuple(only))


# --- the study ------------------------------------------------------------------------------------

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
    raise InputError("--storage", f"cannot open optuna storage {url!r}: {last_error}", field="storage",
                     hint="use sqlite:///path/to/study.db locally, or an optuna RDB URL such as "
                          "postgresql://user@host/db (its driver must be installed)")


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
            engine = self._engines.setdefault(self.dimensions, qmc.Sobol(d=self.dimensions, scramble=True,
                                                                          seed=seed))
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


def open_study(problem: TuneProblem, storage, study_name: str, seed: int, sampler_kind: str = "tpe",
               joined_by_hand: bool = True):
    """Create the study (enqueueing the current values as its first trial) or join it; check it is this problem's.
    The study records its sampler and seed; a process joining it uses that sampler (for `sobol`, the study's seed:
    the same sequence; for `tpe`, its own `seed`). `joined_by_hand`: refuse a join asking for another sampler
    (a worker `optimize` starts follows the study's)."""
    import optuna

    directions: list[Literal["minimize", "maximize"]] = ["minimize"] * len(problem.objectives)
    try:
        study = optuna.create_study(storage=storage, study_name=study_name, directions=directions,
                                    sampler=make_sampler(sampler_kind, seed))
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
        raise InputError("--study", f"study {study_name!r} has no hops-calib tune record (user attribute "
                         f"{PROBLEM_ATTR!r}); it was not created by `hops-calib tune`", field="study",
                         hint="choose another --study name")
    expected = problem.identity()
    differ = [key for key in expected if json.dumps(recorded.get(key)) != json.dumps(expected[key])]
    if differ:
        raise InputError("--study", f"study {study_name!r} belongs to another problem: its "
                         + ", ".join(f"{key} is {recorded.get(key)!r}, here {expected[key]!r}" for key in differ),
                         field="study", hint="choose another --study name (the default one names the term, the "
                                             "model and the fixture set)")
    kind, study_seed = study_sampler(recorded)
    if joined_by_hand and kind != sampler_kind:
        raise InputError("--sampler", f"study {study_name!r} samples with {kind}; this process asks for "
                         f"{sampler_kind}", field="sampler", hint=f"join it with --sampler {kind}, or choose "
                                                                  "another --study name")
    if kind == "sobol" or seed != study_seed:
        study = optuna.load_study(study_name=study_name, storage=storage,
                                  sampler=make_sampler(kind, study_seed if kind == "sobol" else seed))
    return study


def study_sampler(recorded: dict[str, Any]) -> tuple[str, int]:
    """The sampler kind and seed a study records (a study from before the record: tpe)."""
    sampler = recorded.get("sampler") or {}
    return str(sampler.get("kind", "tpe")), int(sampler.get("seed", 0))


def objective(problem: TuneProblem) -> Callable:
    def run(trial) -> tuple[float | None, ...]:
        values = {p.name: trial.suggest_categorical(p.name, p.choices) if p.choices
                  else trial.suggest_float(p.name, p.low, p.high, log=p.log) for p in problem.params}
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


def run_worker(term: str, fixtures_dir: str | list[str], model_path: str | None, storage_url: str, study_name: str,
               trials: int, seed: int, objective_mode: str = "suite", only: tuple[str, ...] = (),
               sampler_kind: str = "tpe") -> None:
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
        raise InputError("tune", f"--workers {workers} needs a storage the processes share", field="storage",
                         hint="pass --storage sqlite:///tune.db (or an optuna RDB URL)")


def _finished(study) -> int:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


def optimize(problem: TuneProblem, *, trials: int, storage_url: str | None, study_name: str, workers: int,
             seed: int, fixtures_dir: Path | str | Sequence[Path | str],
             progress: Callable[[int, int], None] | None = None, sampler: str = "tpe"):
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
    processes = [context.Process(target=run_worker, args=(problem.term, store_dirs(fixtures_dir),
                                                          str(problem.model_path), storage_url, study_name, share,
                                                          seed + k, problem.objective, problem.only, sampler),
                                       daemon=True)
                 for k, share in enumerate(shares(trials, workers)) if share]
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
        raise InputError("tune", f"{len(failed)} of {len(processes)} worker processes failed (exit codes "
                         f"{failed}); their messages are above", field="workers")
    return study


# --- the result -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FrontPoint:
    number: int
    params: dict[str, float]
    score: dict[str, float]  # the SuiteScore of the trial

    def key(self) -> tuple[float, ...]:
        """The front's order: lowest component error (components mode), then lowest MAPE, then lowest bubble MAE,
        then highest rho, then the earliest trial."""
        s = self.score
        return (s.get("component_mape_pct", 0.0), s["throughput_mape_pct"], s["bubble_mae_pp"] or 0.0,
                -(s["util_spearman_mean"] or 0.0), self.number)


def beats(verdict, before: SuiteScore, after: SuiteScore) -> bool:
    """Whether a point beats the current model on the gate's criteria: accepted, and some suite aggregate better."""
    def better(a: float | None, b: float | None, lower: bool = True) -> bool:
        return a is not None and b is not None and (a < b if lower else a > b)

    return verdict.accepted and (after.throughput_mape_pct < before.throughput_mape_pct
                                 or better(after.bubble_mae_pp, before.bubble_mae_pp)
                                 or better(after.util_spearman_mean, before.util_spearman_mean, lower=False))


def choose(problem: TuneProblem, front: list[FrontPoint], before) -> tuple[FrontPoint | None, Any]:
    """The first point of the (ordered) front that beats the current model (`before`, its ModelScore) on the
    gate's criteria (`beats`). Returns it and the gate's verdict on it; when none does, None and the verdict on
    the first point that changes the model (None when every point of the front is the current model).
    """
    from hops_calib.loop.evaluate import judge
    from hops_calib.loop.gate import Tolerances

    changes = [p for p in front if problem.model_with(p.params).sha256 != problem.model.sha256]
    verdicts = []
    for point in changes:
        after = score_model(problem.suite, problem.model_with(point.params), origin=f"tune {problem.term}")
        verdict = judge(problem.suite, before, after, Tolerances())
        if beats(verdict, before.suite, after.suite):
            return point, verdict
        verdicts.append(verdict)
    return None, (verdicts[0] if verdicts else None)


def all_trials(study) -> list[dict[str, Any]]:
    """Every trial of the study: number, state, parameters, objective values and suite scores (tune --json)."""
    keys = list(SuiteScore.__dataclass_fields__) + ["component_mape_pct"]
    return [{"number": t.number, "state": t.state.name, "params": dict(t.params),
             "objectives": list(t.values) if t.values is not None else None,
             "score": {k: t.user_attrs[k] for k in keys if k in t.user_attrs}}
            for t in study.get_trials(deepcopy=False)]


def pareto_front(study) -> list[FrontPoint]:
    """The Pareto front (suite mode), or the COMPONENT_FRONT best trials by component error (components mode)."""
    import optuna

    keys = list(SuiteScore.__dataclass_fields__)
    if len(study.directions) == 1:  # components mode, or a suite whose one objective is the throughput MAPE
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        trials = sorted(done, key=lambda t: (t.values[0], t.number))[:COMPONENT_FRONT]
        if (study.user_attrs.get(PROBLEM_ATTR) or {}).get("objective") == "components":
            keys.append("component_mape_pct")
    else:
        trials = study.best_trials
    points = [FrontPoint(number=t.number, params=dict(t.params), score={k: t.user_attrs[k] for k in keys})
              for t in trials]
    return sorted(points, key=FrontPoint.key)


NO_CANDIDATE = ("every point of the front is the model's current values: no trial did better on every objective; "
                "more --trials, or --only the parameters to search")
NO_WINNER = ("no point of the front beats the current model on the gate's criteria (accepted, and some suite "
             "aggregate better); more --trials, or --only the parameters to search")


@dataclass(frozen=True)
class TuneResult:
    term: str
    fixtures_dir: Path
    study_name: str
    storage: str
    trials_here: int
    trials_in_study: int
    workers: int
    current: SuiteScore
    front: tuple[FrontPoint, ...]
    chosen: FrontPoint | None  # None when no point of the front beats the current model (`beats`)
    # hops_calib.loop.gate.GateResult of the chosen point against the current model; without a chosen point, of the
    # lowest-MAPE point that changes the model (None when none does)
    verdict: Any
    candidate_path: Path | None
    candidate_text: str | None
    objective: str = "suite"
    model_path: Path = DEFAULT_MODEL  # the model tuned (a candidate is judged against it)
    left_out: dict[str, Any] | None = None  # the train runs the model does not price (`Suite.left_out_summary`)
    trials: tuple[dict[str, Any], ...] = ()  # every trial of the study (`all_trials`)
    calibration: Any = None  # hops_calib.loop.calibration.Check of the store tuned on
    warnings: tuple[str, ...] = ()
    fixtures_dirs: tuple[str, ...] = ()  # every store tuned on (--fixtures repeated); () for `fixtures_dir` alone

    @property
    def objectives(self) -> tuple[str, ...]:
        if self.objective == "components":
            return COMPONENT_OBJECTIVES
        return OBJECTIVES if self.current.bubble_mae_pp is not None else OBJECTIVES[:1]

    @property
    def status(self) -> str:
        """candidate_written, or no_candidate (exit 1: no trial beats the model on the gate's criteria)."""
        return "candidate_written" if self.candidate_path is not None else "no_candidate"

    @property
    def exit_code(self) -> int:
        return 0 if self.candidate_path is not None else 1

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "term": self.term, "study": self.study_name, "storage": self.storage,
                "fixtures": list(self.fixtures_dirs) if len(self.fixtures_dirs) > 1 else str(self.fixtures_dir),
                "model": str(self.model_path), "warnings": list(self.warnings),
                "calibration": self.calibration.to_dict() if self.calibration is not None else None,
                "trials": list(self.trials),
                "trials_here": self.trials_here, "trials_in_study": self.trials_in_study, "workers": self.workers,
                "objective": self.objective, "objectives": list(self.objectives), "current": self.current.to_dict(),
                "front": [vars(p) for p in self.front], "chosen": vars(self.chosen) if self.chosen else None,
                "choice_rule": CHOICE_RULE, "chosen_gate": self.verdict.to_dict() if self.verdict else None,
                "candidate": str(self.candidate_path) if self.candidate_path else None,
                "no_candidate_reason": self.no_candidate_reason,
                "left_out": self.left_out or {"count": 0, "reasons": []}}

    @property
    def no_candidate_reason(self) -> str | None:
        if self.chosen is not None:
            return None
        return NO_CANDIDATE if self.verdict is None else NO_WINNER


def evaluate_command(candidate: Path | str, fixtures_dir: Path | str | Sequence[Path | str], model_path: Path) -> str:
    """The command that judges a tuned candidate against the model it was tuned on (on every store it was tuned on)."""
    return (f"hops-calib evaluate {candidate} " + " ".join(f"--fixtures {d}" for d in store_dirs(fixtures_dir))
            + ("" if model_path == default_model() else f" --model {model_path}"))


def _moves(before: float, after: float, digits: int) -> str:
    """The verb for a change of a quantity as printed with `digits` decimals: lowers, holds or raises."""
    before, after = round(before, digits), round(after, digits)
    return "lowers" if after < before else "raises" if after > before else "holds"


def candidate_text(problem: TuneProblem, chosen: FrontPoint, current: SuiteScore, study_name: str,
                   storage: str, trials_in_study: int, front_size: int, candidate_id: str | None = None) -> str:
    """A one-term candidate setting the chosen values, with hypothesis and grounding marked FILL IN."""
    import inspect

    term = TERMS[problem.term]
    action = "set" if problem.model.active(problem.term) else "add"
    after = chosen.score
    how = ("mispricing the stage, optimizer and between-iteration times the traces measure by "
           f"{chosen.score['component_mape_pct']:.2f} % of their time; " if problem.objective == "components" else "")
    physics = " ".join((inspect.getdoc(type(term)) or "").split())
    hypothesis = (f"{PLACEHOLDER} why: {'setting' if action == 'set' else 'adding'} {problem.term} with the values tuned "
                  f"on the train split ({how}objective {problem.objective}) "
                  f"{_moves(current.throughput_mape_pct, after['throughput_mape_pct'], 2)} throughput MAPE "
                  f"{current.throughput_mape_pct:.2f} -> {after['throughput_mape_pct']:.2f} % (bubble MAE "
                  f"{_number(current.bubble_mae_pp, 2)} -> {_number(after['bubble_mae_pp'], 2)} pp, mean rho "
                  f"{_number(current.util_spearman_mean, 3)} -> {_number(after['util_spearman_mean'], 3)})")
    grounding = f"{PLACEHOLDER} why these values are physically plausible. The term's physics: {physics}"
    params = ", ".join(f"{json.dumps(p.name) if '@' in p.name else p.name} = {chosen.params[p.name]!r}"
                       for p in problem.params)
    # json.dumps of a str is a valid TOML basic string (ASCII escapes only).
    lines = [
        f"# Written by `hops-calib tune {problem.term}`: study {study_name!r} in {storage}, {trials_in_study} trials.",
        f"# Trial {chosen.number} of a front of {front_size} (objectives: {', '.join(problem.objectives)}),",
        f"# chosen as {CHOICE_RULE}.",
        f"# Replace both {PLACEHOLDER} texts with the physical reason before evaluating it (evaluate refuses them):",
        f"#   {evaluate_command('<this file>', [p.fixtures_dir for p in problem.suite.stores], problem.model_path)}",
        f"id = {json.dumps(candidate_id or f'tune-{problem.term}-trial{chosen.number}')}",
        f"hypothesis = {json.dumps(hypothesis)}",
        f"grounding = {json.dumps(grounding)}",
        'author = "hops-calib tune"',
        f"notes = {json.dumps(f'model {problem.model.sha256[:12]}, fixture set {problem.suite.sha256[:12]}')}",
        "expected = { " + ", ".join(f"{k} = {after[k]!r}" for k in ("throughput_mape_pct", "bubble_mae_pp",
                                                                     "util_spearman_mean")
                                    if after[k] is not None) + " }",
        "",
        "[change]",
        f'action = "{action}"',
        f'term = "{problem.term}"',
        f"params = {{ {params} }}",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class TuneRequest:
    """What one tune is asked (the `tune` verb's options, built once by the command layer; `tune`'s keywords):
    the term whose parameters are searched, the store(s) of the train split it is judged on, the model, the study
    (trials, storage, name, workers, sampler and its seed), what is searched (objective, only these parameters),
    where the candidate is written, and the ledger's record it is checked against (unless off the record)."""

    term: str
    fixtures_dir: Path | str | Sequence[Path | str]
    model_path: Path | str | None = None
    trials: int = DEFAULT_TRIALS
    storage_url: str | None = None
    study_name: str | None = None
    workers: int = 1
    seed: int = 0
    out: Path | str | None = None
    objective: str = "suite"
    only: tuple[str, ...] = ()
    ledger_path: Path | str | None = None
    off_record: bool = False
    split: str = "train"
    sampler: str = "tpe"


def tune(term: str, fixtures_dir: Path | str | Sequence[Path | str], *,
         progress: Callable[[int, int], None] | None = None, **options: Any) -> TuneResult:
    """`run_tune` of TuneRequest(term, fixtures_dir, **options)."""
    return run_tune(TuneRequest(term, fixtures_dir, **options), progress=progress)


def run_tune(request: TuneRequest, progress: Callable[[int, int], None] | None = None) -> TuneResult:
    """Tune one term's parameters on the train split (a `split` other than train is refused, as by every verb but
    `report`) and write the chosen point as a candidate file (named by its
    id: experiments/ID.toml, or --out whose stem becomes the id).

    Refused (OffRecord) on a store other than the one the parameters were calibrated on (the ledger's record,
    `hops_calib.loop.calibration`; `ledger_path` default: the project's, none when there is none) unless
    `off_record`."""
    from hops_calib.files import atomic_write
    from hops_calib.loop import calibration
    from hops_calib.loop.ledger import default_ledger
    from hops_calib.loop.suite import refuse_test_split

    refuse_test_split(request.split, "tune")
    check_run(request.trials, request.workers, request.storage_url)
    term, storage_url = request.term, request.storage_url
    problem = load_problem(term, request.fixtures_dir, request.model_path, request.objective, request.only)
    ledger_path = request.ledger_path
    if ledger_path is None:
        try:
            ledger_path = default_ledger()
        except InputError:
            ledger_path = None
    check = calibration.check_store(calibration.read_record(ledger_path),
                                    calibration.scope_of_params(term, request.only), problem.suite, "tune",
                                    off_record=request.off_record)
    study_name = request.study_name or default_study_name(problem)
    make_sampler(request.sampler, request.seed)  # an unknown sampler is refused before any work
    study = optimize(problem, trials=request.trials, storage_url=storage_url, study_name=study_name,
                     workers=request.workers, seed=request.seed, fixtures_dir=request.fixtures_dir, progress=progress,
                     sampler=request.sampler)
    before = score_model(problem.suite, problem.model, origin=str(problem.model_path))
    if storage_url is not None:  # every worker's trials, as the storage holds them now
        import optuna

        study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url))
    front = pareto_front(study)
    if not front:
        raise InputError("tune", f"study {study_name!r} has no completed trial", field="trials")
    chosen, verdict = choose(problem, front, before)
    in_study = _finished(study)
    path = text = None
    if chosen is not None:
        path = (Path(request.out) if request.out is not None else
                Path("experiments") / f"tune-{term}-trial{chosen.number}.toml")
        text = candidate_text(problem, chosen, before.suite, study_name, shown_storage(storage_url), in_study,
                              len(front), candidate_id=path.stem)
        if path.exists():
            raise InputError(path, "exists already; a candidate file is never overwritten (the ledger may cite it)",
                             hint="pass --out with a new file name")
        atomic_write(path, text)
    return TuneResult(term=term, fixtures_dir=problem.suite.fixtures_dir, study_name=study_name,
                      storage=shown_storage(storage_url), trials_here=request.trials,
                      trials_in_study=in_study, workers=request.workers, current=before.suite, front=tuple(front),
                      chosen=chosen, verdict=verdict, candidate_path=path, candidate_text=text,
                      objective=problem.objective, model_path=problem.model_path,
                      left_out=problem.suite.left_out_summary,
                      trials=tuple(all_trials(study)), calibration=check, warnings=check.warnings,
                      fixtures_dirs=tuple(store_dirs(request.fixtures_dir)))
