"""Cross-validation of one term's fit on the train split: what the held-out split will say, asked of train alone.

`tune` fits a term's parameters to every train run at once; a parameter that only a few configurations pin
(a per-device efficiency that one GPU-bound shape decides, a burst extent that one shape's hops decide) then
fits them and predicts nothing about the next configuration. `crossval` says so before the held-out report
does: it splits the train runs into K folds by configuration (the repeats of a configuration always share a
fold, as they share a split), refits the term on the other folds, and predicts each fold with the parameters
refit without it. Per fold it reports the current model's error there,
the refit's error there (held out) and the refit's error on the folds it was fitted on (in sample); over all
runs, the cross-validated throughput MAPE against the current model's train MAPE. The gap between the refit's
held-out and in-sample errors (the optimism) is how much of the fit a new configuration would not see.

Only the train split is read. Folds are assigned by a seeded shuffle of the sorted configuration names, so a
rerun with the same seed makes the same folds.

The refit must not know the fold, so it never starts from the model's current values (they were fitted on
every train run, the fold's included, and a search that cannot beat its start would hand them back): it
minimizes the fitting runs' throughput MAPE (components mode: the mispriced share of the measured times, as
`tune --objective components`) by a global search over the parameters' plausible ranges whose first point is
the term's declared defaults (a third of at most `evaluations` model evaluations, optuna TPE), then a CMA-ES
search from its best point (the `cmaes` package optuna's own CMA sampler uses, in coordinates scaled to each
range, step 0.1 of it): the error is piecewise (whole stalls, floors that bind or not), where a line search
stalls; on a 7-parameter joint refit CMA-ES reached 1.98-2.10 % where Powell stopped at 2.14-2.30 %, on three
parameters they tie. Switch parameters (a few allowed values) keep the model's values. The
in-sample score is the same refit's on its own fitting runs, so held out minus in sample compares like with
like; the "current" column is the model as shipped, which has seen every fold. The same search is also run on
every train run ("full refit"): when it lands well above the shipped values' error, the search, not the data,
sets the cross-validated number, and more evaluations are needed before reading it. The same holds per fold: a
fold whose refit scores worse on its own fitting runs than the current values do there (which the search could
have returned) is flagged, and its values are left out of the verdict on which parameters the folds refit apart
(a short search's values disagree for no reason in the data). Warnings and verdicts are in --json as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.loop.score import RunScore, SuiteScore, aggregate
from hops_calib.loop.suite import Suite, score_model
from hops_calib.model.terms import TERMS
from hops_calib.research.tune import TuneProblem, load_problem, term_values

DEFAULT_FOLDS = 5
DEFAULT_EVALUATIONS = 150
SHORTFALL_PP = 0.1  # a refit this much worse than the current values on its own fitting runs: the search fell short
DISAGREEMENT = 1.5  # folds' refit values further apart than this factor: the folds that pin the parameter decide it


def _positions(suite: Suite, ids: tuple[str, ...]) -> list[int]:
    wanted = set(ids)
    return [i for i, fixture_id in enumerate(suite.ids) if fixture_id in wanted]


def subset(suite: Suite, ids: tuple[str, ...], keep: list[int] | None = None) -> Suite:
    """The runs of `suite` named by `ids`, in the suite's order (`keep`: their positions, when known)."""
    keep = _positions(suite, ids) if keep is None else keep
    return replace(
        suite,
        ids=tuple(suite.ids[i] for i in keep),
        specs=tuple(suite.specs[i] for i in keep),
        truths=tuple(suite.truths[i] for i in keep),
        content_hashes=tuple(suite.content_hashes[i] for i in keep),
        groups=tuple(suite.groups[i] for i in keep),
    )


def fold_groups(run_groups: tuple[str, ...], folds: int, seed: int) -> list[tuple[str, ...]]:
    """The configurations of each fold: a seeded shuffle of the sorted configuration names (the runs' stored
    groups, `Suite.groups`), dealt into `folds`."""
    groups = sorted(set(run_groups))
    if folds < 2 or folds > len(groups):
        raise InputError(
            "crossval",
            f"--folds {folds} for {len(groups)} configurations on the train split",
            field="folds",
            hint=f"choose 2 to {len(groups)} folds (each holds whole configurations)",
        )
    order = np.random.default_rng(seed).permutation(len(groups))
    return [tuple(sorted(groups[k] for k in part)) for part in np.array_split(order, folds)]


@dataclass(frozen=True)
class Fold:
    index: int
    groups: tuple[str, ...]  # the configurations held out
    ids: tuple[str, ...]  # their runs
    params: dict[str, float]  # the term's values refit on the other folds
    current: SuiteScore  # the current model on this fold
    held_out: SuiteScore  # the refit on this fold, which it never saw
    in_sample: SuiteScore  # the refit on the folds it was fitted on
    errors: dict[str, tuple[float, float]]  # run -> (current, refit held-out) throughput error %
    runs: tuple[RunScore, ...] = ()  # the refit's scores of the fold's runs
    # Components mode: the mispriced share of the measured times (%), held out and in sample.
    held_out_component_pct: float | None = None
    in_sample_component_pct: float | None = None
    # The refit's objective on its own fitting runs, and the current values' there (the refit searched a space
    # holding them): a refit worse than the current values fell short of its search, not of the data.
    in_sample_objective: float = float("nan")
    current_in_sample_objective: float = float("nan")

    @property
    def fell_short(self) -> bool:
        return self.in_sample_objective > self.current_in_sample_objective + SHORTFALL_PP

    def to_dict(self) -> dict[str, Any]:
        return {
            "fold": self.index,
            "groups": list(self.groups),
            "runs": list(self.ids),
            "params": self.params,
            "current": self.current.to_dict(),
            "held_out": self.held_out.to_dict(),
            "in_sample": self.in_sample.to_dict(),
            "in_sample_objective": self.in_sample_objective,
            "current_in_sample_objective": self.current_in_sample_objective,
            "fell_short": self.fell_short,
            "held_out_component_mape_pct": self.held_out_component_pct,
            "in_sample_component_mape_pct": self.in_sample_component_pct,
            "throughput_error_pct": {k: {"current": c, "held_out": h} for k, (c, h) in self.errors.items()},
        }


@dataclass(frozen=True)
class CrossValidation:
    term: str
    model_sha256: str
    fixture_set_sha256: str
    seed: int
    evaluations: int
    objective: str
    only: tuple[str, ...]
    current_params: dict[str, float]
    current: SuiteScore  # the current model on every train run
    folds: tuple[Fold, ...]
    full_params: dict[str, float]  # the same search on every train run
    full: SuiteScore  # its score there
    # Components mode: the mispriced share of the measured times (%) of the full refit and of the current model.
    full_component_pct: float | None = None
    current_component_pct: float | None = None
    # With shared=True: the per-device values (NAME@TYPE) taken out, so each refit fits one value for every device.
    dropped: tuple[str, ...] = ()
    also: tuple[str, ...] = ()  # other terms' parameters refit alongside ("TERM:PARAM")
    # The objective (throughput MAPE %, or the mispriced share % in components mode) of the full refit and of the
    # current values in the refit's space (the shipped model, less the per-device values --shared took out).
    full_objective: float = float("nan")
    current_objective: float = float("nan")
    left_out: dict[str, Any] | None = None  # the train runs the model does not price (`Suite.left_out_summary`)

    @property
    def full_fell_short(self) -> bool:
        return self.full_objective > self.current_objective + SHORTFALL_PP

    @property
    def short_folds(self) -> tuple[int, ...]:
        return tuple(f.index for f in self.folds if f.fell_short)

    @property
    def disagreement(self) -> dict[str, tuple[float, float]]:
        """Parameters the folds refit more than DISAGREEMENT x apart, (low, high), from the folds whose search did
        not fall short only (at least two of them): a short search's values say nothing about the data."""
        sound = [f for f in self.folds if not f.fell_short]
        if len(sound) < 2:
            return {}
        spread = {n: (min(f.params[n] for f in sound), max(f.params[n] for f in sound)) for n in self.current_params}
        return {n: (low, high) for n, (low, high) in spread.items() if high > low * DISAGREEMENT + 1e-9}

    def warnings(self) -> list[str]:
        out = []
        what = "mispriced share" if self.objective == "components" else "throughput MAPE"
        for fold in self.folds:
            if fold.fell_short:
                out.append(
                    f"fold {fold.index}: its refit scores {fold.in_sample_objective:.2f} % ({what}) on its own "
                    f"fitting runs against the current values' {fold.current_in_sample_objective:.2f} % "
                    "there: the search fell short, so its held-out error and values are the search's, not "
                    "the data's; rerun with more --evaluations"
                )
        if self.full_fell_short:
            out.append(
                f"the refit on every train run scores {self.full_objective:.2f} % against the current values' "
                f"{self.current_objective:.2f} % (its objective): the search, not the data, sets these "
                "numbers; rerun with more --evaluations before reading them"
            )
        sound = len(self.folds) - len(self.short_folds)
        if self.short_folds and sound < 2:
            out.append(
                f"only {sound} fold(s) searched as far as the current values: no verdict on which "
                "parameters the folds refit apart"
            )
        return out

    def verdicts(self) -> list[str]:
        loose = self.disagreement
        if not loose:
            return []
        skipped = (
            f" (fold(s) {', '.join(map(str, self.short_folds))} left out: their search fell short)"
            if self.short_folds
            else ""
        )
        return [
            f"refits disagree by more than {DISAGREEMENT:g}x on: "
            + ", ".join(f"{n} ({low:.3g}-{high:.3g})" for n, (low, high) in loose.items())
            + ": the folds that pin them decide them; a configuration unlike those is predicted with a guess"
            + skipped
        ]

    @property
    def held_out_component_pct(self) -> float | None:
        """Components mode: the folds' held-out mispriced share, weighted by their runs."""
        if self.objective != "components":
            return None
        return float(
            np.average([f.held_out_component_pct for f in self.folds], weights=[len(f.ids) for f in self.folds])
        )

    @property
    def in_sample_component_pct(self) -> float | None:
        if self.objective != "components":
            return None
        return float(np.mean([f.in_sample_component_pct for f in self.folds]))

    @property
    def held_out(self) -> SuiteScore:
        """Every train run predicted by the refit that did not see its configuration."""
        return aggregate([run for fold in self.folds for run in fold.runs])

    @property
    def in_sample_mape_pct(self) -> float:
        """Mean over folds of the refit's throughput MAPE on its own fitting runs."""
        return float(np.mean([f.in_sample.throughput_mape_pct for f in self.folds]))

    @property
    def optimism_pp(self) -> float:
        """Cross-validated MAPE minus in-sample MAPE: what a configuration the fit has not seen loses."""
        return self.held_out.throughput_mape_pct - self.in_sample_mape_pct

    def to_dict(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "model_sha256": self.model_sha256,
            "fixture_set_sha256": self.fixture_set_sha256,
            "split": "train",
            "seed": self.seed,
            "evaluations_per_refit": self.evaluations,
            "objective": self.objective,
            "only": list(self.only),
            "current_params": self.current_params,
            "current": self.current.to_dict(),
            "cross_validated": self.held_out.to_dict(),
            "in_sample_mape_pct": self.in_sample_mape_pct,
            "optimism_pp": self.optimism_pp,
            "per_device_values_dropped": list(self.dropped),
            "also": list(self.also),
            "full_refit": {"params": self.full_params, **self.full.to_dict()},
            "component_mape_pct": None
            if self.objective != "components"
            else {
                "cross_validated": self.held_out_component_pct,
                "in_sample": self.in_sample_component_pct,
                "full_refit": self.full_component_pct,
                "current": self.current_component_pct,
            },
            "folds": [f.to_dict() for f in self.folds],
            "objective_current": self.current_objective,
            "objective_full_refit": self.full_objective,
            "short_folds": list(self.short_folds),
            "disagreeing_params": {n: list(bounds) for n, bounds in self.disagreement.items()},
            "warnings": self.warnings(),
            "verdicts": self.verdicts(),
            "left_out": self.left_out or {"count": 0, "reasons": []},
        }


@dataclass(frozen=True)
class JointProblem:
    """One term's problem with parameters of other terms refit alongside it ("TERM:PARAM", `--also`): a move's
    joint refit, cross-validated as a whole."""

    base: TuneProblem
    also: tuple[tuple[str, str], ...]  # (term, parameter)

    @property
    def term(self) -> str:
        return self.base.term

    @property
    def suite(self) -> Suite:
        return self.base.suite

    @property
    def objective(self) -> str:
        return self.base.objective

    @property
    def params(self) -> tuple:
        return (*self.base.params, *(replace(TERMS[t].param(n), name=f"{t}:{n}") for t, n in self.also))

    def model_with(self, values: dict[str, float]) -> Any:
        from hops_calib.model import resolve_params

        model = self.base.model_with({k: v for k, v in values.items() if ":" not in k})
        for term in dict.fromkeys(t for t, _ in self.also):
            mine = {k.split(":", 1)[1]: v for k, v in values.items() if k.startswith(f"{term}:")}
            active = model.active(term)
            model = model.with_term(
                resolve_params(term, mine, origin=f"crossval --also {term}", base=active.params() if active else None)
            )
        return model

    def score(self, model) -> SuiteScore:
        return self.base.score(model)

    def component_mape(self, model) -> float:
        return self.base.component_mape(model)


def _term_and_name(problem, name: str) -> tuple[str, str]:
    if ":" in name:
        term, _, param = name.partition(":")
        return term, param
    return problem.term, name


def _values(problem, model) -> dict[str, float]:
    """The problem's parameters as `model` has them (else their terms' defaults); with no model, the defaults."""
    out = {}
    for p in problem.params:
        term, name = _term_and_name(problem, p.name)
        out[p.name] = term_values(model, term, [name])[name]
    return out


def _fold_problem(problem, ids: tuple[str, ...]):
    if isinstance(problem, JointProblem):
        return replace(problem, base=_fold_problem(problem.base, ids))
    keep = _positions(problem.suite, ids)
    reals = tuple(problem.real_components[i] for i in keep) if problem.real_components else ()
    return replace(problem, suite=subset(problem.suite, ids, keep), real_components=reals)


def refit(
    problem: TuneProblem | JointProblem, evaluations: int, seed: int = 0, progress: Callable[[int], None] | None = None
) -> dict[str, float]:
    """The term's continuous parameters minimizing the problem's runs' error, found without the model's values.

    A third of the budget is a global search (optuna TPE over the parameters' plausible ranges, log scale where a
    parameter says so; its first trial the term's defaults), the rest CMA-ES from its best point, in coordinates
    scaled to each parameter's range (step 0.1 of the range, bounded to it). The best point seen is returned.
    """
    import cmaes
    import optuna

    params = [p for p in problem.params if not p.choices]
    if not params:
        raise InputError(
            "crossval",
            f"term {problem.term!r} has only switch parameters to refit",
            field="only",
            hint="cross-validate a term (or --only parameters) with a continuous range",
        )
    defaults = _values(problem, None)
    calls = [0]

    def error(x) -> float:
        calls[0] += 1
        if progress:
            progress(min(calls[0], evaluations))
        model = problem.model_with({p.name: float(v) for p, v in zip(params, x)})
        if problem.objective == "components":
            return problem.component_mape(model)
        return problem.score(model).throughput_mape_pct

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial({p.name: defaults[p.name] for p in params})
    study.optimize(
        lambda trial: error([trial.suggest_float(p.name, p.low, p.high, log=p.log) for p in params]),
        n_trials=max(1, evaluations // 3),
    )
    best_x, best_error = [study.best_params[p.name] for p in params], study.best_value
    low, high = np.array([p.low for p in params]), np.array([p.high for p in params])
    search = cmaes.CMA(
        mean=(np.array(best_x) - low) / (high - low), sigma=0.1, bounds=np.array([[0.0, 1.0]] * len(params)), seed=seed
    )
    while evaluations - calls[0] >= search.population_size:  # whole generations only
        generation = []
        for _ in range(search.population_size):
            unit = search.ask()
            x = low + unit * (high - low)
            value = error(x)
            generation.append((unit, value))
            if value < best_error:
                best_x, best_error = list(x), value
        search.tell(generation)
    return {p.name: float(v) for p, v in zip(params, best_x)}


def _shared_problem(problem: TuneProblem) -> tuple[TuneProblem, tuple[str, ...]]:
    """The problem on a model without the per-device values of the parameters it refits."""
    from hops_calib.model import resolve_params

    per_device = [p.name for p in problem.params if "@" in p.name]
    if per_device:
        raise InputError(
            "crossval",
            f"--shared refits one value for every device; {', '.join(per_device)} is one device's value",
            field="only",
            hint="name the parameter without @TYPE",
        )
    active = problem.model.active(problem.term)
    names = {p.name for p in problem.params}
    values = active.params() if active else {}
    dropped = tuple(sorted(k for k in values if "@" in k and k.partition("@")[0] in names))
    if not dropped:
        raise InputError(
            "crossval",
            f"--shared: the model gives term {problem.term!r} no per-device value of {', '.join(sorted(names))}",
            field="shared",
            hint="nothing to share; cross-validate without --shared",
        )
    kept = {k: v for k, v in values.items() if k not in dropped}
    model = problem.model.with_term(resolve_params(problem.term, kept, origin=f"crossval {problem.term} --shared"))
    return replace(problem, model=model), dropped


def _also(specs: tuple[str, ...], selected: tuple[str, ...] = (), term_refit: str = "") -> tuple[tuple[str, str], ...]:
    """Parse "TERM:PARAM" specs, refusing unknown terms and parameters by name, and a parameter already refit
    (one of TERM's `selected` parameters, or the same spec twice): it would be searched as two coordinates."""
    parsed = []
    for spec in specs:
        term, sep, name = spec.partition(":")
        if not sep or term not in TERMS:
            raise InputError(
                "crossval",
                f"--also {spec!r}: expected TERM:PARAM with a known term",
                field="also",
                hint=f"terms: {', '.join(sorted(TERMS))}",
            )
        try:
            TERMS[term].param(name)
        except KeyError:
            raise InputError(
                "crossval",
                f"--also {spec!r}: term {term!r} has no parameter {name!r}",
                field="also",
                hint=f"its parameters: {', '.join(p.name for p in TERMS[term].params)}",
            ) from None
        if (term == term_refit and name in selected) or (term, name) in parsed:
            raise InputError(
                "crossval",
                f"--also {spec!r}: {name} of {term} is refit already"
                + (f" as {term_refit}'s own parameter" if term == term_refit else " (given twice)"),
                field="also",
                hint="name each parameter once: TERM's own with --only, other terms' with --also",
            )
        parsed.append((term, name))
    return tuple(parsed)


@dataclass(frozen=True)
class CrossvalRequest:
    """What one cross-validation is asked (the `crossval` verb's options, built once by the command layer;
    `crossval`'s keywords): the term refit, the store whose train split is folded, the model, the folds and their
    seed, the refits' budget and objective, which parameters are refit (`only`, `also`) and whether their per-device
    values are taken out first (`shared`)."""

    term: str
    fixtures_dir: Path | str
    model_path: Path | str | None = None
    folds: int = DEFAULT_FOLDS
    evaluations: int = DEFAULT_EVALUATIONS
    seed: int = 0
    objective: str = "suite"
    only: tuple[str, ...] = ()
    shared: bool = False
    also: tuple[str, ...] = ()
    split: str = "train"


def crossval(
    term: str, fixtures_dir: Path | str, *, progress: Callable[[int, int], None] | None = None, **options: Any
) -> CrossValidation:
    """`run_crossval` of CrossvalRequest(term, fixtures_dir, **options)."""
    return run_crossval(CrossvalRequest(term, fixtures_dir, **options), progress=progress)


def run_crossval(request: CrossvalRequest, progress: Callable[[int, int], None] | None = None) -> CrossValidation:
    """Refit `term` on K - 1 folds of the train split's configurations and predict the Kth, for each K (`split`
    other than train is refused, as by every verb but `report`).

    `shared`: take the refit parameters' per-device values (NAME@TYPE) out of the model first, so that one value
    serves every device: does the per-device freedom travel better than a shared value? `also`: other terms'
    parameters ("TERM:PARAM") refit together with the term's, as a move's joint refit is.
    """
    from hops_calib.loop.suite import refuse_test_split

    term, folds, evaluations, seed, objective = (
        request.term,
        request.folds,
        request.evaluations,
        request.seed,
        request.objective,
    )
    refuse_test_split(request.split, "crossval")
    if evaluations < 1:
        raise InputError("crossval", "--evaluations must be at least 1", field="evaluations")
    base = load_problem(
        term, request.fixtures_dir, request.model_path, objective, request.only, command="crossval"
    )  # train only
    shipped = base.model
    dropped: tuple[str, ...] = ()
    if request.shared:
        base, dropped = _shared_problem(base)
    problem: TuneProblem | JointProblem = base
    if request.also:
        problem = JointProblem(base, _also(request.also, tuple(p.name for p in base.params), term))
    suite = problem.suite
    parts = fold_groups(suite.groups, folds, seed)
    current = score_model(suite, shipped, origin=f"crossval {term}")
    current_errors = {r.run_id: r.throughput_error_pct for r in current.runs}
    components = objective == "components"
    # The current values in the space the refits search (--shared: the shipped model without the per-device
    # values it took out): the point a search that did its job scores no worse than, on any runs.
    reference = problem.base.model if isinstance(problem, JointProblem) else problem.model
    reference_runs = current.runs if reference is shipped else score_model(suite, reference, origin="crossval").runs

    def reference_objective(sub_problem, ids: set[str]) -> float:
        if components:
            return sub_problem.component_mape(reference)
        return aggregate([r for r in reference_runs if r.run_id in ids]).throughput_mape_pct

    results = []
    for index, groups in enumerate(parts):
        held = tuple(i for i, group in zip(suite.ids, suite.groups) if group in groups)
        fit_problem = _fold_problem(problem, tuple(i for i in suite.ids if i not in held))

        def step(calls: int, offset: int = index * evaluations) -> None:
            if progress:
                progress(offset + calls, evaluations * (len(parts) + 1))

        values = refit(fit_problem, evaluations, seed + index, step)
        model = problem.model_with(values)
        held_problem = _fold_problem(problem, held)
        held_out = score_model(held_problem.suite, model, origin=f"crossval {term} fold {index}")
        in_sample = score_model(fit_problem.suite, model, origin=f"crossval {term} fold {index}").suite
        in_sample_objective = fit_problem.component_mape(model) if components else in_sample.throughput_mape_pct
        results.append(
            Fold(
                index=index,
                groups=groups,
                ids=held,
                params=values,
                current=aggregate([r for r in current.runs if r.run_id in held]),
                held_out=held_out.suite,
                in_sample=in_sample,
                errors={r.run_id: (current_errors[r.run_id], r.throughput_error_pct) for r in held_out.runs},
                runs=tuple(held_out.runs),
                held_out_component_pct=held_problem.component_mape(model) if components else None,
                in_sample_component_pct=in_sample_objective if components else None,
                in_sample_objective=in_sample_objective,
                current_in_sample_objective=reference_objective(fit_problem, set(fit_problem.suite.ids)),
            )
        )
    full_values = refit(
        problem,
        evaluations,
        seed + len(parts),
        lambda calls: progress(len(parts) * evaluations + calls, evaluations * (len(parts) + 1)) if progress else None,
    )
    current_values = _values(problem, shipped)
    full_model = problem.model_with(full_values)
    full = score_model(suite, full_model, origin=f"crossval {term}").suite
    full_objective = problem.component_mape(full_model) if components else full.throughput_mape_pct
    return CrossValidation(
        term=term,
        model_sha256=shipped.sha256,
        fixture_set_sha256=suite.sha256,
        seed=seed,
        evaluations=evaluations,
        objective=objective,
        only=tuple(request.only),
        current_params={k: current_values[k] for k in results[0].params},
        current=current.suite,
        folds=tuple(results),
        full_params=full_values,
        full=full,
        full_component_pct=full_objective if components else None,
        current_component_pct=problem.component_mape(shipped) if components else None,
        dropped=dropped,
        also=tuple(request.also),
        full_objective=full_objective,
        current_objective=reference_objective(problem, set(suite.ids)),
        left_out=suite.left_out_summary,
    )
