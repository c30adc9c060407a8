"""The `version` verb."""

from __future__ import annotations

import typer

from hops_calib import __version__


def version() -> None:
    """Print the hops-calib version."""
    typer.echo(__version__)
