"""The `fixtures list|show` verbs: the fixture store's views (`hops_calib.store.views`), as text or JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hops_calib.cli.options import FIXTURES_OPTION, LEDGER_OPTION
from hops_calib.cli.output import guarded, refuse_job_dir_as_id

app = typer.Typer(help="Look at the fixture store.", no_args_is_help=True)


@app.command("list")
def fixtures_list(
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (fixtures: one row each)."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """One line per fixture: split, observed and declared schedule, devices, throughput, bubble (test, and train runs
    held out: withheld)."""
    raise typer.Exit(list_command(fixtures, as_json, ledger))


@app.command("show")
def fixtures_show(
    fixture_id: str = typer.Argument(..., metavar="ID", help="Fixture id (see fixtures list)."),
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """A readable summary of one fixture: configuration, devices, per-stage medians, metrics, quality flags."""
    raise typer.Exit(show_command(fixture_id, fixtures, as_json, ledger))


def list_command(fixtures: Path, as_json: bool = False, ledger: Path | None = None) -> int:
    def run() -> int:
        from hops_calib.cli.render import fixtures as render
        from hops_calib.store import views
        from hops_calib.store.digests import StoreError
        from hops_calib.store.writer import FixtureStore
        from hops_calib.trace.job import is_job_dir

        store = FixtureStore(fixtures)
        if not store.exists():
            raise StoreError(f"no fixture store at {fixtures}; run: hops-calib ingest SRC --fixtures {fixtures}")
        if is_job_dir(Path(fixtures)):
            raise StoreError(
                f"--fixtures {fixtures} is a job directory, not a fixture store; ingest it into a store "
                f"(a new folder, or an existing store such as the shipped fixtures/): hops-calib ingest "
                f"{fixtures} --fixtures STORE, then hops-calib fixtures list --fixtures STORE"
            )
        store.check_writable()  # a folder that holds something else is said to be one, not listed as an empty store
        running = store.running()
        if running:
            print(f"warning: {running}", file=sys.stderr)
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
        from hops_calib.cli.render import fixtures as render
        from hops_calib.store import views
        from hops_calib.store.writer import FixtureStore

        refuse_job_dir_as_id(
            fixture_id,
            fixtures,
            f"`hops-calib ingest DIR --fixtures {fixtures}`, then `hops-calib fixtures show` with its run id",
        )
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
