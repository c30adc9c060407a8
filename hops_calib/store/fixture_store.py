"""Store room: the Parquet fixture store (one folder per run, an index, atomic writes).

Layout of a store folder:

    index.parquet            one row per fixture (rebuilt after every change)
    <run id>/fixture.json    id, split, group, content hash, provenance, quality flags
    <run id>/spec.json       the Spec (what was known before the run)
    <run id>/truth.json      the Truth summary (metrics measured from the events)
    <run id>/events.parquet  the normalized events

Runs measured at iteration level (a training log, a run table: no events) are
stored one folder per source, one row per run:

    <table id>/fixture.json  kind iteration_table, provenance, the digest of runs.parquet
    <table id>/runs.parquet  per run: id, split, group, content hash, launch (args), hardware, truth
    .collectives/<sha256>.json  the all-reduce tables runs are priced with, named by digest in their hardware,
                             one file per machine shared by its runs (`store.collectives`)

so 1,440 runs of one table are one atomic write and one digest; every run is
still a fixture of its own (its id in the index, `load(id)`, its split).

A fixture folder is written under a temporary name and renamed into place, so
it is either complete or absent. Loading reads the three small JSON files; the
events are read only when asked for.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from hops_calib.files import atomic_write
from hops_calib.spec import Spec, shared_cores
from hops_calib.truth import CATEGORIES, EVENT_COLUMNS, IterationTruth, Truth, category_dtype, to_timeline

if TYPE_CHECKING:  # pandas is imported where a frame is read or built; the loop's verbs read JSON and the index
    import pandas as pd

INDEX = "index.parquet"
FIXTURE_FILE = "fixture.json"
SPEC_FILE = "spec.json"
TRUTH_FILE = "truth.json"
EVENTS_FILE = "events.parquet"
RUNS_FILE = "runs.parquet"
TABLE_KIND = "iteration_table"
EVENTS_KIND, ITERATION_KIND = "events", "iteration"
LOCK_FILE = ".lock"
# Written by an ingest while it holds the lock (its PID, sources, and whether it began changing the store); removed
# when it finishes. Left behind with "writing" while no one holds the lock: the ingest was stopped part way.
JOURNAL_FILE = ".ingest.json"
DEFAULT_LOCK_TIMEOUT_S = 600.0
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
# Ids become folder names: letters, digits, '.', '_' and '-', not starting with a dot, not a store file's name.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_RESERVED_IDS = frozenset({INDEX})

INDEX_COLUMNS = ("id", "split", "group", "schedule", "declared_schedule", "configured_schedule", "pp", "vp",
                 "microbatches", "iterations", "devices", "throughput_per_s", "steady_throughput_per_s",
                 "bubble_ratio", "iteration_time_ms", "idle_ms", "dropped_lines", "content_hash", "source", "kind", "container", "tp", "dp",
                 "gpus", "num_layers", "hidden_size", "seq_length", "micro_batch_size", "global_batch_size")


class StoreError(ValueError):
    """A store operation that cannot proceed as asked (unsafe id, unknown fixture, ...)."""


class FixtureFileError(StoreError):
    """A fixture file that is not as ingest wrote it (missing, damaged, edited): where (file, line), what, and what to
    do; the same attributes as `hops_calib.errors.InputError`, so `--json` errors carry them."""

    def __init__(self, origin: Path | str, problem: str, *, line: int | None = None, hint: str = "") -> None:
        self.origin, self.line, self.field, self.problem, self.hint = str(origin), line, None, problem, hint
        super().__init__(f"{origin}" + (f":{line}" if line is not None else "") + f": {problem}"
                         + (f"; {hint}" if hint else ""))


def _is_table(folder: Path) -> bool:
    """Whether a fixture folder holds iteration-level runs (a runs.parquet; or, with it deleted, a fixture.json of
    that kind, read only then), rather than one run with events."""
    if (folder / RUNS_FILE).is_file():
        return True
    if (folder / SPEC_FILE).is_file():
        return False
    try:
        return f'"kind": "{TABLE_KIND}"' in (folder / FIXTURE_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


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
        why = ("it would escape or hide in the store" if escapes
               else f"it holds {', '.join(repr(ch) for ch in bad)}, which a fixture folder name may not" if bad
               else "it is empty or longer than 200 characters")
        raise StoreError(f"run id {fixture_id!r}{where} is not a safe fixture name ({why}; store {store_root}); "
                         "rename the job directory (or set its manifest run_id) to letters, digits, '.', '_' and "
                         "'-'")
    if fixture_id.lower() in _RESERVED_IDS:
        raise StoreError(f"run id {fixture_id!r}{where} is the name of the store's own {INDEX} (store {store_root}); "
                         "rename the job directory (or set its manifest run_id)")
    folder = store_root / fixture_id
    if folder.resolve().parent != store_root.resolve():
        raise StoreError(f"run id {fixture_id!r}{where} resolves outside the store {store_root}")
    return folder


def text_digest(text: str) -> str:
    """sha256 of a fixture file's text as written (what fixture.json records in `file_sha256`)."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_digest(path: Path) -> str:
    import hashlib

    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of fixture.json's content without its own digest (`fixture_sha256`): split, group, provenance."""
    return text_digest(dumps({k: v for k, v in meta.items() if k != META_DIGEST}))


META_DIGEST, FILE_DIGESTS = "fixture_sha256", "file_sha256"
# fixture.json's `events_fingerprint` (`events_fingerprint`): what the run measured, whatever its id, folder or clock
FINGERPRINT = "events_fingerprint"
TIMING_KEY = "timing:"  # an events fingerprint among a group's digests (the ledger's held_out_groups)
_CONFIGURATION = ("model", "pp", "vp", "dp", "microbatches", "devices")
_FINGERPRINT_ROWS = 1 << 18


def events_fingerprint(columns: Any, spec: dict[str, Any]) -> str:
    """sha256 of what a run measured, whatever its id, its folder or its clocks: its configuration (the spec's
    model, pipeline and device types) and its events in stored order, each stage's times counted from that stage's
    first event. A copy of a run under another name, or with every timestamp shifted (on one clock, or each
    rank's by its own amount), has the same; two runs of one configuration never do (their timings differ).
    `columns`: the event columns (`EVENT_COLUMNS`), as ingest holds them or as read from events.parquet."""
    import hashlib

    outer = hashlib.sha256(b"hops-calib events fingerprint v1\n")
    outer.update(dumps({key: spec.get(key) for key in _CONFIGURATION}).encode())
    stage, start = np.asarray(columns["stage"]), np.asarray(columns["start_ns"], dtype=np.int64)
    first = np.full(int(stage.max()) + 1 if len(stage) else 0, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, stage, start)
    for name in EVENT_COLUMNS:  # (in slices: a 2 GB trace's events hashed in a few MB beside its columns)
        outer.update(name.encode() + b"\0")
        column = np.asarray(columns[name])
        for low in range(0, len(column), _FINGERPRINT_ROWS):
            part = column[low:low + _FINGERPRINT_ROWS].astype(np.int64)
            if name in ("start_ns", "end_ns"):
                part -= first[stage[low:low + _FINGERPRINT_ROWS]]
            outer.update(part.tobytes())
    return outer.hexdigest()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, indent=1, default=_json_default) + "\n"


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as None (strict JSON for --json output)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        return json_safe(value.tolist())
    return value


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
        from hops_calib.store.collectives import HARDWARE_KEY, load_collectives
        from hops_calib.store.measured_spec import measured_spec, reason_of

        digest = self.hardware.get(HARDWARE_KEY)
        collectives = load_collectives(self.path.parent, digest) if digest else ()  # FixtureFileError if not intact
        try:
            return measured_spec(self.id, self.launch, self.hardware, self.meta.get("origin", ""), collectives)
        except (ValueError, KeyError, TypeError) as err:
            raise NotPriced(self.id, reason_of(err)) from None

    @property
    def not_priced(self) -> str | None:
        """Why the model does not price this run, or None when it does."""
        try:
            self.spec
        except NotPriced as err:
            return err.reason
        return None

    @property
    def events(self) -> pd.DataFrame:
        raise StoreError(f"fixture {self.id} was measured at iteration level ({self.meta.get('source', '')}): it has "
                         "no events, so no timeline, bubble or utilization")

    def timeline(self) -> pd.DataFrame:
        return self.events


def read_events(path: Path) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        frame = pq.read_table(path).to_pandas()
    except (OSError, pa.ArrowException) as err:
        raise FixtureFileError(path, f"cannot be read: {err.__class__.__name__}: {err}",
                               hint=_reingest(path.parent)) from None
    for name in CATEGORIES:
        frame[name] = frame[name].astype(category_dtype(name))
    return frame


def _event_codes(path: Path, hint: str) -> dict[str, np.ndarray]:
    """The event columns of an events.parquet as ingest held them (kind and phase as codes), with pyarrow alone (the
    loop's verbs read no pandas)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path).read(columns=list(EVENT_COLUMNS)).unify_dictionaries()
    except (OSError, pa.ArrowException) as err:
        raise FixtureFileError(path, f"cannot be read: {err.__class__.__name__}: {err}", hint=hint) from None
    def integers(array: Any) -> np.ndarray:  # (Arrow's to_numpy imports pandas: read the data buffer itself)
        if array.null_count:
            raise FixtureFileError(path, f"has empty values in an integer column ({array.type})", hint=hint)
        values = np.frombuffer(array.buffers()[1], dtype=np.dtype(str(array.type)))
        return values[array.offset:array.offset + len(array)]

    columns = {}
    for name in EVENT_COLUMNS:
        column = table.column(name).combine_chunks()
        if name in CATEGORIES:  # stored as a dictionary: its indices, mapped onto the category order ingest used
            known = list(CATEGORIES[name])
            codes = np.array([known.index(value) for value in column.dictionary.to_pylist()], dtype=np.int64)
            columns[name] = codes[integers(column.indices)]
        else:
            columns[name] = integers(column)
    return columns


def _unreadable_index(path: Path, err: Exception) -> FixtureFileError:
    return FixtureFileError(path, f"cannot be read: {type(err).__name__}: {err}",
                            hint="delete it: it is rebuilt from the fixture folders (the next ingest writes it again)")


def write_events(columns: dict[str, np.ndarray], path: Path) -> None:
    """Reader columns (`hops_calib.trace.EVENT_DTYPES`; kind and phase as codes) as Parquet, without a pandas copy."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    for name in EVENT_COLUMNS:
        if name in CATEGORIES:
            arrays[name] = pa.DictionaryArray.from_arrays(pa.array(columns[name]), pa.array(list(CATEGORIES[name])))
        else:
            arrays[name] = pa.array(columns[name])
    pq.write_table(pa.table(arrays), path, compression="zstd")
    del arrays
    # Arrow's allocator keeps freed encode buffers for reuse; hand them back before truth needs the memory.
    pa.default_memory_pool().release_unused()


def _reingest(folder: Path, meta: dict[str, Any] | None = None) -> str:
    recorded = (meta or {}).get("source")
    source = source_path(recorded, folder.parent) if recorded else "JOB"
    return (f"ingest the run's job again (hops-calib ingest {source} --fixtures {folder.parent}): it rewrites a "
            "fixture that is not as ingest wrote it")


def _read_text(path: Path, hint: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FixtureFileError(path, "is missing", hint=hint) from None
    except (OSError, UnicodeDecodeError) as err:
        raise FixtureFileError(path, f"cannot be read: {err}", hint=hint) from None


def _parse_json(path: Path, text: str, hint: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FixtureFileError(path, f"is not valid JSON ({err.msg}, column {err.colno}): the file is corrupt or cut "
                               "short", line=err.lineno, hint=hint) from None


def _read_json(path: Path, hint: str) -> Any:
    return _parse_json(path, _read_text(path, hint), hint)


def check_digest(path: Path, meta: dict[str, Any], hint: str, digest: str | None = None) -> None:
    """FixtureFileError unless the file (whose sha256 is `digest` when the caller has it) is the one `meta`
    (fixture.json) recorded: a fixture edited by hand would be scored as if measured."""
    if (digest or file_digest(path)) != (meta.get(FILE_DIGESTS) or {}).get(path.name):
        raise FixtureFileError(path, f"changed after ingest wrote it (its sha256 is not the one {FIXTURE_FILE} "
                               "recorded): a fixture edited by hand would be scored as if measured", hint=hint)


class FixtureStore:
    """A folder of fixtures. Reading is lock-free; writers (ingest) hold `store.lock()`."""

    def __init__(self, path: Path | str) -> None:
        self.root = Path(path)
        self._tables: dict[str, tuple[dict[str, Any], pd.DataFrame]] = {}
        self._index: pd.DataFrame | None = None
        self._rows: list[dict[str, Any]] | None = None
        self._fingerprints: dict[str, str] = {}  # fixtures whose fixture.json records none: computed once
        # the journal of the ingest holding the lock through this object (see `lock`)
        self._journal: dict[str, Any] = {}
        self._left_writing = self._finished = False

    # -- reading ---------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.root.is_dir()

    def check_writable(self) -> None:
        """StoreError unless the root is absent, an empty folder, or a fixture store: ingest never writes its
        fixtures into (or replaces folders of) a folder that holds something else."""
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"--fixtures {self.root} is a file, not a folder; pass a new or existing fixture store "
                             "folder")
        if not self.root.is_dir():
            return
        if (self.root / INDEX).is_dir():
            raise StoreError(f"{self.root / INDEX} is a folder where the store keeps its index (a job named "
                             f"{INDEX} was stored by an earlier hops-calib): move it out of {self.root}; the next "
                             "ingest rebuilds the index")
        entries = [p for p in self.root.iterdir() if p.name not in (LOCK_FILE, JOURNAL_FILE)]
        if not entries or (self.root / INDEX).is_file() or self.fixture_folders() or self.table_folders() \
                or self.unfinished():
            return
        shown = ", ".join(sorted(p.name for p in entries)[:4])
        raise StoreError(f"--fixtures {self.root} is not a fixture store (no {INDEX}, no fixture folders; it holds "
                         f"{shown}{', ...' if len(entries) > 4 else ''}); ingest writes one folder per run there, so "
                         "pass a new or empty folder, or an existing store")

    def folder(self, fixture_id: str) -> Path:
        return check_fixture_id(self.root, fixture_id)

    def fixture_folders(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (p / FIXTURE_FILE).is_file() and not _is_table(p))

    def table_folders(self) -> list[Path]:
        """Folders of runs measured at iteration level (one per ingested log or table)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (p / FIXTURE_FILE).is_file() and _is_table(p))

    def table(self, name: str) -> tuple[dict[str, Any], pd.DataFrame]:
        """A table folder's fixture.json and its runs (one row per run), refused (FixtureFileError) when either
        is not as ingest wrote it; read once per store object."""
        if name not in self._tables:
            import pandas as pd

            meta = self.meta(name)
            folder = self.folder(name)
            path = folder / RUNS_FILE
            hint = _reingest(folder, meta)
            if not path.is_file():
                raise FixtureFileError(path, "is missing", hint=hint)
            check_digest(path, meta, hint)
            try:
                runs = pd.read_parquet(path)
            except Exception as err:  # noqa: BLE001 - pyarrow's own types: an unreadable file
                raise FixtureFileError(path, f"cannot be read: {type(err).__name__}: {err}", hint=hint) from None
            self._tables[name] = (meta, runs)
        return self._tables[name]

    def index(self) -> pd.DataFrame:
        """One row per fixture (columns INDEX_COLUMNS), sorted by id; empty when the store is. StoreError when an
        ingest stopped part way (`check_finished`): its index may not list what its folders hold."""
        if self._index is not None:
            return self._index
        self.check_finished()
        self._index = self._read_index()
        return self._index

    def _read_index(self) -> pd.DataFrame:
        import pandas as pd

        path = self.root / INDEX
        if path.is_file():
            try:
                frame = pd.read_parquet(path)
                if not set(INDEX_COLUMNS) <= set(frame.columns):  # written before a column existed: rebuilt
                    frame = self.build_index()
                return frame
            except Exception as err:  # noqa: BLE001 - pyarrow raises its own types; all mean an unreadable file
                raise _unreadable_index(path, err) from None
        if (self.fixture_folders() or self.table_folders()) and (self._journal or not self.locked()):
            return self.build_index()  # (an index deleted by hand; while another ingest writes, its folders are not
            # what the store holds yet: no run, as its index would list before it finishes)
        return pd.DataFrame({name: pd.Series(dtype="object") for name in INDEX_COLUMNS})

    def rows(self) -> list[dict[str, Any]]:
        """The index as one dict per fixture (columns INDEX_COLUMNS), read with pyarrow alone: the loop's verbs
        need no pandas (importing it was a third of an evaluate's start-up). An index without every column is
        rebuilt, as `index` does."""
        if self._rows is None:
            self.check_finished()  # (as `index`: an ingest that stopped part way leaves an index that may lag)
            path = self.root / INDEX
            rows = None
            if path.is_file():
                import pyarrow.parquet as pq

                try:  # (pq.read_table would import pandas, through pyarrow.dataset)
                    index_file = pq.ParquetFile(path)
                    if set(INDEX_COLUMNS) <= set(index_file.schema_arrow.names):
                        rows = index_file.read().to_pylist()
                except Exception as err:  # noqa: BLE001 - pyarrow raises its own types; all mean an unreadable file
                    raise _unreadable_index(path, err) from None
            self._rows = rows if rows is not None else self.index().to_dict(orient="records")
        return self._rows

    def ids(self, split: str | None = None) -> list[str]:
        """Fixture ids, all or those of one split ('train' or 'test')."""
        if split not in (None, "train", "test"):
            raise StoreError(f"unknown split {split!r}; expected 'train', 'test' or None")
        return sorted(row["id"] for row in self.rows() if split is None or row["split"] == split)

    def meta(self, fixture_id: str) -> dict[str, Any]:
        path = self.folder(fixture_id) / FIXTURE_FILE
        if not path.is_file():
            known = ", ".join(self.ids()[:5])
            raise StoreError(f"no fixture {fixture_id!r} in {self.root}" + (f" (some ids: {known}, ...)" if known else
                                                                            " (the store is empty; run ingest)"))
        meta = _read_json(path, _reingest(path.parent))
        if not isinstance(meta, dict) or meta.get(META_DIGEST) != meta_digest(meta):
            why = ("has no digests: an earlier hops-calib wrote it" if isinstance(meta, dict) and META_DIGEST not in
                   meta else "changed after ingest wrote it (its sha256 is not the one it records)")
            raise FixtureFileError(path, f"{why}; its split and provenance cannot be trusted",
                                   hint=_reingest(path.parent, meta if isinstance(meta, dict) else None))
        if meta.get("id") != fixture_id:  # whole and digested, but another run's: a folder copied over this one
            raise FixtureFileError(path, f"is the fixture of run {meta.get('id')!r}, not of {fixture_id!r} (its "
                                   "folder): another run's fixture was copied over it, so what it holds is not "
                                   f"{fixture_id}'s", hint=f"delete {path.parent} and ingest the job of "
                                   f"{fixture_id} again (hops-calib ingest JOB --fixtures {path.parent.parent})")
        return meta

    def legacy_meta(self, fixture_id: str) -> dict[str, Any] | None:
        """fixture.json of a fixture written before digests were recorded (readable, no `fixture_sha256`): its
        split may be trusted to keep a group together; None for any other fixture.json (digested, or damaged)."""
        try:
            meta = _read_json(self.folder(fixture_id) / FIXTURE_FILE, "")
        except StoreError:
            return None
        return meta if isinstance(meta, dict) and META_DIGEST not in meta else None

    def container(self, fixture_id: str) -> str | None:
        """The table folder holding an iteration-level run (None for a run with its own folder, or unknown)."""
        row = next((row for row in self.rows() if row["id"] == fixture_id), None)
        if row is not None and row["kind"] == ITERATION_KIND:
            return str(row["container"])
        return None

    def load(self, fixture_id: str) -> Fixture | MeasuredFixture:
        """The fixture as ingest wrote it; FixtureFileError (file, line, what to do) when one of its files is
        missing, damaged, or changed since (fixture.json records each file's digest)."""
        container = self.container(fixture_id)
        if container is not None:
            return self.load_measured(container, fixture_id)
        meta = self.meta(fixture_id)
        folder = self.folder(fixture_id)
        hint = _reingest(folder, meta)
        texts = {name: _read_text(folder / name, hint) for name in (SPEC_FILE, TRUTH_FILE)}
        data = {name: _parse_json(folder / name, text, hint) for name, text in texts.items()}
        for name, text in texts.items():
            check_digest(folder / name, meta, hint, text_digest(text))
        parsed = []
        for name, build in ((SPEC_FILE, Spec.from_dict), (TRUTH_FILE, Truth.from_dict)):
            try:
                parsed.append(build(data[name]))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise FixtureFileError(folder / name, f"cannot be used as a fixture file: {type(err).__name__}: "
                                       f"{err}", hint=hint) from None
        spec, truth = parsed
        if spec.ranks_per_device != 1 and not spec.cores:
            # written before specs recorded which ranks share a core: the manifest the fixture kept says it
            cores = shared_cores((meta.get("manifest") or {}).get("cores"), spec.gpus)
            spec = replace(spec, cores=cores) if cores else spec
        return Fixture(id=meta["id"], split=meta["split"], group=meta["group"], content_hash=meta["content_hash"],
                       spec=spec, truth=truth, quality=meta.get("quality", {}), meta=meta, path=folder)

    def load_measured(self, container: str, fixture_id: str) -> MeasuredFixture:
        meta, runs = self.table(container)
        rows = runs[runs["id"] == fixture_id]
        if not len(rows):
            raise FixtureFileError(self.folder(container) / RUNS_FILE, f"holds no run {fixture_id!r}, which "
                                   f"{INDEX} lists", hint=f"delete {self.root / INDEX} (it is rebuilt from the "
                                   "fixture folders)")
        return measured_fixture(rows.iloc[0].to_dict(), meta, self.folder(container))

    def measured_fixtures(self, container: str) -> list[MeasuredFixture]:
        """Every run of a table folder."""
        meta, runs = self.table(container)
        folder = self.folder(container)
        return [measured_fixture(row, meta, folder) for row in runs.to_dict(orient="records")]

    def intact(self, fixture_id: str) -> bool:
        """Whether the fixture's files are as ingest wrote them (each recorded digest, and the events file)."""
        try:
            meta = self.meta(fixture_id)
            folder = self.folder(fixture_id)
            for name in (SPEC_FILE, TRUTH_FILE, EVENTS_FILE):
                check_digest(folder / name, meta, "")
            return True
        except (StoreError, OSError):
            return False

    def load_all(self, split: str | None = None) -> list[Fixture | MeasuredFixture]:
        return self.load_many(self.ids(split))

    def load_many(self, ids: list[str] | tuple[str, ...]) -> list[Fixture | MeasuredFixture]:
        """`load` of each id, in order; the runs of one table folder are read together (one pass over its rows)."""
        wanted = set(ids)
        measured: dict[str, set[str]] = {}  # container -> its runs asked for
        for row in self.rows():
            if row["id"] in wanted and row["kind"] == ITERATION_KIND:
                measured.setdefault(str(row["container"]), set()).add(row["id"])
        found: dict[str, Fixture | MeasuredFixture] = {}
        for container, its_ids in sorted(measured.items()):
            meta, runs = self.table(container)
            folder = self.folder(container)
            mine = runs[runs["id"].isin(its_ids)]
            found.update((row["id"], measured_fixture(row, meta, folder)) for row in mine.to_dict(orient="records"))
        return [found[i] if i in found else self.load(i) for i in ids]

    def fingerprint(self, fixture_id: str) -> str:
        """The `events_fingerprint` of a run with events: as its fixture.json records it, else (a fixture ingested
        before it was recorded) computed from its events.parquet and spec.json, checked against their digests."""
        meta = self.meta(fixture_id)
        if meta.get(FINGERPRINT):
            return meta[FINGERPRINT]
        if fixture_id not in self._fingerprints:
            folder = self.folder(fixture_id)
            hint = _reingest(folder, meta)
            spec_text = _read_text(folder / SPEC_FILE, hint)
            check_digest(folder / SPEC_FILE, meta, hint, text_digest(spec_text))
            check_digest(folder / EVENTS_FILE, meta, hint)
            self._fingerprints[fixture_id] = events_fingerprint(_event_codes(folder / EVENTS_FILE, hint),
                                                                _parse_json(folder / SPEC_FILE, spec_text, hint))
        return self._fingerprints[fixture_id]

    def group_digests(self, split: str) -> dict[str, dict[str, list[str]]]:
        """group -> {"ids": its fixtures in `split`, "digests": what the runs measured, whatever their names: a run
        with events by its events' sha256 (as fixture.json records it) and its `events_fingerprint` (prefixed
        `TIMING_KEY`: the same for a copy whose timestamps were shifted), a run of a table folder by its row's content
        hash}, for every group with fixtures in `split`."""
        groups: dict[str, dict[str, list[str]]] = {}
        kinds = {row["id"]: row for row in self.rows()}
        for fixture_id in self.ids(split):
            row = kinds.get(fixture_id)
            if row is not None and row["kind"] == ITERATION_KIND:
                # a run of a table folder has no events file: its digest is its row's content hash (what it measured)
                group, digests = row["group"], [row["content_hash"]]
            else:
                meta = self.meta(fixture_id)
                group = meta["group"]
                digests = [(meta.get(FILE_DIGESTS) or {}).get(EVENTS_FILE), TIMING_KEY + self.fingerprint(fixture_id)]
            entry = groups.setdefault(group, {"ids": [], "digests": []})
            entry["ids"].append(fixture_id)
            entry["digests"] += [digest for digest in digests if digest]
        return groups

    def split_of_groups(self) -> dict[str, str]:
        """group -> its stored split, over every fixture in the store."""
        index = self.index()
        return dict(zip(index["group"], index["split"]))

    # -- an ingest in progress, or one that stopped part way ---------------------------------------------
    def journal(self) -> dict[str, Any] | None:
        """What the last ingest to take the lock recorded (pid, sources, started, writing); None without one."""
        try:
            data = json.loads((self.root / JOURNAL_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def locked(self) -> bool:
        """Whether a writer (an ingest) holds the store's lock now; a test that takes and drops it at once."""
        import fcntl

        try:
            fd = os.open(self.root / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def _ingest_named(self, journal: dict[str, Any] | None) -> str:
        if not journal:
            return "an ingest"
        sources = " ".join(str(s) for s in journal.get("sources") or [])
        return f"the ingest of {sources or '?'} (PID {journal.get('pid', '?')}, started {journal.get('started', '?')})"

    def _rerun(self, journal: dict[str, Any] | None) -> str:
        sources = " ".join(str(s) for s in (journal or {}).get("sources") or []) or "SRC"
        return f"hops-calib ingest {sources} --fixtures {self.root}"

    def interrupted(self) -> str | None:
        """The message for a store an ingest stopped changing part way (its index may lag its folders), else None."""
        journal = self.journal()
        if not journal or not journal.get("writing") or self.locked():
            return None
        return (f"{self.root}: {self._ingest_named(journal)} stopped before it finished: the index may not list the "
                f"fixtures it wrote, nor drop the ones it replaced; run `{self._rerun(journal)}` to finish it (the "
                "fixtures it wrote are kept, unchanged runs are skipped; any ingest into this store puts its index "
                "right)")

    def check_finished(self) -> None:
        """StoreError (what to run) when an ingest stopped part way: what the store holds is not what it lists."""
        message = self.interrupted()
        if message:
            raise StoreError(message)

    def running(self) -> str | None:
        """A warning when an ingest is writing into the store now (its runs appear when it finishes), else None."""
        if not self.locked():
            return None
        journal = self.journal()
        return (f"{self.root}: {self._ingest_named(journal)} is writing into this store: what follows reads the "
                "fixtures its index listed before, and the runs it writes appear when it finishes")

    # -- writing (callers hold the lock) ---------------------------------------------------------------
    @contextmanager
    def lock(self, timeout: float | None = DEFAULT_LOCK_TIMEOUT_S, on_wait: Callable[[str], None] | None = None,
             sources: Sequence[Path | str] = ()) -> Iterator[None]:
        """Hold the store's lock for writing (waiting up to `timeout` s, None: without end; `on_wait` hears whom
        for) and keep its journal: who holds it and, once `begin_writing` is called, that the store is changing."""
        from filelock import FileLock, Timeout

        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = self._ingest_named(self.journal())
            if on_wait:
                on_wait(f"waiting for the store lock held by {holder}"
                        + (f" (up to {timeout:g} s, --lock-timeout)" if timeout is not None else ""))
            try:
                lock.acquire(timeout=-1 if timeout is None else timeout)
            except Timeout:
                raise StoreError(f"{self.root}: the store lock is still held by {holder} after {timeout:g} s; run "
                                 "again when it has finished, or pass a longer --lock-timeout") from None
        try:
            left = self.journal()
            self._left_writing = bool(left and left.get("writing"))  # an earlier ingest stopped part way
            self._journal = {"pid": os.getpid(), "sources": [os.path.abspath(s) for s in sources],
                             "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "writing": self._left_writing}
            self._finished = False
            atomic_write(self.root / JOURNAL_FILE, json.dumps(self._journal))
            new = not (self.root / INDEX).exists() and not self.fixture_folders() and not self.table_folders()
            if new:
                # A new store gets its (empty) index before any fixture folder: readers see no run until the index
                # lists them at the end, as during any later ingest (they read the index, never the folders).
                self.write_index()
            try:
                yield
            except BaseException:
                if new and self._lists_nothing() and not self.fixture_folders() and not self.table_folders():
                    for name in (INDEX, JOURNAL_FILE, ".secret"):  # a new store that stored nothing: as it was
                        (self.root / name).unlink(missing_ok=True)
                raise
            if new and self._lists_nothing() and not self.fixture_folders() and not self.table_folders():
                (self.root / INDEX).unlink(missing_ok=True)  # nothing stored: the store is as it was
            if not self._journal["writing"] or self._finished:
                (self.root / JOURNAL_FILE).unlink(missing_ok=True)
        finally:
            lock.release()
            self._journal = {}  # (no longer the writer: it reads as any reader)

    def begin_writing(self) -> None:
        """Record (before the first change) that the store is changing: should the writer stop before `finish`,
        readers are told to run the ingest again rather than trust an index that may lag its folders."""
        if not self._journal["writing"]:
            self._journal["writing"] = True
            atomic_write(self.root / JOURNAL_FILE, json.dumps(self._journal))

    @property
    def left_unfinished(self) -> bool:
        """Whether an earlier writer stopped part way (seen when this one took the lock): its index needs rewriting."""
        return self._left_writing

    def finish(self) -> None:
        """The index is written: the store is consistent again (the journal goes when the lock is released)."""
        self._finished = True

    def remove_if_empty(self) -> None:
        """Remove the store's folder when it holds nothing but the writers' lock (an ingest that stored nothing)."""
        if self.root.is_dir() and {p.name for p in self.root.iterdir()} <= {LOCK_FILE}:
            (self.root / LOCK_FILE).unlink(missing_ok=True)
            self.root.rmdir()

    def _lists_nothing(self) -> bool:
        """Whether the index file is absent or lists no run."""
        import pyarrow.parquet as pq

        if not (self.root / INDEX).is_file():
            return True
        try:
            return pq.ParquetFile(self.root / INDEX).metadata.num_rows == 0
        except Exception:  # noqa: BLE001 - a damaged index: not ours to remove
            return False

    def unfinished(self) -> list[str]:
        """Names of what an interrupted writer left (temporary or displaced fixture folders): `recover` clears them."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)))

    def recover(self) -> None:
        """Finish or undo what an interrupted writer left: drop temp folders, restore displaced fixtures."""
        for path in (self.root / name for name in self.unfinished()):
            if path.name.startswith(_TMP_PREFIX):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            else:  # a displaced fixture (_OLD_PREFIX)
                fixture_id = path.name[len(_OLD_PREFIX):].rsplit("-", 1)[0]
                target = self.root / fixture_id
                if target.exists():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.rename(target)

    @contextmanager
    def writing(self, fixture_id: str) -> Iterator[Path]:
        """A temporary folder to fill with one fixture's files; renamed into place when the block ends cleanly.

        On any exception the folder is removed, so a fixture is either complete or absent.
        """
        final = self.folder(fixture_id)
        if final.exists() and not (final / FIXTURE_FILE).is_file():
            raise StoreError(f"{final} is in the way: it is not a fixture folder (no {FIXTURE_FILE}), and ingest "
                             "replaces only its own fixtures; move it out of the store, or ingest into another "
                             "--fixtures folder")
        self.root.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex[:8]
        tmp = self.root / f"{_TMP_PREFIX}{fixture_id}-{token}"
        tmp.mkdir()
        try:
            yield tmp
            if final.exists():
                displaced = self.root / f"{_OLD_PREFIX}{fixture_id}-{token}"
                final.rename(displaced)
                tmp.rename(final)
                shutil.rmtree(displaced)
            else:
                tmp.rename(final)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            from hops_calib.errors import DiskFull, is_disk_full

            if is_disk_full(error):
                raise DiskFull(final) from None
            raise

    @staticmethod
    def write_summary(folder: Path, *, meta: dict[str, Any], spec: Spec, truth: Truth, events_sha256: str) -> None:
        """The small files of a fixture (spec, truth, fixture.json) into a folder from `writing`, beside its events
        (written first, by read_run; `events_sha256`: their `file_digest`, which ingest has already taken); fixture.json
        records the digests of every file (`file_sha256`) and of its own content (`fixture_sha256`), so a later hand
        edit is refused rather than scored."""
        texts = {SPEC_FILE: spec.to_json() + "\n", TRUTH_FILE: dumps(truth.to_dict())}
        for name, text in texts.items():
            (folder / name).write_text(text, encoding="utf-8")
        digests = {name: text_digest(text) for name, text in texts.items()}
        digests[EVENTS_FILE] = events_sha256
        meta = {**meta, FILE_DIGESTS: digests}
        (folder / FIXTURE_FILE).write_text(dumps({**meta, META_DIGEST: meta_digest(meta)}), encoding="utf-8")

    def index_row(self, folder: Path) -> dict[str, Any]:
        meta = json.loads((folder / FIXTURE_FILE).read_text(encoding="utf-8"))
        if meta["id"] != folder.name:  # another run's fixture copied over this folder: not listed as either
            raise ValueError(f"{folder / FIXTURE_FILE} is the fixture of {meta['id']!r}")
        spec = json.loads((folder / SPEC_FILE).read_text(encoding="utf-8"))
        truth = Truth.from_dict(json.loads((folder / TRUTH_FILE).read_text(encoding="utf-8")))
        metrics = truth.metrics
        return {
            "id": meta["id"],
            "split": meta["split"],
            "group": meta["group"],
            "schedule": truth.observed_schedule,
            "declared_schedule": spec.get("declared_schedule"),
            "configured_schedule": spec["schedule"],
            "pp": int(spec["pp"]),
            "vp": int(spec["vp"]),
            "microbatches": int(spec["microbatches"]),
            "iterations": len(truth.iterations),
            "devices": list(spec["devices"]),
            "throughput_per_s": metrics.throughput_per_s,
            "steady_throughput_per_s": metrics.steady_throughput_per_s,
            "bubble_ratio": metrics.bubble_ratio,
            "iteration_time_ms": metrics.iteration_time_ms,
            "idle_ms": truth.idle_ms,
            "dropped_lines": int(meta.get("quality", {}).get("dropped_lines", 0)),
            "content_hash": meta["content_hash"],
            "source": meta.get("source", ""),
            "kind": EVENTS_KIND,
            "container": meta["id"],
            # spec.json writes tp and dp only when they are not 1 (Spec.to_dict)
            "tp": int(spec["model"].get("tensor_parallel", 1)),
            "dp": int(spec.get("dp", 1)),
            "gpus": int(spec["pp"]) * int(spec["model"].get("tensor_parallel", 1)) * int(spec.get("dp", 1)),
            **{name: int(spec["model"][name]) for name in ("num_layers", "hidden_size", "seq_length",
                                                             "micro_batch_size", "global_batch_size")},
        }

    def table_index_rows(self, folder: Path) -> list[dict[str, Any]]:
        meta, runs = self.table(folder.name)
        return [measured_index_row(row, meta, folder.name) for row in runs.to_dict(orient="records")]

    def build_index(self) -> pd.DataFrame:
        """The index of the fixture folders. A fixture whose files cannot be read (damaged by hand) keeps the row
        the index had for it, so readers still meet it (and are told to ingest its job again); without one it is
        left out."""
        import pandas as pd

        rows, listed = [], None
        for folder in self.fixture_folders():
            try:
                rows.append(self.index_row(folder))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                listed = self._listed_rows() if listed is None else listed
                if folder.name in listed:
                    rows.append(listed[folder.name])
        for folder in self.table_folders():
            rows += self.table_index_rows(folder)
        if not rows:
            return pd.DataFrame({name: pd.Series(dtype="object") for name in INDEX_COLUMNS})
        frame = pd.DataFrame(rows, columns=list(INDEX_COLUMNS))
        for name in ("idle_ms", "bubble_ratio", "throughput_per_s", "steady_throughput_per_s", "iteration_time_ms"):
            frame[name] = frame[name].astype("float64")
        return frame.sort_values("id", kind="stable").reset_index(drop=True)

    def _listed_rows(self) -> dict[str, dict[str, Any]]:
        """id -> its row in the index file as it is ({} without a readable one)."""
        import pyarrow.parquet as pq

        try:  # (with pyarrow alone, as `rows`)
            records = pq.ParquetFile(self.root / INDEX).read().to_pylist()
        except Exception:  # noqa: BLE001 - no index, or a damaged one: no earlier rows
            return {}
        rows = {}
        for record in records:
            record["devices"] = list(record.get("devices") if record.get("devices") is not None else [])
            rows[record["id"]] = record
        return rows

    def write_index(self) -> pd.DataFrame:
        self._tables.clear()
        frame = self.build_index()
        self._index = self._rows = None
        tmp = self.root / f"{_TMP_PREFIX}{INDEX}-{uuid.uuid4().hex[:8]}"
        try:
            frame.to_parquet(tmp, index=False)
            os.replace(tmp, self.root / INDEX)
        except BaseException as error:
            tmp.unlink(missing_ok=True)
            from hops_calib.errors import DiskFull, is_disk_full

            if is_disk_full(error):
                raise DiskFull(self.root / INDEX) from None
            raise
        return frame


# -- runs measured at iteration level: one row of a table folder's runs.parquet per run -------------------------

RUN_COLUMNS = ("id", "split", "group", "content_hash", "origin", "args", "hardware", "truth", "warnings")


def measured_fixture(row: dict[str, Any], meta: dict[str, Any], folder: Path) -> MeasuredFixture:
    """A run of a table folder from its runs.parquet row (JSON columns decoded)."""
    try:
        return MeasuredFixture(
            id=row["id"], split=row["split"], group=row["group"], content_hash=row["content_hash"],
            launch=json.loads(row["args"]), hardware=json.loads(row["hardware"]),
            truth=IterationTruth.from_dict(json.loads(row["truth"])),
            quality={"warnings": json.loads(row["warnings"]), "origin": row["origin"]},
            meta={**meta, "origin": row["origin"]}, path=folder)
    except (ValueError, KeyError, TypeError) as err:
        raise FixtureFileError(folder / RUNS_FILE, f"run {row.get('id')!r} cannot be used as a fixture: "
                               f"{type(err).__name__}: {err}", hint=_reingest(folder, meta)) from None


def measured_index_row(row: dict[str, Any], meta: dict[str, Any], container: str) -> dict[str, Any]:
    args, hardware = json.loads(row["args"]), json.loads(row["hardware"])
    truth = IterationTruth.from_dict(json.loads(row["truth"]))
    metrics = truth.metrics
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    per_virtual = args.get("num_layers_per_virtual_pipeline_stage")
    vp = int(args["num_layers"]) // (pp * per_virtual) if per_virtual else int(
        args.get("virtual_pipeline_model_parallel_size") or 1)
    return {
        "id": row["id"], "split": row["split"], "group": row["group"], "schedule": None, "declared_schedule": None,
        "configured_schedule": "interleaved_1f1b" if vp > 1 else "1f1b", "pp": pp, "vp": vp,
        "microbatches": metrics.microbatches_per_iteration, "iterations": int(sum(metrics.interval_iterations)),
        "devices": [hardware["gpu"]] * pp, "throughput_per_s": metrics.throughput_per_s,
        "steady_throughput_per_s": metrics.steady_throughput_per_s, "bubble_ratio": None,
        "iteration_time_ms": metrics.iteration_time_ms, "idle_ms": None, "dropped_lines": 0,
        "content_hash": row["content_hash"], "source": row["origin"], "kind": ITERATION_KIND, "container": container,
        "tp": int(args.get("tensor_model_parallel_size") or 1), "dp": int(args.get("data_parallel_size") or 1),
        "gpus": int(args.get("world_size") or pp),
        **{name: int(args[name]) for name in ("num_layers", "hidden_size", "seq_length", "micro_batch_size",
                                              "global_batch_size")},
    }


def write_table(folder: Path, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A table folder's files into a folder from `FixtureStore.writing`: runs.parquet (one row per run, columns
    RUN_COLUMNS) and fixture.json with its digest (and its own), as `write_summary` does for a run with events."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: pa.array([run[name] for run in runs], type=pa.string()) for name in RUN_COLUMNS})
    pq.write_table(table, folder / RUNS_FILE, compression="zstd")
    meta = {**meta, "kind": TABLE_KIND, FILE_DIGESTS: {RUNS_FILE: file_digest(folder / RUNS_FILE)}}
    (folder / FIXTURE_FILE).write_text(dumps({**meta, META_DIGEST: meta_digest(meta)}), encoding="utf-8")
