"""The `plot timeline|parity|ledger` verbs: draw with `hops_calib.plot.images`, write the image, say where it went
and its size; exit codes as the loop's verbs (`hops_calib.cli.output.guarded`)."""

from __future__ import annotations

from pathlib import Path

from hops_calib.cli.output import EXIT_OK, guarded, refuse_job_dir_as_id


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
        print(f"wrote {path} (Chrome trace JSON, {len(trace['traceEvents'])} events: open it in ui.perfetto.dev or "
              "chrome://tracing)")
        window = trace.get("otherData", {}).get("window")
        if window:
            print(f"  exported: {window['note']}")
    return EXIT_OK


def timeline_command(fixture_id: str | None, fixtures: Path, model_path: Path | None, iterations: int | None,
                     out: Path | None, dpi: float, job: Path | None = None, schedules: tuple[str, ...] = (),
                     cluster: Path | None = None, perturbations: dict | None = None, chrome: Path | None = None,
                     ledger: Path | None = None, chrome_iterations: int | None = -1) -> int:
    def run() -> int:
        from hops_calib.cli.whatif import load_cluster, parse_perturbations
        from hops_calib.plot.images import timeline_image

        refuse_job_dir_as_id(fixture_id, fixtures, "`hops-calib plot timeline --job DIR`")
        if fixture_id is not None and job is None:
            from hops_calib.loop.heldout import refuse_held_out_run

            refuse_held_out_run(fixtures, fixture_id, ledger, "plot timeline")
        return _wrote(timeline_image(fixture_id, fixtures, model_path, iterations, out, dpi, job, schedules,
                                     load_cluster(cluster) if job is not None else None,
                                     parse_perturbations(perturbations, job), chrome, chrome_iterations))

    return guarded(run)


def parity_command(split: str, fixtures: Path, model_path: Path | None, out: Path | None, label_worst: int,
                   dpi: float, ledger: Path | None = None) -> int:
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
