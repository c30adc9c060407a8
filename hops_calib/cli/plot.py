"""The `plot timeline|parity|ledger` verbs: draw with `hops_calib.plot.images`, write the image, say where it went
and its size; exit codes as the loop's verbs (`hops_calib.cli.output.guarded`)."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.options import (
    CLUSTER_OPTION,
    FIXTURES_OPTION,
    LEDGER_OPTION,
    MODEL_OPTION,
    NO_CLUSTER_OPTION,
    cluster_of,
    with_perturbations,
)
from hops_calib.cli.output import EXIT_OK, guarded, refuse_job_dir_as_id

app = typer.Typer(
    help="Pictures: timelines (real vs predicted), parity plots, ledger history. PNG or SVG by the --out suffix.",
    no_args_is_help=True,
)
DPI_OPTION = typer.Option(150.0, "--dpi", help="Pixels per inch of a PNG (the figure's size is fixed in inches).")


@app.command("timeline")
@with_perturbations
def plot_timeline(
    ctx: typer.Context,
    fixture_id: str | None = typer.Argument(None, metavar="[ID]", help="Fixture id (train split; see fixtures list)."),
    job: Path | None = typer.Option(
        None,
        "--job",
        help="Instead of a fixture: a job directory that has not run (what-if; its configuration files only).",
    ),
    schedules: list[str] | None = typer.Option(
        None,
        "--schedule",
        help="With --job: one predicted panel per schedule (repeatable); default the configured one.",
    ),
    iterations: int | None = typer.Option(
        None,
        "--iterations",
        help="Show the first K whole iterations. "
        "Default 2, fewer, down to the start of one, when a forward would be "
        "under 6 px wide (the title says which window is drawn).",
    ),
    fixtures: Path = FIXTURES_OPTION,
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Image to write, *.png or *.svg (default: "
        "timeline-ID.png, with --job timeline-<job folder name>.png, in the current "
        "directory; with --chrome, no image unless --out asks for one).",
    ),
    chrome: Path | None = typer.Option(
        None,
        "--chrome",
        help="Write the panels as Chrome trace JSON (*.json: "
        "Perfetto or chrome://tracing opens it, zoomable) instead of an image "
        "(as well as one with --out): their first 3 iterations, see "
        "--chrome-iterations and --chrome-all.",
    ),
    chrome_iterations: int | None = typer.Option(
        None, "--chrome-iterations", help="With --chrome: export each panel's first K iterations (default 3)."
    ),
    chrome_all: bool = typer.Option(
        False, "--chrome-all", help="With --chrome: export whole runs (a large job's can be hundreds of MB)."
    ),
    dpi: float = DPI_OPTION,
    ledger: Path = LEDGER_OPTION,
    perturbations: dict | None = None,
) -> None:
    """The real run above its prediction on one time axis: a lane per stage, bars by phase, sends, idle time, and
    the kernel classes under each step where the run has per-kernel truth (a profiler trace); with --job, a
    configuration's predictions under each schedule (and, with stragglers or failures, a perturbed draw)."""
    raise typer.Exit(
        timeline_command(
            fixture_id,
            fixtures,
            model,
            iterations,
            out,
            dpi,
            job,
            tuple(schedules or ()),
            cluster_of(ctx, cluster, no_cluster),
            perturbations,
            chrome,
            ledger,
            _chrome_window(chrome_iterations, chrome_all),
        )
    )


def _chrome_window(iterations: int | None, whole: bool) -> int | None:
    """The Chrome export's window: K iterations, None for whole runs, -1 for the default."""
    if whole and iterations is not None:
        raise typer.BadParameter(
            "--chrome-iterations and --chrome-all given together: give one (K iterations, or whole runs)",
            param_hint="--chrome-all",
        )
    return None if whole else -1 if iterations is None else iterations


@app.command("parity")
def plot_parity(
    split: str = typer.Option("train", "--split", help="Only 'train': held-out runs are seen only in aggregate."),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(
        None, "--out", help="Image to write, *.png or *.svg (default: parity-train.png in the current directory)."
    ),
    label_worst: int = typer.Option(3, "--label-worst", help="Label this many worst runs in each panel."),
    dpi: float = DPI_OPTION,
    ledger: Path = LEDGER_OPTION,
) -> None:
    """Predicted vs real throughput and bubble, one point per run, coloured by device mix."""
    raise typer.Exit(parity_command(split, fixtures, model, out, label_worst, dpi, ledger))


@app.command("ledger")
def plot_ledger(
    ledger: Path = LEDGER_OPTION,
    out: Path | None = typer.Option(
        None, "--out", help="Image to write, *.png or *.svg (default: ledger-history.png in the current directory)."
    ),
    dpi: float = DPI_OPTION,
    candidates: str | None = typer.Option(
        None,
        "--candidates",
        help="Only candidates whose id matches this regular expression (one campaign, when "
        "a ledger holds campaigns on different fixture sets).",
    ),
) -> None:
    """Suite MAPE, bubble MAE and rho after each accepted change; rejected candidates and held-out reports marked."""
    raise typer.Exit(ledger_command(ledger, out, dpi, candidates))


def _wrote(image) -> int:
    from hops_calib.plot.images import write_image

    for note in image.notes:
        print(note)
    if image.target is not None:
        size = write_image(image)
        print(f"wrote {image.target} ({size})")
    if image.chrome is not None:
        import json

        from hops_calib.files import atomic_write

        path, trace = image.chrome
        atomic_write(path, json.dumps(trace, separators=(",", ":")))
        print(
            f"wrote {path} (Chrome trace JSON, {len(trace['traceEvents'])} events: open it in ui.perfetto.dev or "
            "chrome://tracing)"
        )
        window = trace.get("otherData", {}).get("window")
        if window:
            print(f"  exported: {window['note']}")
    return EXIT_OK


def timeline_command(
    fixture_id: str | None,
    fixtures: Path,
    model_path: Path | None,
    iterations: int | None,
    out: Path | None,
    dpi: float,
    job: Path | None = None,
    schedules: tuple[str, ...] = (),
    cluster: Path | None = None,
    perturbations: dict | None = None,
    chrome: Path | None = None,
    ledger: Path | None = None,
    chrome_iterations: int | None = -1,
) -> int:
    def run() -> int:
        from hops_calib.cli.whatif import load_cluster, parse_perturbations
        from hops_calib.plot.images import timeline_image

        refuse_job_dir_as_id(fixture_id, fixtures, "`hops-calib plot timeline --job DIR`")
        if fixture_id is not None and job is None:
            from hops_calib.loop.heldout import refuse_held_out_run

            refuse_held_out_run(fixtures, fixture_id, ledger, "plot timeline")
        return _wrote(
            timeline_image(
                fixture_id,
                fixtures,
                model_path,
                iterations,
                out,
                dpi,
                job,
                schedules,
                load_cluster(cluster) if job is not None else None,
                parse_perturbations(perturbations, job),
                chrome,
                chrome_iterations,
            )
        )

    return guarded(run)


def parity_command(
    split: str,
    fixtures: Path,
    model_path: Path | None,
    out: Path | None,
    label_worst: int,
    dpi: float,
    ledger: Path | None = None,
) -> int:
    def run() -> int:
        from hops_calib.cli.output import held_out_guard
        from hops_calib.plot.images import parity_image

        held_out_guard(fixtures, ledger, "plot parity", False)()
        return _wrote(parity_image(split, fixtures, model_path, out, label_worst, dpi))

    return guarded(run)


def ledger_command(ledger: Path | None, out: Path | None, dpi: float, candidates: str | None = None) -> int:
    def run() -> int:
        from hops_calib.plot.images import ledger_image

        return _wrote(ledger_image(ledger, out, dpi, candidates))

    return guarded(run)
