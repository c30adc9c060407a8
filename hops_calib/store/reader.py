"""The store's reader: a store's index, its fixtures as ingest wrote them (each file checked against its digest),
and what a writer's journal says, all without the writers' lock."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hops_calib.spec.job_dir import shared_cores
from hops_calib.spec.types import Spec
from hops_calib.store.digests import (
    EVENTS_FILE,
    EVENTS_KIND,
    FILE_DIGESTS,
    FINGERPRINT,
    FIXTURE_FILE,
    INDEX,
    INDEX_COLUMNS,
    ITERATION_KIND,
    JOURNAL_FILE,
    LOCK_FILE,
    META_DIGEST,
    RUNS_FILE,
    SPEC_FILE,
    TABLE_KIND,
    TIMING_KEY,
    TRUTH_FILE,
    FixtureFileError,
    StoreError,
    check_digest,
    events_fingerprint,
    meta_digest,
    text_digest,
)
from hops_calib.store.fixture import Fixture, MeasuredFixture, _reingest, check_fixture_id, measured_fixture
from hops_calib.truth import CATEGORIES, EVENT_COLUMNS, IterationTruth, Truth

if TYPE_CHECKING:  # pandas is imported where a frame is read or built; the loop's verbs read JSON and the index
    import pandas as pd


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
        return values[array.offset : array.offset + len(array)]

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
    return FixtureFileError(
        path,
        f"cannot be read: {type(err).__name__}: {err}",
        hint="delete it: it is rebuilt from the fixture folders (the next ingest writes it again)",
    )


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
        raise FixtureFileError(
            path,
            f"is not valid JSON ({err.msg}, column {err.colno}): the file is corrupt or cut short",
            line=err.lineno,
            hint=hint,
        ) from None


def _read_json(path: Path, hint: str) -> Any:
    return _parse_json(path, _read_text(path, hint), hint)


class FixtureReader:
    """A fixture store as its readers see it, without its lock: the index, each fixture, the journal a writer
    leaves; `FixtureStore` adds the writing."""

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

    def folder(self, fixture_id: str) -> Path:
        return check_fixture_id(self.root, fixture_id)

    def fixture_folders(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / FIXTURE_FILE).is_file() and not _is_table(p)
        )

    def table_folders(self) -> list[Path]:
        """Folders of runs measured at iteration level (one per ingested log or table)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / FIXTURE_FILE).is_file() and _is_table(p)
        )

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
            raise StoreError(
                f"no fixture {fixture_id!r} in {self.root}"
                + (f" (some ids: {known}, ...)" if known else " (the store is empty; run ingest)")
            )
        meta = _read_json(path, _reingest(path.parent))
        if not isinstance(meta, dict) or meta.get(META_DIGEST) != meta_digest(meta):
            why = (
                "has no digests: an earlier hops-calib wrote it"
                if isinstance(meta, dict) and META_DIGEST not in meta
                else "changed after ingest wrote it (its sha256 is not the one it records)"
            )
            raise FixtureFileError(
                path,
                f"{why}; its split and provenance cannot be trusted",
                hint=_reingest(path.parent, meta if isinstance(meta, dict) else None),
            )
        if meta.get("id") != fixture_id:  # whole and digested, but another run's: a folder copied over this one
            raise FixtureFileError(
                path,
                f"is the fixture of run {meta.get('id')!r}, not of {fixture_id!r} (its "
                "folder): another run's fixture was copied over it, so what it holds is not "
                f"{fixture_id}'s",
                hint=f"delete {path.parent} and ingest the job of "
                f"{fixture_id} again (hops-calib ingest JOB --fixtures {path.parent.parent})",
            )
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
        name = SPEC_FILE
        try:
            spec = Spec.from_dict(data[name])
            name = TRUTH_FILE
            truth = Truth.from_dict(data[name])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise FixtureFileError(
                folder / name, f"cannot be used as a fixture file: {type(err).__name__}: {err}", hint=hint
            ) from None
        if spec.ranks_per_device != 1 and not spec.cores:
            # written before specs recorded which ranks share a core: the manifest the fixture kept says it
            cores = shared_cores((meta.get("manifest") or {}).get("cores"), spec.gpus)
            spec = replace(spec, cores=cores) if cores else spec
        return Fixture(
            id=meta["id"],
            split=meta["split"],
            group=meta["group"],
            content_hash=meta["content_hash"],
            spec=spec,
            truth=truth,
            quality=meta.get("quality", {}),
            meta=meta,
            path=folder,
        )

    def load_measured(self, container: str, fixture_id: str) -> MeasuredFixture:
        meta, runs = self.table(container)
        rows = runs[runs["id"] == fixture_id]
        if not len(rows):
            raise FixtureFileError(
                self.folder(container) / RUNS_FILE,
                f"holds no run {fixture_id!r}, which {INDEX} lists",
                hint=f"delete {self.root / INDEX} (it is rebuilt from the fixture folders)",
            )
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
            self._fingerprints[fixture_id] = events_fingerprint(
                _event_codes(folder / EVENTS_FILE, hint), _parse_json(folder / SPEC_FILE, spec_text, hint)
            )
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
        return (
            f"{self.root}: {self._ingest_named(journal)} stopped before it finished: the index may not list the "
            f"fixtures it wrote, nor drop the ones it replaced; run `{self._rerun(journal)}` to finish it (the "
            "fixtures it wrote are kept, unchanged runs are skipped; any ingest into this store puts its index "
            "right)"
        )

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
        return (
            f"{self.root}: {self._ingest_named(journal)} is writing into this store: what follows reads the "
            "fixtures its index listed before, and the runs it writes appear when it finishes"
        )

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
            **{
                name: int(spec["model"][name])
                for name in ("num_layers", "hidden_size", "seq_length", "micro_batch_size", "global_batch_size")
            },
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


def measured_index_row(row: dict[str, Any], meta: dict[str, Any], container: str) -> dict[str, Any]:
    args, hardware = json.loads(row["args"]), json.loads(row["hardware"])
    truth = IterationTruth.from_dict(json.loads(row["truth"]))
    metrics = truth.metrics
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    per_virtual = args.get("num_layers_per_virtual_pipeline_stage")
    vp = (
        int(args["num_layers"]) // (pp * per_virtual)
        if per_virtual
        else int(args.get("virtual_pipeline_model_parallel_size") or 1)
    )
    return {
        "id": row["id"],
        "split": row["split"],
        "group": row["group"],
        "schedule": None,
        "declared_schedule": None,
        "configured_schedule": "interleaved_1f1b" if vp > 1 else "1f1b",
        "pp": pp,
        "vp": vp,
        "microbatches": metrics.microbatches_per_iteration,
        "iterations": int(sum(metrics.interval_iterations)),
        "devices": [hardware["gpu"]] * pp,
        "throughput_per_s": metrics.throughput_per_s,
        "steady_throughput_per_s": metrics.steady_throughput_per_s,
        "bubble_ratio": None,
        "iteration_time_ms": metrics.iteration_time_ms,
        "idle_ms": None,
        "dropped_lines": 0,
        "content_hash": row["content_hash"],
        "source": row["origin"],
        "kind": ITERATION_KIND,
        "container": container,
        "tp": int(args.get("tensor_model_parallel_size") or 1),
        "dp": int(args.get("data_parallel_size") or 1),
        "gpus": int(args.get("world_size") or pp),
        **{
            name: int(args[name])
            for name in ("num_layers", "hidden_size", "seq_length", "micro_batch_size", "global_batch_size")
        },
    }
