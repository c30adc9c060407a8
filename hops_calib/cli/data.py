"""The data verbs: `ingest` and `fixtures list/show`, over the store room (`hops_calib.store`); they print the
store's views and return exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hops_calib.cli.output import guarded, refuse_job_dir_as_id
from hops_calib.cli.render import fixtures as render
from hops_calib.errors import InputError
from hops_calib.store import views
from hops_calib.store.digests import DEFAULT_LOCK_TIMEOUT_S, StoreError
from hops_calib.store.writer import FixtureStore
from hops_calib.trace.job import is_job_dir
from hops_calib.trace.megatron_log import DEFAULT_WARMUP_ITERATIONS

if TYPE_CHECKING:  # fixtures list/show need no trace reader
    from hops_calib.store.ingest import RunOutcome


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def ingest_command(sources: list[Path], fixtures: Path, split: str = "source", test_fraction: float = 0.3,
                   lenient: bool = False, skew_ms: float | None = None, gpu: str | None = None,
                   gpus_per_node: int | None = None, warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
                   as_json: bool = False, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT_S,
                   source: str = "auto") -> int:
    """Ingest and print a summary; warnings, rejected runs, what the search skipped (notes) and whom it waits for
    go to stderr (and, with --json, into the object). 0 when every run made it, 6 (partial) when some were
    rejected and the others stored, 2 for a bad store (or a lock still held after `lock_timeout` s), an unknown
    --gpu, or input of which nothing could be stored."""
    from hops_calib.cli.output import EXIT_INVALID, EXIT_OK, EXIT_PARTIAL, STATUS, print_json
    from hops_calib.progress import progress_bar
    from hops_calib.store.ingest import ingest
    from hops_calib.trace.measured import RunHardware

    if (gpu is None) != (gpus_per_node is None):
        _err("Error: --gpu and --gpus-per-node go together (the device type and how many share a node); give both")
        return 2
    hardware = (RunHardware(gpu=gpu.lower(), gpus_per_node=gpus_per_node)
                if gpu is not None and gpus_per_node is not None else None)
    store = FixtureStore(fixtures)
    existed = store.exists()

    def run() -> int:
        from hops_calib.loop.model_files import device_types

        known = device_types()
        if hardware is not None and hardware.gpu not in known:
            raise InputError("ingest", f"{gpu!r} is not a device type of the catalog (known: "
                             f"{', '.join(sorted(known))})", field="--gpu", hint="name one of them (a100: A100 SXM4 "
                             "80 GB), or add the type with its constants and their sources to "
                             "hops_calib/model/devices.toml")
        return ingest_and_print(known)

    def ingest_and_print(known: frozenset[str]) -> int:
        with progress_bar("ingest", quiet=as_json) as progress:
            def on_run(outcome: RunOutcome) -> None:
                progress.advance(outcome.run_id or str(outcome.source))
                for warning in outcome.warnings:
                    _err(f"warning: {outcome.run_id}: {warning}")
                if outcome.status == "rejected":
                    _err(f"rejected: {outcome.run_id}: {outcome.error}" if outcome.run_id
                         else f"rejected: {outcome.error}")

            extra = {} if skew_ms is None else {"skew_ms": skew_ms}
            try:
                report = ingest(sources, store, split=split, test_fraction=test_fraction, lenient=lenient,
                                on_run=on_run, on_start=progress.start, hardware=hardware,
                                warmup_iterations=warmup_iterations, device_types=known, lock_timeout=lock_timeout,
                                on_wait=lambda line: _err(f"{line} ..."), source=source, **extra)
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
            print_json({"fixtures": str(store.root),
                        **{status: report.count(status) for status in ("new", "updated", "unchanged", "rejected")},
                        "counts": views.ingest_counts(report, store),
                        "runs": [{"source": str(o.source), "run_id": o.run_id, "kind": o.kind, "status": o.status,
                                  "split": o.split, "split_from": o.split_from, "sources": o.sources,
                                  "priced": o.priced,
                                  "not_priced": o.not_priced, "error": o.error, "warnings": list(o.warnings)}
                                 for o in report.outcomes],
                        "warnings": [f"{o.run_id}: {w}" for o in report.outcomes for w in o.warnings],
                        "notes": list(report.notes) + views.ingest_notes(report)},
                       STATUS[code])
        else:
            print(render.ingest_summary(report, store))
        return code

    return guarded(run, as_json)


def list_command(fixtures: Path, as_json: bool = False, ledger: Path | None = None) -> int:
    def run() -> int:
        store = FixtureStore(fixtures)
        if not store.exists():
            raise StoreError(f"no fixture store at {fixtures}; run: hops-calib ingest SRC --fixtures {fixtures}")
        if is_job_dir(Path(fixtures)):
            raise StoreError(f"--fixtures {fixtures} is a job directory, not a fixture store; ingest it into a store "
                             f"(a new folder, or an existing store such as the shipped fixtures/): hops-calib ingest "
                             f"{fixtures} --fixtures STORE, then hops-calib fixtures list --fixtures STORE")
        store.check_writable()  # a folder that holds something else is said to be one, not listed as an empty store
        running = store.running()
        if running:
            _err(f"warning: {running}")
        from hops_calib.loop.heldout import withheld

        held = withheld(store, ledger)
        if as_json:
            from hops_calib.cli.output import print_json

            print_json({"fixtures_dir": str(store.root), "fixtures": views.fixture_rows(store, held)})
        else:
            print(render.list_text(store, held))
        return 0

    return guarded(run, as_json)


def show_command(fixture_id: str, fixtures: Path, as_json: bool = False, ledger: Path | None = None) -> int:
    """One fixture; errors (unknown id, missing store, a damaged fixture) exit 2, with --json also as an object."""
    def run() -> int:
        refuse_job_dir_as_id(fixture_id, fixtures, f"`hops-calib ingest DIR --fixtures {fixtures}`, then "
                             "`hops-calib fixtures show` with its run id")
        store = FixtureStore(fixtures)
        fixture = store.load(fixture_id)
        from hops_calib.loop.heldout import held_out_reason

        why = held_out_reason(store, fixture_id, ledger) if fixture.split == "train" else None
        if as_json:
            from hops_calib.cli.output import print_json

            print_json(views.show_dict(fixture, why))
        else:
            print(render.show_text(fixture, why))
        return 0

    return guarded(run, as_json)
