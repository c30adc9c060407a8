"""Store room: the component tables (GEMM and memory-bound kernel times, `trace.component_tables`) that runs are
priced with, kept in the store itself as the all-reduce tables are (`store.collectives`), so a store stands alone:

    <store>/.components/<sha256>.json   one machine's tables (`ComponentTables`, one per device type), named by the
                                        sha256 of the file's text

A run names its machine's tables by that digest (hardware entry `components`); loading checks the file against its
name and refuses a changed, torn or missing one, naming it. A run that names none is priced from its devices'
datasheets (the kernel terms' default curves).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hops_calib.spec.types import Spec
from hops_calib.store.addressed import digest_of, load_parsed, put_text
from hops_calib.trace.component_tables import ComponentTables, read_component_tables

COMPONENTS_STORE_DIR = ".components"
HARDWARE_KEY = "components"  # a run's hardware entry: the sha256 of its machine's component tables


def tables_text(tables: tuple[ComponentTables, ...]) -> str:
    """The stored form of a machine's component tables (canonical JSON: one text per content)."""
    data = [
        {
            "device": t.device,
            "source": t.source,
            "gemm": [list(row) for row in t.gemm],
            "memory": [list(row) for row in t.memory],
        }
        for t in sorted(tables, key=lambda t: t.device)
    ]
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def source_digest(folder: str | Path) -> str:
    """The sha256 the tables read from a source folder would be stored under (TraceError for a bad table)."""
    return digest_of(tables_text(read_component_tables(Path(folder))))


def store_components(store_root: Path, folder: str | Path) -> str | None:
    """Read a machine's component tables from their folder (`calibration/components/` of a job, or the folder
    `hops-calib bench` wrote) and keep them in the store; the digest a run's hardware names them by, None when the
    folder has no table. TraceError for a bad table."""
    tables = read_component_tables(Path(folder))
    return put_text(store_root, COMPONENTS_STORE_DIR, tables_text(tables)) if tables else None


def load_components(store_root: Path, digest: str) -> tuple[ComponentTables, ...]:
    """The tables a run names by `digest`, from the store; FixtureFileError when the file is missing or not the one
    ingest wrote."""
    return load_parsed(
        store_root,
        COMPONENTS_STORE_DIR,
        digest,
        _parse,
        what="the component tables of runs that name them",
        hint=(
            "ingest the runs' source again (it stores the component tables they are priced "
            "with); a store is moved or copied whole, its .components folder too"
        ),
    )


def _parse(data: list) -> tuple[ComponentTables, ...]:
    return tuple(
        ComponentTables(
            device=t["device"],
            gemm=tuple(tuple(r) for r in t["gemm"]),
            memory=tuple(tuple(r) for r in t["memory"]),
            source=t["source"],
        )
        for t in data
    )


def with_stored_components(spec: Spec, store_root: Path, hardware: Mapping[str, Any]) -> Spec:
    """`spec` with the component tables its run's hardware names (by digest, `HARDWARE_KEY`), from the store; as it
    is when it names none. FixtureFileError when the named file is not intact."""
    digest = hardware.get(HARDWARE_KEY)
    return replace(spec, component_tables=load_components(store_root, digest)) if digest else spec
