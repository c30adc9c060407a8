"""Store room: the collective benchmarks (all-reduce tables) that iteration-level runs are priced with, kept in the
store itself, so that a store stands alone: moved elsewhere, or with the tables' source folder changed or gone,
it predicts as it did when ingested.

    <store>/.collectives/<sha256>.json   the tables of one machine (`CollectiveTable`s: op, GPUs, (bytes, ms)
                                         points, source), named by the sha256 of the file's text

A table folder's run names its tables by that digest (`hardware.collectives`), so a run's content hash and its
table folder's runs.parquet digest cover them; the 1,440 vTrain runs share one file, written once per store
(content-addressed: the same tables are the same file). Loading checks the file's sha256 against its name: a
changed, torn or missing file is refused naming it (ingest the source again). The folder's name starts with a dot,
which no fixture id may, so it never takes a run's place.
"""

from __future__ import annotations

import json
from pathlib import Path

from hops_calib.store.addressed import digest_of, load_parsed, put_text
from hops_calib.trace.collective_bench import CollectiveTable, read_collective_tables

COLLECTIVES_DIR = ".collectives"
HARDWARE_KEY = "collectives"  # a run's hardware entry: the sha256 of its tables' file


def tables_text(tables: tuple[CollectiveTable, ...]) -> str:
    """The stored form of a machine's tables (canonical JSON: one text per content)."""
    data = [{"op": t.op, "gpus": t.gpus, "source": t.source, "points": [list(p) for p in t.points]} for t in tables]
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def source_digest(folder: str | Path) -> str:
    """The sha256 the tables read from a source folder would be stored under (TraceError for a bad table)."""
    return digest_of(tables_text(read_collective_tables(Path(folder))))


def store_collectives(store_root: Path, folder: str | Path) -> str:
    """Read a machine's all-reduce tables from their source folder and keep them in the store (once: a file of the
    same digest is already them); returns the digest a run's hardware names them by. TraceError for a bad table."""
    return put_text(store_root, COLLECTIVES_DIR, tables_text(read_collective_tables(Path(folder))))


def load_collectives(store_root: Path, digest: str) -> tuple[CollectiveTable, ...]:
    """The tables a run names by `digest`, from the store; FixtureFileError when the file is missing or not the one
    ingest wrote."""
    return load_parsed(
        store_root,
        COLLECTIVES_DIR,
        digest,
        _parse,
        what="the all-reduce tables of runs that name them",
        hint=(
            "ingest the runs' source again (it stores the all-reduce tables they are priced "
            "with); a store is moved or copied whole, its .collectives folder too"
        ),
    )


def _parse(data: list) -> tuple[CollectiveTable, ...]:
    return tuple(
        CollectiveTable(
            op=t["op"],
            gpus=int(t["gpus"]),
            source=t["source"],
            points=tuple((float(b), float(ms)) for b, ms in t["points"]),
        )
        for t in data
    )
