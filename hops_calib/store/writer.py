"""The store's writer: the lock and journal of an ingest, a fixture folder written whole or not at all
(`FixtureStore.writing`), its files with their digests, and the index rewritten after every change."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hops_calib.errors import DiskFull, is_disk_full
from hops_calib.files import atomic_write
from hops_calib.spec.types import Spec
from hops_calib.store.digests import (
    _OLD_PREFIX,
    _TMP_PREFIX,
    DEFAULT_LOCK_TIMEOUT_S,
    EVENTS_FILE,
    FILE_DIGESTS,
    FIXTURE_FILE,
    INDEX,
    JOURNAL_FILE,
    LOCK_FILE,
    META_DIGEST,
    RUNS_FILE,
    SPEC_FILE,
    TABLE_KIND,
    TRUTH_FILE,
    StoreError,
    dumps,
    file_digest,
    meta_digest,
    text_digest,
)
from hops_calib.store.fixture import RUN_COLUMNS
from hops_calib.store.guard import SECRET_FILE
from hops_calib.store.reader import FixtureReader
from hops_calib.truth import CATEGORIES, EVENT_COLUMNS, Truth

if TYPE_CHECKING:  # pandas is imported where a frame is read or built; the loop's verbs read JSON and the index
    import pandas as pd


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


class FixtureStore(FixtureReader):
    """A folder of fixtures. Reading is lock-free; writers (ingest) hold `store.lock()`."""

    def check_writable(self) -> None:
        """StoreError unless the root is absent, an empty folder, or a fixture store: ingest never writes its
        fixtures into (or replaces folders of) a folder that holds something else."""
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(
                f"--fixtures {self.root} is a file, not a folder; pass a new or existing fixture store folder"
            )
        if not self.root.is_dir():
            return
        if (self.root / INDEX).is_dir():
            raise StoreError(
                f"{self.root / INDEX} is a folder where the store keeps its index (a job named "
                f"{INDEX} was stored by an earlier hops-calib): move it out of {self.root}; the next "
                "ingest rebuilds the index"
            )
        entries = [p for p in self.root.iterdir() if p.name not in (LOCK_FILE, JOURNAL_FILE)]
        if (
            not entries
            or (self.root / INDEX).is_file()
            or self.fixture_folders()
            or self.table_folders()
            or self.unfinished()
        ):
            return
        shown = ", ".join(sorted(p.name for p in entries)[:4])
        raise StoreError(
            f"--fixtures {self.root} is not a fixture store (no {INDEX}, no fixture folders; it holds "
            f"{shown}{', ...' if len(entries) > 4 else ''}); ingest writes one folder per run there, so "
            "pass a new or empty folder, or an existing store"
        )

    # -- writing (callers hold the lock) ---------------------------------------------------------------
    @contextmanager
    def lock(
        self,
        timeout: float | None = DEFAULT_LOCK_TIMEOUT_S,
        on_wait: Callable[[str], None] | None = None,
        sources: Sequence[Path | str] = (),
    ) -> Iterator[None]:
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
                on_wait(
                    f"waiting for the store lock held by {holder}"
                    + (f" (up to {timeout:g} s, --lock-timeout)" if timeout is not None else "")
                )
            try:
                lock.acquire(timeout=-1 if timeout is None else timeout)
            except Timeout:
                raise StoreError(
                    f"{self.root}: the store lock is still held by {holder} after {timeout:g} s; run "
                    "again when it has finished, or pass a longer --lock-timeout"
                ) from None
        try:
            left = self.journal()
            self._left_writing = bool(left and left.get("writing"))  # an earlier ingest stopped part way
            self._journal = {
                "pid": os.getpid(),
                "sources": [os.path.abspath(s) for s in sources],
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "writing": self._left_writing,
            }
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
                    for name in (INDEX, JOURNAL_FILE, SECRET_FILE):  # a new store that stored nothing: as it was
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
                fixture_id = path.name[len(_OLD_PREFIX) :].rsplit("-", 1)[0]
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
            raise StoreError(
                f"{final} is in the way: it is not a fixture folder (no {FIXTURE_FILE}), and ingest "
                "replaces only its own fixtures; move it out of the store, or ingest into another "
                "--fixtures folder"
            )
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
            if is_disk_full(error):
                raise DiskFull(self.root / INDEX) from None
            raise
        return frame


def write_table(folder: Path, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A table folder's files into a folder from `FixtureStore.writing`: runs.parquet (one row per run, columns
    RUN_COLUMNS) and fixture.json with its digest (and its own), as `write_summary` does for a run with events."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: pa.array([run[name] for run in runs], type=pa.string()) for name in RUN_COLUMNS})
    pq.write_table(table, folder / RUNS_FILE, compression="zstd")
    meta = {**meta, "kind": TABLE_KIND, FILE_DIGESTS: {RUNS_FILE: file_digest(folder / RUNS_FILE)}}
    (folder / FIXTURE_FILE).write_text(dumps({**meta, META_DIGEST: meta_digest(meta)}), encoding="utf-8")
