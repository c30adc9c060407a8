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

The names live by concept: `tune_problem` (the problem a study evaluates, its parameter space and objectives),
`tune_study` (the optuna storage, samplers and study, and the workers that run its trials) and this module (the
front, the chosen point, the candidate file and the result), which gathers them under one name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop.candidate import PLACEHOLDER
from hops_calib.loop.model_files import DEFAULT_MODEL, default_model
from hops_calib.loop.score import SuiteScore
from hops_calib.loop.suite import score_model
from hops_calib.model import TERMS
from hops_calib.research.tune_problem import (
    COMPONENT_OBJECTIVES,
    KERNEL_TERMS,
    OBJECTIVE_MODES,
    OBJECTIVES,
    TuneProblem,
    load_problem,
    objectives_of,
    store_dirs,
    term_values,
)
from hops_calib.research.tune_study import (
    PROBLEM_ATTR,
    check_run,
    default_study_name,
    objective,
    open_study,
    optimize,
    run_worker,
    study_sampler,
)
from hops_calib.study import (
    JOIN_WAIT_S,
    SAMPLERS,
    SQLITE_TIMEOUT_S,
    make_sampler,
    make_storage,
    shares,
    shown_storage,
    sobol_sampler,
)
from hops_calib.study import finished as _finished

__all__ = [
    "CHOICE_RULE",
    "COMPONENT_FRONT",
    "COMPONENT_OBJECTIVES",
    "DEFAULT_TRIALS",
    "JOIN_WAIT_S",
    "KERNEL_TERMS",
    "NO_CANDIDATE",
    "NO_WINNER",
    "OBJECTIVES",
    "OBJECTIVE_MODES",
    "PLACEHOLDER",
    "PROBLEM_ATTR",
    "SAMPLERS",
    "SQLITE_TIMEOUT_S",
    "FrontPoint",
    "TuneProblem",
    "TuneRequest",
    "TuneResult",
    "all_trials",
    "beats",
    "candidate_text",
    "check_run",
    "choose",
    "default_study_name",
    "evaluate_command",
    "load_problem",
    "make_sampler",
    "make_storage",
    "objective",
    "objectives_of",
    "open_study",
    "optimize",
    "pareto_front",
    "run_tune",
    "run_worker",
    "shares",
    "shown_storage",
    "sobol_sampler",
    "store_dirs",
    "study_sampler",
    "term_values",
    "tune",
]

COMPONENT_FRONT = 10  # trials shown and considered in components mode
DEFAULT_TRIALS = 60
CHOICE_RULE = (
    "the lowest-MAPE Pareto point (ties: bubble MAE, then higher rho) that beats the current model on the "
    "gate's criteria: the gate accepts it with default tolerances and it improves at least one suite "
    "aggregate; no candidate when none does"
)


def _number(value: float | None, digits: int) -> str:
    """A suite aggregate as printed: 'n/a' where no run has the metric (iteration-level runs: bubble, rho)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


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
        return (
            s.get("component_mape_pct", 0.0),
            s["throughput_mape_pct"],
            s["bubble_mae_pp"] or 0.0,
            -(s["util_spearman_mean"] or 0.0),
            self.number,
        )


def beats(verdict, before: SuiteScore, after: SuiteScore) -> bool:
    """Whether a point beats the current model on the gate's criteria: accepted, and some suite aggregate better."""

    def better(a: float | None, b: float | None, lower: bool = True) -> bool:
        return a is not None and b is not None and (a < b if lower else a > b)

    return verdict.accepted and (
        after.throughput_mape_pct < before.throughput_mape_pct
        or better(after.bubble_mae_pp, before.bubble_mae_pp)
        or better(after.util_spearman_mean, before.util_spearman_mean, lower=False)
    )


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
    return [
        {
            "number": t.number,
            "state": t.state.name,
            "params": dict(t.params),
            "objectives": list(t.values) if t.values is not None else None,
            "score": {k: t.user_attrs[k] for k in keys if k in t.user_attrs},
        }
        for t in study.get_trials(deepcopy=False)
    ]


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
    points = [
        FrontPoint(number=t.number, params=dict(t.params), score={k: t.user_attrs[k] for k in keys}) for t in trials
    ]
    return sorted(points, key=FrontPoint.key)


NO_CANDIDATE = (
    "every point of the front is the model's current values: no trial did better on every objective; "
    "more --trials, or --only the parameters to search"
)
NO_WINNER = (
    "no point of the front beats the current model on the gate's criteria (accepted, and some suite "
    "aggregate better); more --trials, or --only the parameters to search"
)


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
        return {
            "status": self.status,
            "term": self.term,
            "study": self.study_name,
            "storage": self.storage,
            "fixtures": list(self.fixtures_dirs) if len(self.fixtures_dirs) > 1 else str(self.fixtures_dir),
            "model": str(self.model_path),
            "warnings": list(self.warnings),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "trials": list(self.trials),
            "trials_here": self.trials_here,
            "trials_in_study": self.trials_in_study,
            "workers": self.workers,
            "objective": self.objective,
            "objectives": list(self.objectives),
            "current": self.current.to_dict(),
            "front": [vars(p) for p in self.front],
            "chosen": vars(self.chosen) if self.chosen else None,
            "choice_rule": CHOICE_RULE,
            "chosen_gate": self.verdict.to_dict() if self.verdict else None,
            "candidate": str(self.candidate_path) if self.candidate_path else None,
            "no_candidate_reason": self.no_candidate_reason,
            "left_out": self.left_out or {"count": 0, "reasons": []},
        }

    @property
    def no_candidate_reason(self) -> str | None:
        if self.chosen is not None:
            return None
        return NO_CANDIDATE if self.verdict is None else NO_WINNER


def evaluate_command(candidate: Path | str, fixtures_dir: Path | str | Sequence[Path | str], model_path: Path) -> str:
    """The command that judges a tuned candidate against the model it was tuned on (on every store it was tuned on)."""
    return (
        f"hops-calib evaluate {candidate} "
        + " ".join(f"--fixtures {d}" for d in store_dirs(fixtures_dir))
        + ("" if model_path == default_model() else f" --model {model_path}")
    )


def _moves(before: float, after: float, digits: int) -> str:
    """The verb for a change of a quantity as printed with `digits` decimals: lowers, holds or raises."""
    before, after = round(before, digits), round(after, digits)
    return "lowers" if after < before else "raises" if after > before else "holds"


def candidate_text(
    problem: TuneProblem,
    chosen: FrontPoint,
    current: SuiteScore,
    study_name: str,
    storage: str,
    trials_in_study: int,
    front_size: int,
    candidate_id: str | None = None,
) -> str:
    """A one-term candidate setting the chosen values, with hypothesis and grounding marked FILL IN."""
    import inspect

    term = TERMS[problem.term]
    action = "set" if problem.model.active(problem.term) else "add"
    after = chosen.score
    how = (
        "mispricing the stage, optimizer and between-iteration times the traces measure by "
        f"{chosen.score['component_mape_pct']:.2f} % of their time; "
        if problem.objective == "components"
        else ""
    )
    physics = " ".join((inspect.getdoc(type(term)) or "").split())
    hypothesis = (
        f"{PLACEHOLDER} why: {'setting' if action == 'set' else 'adding'} {problem.term} with the values tuned "
        f"on the train split ({how}objective {problem.objective}) "
        f"{_moves(current.throughput_mape_pct, after['throughput_mape_pct'], 2)} throughput MAPE "
        f"{current.throughput_mape_pct:.2f} -> {after['throughput_mape_pct']:.2f} % (bubble MAE "
        f"{_number(current.bubble_mae_pp, 2)} -> {_number(after['bubble_mae_pp'], 2)} pp, mean rho "
        f"{_number(current.util_spearman_mean, 3)} -> {_number(after['util_spearman_mean'], 3)})"
    )
    grounding = f"{PLACEHOLDER} why these values are physically plausible. The term's physics: {physics}"
    params = ", ".join(
        f"{json.dumps(p.name) if '@' in p.name else p.name} = {chosen.params[p.name]!r}" for p in problem.params
    )
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
        "expected = { "
        + ", ".join(
            f"{k} = {after[k]!r}"
            for k in ("throughput_mape_pct", "bubble_mae_pp", "util_spearman_mean")
            if after[k] is not None
        )
        + " }",
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


def tune(
    term: str,
    fixtures_dir: Path | str | Sequence[Path | str],
    *,
    progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> TuneResult:
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
    check = calibration.check_store(
        calibration.read_record(ledger_path),
        calibration.scope_of_params(term, request.only),
        problem.suite,
        "tune",
        off_record=request.off_record,
    )
    study_name = request.study_name or default_study_name(problem)
    make_sampler(request.sampler, request.seed)  # an unknown sampler is refused before any work
    study = optimize(
        problem,
        trials=request.trials,
        storage_url=storage_url,
        study_name=study_name,
        workers=request.workers,
        seed=request.seed,
        fixtures_dir=request.fixtures_dir,
        progress=progress,
        sampler=request.sampler,
    )
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
        path = (
            Path(request.out)
            if request.out is not None
            else Path("experiments") / f"tune-{term}-trial{chosen.number}.toml"
        )
        text = candidate_text(
            problem,
            chosen,
            before.suite,
            study_name,
            shown_storage(storage_url),
            in_study,
            len(front),
            candidate_id=path.stem,
        )
        if path.exists():
            raise InputError(
                path,
                "exists already; a candidate file is never overwritten (the ledger may cite it)",
                hint="pass --out with a new file name",
            )
        atomic_write(path, text)
    return TuneResult(
        term=term,
        fixtures_dir=problem.suite.fixtures_dir,
        study_name=study_name,
        storage=shown_storage(storage_url),
        trials_here=request.trials,
        trials_in_study=in_study,
        workers=request.workers,
        current=before.suite,
        front=tuple(front),
        chosen=chosen,
        verdict=verdict,
        candidate_path=path,
        candidate_text=text,
        objective=problem.objective,
        model_path=problem.model_path,
        left_out=problem.suite.left_out_summary,
        trials=tuple(all_trials(study)),
        calibration=check,
        warnings=check.warnings,
        fixtures_dirs=tuple(store_dirs(request.fixtures_dir)),
    )
