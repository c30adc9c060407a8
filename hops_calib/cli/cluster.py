"""The `cluster` verb: build a cluster file from job directories, or check one (`hops_calib.cli.whatif`)."""

from __future__ import annotations

from pathlib import Path

import typer


def cluster(
    sources: list[Path] | None = typer.Argument(
        None, help="Job directories, or folders holding them (found recursively)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Cluster file to write (YAML)."),
    check: Path | None = typer.Option(
        None,
        "--check",
        help="Instead: read this cluster file (written by hand or "
        "edited) and say what it holds, or the line, field and fix of its first "
        "error (exit 2).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the cluster as JSON instead of a summary."),
) -> None:
    """Build the cluster of job directories: every device's host (the pair files name the hosts of their ranks) and
    every benchmarked host pair's link (pooled over the runs that measured it). Edit it by hand to declare links;
    --check FILE validates it."""
    from hops_calib.cli.whatif import cluster_check_command, cluster_command

    if check is not None:
        if sources or out is not None:
            raise typer.BadParameter(
                "--check reads a cluster file; it takes no job directories and no --out", param_hint="--check"
            )
        raise typer.Exit(cluster_check_command(check, as_json))
    if not sources or out is None:
        raise typer.BadParameter("give job directories and --out FILE (or --check FILE)", param_hint="--out")
    raise typer.Exit(cluster_command(sources, out, as_json))
