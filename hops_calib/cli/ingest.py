"""The `ingest` verb: job directories, training logs and run tables into the fixture store (`hops_calib.store`);
it prints a summary (or one JSON object) and returns the exit code of the outcome."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hops_calib.cli.options import FIXTURES_OPTION
from hops_calib.cli.output import guarded

if TYPE_CHECKING:
    from hops_calib.store.ingest import RunOutcome


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def ingest(
    sources: list[Path] = typer.Argument(
        ...,
        help="Job directories, or folders holding job directories (searched recursively); Megatron training "
        "logs; run tables (.csv, .parquet), the published vTrain table included.",
    ),
    fixtures: Path = FIXTURES_OPTION,
    split: str = typer.Option(
        "source",
        "--split",
        help="source (default): the split the source states in a hops-calib-source.toml beside "
        "it, else train (your own runs); auto: the grouped, hashed train/test split the "
        "calibration sets need; or force train / test. A stored group keeps its split.",
    ),
    test_fraction: float = typer.Option(0.3, "--test-fraction", help="Share of new configuration groups put in test."),
    lenient: bool = typer.Option(
        False,
        "--lenient",
        help="Drop bad event lines, repeated events and iterations a cut-short log left "
        "incomplete (counted in quality flags) instead of rejecting the run.",
    ),
    clock_skew_ms: float | None = typer.Option(
        None,
        "--clock-skew-ms",
        min=0.0,
        help="How far (ms) a stage may seem to start before the stage feeding it finished, from the nodes' clock "
        "offsets, before the run is refused as impossible (default: 2).",
    ),
    gpu: str | None = typer.Option(
        None,
        "--gpu",
        help="Device type (of the model's catalog, e.g. a100) of logs and run tables that do not "
        "name theirs (no hops.base.yaml beside a log, no gpu column or sidecar).",
    ),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node, with --gpu."),
    warmup_iterations: int = typer.Option(
        2,
        "--warmup-iterations",
        min=0,
        help="Training logs: drop every logged interval that holds one of the log's first N iterations (slow warm-up).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object: counts, every run's outcome and warnings."
    ),
    lock_timeout: float = typer.Option(
        600.0,
        "--lock-timeout",
        min=0.0,
        help="Seconds to wait for the store lock another ingest holds (it says whose) before giving up (exit 2).",
    ),
    source: str = typer.Option(
        "auto",
        "--source",
        help="Which per-rank traces of a job directory to read (docs/traces.md). auto (default): the timing from "
        "megatron_trace/ (event logs), else from the profiler traces, and the per-kernel truth from "
        "torch_profile/ (Kineto) or nsys/ where present, both at once when the job holds an event log and a "
        "profiler trace; events, kineto, nsys: that source alone.",
    ),
) -> None:
    """Ingest Megatron job directories, training logs and run tables into the Parquet fixture store. Exit 0 every
    run stored, 6 some rejected (the others stored), 2 a bad store."""
    # Warnings, rejected runs, what the search skipped (notes) and whom it waits for go to stderr (and, with --json,
    # into the object); exit 2 also for a lock still held after --lock-timeout s, an unknown --gpu, or input of
    # which nothing could be stored.
    from hops_calib.cli.output import EXIT_INVALID, EXIT_OK, EXIT_PARTIAL, STATUS, print_json
    from hops_calib.cli.render import fixtures as render
    from hops_calib.errors import InputError
    from hops_calib.progress import progress_bar
    from hops_calib.store import views
    from hops_calib.store.ingest import ingest as ingest_sources
    from hops_calib.store.writer import FixtureStore
    from hops_calib.trace.measured import RunHardware

    if (gpu is None) != (gpus_per_node is None):
        _err("Error: --gpu and --gpus-per-node go together (the device type and how many share a node); give both")
        raise typer.Exit(2)
    hardware = (
        RunHardware(gpu=gpu.lower(), gpus_per_node=gpus_per_node)
        if gpu is not None and gpus_per_node is not None
        else None
    )
    store = FixtureStore(fixtures)
    existed = store.exists()

    def run() -> int:
        from hops_calib.loop.model_files import device_types

        known = device_types()
        if hardware is not None and hardware.gpu not in known:
            raise InputError(
                "ingest",
                f"{gpu!r} is not a device type of the catalog (known: {', '.join(sorted(known))})",
                field="--gpu",
                hint="name one of them (a100: A100 SXM4 "
                "80 GB), or add the type with its constants and their sources to "
                "hops_calib/model/devices.toml",
            )
        return ingest_and_print(known)

    def ingest_and_print(known: frozenset[str]) -> int:
        with progress_bar("ingest", quiet=as_json) as progress:

            def on_run(outcome: RunOutcome) -> None:
                progress.advance(outcome.run_id or str(outcome.source))
                for warning in outcome.warnings:
                    _err(f"warning: {outcome.run_id}: {warning}")
                if outcome.status == "rejected":
                    _err(
                        f"rejected: {outcome.run_id}: {outcome.error}"
                        if outcome.run_id
                        else f"rejected: {outcome.error}"
                    )

            extra = {} if clock_skew_ms is None else {"skew_ms": clock_skew_ms}
            try:
                report = ingest_sources(
                    sources,
                    store,
                    split=split,
                    test_fraction=test_fraction,
                    lenient=lenient,
                    on_run=on_run,
                    on_start=progress.start,
                    hardware=hardware,
                    warmup_iterations=warmup_iterations,
                    device_types=known,
                    lock_timeout=lock_timeout,
                    on_wait=lambda line: _err(f"{line} ..."),
                    source=source,
                    **extra,
                )
            except Exception:
                if not existed:
                    store.remove_if_empty()  # (a first ingest stopped by a full disk leaves no store behind)
                raise
        if not existed:
            store.remove_if_empty()  # a first ingest that stored nothing leaves no store behind
        # every run stored: 0; some rejected, others stored (or there already): 6; nothing usable: 2 (bad input)
        code = EXIT_OK if report.ok else EXIT_PARTIAL if report.stored else EXIT_INVALID
        for note in report.notes:
            _err(f"note: {note}")
        if as_json:
            print_json(
                {
                    "fixtures": str(store.root),
                    **{status: report.count(status) for status in ("new", "updated", "unchanged", "rejected")},
                    "counts": views.ingest_counts(report, store),
                    "runs": [
                        {
                            "source": str(o.source),
                            "run_id": o.run_id,
                            "kind": o.kind,
                            "status": o.status,
                            "split": o.split,
                            "split_from": o.split_from,
                            "sources": o.sources,
                            "priced": o.priced,
                            "not_priced": o.not_priced,
                            "error": o.error,
                            "warnings": list(o.warnings),
                        }
                        for o in report.outcomes
                    ],
                    "warnings": [f"{o.run_id}: {w}" for o in report.outcomes for w in o.warnings],
                    "notes": list(report.notes) + views.ingest_notes(report),
                },
                STATUS[code],
            )
        else:
            print(render.ingest_summary(report, store))
        return code

    raise typer.Exit(guarded(run, as_json))
