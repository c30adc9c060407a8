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
from functools import lru_cache
from pathlib import Path

from hops_calib.files import atomic_write
from hops_calib.store.digests import FixtureFileError, text_digest
from hops_calib.trace.collective_bench import CollectiveTable, read_collective_tables

COLLECTIVES_DIR = ".collectives"
HARDWARE_KEY = "collectives"  # a run's hardware entry: the sha256 of its tables' file


def tables_text(tables: tuple[CollectiveTable, ...]) -> str:
    """The stored form of a machine's tables (canonical JSON: one text per content)."""
    data = [{"op": t.op, "gpus": t.gpus, "source": t.source, "points": [list(p) for p in t.points]} for t in tables]
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def _digest(text: str) -> str:
    return text_digest(text)


def source_digest(folder: str | Path) -> str:
    """The sha256 the tables read from a source folder would be stored under (TraceError for a bad table)."""
    return _digest(tables_text(read_collective_tables(Path(folder))))


def store_collectives(store_root: Path, folder: str | Path) -> str:
    """Read a machine's all-reduce tables from their source folder and keep them in the store (once: a file of the
    same digest is already them); returns the digest a run's hardware names them by. TraceError for a bad table."""
    text = tables_text(read_collective_tables(Path(folder)))
    digest = _digest(text)
    path = Path(store_root) / COLLECTIVES_DIR / f"{digest}.json"
    if not (path.is_file() and _file_ok(path, digest)):
        atomic_write(path, text)
    return digest


def _file_ok(path: Path, digest: str) -> bool:
    try:
        return _digest(path.read_text(encoding="utf-8")) == digest
    except (OSError, UnicodeDecodeError):
        return False


def load_collectives(store_root: Path, digest: str) -> tuple[CollectiveTable, ...]:
    """The tables a run names by `digest`, from the store; FixtureFileError when the file is missing or not the one
    ingest wrote."""
    path = Path(store_root).resolve() / COLLECTIVES_DIR / f"{digest}.json"
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None
    return _load(str(path), digest, stamp)


@lru_cache(maxsize=16)  # a file checked once is read again only when it changes (its mtime or size)
def _load(path_text: str, digest: str, stamp: tuple[int, int] | None) -> tuple[CollectiveTable, ...]:
    path = Path(path_text)
    hint = ("ingest the runs' source again (it stores the all-reduce tables they are priced with); a store is "
            "moved or copied whole, its .collectives folder too")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FixtureFileError(path, "is missing (the all-reduce tables of runs that name them)", hint=hint) from None
    except (OSError, UnicodeDecodeError) as err:
        raise FixtureFileError(path, f"cannot be read: {err}", hint=hint) from None
    if _digest(text) != digest:
        raise FixtureFileError(path, "changed after ingest wrote it (its sha256 is not the one its name and its "
                               "runs record)", hint=hint)
    return tuple(CollectiveTable(op=t["op"], gpus=int(t["gpus"]), source=t["source"],
                                 points=tuple((float(b), float(ms)) for b, ms in t["points"]))
                 for t in json.loads(text))
