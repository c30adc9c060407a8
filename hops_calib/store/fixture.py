"""The store's fixture record: one ingested run (`Fixture`: spec, truth, events) or one run measured at iteration
level (`MeasuredFixture`: a row of a table folder), where its folder is (`check_fixture_id`) and where it came from
(`recorded_source`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hops_calib.spec.types import Spec
from hops_calib.store.collectives import HARDWARE_KEY, load_collectives
from hops_calib.store.components import with_stored_components
from hops_calib.store.digests import (
    EVENTS_FILE,
    EVENTS_KIND,
    INDEX,
    ITERATION_KIND,
    RUNS_FILE,
    FixtureFileError,
    StoreError,
    check_digest,
)
from hops_calib.store.measured_spec import measured_spec, reason_of
from hops_calib.truth import CATEGORIES, IterationTruth, Truth, category_dtype, to_timeline

if TYPE_CHECKING:  # pandas is imported where a frame is read or built; the loop's verbs read JSON and the index
    import pandas as pd


# Ids become folder names: letters, digits, '.', '_' and '-', not starting with a dot, not a store file's name.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_RESERVED_IDS = frozenset({INDEX})


def recorded_source(path: Path, store_root: Path) -> str:
    """Where a run came from, as the store records it: relative to the store folder's parent when the source lies
    under it (a repository's `traces/` beside its `fixtures/`: the record holds in every clone), else absolute."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path(store_root).resolve().parent).as_posix()
    except ValueError:
        return str(resolved)


def source_path(recorded: str, store_root: Path) -> Path:
    """The path a recorded source names (`recorded_source`'s inverse)."""
    path = Path(recorded)
    return path if path.is_absolute() else Path(store_root).resolve().parent / path


def check_fixture_id(store_root: Path, fixture_id: str, origin: str = "") -> Path:
    """The folder of `fixture_id` in the store; StoreError when the id would escape the store or hide its folder."""
    where = f" (from {origin})" if origin else ""
    if not _SAFE_ID.fullmatch(fixture_id) or ".." in fixture_id:
        bad = sorted({ch for ch in fixture_id if not (ch.isascii() and (ch.isalnum() or ch in "._-"))})
        escapes = fixture_id.startswith(".") or ".." in fixture_id or "/" in fixture_id or "\\" in fixture_id
        why = (
            "it would escape or hide in the store"
            if escapes
            else f"it holds {', '.join(repr(ch) for ch in bad)}, which a fixture folder name may not"
            if bad
            else "it is empty or longer than 200 characters"
        )
        raise StoreError(
            f"run id {fixture_id!r}{where} is not a safe fixture name ({why}; store {store_root}); "
            "rename the job directory (or set its manifest run_id) to letters, digits, '.', '_' and "
            "'-'"
        )
    if fixture_id.lower() in _RESERVED_IDS:
        raise StoreError(
            f"run id {fixture_id!r}{where} is the name of the store's own {INDEX} (store {store_root}); "
            "rename the job directory (or set its manifest run_id)"
        )
    folder = store_root / fixture_id
    if folder.resolve().parent != store_root.resolve():
        raise StoreError(f"run id {fixture_id!r}{where} resolves outside the store {store_root}")
    return folder


@dataclass(frozen=True)
class Fixture:
    """One ingested run: the spec (before the run), the truth (measured), the events, and quality flags."""

    id: str
    split: str
    group: str
    content_hash: str
    spec: Spec
    truth: Truth
    quality: dict[str, Any]
    meta: dict[str, Any] = field(hash=False, compare=False)  # provenance: source, hostnames, ingest version
    path: Path = field(hash=False, compare=False)

    kind = EVENTS_KIND

    @cached_property
    def events(self) -> pd.DataFrame:
        """The normalized events (read from Parquet on first use; refused when the file is not the one ingest
        wrote)."""
        path = self.path / EVENTS_FILE
        if path.is_file():  # (a missing file: read_events names it)
            check_digest(path, self.meta, _reingest(self.path, self.meta))
        return read_events(path)

    def timeline(self) -> pd.DataFrame:
        """The events as a `hops_calib.timeline` table, ms from the run's first event."""
        return to_timeline(self.events, self.truth.t0_ns)


class NotPriced(StoreError):
    """A run the cost model does not price (tensor or data parallelism, ...): listed, but refused by every verb
    that would predict it, naming it and why."""

    def __init__(self, run_id: str, reason: str) -> None:
        self.run_id, self.reason = run_id, reason
        super().__init__(f"run {run_id} is not priced: {reason}")


@dataclass(frozen=True)
class MeasuredFixture:
    """One run measured at iteration level (a row of a table folder): its launch, hardware and truth; no events."""

    id: str
    split: str
    group: str
    content_hash: str
    launch: dict[str, Any]  # Megatron's arguments (args. spelling)
    hardware: dict[str, Any]  # gpu, gpus_per_node (and the digest of its all-reduce tables in the store, collectives)
    truth: IterationTruth
    quality: dict[str, Any]
    meta: dict[str, Any] = field(hash=False, compare=False)  # the table folder's fixture.json, and the row's origin
    path: Path = field(hash=False, compare=False)  # the table folder
    kind = ITERATION_KIND

    @cached_property
    def spec(self) -> Spec:
        """The spec of the run, from its launch and hardware; NotPriced when the cost model does not price it."""
        digest = self.hardware.get(HARDWARE_KEY)
        collectives = load_collectives(self.path.parent, digest) if digest else ()  # FixtureFileError if not intact
        try:
            spec = measured_spec(self.id, self.launch, self.hardware, self.meta.get("origin", ""), collectives)
        except (ValueError, KeyError, TypeError) as err:
            raise NotPriced(self.id, reason_of(err)) from None
        return with_stored_components(spec, self.path.parent, self.hardware)

    @property
    def not_priced(self) -> str | None:
        """Why the model does not price this run, or None when it does."""
        try:
            _ = self.spec  # built for the refusal it raises
        except NotPriced as err:
            return err.reason
        return None

    @property
    def events(self) -> pd.DataFrame:
        raise StoreError(
            f"fixture {self.id} was measured at iteration level ({self.meta.get('source', '')}): it has "
            "no events, so no timeline, bubble or utilization"
        )

    def timeline(self) -> pd.DataFrame:
        return self.events


def read_events(path: Path) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        frame = pq.read_table(path).to_pandas()
    except (OSError, pa.ArrowException) as err:
        raise FixtureFileError(
            path, f"cannot be read: {err.__class__.__name__}: {err}", hint=_reingest(path.parent)
        ) from None
    for name in CATEGORIES:
        frame[name] = frame[name].astype(category_dtype(name))
    return frame


def _reingest(folder: Path, meta: dict[str, Any] | None = None) -> str:
    recorded = (meta or {}).get("source")
    source = source_path(recorded, folder.parent) if recorded else "JOB"
    return (
        f"ingest the run's job again (hops-calib ingest {source} --fixtures {folder.parent}): it rewrites a "
        "fixture that is not as ingest wrote it"
    )


RUN_COLUMNS = ("id", "split", "group", "content_hash", "origin", "args", "hardware", "truth", "warnings")


def measured_fixture(row: dict[str, Any], meta: dict[str, Any], folder: Path) -> MeasuredFixture:
    """A run of a table folder from its runs.parquet row (JSON columns decoded)."""
    try:
        return MeasuredFixture(
            id=row["id"],
            split=row["split"],
            group=row["group"],
            content_hash=row["content_hash"],
            launch=json.loads(row["args"]),
            hardware=json.loads(row["hardware"]),
            truth=IterationTruth.from_dict(json.loads(row["truth"])),
            quality={"warnings": json.loads(row["warnings"]), "origin": row["origin"]},
            meta={**meta, "origin": row["origin"]},
            path=folder,
        )
    except (ValueError, KeyError, TypeError) as err:
        raise FixtureFileError(
            folder / RUNS_FILE,
            f"run {row.get('id')!r} cannot be used as a fixture: {type(err).__name__}: {err}",
            hint=_reingest(folder, meta),
        ) from None
