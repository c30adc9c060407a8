"""Tune's problem: what every trial of a study evaluates (one term's parameter space, the base model, the train
fixtures and, in components mode, the times each run measures directly) and how a trial's suite score becomes the
study's objective values. `hops_calib.research.tune` describes the whole tune."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop.model_files import default_model
from hops_calib.loop.score import SuiteScore
from hops_calib.loop.suite import Suite, load_suites, score_model
from hops_calib.model import TERMS, Model, resolve_params, unknown_device_overrides

OBJECTIVES = ("throughput_mape_pct", "bubble_mae_pp", "negative_util_spearman_mean")
COMPONENT_OBJECTIVES = ("component_mape_pct",)
OBJECTIVE_MODES = ("suite", "components")
KERNEL_TERMS = ("decoder_kernels",)  # terms that price each kernel: components mode fits them to kernel truth


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
        return {
            "term": self.term,
            "space": self.space(),
            "model_sha256": self.model.sha256,
            "fixture_set_sha256": self.suite.sha256,
            "objective": self.objective,
            "objectives": list(self.objectives),
            **({"kernel_truth_runs": self.kernel_runs} if self.kernel_runs else {}),
        }

    def model_with(self, values: dict[str, float]) -> Model:
        base = self.model.active(self.term)
        return self.model.with_term(
            resolve_params(self.term, values, origin=f"tune {self.term}", base=base.params() if base else None)
        )

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
    values = {
        "throughput_mape_pct": score.throughput_mape_pct,
        "bubble_mae_pp": score.bubble_mae_pp,
        "negative_util_spearman_mean": None if score.util_spearman_mean is None else -score.util_spearman_mean,
    }
    return tuple(values[name] for name in objectives)


def store_dirs(fixtures_dir: Path | str | Sequence[Path | str]) -> list[str]:
    """The store(s) of a --fixtures given once or repeated, as strings (a worker process's arguments)."""
    return [str(fixtures_dir)] if isinstance(fixtures_dir, (str, Path)) else [str(d) for d in fixtures_dir]


def load_problem(
    term: str,
    fixtures_dir: Path | str | Sequence[Path | str],
    model_path: Path | str | None,
    objective: str = "suite",
    only: tuple[str, ...] = (),
    command: str = "tune",
) -> TuneProblem:
    from hops_calib.loop.model_files import load_model

    if term not in TERMS:
        raise InputError(
            command,
            f"unknown term {term!r}",
            field="TERM",
            hint=f"terms implemented in hops_calib.model.terms: {', '.join(sorted(TERMS))} "
            "(`hops-calib terms` lists them with their parameters)",
        )
    if not TERMS[term].params:
        raise InputError(
            command,
            f"term {term!r} has no parameters to tune",
            field="TERM",
            hint="it is a measurement-driven term; tune a term that has parameters (`hops-calib terms`)",
        )
    unknown = []
    for name in only:
        try:
            TERMS[term].param(name)
        except KeyError:
            unknown.append(name)
    if unknown:
        per_device = [p.name for p in TERMS[term].params if p.per_device]
        raise InputError(
            command,
            f"term {term!r} has no parameter {', '.join(map(repr, unknown))}",
            field="only",
            hint=f"its parameters: {', '.join(p.name for p in TERMS[term].params)}"
            + (f"; per device type (NAME@TYPE): {', '.join(per_device)}" if per_device else ""),
        )
    if objective not in OBJECTIVE_MODES:
        raise InputError(
            command,
            f"unknown objective {objective!r}",
            field="objective",
            hint=f"choose one of {', '.join(OBJECTIVE_MODES)}",
        )
    model_path = Path(model_path) if model_path is not None else default_model()
    suite = load_suites(fixtures_dir, "train")
    reals: tuple = ()
    kernels: tuple = ()
    if objective == "components":
        from hops_calib.loop.suite import open_store
        from hops_calib.research.components import real_components
        from hops_calib.research.kernel_truth import measured_kernels

        loaded = [
            store.load(fixture_id)
            for part in suite.stores
            for store in (open_store(part.fixtures_dir),)
            for fixture_id in part.ids
        ]
        reals = tuple(real_components(fixture) for fixture in loaded)
        kernels = tuple(measured_kernels(fixture) for fixture in loaded) if term in KERNEL_TERMS else ()
        if not any(real.values for real in reals) and not any(k is not None for k in kernels):
            raise InputError(
                command,
                f"no train run of {', '.join(str(part.fixtures_dir) for part in suite.stores)} measured the "
                "components of an iteration (forward, backward, communication) or its kernels: every run is "
                "measured per iteration (a run table or training log), so the components objective has "
                "nothing to fit and every trial would score NaN",
                field="objective",
                hint="use --objective suite on such a store, or add a store whose runs have events "
                "(per-rank event logs, CPU captures) or kernel truth (a profiler trace)",
            )
    model = load_model(model_path)
    known = {d.type for d in model.devices}
    strangers = unknown_device_overrides(only, known)
    if strangers:
        raise InputError(
            command,
            f"{', '.join(map(repr, strangers))} names a device type the model does not know "
            f"(known: {', '.join(sorted(known))})",
            field="only",
            hint="a per-device parameter (NAME@TYPE) takes a device type of the model: a value for no "
            "device changes nothing to search",
        )
    return TuneProblem(
        term=term,
        model=model,
        model_path=model_path,
        suite=suite,
        objective=objective,
        real_components=reals,
        real_kernels=kernels,
        only=tuple(only),
    )
