"""The typer app: one thin function per verb, no logic of its own."""

from __future__ import annotations

import typer

from hops_calib import __version__

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the hops-calib version."""
    typer.echo(__version__)


def main() -> None:
    app()
