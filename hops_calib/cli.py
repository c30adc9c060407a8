"""The typer app: one thin function per verb, no logic of its own."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from hops_calib import __version__

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)
fixtures_app = typer.Typer(help="Look at the fixture store.", no_args_is_help=True)
app.add_typer(fixtures_app, name="fixtures")

FIXTURES_OPTION = typer.Option(Path("fixtures"), "--fixtures", help="Fixture store folder.")


@app.command()
def version() -> None:
    """Print the hops-calib version."""
    typer.echo(__version__)


@app.command()
def ingest(
    sources: List[Path] = typer.Argument(
        ..., help="Job directories, or folders holding job directories (searched recursively)."),
    fixtures: Path = FIXTURES_OPTION,
    split: str = typer.Option("auto", "--split", help="auto (grouped, hashed), or force train / test."),
    test_fraction: float = typer.Option(0.3, "--test-fraction", help="Share of new configuration groups put in test."),
    lenient: bool = typer.Option(
        False, "--lenient", help="Drop bad event lines (counted in quality flags) instead of rejecting the run."),
) -> None:
    """Ingest Megatron job directories into the Parquet fixture store."""
    from hops_calib.store.commands import ingest_command

    raise typer.Exit(ingest_command(sources, fixtures, split, test_fraction, lenient))


@fixtures_app.command("list")
def fixtures_list(
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array."),
) -> None:
    """One line per fixture: split, observed and declared schedule, devices, throughput, bubble."""
    from hops_calib.store.commands import list_command

    raise typer.Exit(list_command(fixtures, as_json))


@fixtures_app.command("show")
def fixtures_show(
    fixture_id: str = typer.Argument(..., metavar="ID", help="Fixture id (see fixtures list)."),
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """A readable summary of one fixture: configuration, devices, per-stage medians, metrics, quality flags."""
    from hops_calib.store.commands import show_command

    raise typer.Exit(show_command(fixture_id, fixtures, as_json))


@app.command()
def plan(
    stages: int = typer.Option(..., "--stages", help="Pipeline stages (devices), p."),
    microbatches: int = typer.Option(..., "--microbatches", help="Microbatches per iteration, m."),
    memory_budget: float = typer.Option(..., "--memory-budget",
                                        help="Activation slots per device (one microbatch of one stage each)."),
    forward_cost: float = typer.Option(1.0, "--forward-cost", help="Forward time of one microbatch on one stage."),
    backward_cost: float = typer.Option(2.0, "--backward-cost", help="Whole backward time (input + weight grads)."),
    weight_grad_cost: float = typer.Option(0.0, "--weight-grad-cost",
                                           help="Weight-gradient part of the backward; > 0 adds ZB-H1."),
    chunks: int = typer.Option(1, "--chunks", help="Model chunks per device; > 1 adds interleaved 1F1B."),
    target_bubble: float = typer.Option(None, "--target-bubble",
                                        help="Also print the microbatches balanced 1F1B needs for this bubble."),
    as_json: bool = typer.Option(False, "--json", help="Print {chosen, candidates, ...} as JSON."),
) -> None:
    """Choose the pipeline schedule with the lowest bubble that fits a per-device activation budget."""
    import json

    from hops_calib.plan import format_plan, plan as make_plan

    try:
        result = make_plan(stages, microbatches, memory_budget, forward_cost, backward_cost, weight_grad_cost,
                           chunks, target_bubble)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_plan(result))


def main() -> None:
    app()
