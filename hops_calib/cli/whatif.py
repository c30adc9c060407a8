"""The what-if verbs: `plan` (a schedule for a pipeline that fits a memory budget) and `predict --job` (a job
directory priced before it runs), computed by `hops_calib.whatif` and printed here."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import typer

from hops_calib.cli.output import EXIT_OK, print_json
from hops_calib.errors import InputError


def plan_command(stages: int, microbatches: int, memory_budget: float, forward_cost: float, backward_cost: float,
                 weight_grad_cost: float, chunks: int, target_bubble: float | None, as_json: bool) -> None:
    """Print the plan (a bad value is a usage error naming it, exit 2)."""
    from hops_calib.whatif.plan import plan_report

    try:
        report = plan_report(stages, microbatches, memory_budget, forward_cost, backward_cost, weight_grad_cost,
                             chunks, target_bubble, as_json)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(report)


def _calibration_coverage(fixtures: Path, defaulted: bool = False):
    """The train split of the fixture store as a what-if's calibration runs, and how to name them (its absolute
    path, and that it is the default store when --fixtures was not given); (None, why) when there is no store."""
    from hops_calib.loop.suite import load_suite
    from hops_calib.model.coverage import coverage

    default = "; --fixtures not given: the default, ./fixtures in the current directory" if defaulted else ""
    try:
        suite = load_suite(fixtures, "train")
    except InputError as error:
        return None, (f"{error} (store {fixtures.resolve()}{default}; pass --fixtures with the store the model was "
                      "calibrated on)")
    return coverage(suite.specs), f"train split of {fixtures.resolve()}, {len(suite.ids)} runs{default}"


def predict_job(job: Path, model_path: Path | None, schedules: Sequence[str], fixtures: Path, fixtures_defaulted: bool,
                as_json: bool) -> int:
    """`predict --job DIR`: the configuration under each schedule, and where it lies outside the store's train
    runs. Errors are the caller's (`hops_calib.cli.output.guarded`)."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job import what_if, what_if_text

    result = what_if(job, load_model(model_path), schedules, *_calibration_coverage(fixtures, fixtures_defaulted))
    if as_json:
        print_json(result.to_dict())
    else:
        print(what_if_text(result))
    return EXIT_OK
