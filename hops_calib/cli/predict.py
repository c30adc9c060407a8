"""The `predict` verbs: `predict run ID` (a stored fixture, predicted from its configuration alone, beside its
measurement), `predict all` (every train fixture and the suite), `predict job DIR` (a configuration that has not
run: what-if, several schedules side by side); printed by `cli.loop` and `cli.whatif`. The old spellings
(`predict ID`, `predict --all`, `predict --job DIR`) still work (`cli.verbs.DefaultVerbGroup`). Each option is
declared once, here, and shared by the sub-verb that reads it and the old spelling."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.options import (
    ALLOW_HELD_OUT_OPTION,
    CLUSTER_OPTION,
    FIXTURES_HELP,
    LEDGER_OPTION,
    MODEL_OPTION,
    NO_CLUSTER_OPTION,
    with_perturbations,
)
from hops_calib.cli.options import cluster_of as _cluster
from hops_calib.cli.options import default_path as _default
from hops_calib.cli.options import given as _given
from hops_calib.cli.verbs import LEGACY, DefaultVerbGroup, OldSpelling

app = typer.Typer(
    cls=DefaultVerbGroup,
    no_args_is_help=True,
    help="Predict from the configuration alone: `predict run ID` (a stored fixture beside its measurement), "
    "`predict all` (every train fixture and the suite), `predict job DIR` (a configuration that has not run). "
    "The old spellings `predict ID`, `predict --all` and `predict --job DIR` still work.",
)

JOB_HELP = (
    "A job directory to predict before it runs: megatron_args.txt (Megatron's flags: tensor, pipeline, data "
    "and sequence parallelism, distributed optimizer, recomputation, modern layers; torchrun "
    "--nnodes/--nproc-per-node place ranks on nodes), hops_trace_map.json, hops.base.yaml (the GPU type), "
    "link benchmark (optional on nodes). Prints the time by kind per stage, memory per GPU, samples/s and "
    "MFU; a flag the model does not price is refused naming it, one it does not know is named in a note."
)
ID_HELP = "Fixture id (train split)."
SCHEDULES = typer.Option(
    None,
    "--schedule",
    help="With --job: simulate this schedule (repeatable: 1f1b, "
    "interleaved_1f1b, gpipe, zb_h1, auto); default the configured one.",
)
PREDICT_FIXTURES = typer.Option(
    ...,
    "--fixtures",
    default_factory=_default("fixtures"),
    show_default=False,
    help=FIXTURES_HELP + " With --job, the store whose train split the configuration is "
    "checked against for coverage: pass the store the model was calibrated on.",
)
AS_JSON = typer.Option(False, "--json", help="Print JSON.")
KERNELS = typer.Option(
    False,
    "--kernels",
    help="With --job: also the kernel table of a stage (each kernel Megatron "
    "launches per microbatch: shape, FLOPs, bytes, time, what bounds it; "
    "priced by decoder_kernels' values, its defaults when the model does "
    "not activate it).",
)
KERNEL_STAGE = typer.Option(
    None, "--kernel-stage", help="With --kernels: the virtual stage to list (default: the slowest).", show_default=False
)


def _predict(
    ctx: typer.Context,
    fixture_id: str | None,
    all_train: bool,
    job: Path | None,
    schedules: list[str] | None,
    fixtures: Path,
    cluster: Path | None,
    no_cluster: bool,
    model: Path | None,
    as_json: bool,
    kernels: bool,
    kernel_stage: int | None,
    perturbations: dict | None,
    ledger: Path | None,
    allow_held_out: bool,
) -> int:
    from hops_calib.cli.loop import predict_command

    return predict_command(
        fixture_id,
        all_train,
        fixtures,
        model,
        as_json,
        job,
        schedules or (),
        fixtures_defaulted=not _given(ctx, "fixtures"),
        cluster=_cluster(ctx, cluster, no_cluster),
        perturbations=perturbations,
        ledger_path=ledger,
        allow_held_out=allow_held_out,
        kernels=kernels,
        kernel_stage=kernel_stage,
    )


@app.command("run")
def predict_run(
    ctx: typer.Context,
    fixture_id: str = typer.Argument(..., metavar="ID", help=ID_HELP),
    fixtures: Path = PREDICT_FIXTURES,
    model: Path | None = MODEL_OPTION,
    as_json: bool = AS_JSON,
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Predicted vs real throughput, bubble, per-stage utilization and phase times of a stored fixture, from its
    configuration alone, with the breakdown, memory and pricing inputs `predict job` prints (the old spelling:
    predict ID)."""
    raise typer.Exit(
        _predict(
            ctx,
            fixture_id,
            False,
            None,
            None,
            fixtures,
            None,
            True,
            model,
            as_json,
            False,
            None,
            None,
            ledger,
            allow_held_out,
        )
    )


@app.command("all")
def predict_all(
    ctx: typer.Context,
    fixtures: Path = PREDICT_FIXTURES,
    model: Path | None = MODEL_OPTION,
    as_json: bool = AS_JSON,
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Every train fixture: per-run errors and the suite (the old spelling: predict --all)."""
    raise typer.Exit(
        _predict(
            ctx, None, True, None, None, fixtures, None, True, model, as_json, False, None, None, ledger, allow_held_out
        )
    )


@app.command("job")
@with_perturbations
def predict_job(
    ctx: typer.Context,
    job: Path = typer.Argument(..., metavar="DIR", help=JOB_HELP),
    schedules: list[str] | None = SCHEDULES,
    fixtures: Path = PREDICT_FIXTURES,
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = AS_JSON,
    kernels: bool = KERNELS,
    kernel_stage: int | None = KERNEL_STAGE,
    perturbations: dict | None = None,
    ledger: Path = LEDGER_OPTION,
) -> None:
    """A configuration that has not run (what-if): several schedules side by side, each hop priced by the hosts at
    its ends; with stragglers and failures, also their mean and 5th-percentile throughput (the old spelling:
    predict --job DIR)."""
    raise typer.Exit(
        _predict(
            ctx,
            None,
            False,
            job,
            schedules,
            fixtures,
            cluster,
            no_cluster,
            model,
            as_json,
            kernels,
            kernel_stage,
            perturbations,
            ledger,
            False,
        )
    )


@app.command(LEGACY, hidden=True, cls=OldSpelling)
@with_perturbations
def predict(
    ctx: typer.Context,
    fixture_id: str | None = typer.Argument(None, metavar="[ID]", help=ID_HELP),
    all_train: bool = typer.Option(False, "--all", help="Every train fixture: per-run errors and the suite."),
    job: Path | None = typer.Option(None, "--job", help=JOB_HELP),
    schedules: list[str] | None = SCHEDULES,
    fixtures: Path = PREDICT_FIXTURES,
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = AS_JSON,
    kernels: bool = KERNELS,
    kernel_stage: int | None = KERNEL_STAGE,
    perturbations: dict | None = None,
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """The old spelling of the predict verbs: predict ID (predict run ID), predict --all (predict all), predict
    --job DIR (predict job DIR)."""
    raise typer.Exit(
        _predict(
            ctx,
            fixture_id,
            all_train,
            job,
            schedules,
            fixtures,
            cluster,
            no_cluster,
            model,
            as_json,
            kernels,
            kernel_stage,
            perturbations,
            ledger,
            allow_held_out,
        )
    )
