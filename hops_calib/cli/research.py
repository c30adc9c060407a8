"""The research verbs: observe, tune and crossval, computed by `hops_calib.research` and printed here as text or
JSON (a progress bar on a terminal's stderr meanwhile). tune and crossval hand their room one request
(`research.tune.TuneRequest`, `research.crossval.CrossvalRequest`), built here from their options."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.options import (
    ALLOW_HELD_OUT_OPTION,
    FIXTURES_MANY_OPTION,
    FIXTURES_OPTION,
    LEDGER_OPTION,
    MODEL_OPTION,
    OFF_RECORD_OPTION,
    fixtures_given,
)
from hops_calib.cli.output import held_out_guard, run_and_print


def observe_command(
    fixtures: Path,
    model_path: Path | None,
    split: str,
    as_json: bool,
    top: int,
    ledger_path: Path | None = None,
    allow_held_out: bool = False,
) -> int:
    """The `observe` verb: text (or JSON) on stdout, a progress bar on a terminal's stderr."""
    from hops_calib.cli.render.observe import observation_text
    from hops_calib.research.observe import observe

    return run_and_print(
        "observe",
        as_json,
        lambda bar: observe(fixtures, model_path=model_path, split=split, progress=bar),
        lambda observation: observation_text(observation, top=top),
        held_out_guard=held_out_guard(fixtures, ledger_path, "observe", allow_held_out),
    )


def observe(
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (every contributor and run)."),
    top: int = typer.Option(12, "--top", min=1, help="Contributors and runs shown in the text output."),
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Where the throughput error comes from: iteration parts and stage times by group, largest MAPE share first."""
    raise typer.Exit(observe_command(fixtures, model, split, as_json, top, ledger, allow_held_out))


def decompose(
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (every family and micro batch)."),
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Runs measured at iteration level cut into a layer's, a microbatch's and an iteration's time, measured and
    predicted, with each layer's least time on its device (docs/decompose.md)."""
    from hops_calib.cli.render.decompose import decomposition_text
    from hops_calib.research.decompose import decompose_store

    raise typer.Exit(
        run_and_print(
            "decompose",
            as_json,
            lambda bar: decompose_store(fixtures, model_path=model, split=split, progress=bar),
            decomposition_text,
            held_out_guard=held_out_guard(fixtures, ledger, "decompose", allow_held_out),
        )
    )


def tune(
    term: str = typer.Argument(..., help="The cost term whose parameters are searched (see `hops-calib terms`)."),
    trials: int = typer.Option(60, "--trials", min=1, help="Trials to run (shared among the workers)."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="Optuna storage URL: sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB (the [db] "
        "extra) or any RDB URL. Default: $HOPS_CALIB_STORAGE, else `storage` under \\[defaults] "
        "of the nearest hops-calib.toml, else in memory.",
    ),
    study: str | None = typer.Option(None, "--study", help="Study name (default: term, model and fixture set)."),
    workers: int = typer.Option(1, "--workers", min=1, help="Processes working on the study (needs --storage)."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(
        None, "--out", help="Candidate file to write (default: experiments/tune-TERM-trialN.toml)."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampler seed (tpe: worker k uses seed + k; sobol: the study's)."),
    sampler: str = typer.Option(
        "tpe",
        "--sampler",
        help="tpe (learns from the trials so far), or sobol (trial k is the study's k-th Sobol "
        "point: the same study with any number of workers; docs/distributed-tuning.md).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    objective: str = typer.Option(
        "suite",
        "--objective",
        help="suite: throughput MAPE, bubble MAE, -rho (Pareto); components: the error of "
        "the stage, optimizer and between-iteration times the traces measure.",
    ),
    only: list[str] | None = typer.Option(
        None, "--only", help="Search only this parameter (repeatable); the others keep the model's values."
    ),
    ledger: Path = LEDGER_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Optuna study over one term's parameters on the train split; writes the chosen Pareto point as a candidate
    (experiments/ID.toml). Exit 0 written, 1 none (no trial beats the model: status no_candidate), 4 off the record."""
    from hops_calib.cli.render.research import tune_text
    from hops_calib.cli.settings import default_storage
    from hops_calib.research.tune import TuneRequest, run_tune

    stores = fixtures_given(fixtures)

    def work(bar):
        # without --storage: $HOPS_CALIB_STORAGE, else the nearest hops-calib.toml's [defaults] storage, else memory
        request = TuneRequest(
            term,
            stores,
            model_path=model,
            trials=trials,
            storage_url=storage if storage is not None else default_storage()[0],
            study_name=study,
            workers=workers,
            seed=seed,
            out=out,
            objective=objective,
            only=tuple(only or ()),
            ledger_path=ledger,
            off_record=off_record,
            split=split,
            sampler=sampler,
        )
        return run_tune(request, progress=bar.update)

    raise typer.Exit(
        run_and_print(
            f"tune {term}",
            as_json,
            work,
            tune_text,
            held_out_guard=held_out_guard(stores, ledger, "tune", allow_held_out),
        )
    )


def crossval(
    term: str = typer.Argument(..., help="The cost term whose fit is cross-validated (see `hops-calib terms`)."),
    folds: int = typer.Option(
        5,
        "--folds",
        help="Folds of the train split's configurations (repeats stay together); "
        "as many as configurations: leave one configuration out.",
    ),
    evaluations: int = typer.Option(
        150, "--evaluations", min=1, help="Model evaluations per refit at most (one refit per fold, from defaults)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the fold assignment."),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (every fold and train run)."),
    objective: str = typer.Option("suite", "--objective", help="As for tune: suite or components."),
    only: list[str] | None = typer.Option(
        None, "--only", help="Refit only this parameter (repeatable); the others keep the model's values."
    ),
    shared: bool = typer.Option(
        False,
        "--shared",
        help="Take the refit parameters' per-device values (NAME@TYPE) out first: one value for every device.",
    ),
    also: list[str] | None = typer.Option(
        None, "--also", help="Another term's parameter refit together with TERM's, as TERM:PARAM (repeatable)."
    ),
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Refit one term without each fold of train configurations and predict that fold: held-out error from train."""
    from hops_calib.cli.render.research import crossval_text
    from hops_calib.research.crossval import CrossvalRequest, run_crossval

    request = CrossvalRequest(
        term,
        fixtures,
        model_path=model,
        folds=folds,
        evaluations=evaluations,
        seed=seed,
        objective=objective,
        only=tuple(only or ()),
        shared=shared,
        also=tuple(also or ()),
        split=split,
    )
    raise typer.Exit(
        run_and_print(
            f"crossval {term}",
            as_json,
            lambda bar: run_crossval(request, progress=bar.update),
            crossval_text,
            held_out_guard=held_out_guard(fixtures, ledger, "crossval", allow_held_out),
        )
    )
