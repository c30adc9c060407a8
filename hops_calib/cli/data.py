"""The data verbs: `ingest` and `fixtures list/show`, over the store room (`hops_calib.store`); they print the
store's views and return exit codes."""

from __future__ import annotations

import sys
from pathlib import Path

from hops_calib.cli.output import guarded
from hops_calib.store import views
from hops_calib.store.fixture_store import DEFAULT_LOCK_TIMEOUT_S, FixtureStore, StoreError
from hops_calib.store.ingest import RunOutcome, ingest


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def ingest_command(sources: list[Path], fixtures: Path, split: str = "auto", test_fraction: float = 0.3,
                   lenient: bool = False, skew_ms: float | None = None,
                   lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT_S) -> int:
    """Ingest and print a summary; rejected runs go to stderr. 0 when every run made it, 1 otherwise."""
    from hops_calib.progress import progress_bar

    store = FixtureStore(fixtures)
    with progress_bar("ingest") as progress:
        def on_run(outcome: RunOutcome) -> None:
            progress.advance(outcome.run_id or str(outcome.source))
            for warning in outcome.warnings:
                _err(f"warning: {outcome.run_id}: {warning}")
            if outcome.status == "rejected":
                _err(f"rejected: {outcome.run_id}: {outcome.error}" if outcome.run_id else f"rejected: {outcome.error}")

        try:
            extra = {} if skew_ms is None else {"skew_ms": skew_ms}
            report = ingest(sources, store, split=split, test_fraction=test_fraction, lenient=lenient,
                            on_run=on_run, on_start=progress.start, lock_timeout=lock_timeout,
                            on_wait=lambda line: _err(f"{line} ..."), **extra)
        except StoreError as err:
            _err(f"error: {err}")
            return 2
    for note in report.notes:
        _err(f"note: {note}")
    print(views.ingest_summary(report, store))
    return 0 if report.ok else 1


def list_command(fixtures: Path, as_json: bool = False) -> int:
    def run() -> int:
        store = FixtureStore(fixtures)
        if not store.exists():
            raise StoreError(f"no fixture store at {fixtures}; run: hops-calib ingest SRC --fixtures {fixtures}")
        running = store.running()
        if running:
            _err(f"warning: {running}")
        print(views.list_json(store) if as_json else views.list_text(store))
        return 0

    return guarded(run, as_json)


def show_command(fixture_id: str, fixtures: Path, as_json: bool = False) -> int:
    """One fixture; errors (unknown id, missing store, a damaged fixture) exit 2, with --json also as an object."""
    import json

    def run() -> int:
        fixture = FixtureStore(fixtures).load(fixture_id)
        print(json.dumps(views.show_dict(fixture), indent=1) if as_json else views.show_text(fixture))
        return 0

    return guarded(run, as_json)
