"""Observe: where the prediction error comes from, ranked by how much throughput MAPE each quantity carries.

The step an agent starts each iteration with, on the train split only. For every
run, both sides are cut the same way:

- the iteration into four parts by one function for the real and the simulated
  timeline (`hops_calib.metrics.column_iteration_parts`): pipeline span, silent
  stretch, optimizer step, rest; they add up to the median iteration period;
- each stage's per-microbatch forward and backward: the model's task cost
  against the truth's median duration.

A contributor is one quantity within one group: of runs (device types present,
device types at the two pipeline ends, model shape, microbatches, pipeline
depth) or of stages (device type, position first / middle / last, the stage's
shape, and the run-level groups). Its contribution is the throughput MAPE
(window definition, the gate's) that would disappear if the model predicted
that quantity exactly on the group's members, everything else unchanged:

- forward or backward of some stages: the run is simulated again with those
  stages' costs set to the real medians (exact);
- a part of the iteration: the predicted window shrinks by the part's residual
  once per traced iteration holding it (the span `iterations` times, the others
  `iterations - 1`), and the predicted period by the residual once (first order
  for the window, exact for steady throughput). The simulator has no input that
  is "the span": the stage times and transfers are its inputs.

A negative contribution means fixing that quantity alone makes MAPE worse: its
error currently offsets another one. Runs whose trace has no optimizer events
are left out of the silent, optimizer and rest contributors (their silent
stretch holds the untraced optimizer step).

The measured replay feeds the simulator every part the trace measures at once
(each stage's forward and backward median, each rank's optimizer step, the
silent stretch and the rest, as means over iterations) and keeps only what the
model prices that no trace event times: the hops, the untraced host time, the
schedule. Its error is the simulator's structural residual; a bias there (all
runs slow, say) is one no cost term of the measured parts can fix honestly.
Runs without optimizer events have no replay.

The hops, which no trace event times, show where their consumer was idle: the
consumer (the next stage for a forward, the previous one for a backward) had
finished its previous step before the producer's step ended, so the gap from the
producer's end to the consumer's start is the hop plus the host work after the
receive (and any wait the blocking calls add), measured alike on the simulated
timeline. Grouped by the device types at the hop's two ends and the message size; the median over
forward and backward hops, which cross a pair in opposite directions, cancels
most of an offset between the two hosts' clocks. Interleaved runs are left out
(a rank's chunks make a step's producer ambiguous in the trace).

Runs measured at iteration level (training logs, run tables, the vTrain table) have no events: no part or stage
of theirs is measured. Their contributors are the terms of each run's predicted iteration (the model's breakdown
on the busiest rank, and the bubble), fitted to the runs' iteration residuals within each configuration group
(`hops_calib.research.observe_iteration`), in the same schema (`level` "iteration", `implied` true).

The slowest stage (forward plus backward per microbatch, which paces a
pipeline's steady state) is compared per run: a run is flagged where the model
calls another stage the slowest (one the traces show more than 5 % faster) or
prices the real slowest more than 5 % off. A right throughput on such a run
rests on errors that make up for each other, which is what a what-if about that
stage's device would inherit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.loop.score import SuiteScore, aggregate
from hops_calib.progress import QUIET, Progress

# The rows and the contributors live in their own modules; their names stay importable from here.
from hops_calib.research.observe_contributors import (
    CARRIED,
    CONTRIBUTOR_FIELDS,
    DOMINANT_RUNS,
    RUN_PHRASES,
    STAGE_PHRASES,
    Contributor,
    _fixable,
    merge_same_runs,
    part_contributors,
    part_fixed_errors,
    stage_contributors,
    stages_fixed_errors,
    with_suite_noise,
)
from hops_calib.research.observe_iteration import iteration_contributors, measured_terms, pricing_sample
from hops_calib.research.observe_rows import (
    BOTTLENECK_MARGIN,
    LABELS,
    PART_QUANTITIES,
    STAGE_QUANTITIES,
    BottleneckRow,
    HopRow,
    RunRow,
    StageRow,
    bottleneck,
    hop_gaps,
    hop_rows,
    measured_replay_error_pct,
    observe_run,
    run_groups,
    stage_groups,
    stage_position,
)

__all__ = [
    "BOTTLENECK_MARGIN",
    "CARRIED",
    "CONTRIBUTOR_FIELDS",
    "DOMINANT_RUNS",
    "LABELS",
    "PART_QUANTITIES",
    "RUN_PHRASES",
    "STAGE_PHRASES",
    "STAGE_QUANTITIES",
    "BottleneckRow",
    "Contributor",
    "HopRow",
    "Observation",
    "RunRow",
    "StageRow",
    "bottleneck",
    "error_by_configuration",
    "hop_gaps",
    "hop_rows",
    "measured_replay_error_pct",
    "merge_same_runs",
    "observe",
    "observe_run",
    "part_contributors",
    "part_fixed_errors",
    "run_groups",
    "stage_contributors",
    "stage_groups",
    "stage_position",
    "stages_fixed_errors",
    "with_suite_noise",
]


# --- the whole observation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    split: str
    fixtures_dir: Path
    model_path: Path
    model_name: str
    model_sha256: str
    fixture_set_sha256: str
    suite: SuiteScore
    runs: tuple[RunRow, ...]
    overall: tuple[Contributor, ...]  # each quantity over all runs / stages
    ranked: tuple[Contributor, ...]  # every quantity within every group, largest contribution first
    # The split's runs the model does not price, left out (`hops_calib.loop.suite.left_out_summary`).
    left_out: dict[str, Any] = field(default_factory=lambda: {"count": 0, "reasons": []})
    # Measured against predicted kernel time by class, over the runs with kernel truth
    # (`hops_calib.research.kernel_truth.kernel_section`); None when no run has any.
    kernel_classes: dict[str, Any] | None = None

    @property
    def iteration_level_runs(self) -> int:
        """Runs measured at iteration level: scored on throughput, and outside every analysis that needs events."""
        return sum(not r.real_metrics.has_events for r in self.runs)

    @property
    def by_configuration(self) -> tuple[dict[str, Any], ...]:
        """`error_by_configuration` of every run."""
        return error_by_configuration(self.runs)

    @property
    def measured_replay(self) -> dict[str, float] | None:
        """MAPE and mean signed error of the measured replay over the runs that have one."""
        return _error_summary([r.measured_replay_error_pct for r in self.runs])

    @property
    def stall_free(self) -> dict[str, float] | None:
        """MAPE and mean signed error with the stalls taken out of both sides, over the runs that allow it."""
        return _error_summary([r.stall_free_error_pct for r in self.runs])

    @property
    def hops(self) -> tuple[HopRow, ...]:
        """The hops whose consumer waited, real against predicted, by device types and message size."""
        return hop_rows(self.runs)

    @property
    def bottlenecks(self) -> tuple[BottleneckRow, ...]:
        """Every run's slowest stage, real and predicted (runs with a stage the traces do not time are left out)."""
        return tuple(row for row in map(bottleneck, self.runs) if row is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "fixtures": str(self.fixtures_dir),
            "model": str(self.model_path),
            "model_name": self.model_name,
            "model_sha256": self.model_sha256,
            "fixture_set_sha256": self.fixture_set_sha256,
            **self.suite.to_dict(),
            "measured_replay": self.measured_replay,
            "stall_free": self.stall_free,
            "hops": [h.to_dict() for h in self.hops],
            "bottlenecks": [b.to_dict() for b in self.bottlenecks],
            "overall": [c.to_dict() for c in self.overall],
            "ranked": [c.to_dict() for c in self.ranked],
            "iteration_level_runs": self.iteration_level_runs,
            "left_out": self.left_out,
            "by_configuration": list(self.by_configuration),
            "kernel_classes": self.kernel_classes,
            # the same list as ranked, under the name AGENTS.md reads: ranked by fixable_mape_pp
            "contributors": [c.to_dict() for c in self.ranked],
            "fields": CONTRIBUTOR_FIELDS,
            "runs": [r.to_dict() for r in self.runs],
        }


def error_by_configuration(runs: Sequence[RunRow]) -> tuple[dict[str, Any], ...]:
    """The throughput error by configuration group (`run_groups`: devices, pipeline ends, shape, microbatches,
    depth), largest share of the suite's MAPE first: the runs, their MAPE and mean signed error, and the pp of the
    suite MAPE they carry (what it would lose were they exact). Needs no events, so it covers every run."""
    if not runs:
        return ()
    groups: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for dimension, group in run_groups(run.spec).items():
            groups.setdefault((dimension, group), []).append(run.score.throughput_error_pct)
    rows = [
        {
            "dimension": dimension,
            "group": group,
            "n_runs": len(errors),
            "throughput_mape_pct": float(np.mean(np.abs(errors))),
            "mean_error_pct": float(np.mean(errors)),
            "contribution_pp": float(np.sum(np.abs(errors)) / len(runs)),
        }
        for (dimension, group), errors in groups.items()
        if len(errors) < len(runs)
    ]
    return tuple(sorted(rows, key=lambda row: -row["contribution_pp"]))


def _error_summary(values: list[float | None]) -> dict[str, float] | None:
    """Runs, MAPE and mean signed error (%) of the runs that have a value; None when none has."""
    errors = [v for v in values if v is not None]
    if not errors:
        return None
    return {
        "n_runs": len(errors),
        "throughput_mape_pct": float(np.mean(np.abs(errors))),
        "mean_error_pct": float(np.mean(errors)),
    }


def observe(
    fixtures_dir: Path | str,
    *,
    model_path: Path | str | None = None,
    split: str = "train",
    progress: Progress = QUIET,
    with_terms: bool = True,
) -> Observation:
    """Compare every run of the train split with its prediction, and rank where the throughput error comes from."""
    from hops_calib.loop.model_files import default_model, load_model
    from hops_calib.loop.suite import fixture_set_digest, open_store, refuse_test_split
    from hops_calib.research.kernel_truth import kernel_section

    refuse_test_split(split, "observe")
    model_path = Path(model_path) if model_path is not None else default_model()
    model = load_model(model_path)
    from hops_calib.loop.suite import left_out_summary, priced

    store = open_store(fixtures_dir)
    ids = store.ids(split)
    if not ids:
        raise InputError(
            fixtures_dir,
            f"the fixture store has no {split} fixtures",
            hint=f"ingest runs into it (hops-calib ingest SRC --fixtures {fixtures_dir})",
        )
    fixtures, left_out = priced(store.load_many(ids))
    if not fixtures:
        raise InputError(
            fixtures_dir,
            f"none of the {len(left_out)} {split} fixtures is priced by the cost model",
            field="split",
            hint="ingest runs the model prices (one GPU per pipeline stage)",
        )
    ids = [f.id for f in fixtures]
    runs, content_hashes = [], []
    progress.start(len(ids))
    for fixture in fixtures:
        runs.append(observe_run(fixture, model))
        content_hashes.append(fixture.content_hash)
        progress.advance(fixture.id)
    contributors = part_contributors(runs) + stage_contributors(runs)
    if with_terms and contributors:  # (the parts and stages come from events: no run with events, nothing to price)
        from hops_calib.research.pricing import pricing, terms_of

        found = pricing([r for r in runs if r.real_metrics.has_events], model)
        contributors = [
            replace(c, terms=tuple(terms_of(found, c.quantity, c.members, c.residuals))) for c in contributors
        ]
    relative = {
        c.quantity: c.noise_ms / abs(c.real_ms_mean)
        for c in contributors
        if c.dimension == "all" and c.noise_ms is not None and abs(c.real_ms_mean) > 0
    }
    contributors = [with_suite_noise(c, relative.get(c.quantity)) for c in contributors]
    # the runs without events: the terms of their predicted iteration, fitted to their iteration residuals
    iteration = iteration_contributors(runs, len(runs))
    if with_terms and iteration:
        from hops_calib.research.pricing import pricing, terms_of

        found = pricing(pricing_sample(runs), model, measure=measured_terms)
        iteration = [replace(c, terms=tuple(terms_of(found, c.quantity, c.members, c.residuals))) for c in iteration]
    contributors += iteration
    overall = tuple(c for c in contributors if c.dimension == "all")
    ranked = merge_same_runs(
        sorted((c for c in contributors if c.dimension != "all"), key=lambda c: (-_fixable(c), -c.contribution_pp))
    )
    ranked = judged_here(ranked, Path(fixtures_dir), fixture_set_digest(ids, content_hashes), fixtures)
    return Observation(
        split=split,
        fixtures_dir=Path(fixtures_dir),
        model_path=model_path,
        model_name=model.name,
        model_sha256=model.sha256,
        fixture_set_sha256=fixture_set_digest(ids, content_hashes),
        suite=aggregate(r.score for r in runs),
        runs=tuple(runs),
        overall=overall,
        ranked=tuple(ranked),
        left_out=left_out_summary(left_out),
        kernel_classes=kernel_section(fixtures, model),
    )


@dataclass(frozen=True)
class _OneStore:
    """A store as the calibration record's check reads it (`loop.calibration.check_store`): its folder, fixture set,
    run ids and specs."""

    fixtures_dir: Path
    sha256: str
    ids: tuple[str, ...]
    specs: tuple[Any, ...]

    @property
    def stores(self) -> tuple[_OneStore, ...]:
        return (self,)


def judged_here(ranked: list, fixtures_dir: Path, sha256: str, fixtures: list) -> list:
    """Each contributor's suggested parameter marked with whether a change of it may be judged on this store
    (`judged_here`, by the project ledger's calibration record, as `tune` and `evaluate` check it) and, where not,
    the stores its value was calibrated on (`judge_on`: pass them all as --fixtures, or take the device's own
    NAME@TYPE). Unmarked where no ledger is found."""
    from hops_calib.loop import calibration
    from hops_calib.loop.ledger import default_ledger

    try:
        record = calibration.read_record(default_ledger())
    except InputError:
        return ranked
    store = _OneStore(fixtures_dir, sha256, tuple(f.id for f in fixtures), tuple(f.spec for f in fixtures))
    checked: dict[tuple[str, str], Any] = {}
    out = []
    for contributor in ranked:
        terms = []
        for row in contributor.terms:
            if row.get("suggested"):
                key = (row["term"], row["param"])
                if key not in checked:
                    scope = calibration.scope_of_params(row["term"], [row["param"]])
                    checked[key] = calibration.check_store(record, scope, store, "observe", off_record=True)
                check = checked[key]
                row = {**row, "judged_here": check.holds}
                if not check.holds:
                    row["judge_on"] = [fs.path or fs.describe() for fs in check.calibrated_all]
            terms.append(row)
        out.append(replace(contributor, terms=tuple(terms)))
    return out
