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

The store is four modules: `digests` (the files' names, their digests, the store's
errors: a leaf), `fixture` (the record of one run), `reader` (`FixtureReader`: the
index and the fixtures, lock-free) and `writer` (`FixtureStore`: a reader that also
writes, under the lock). This module gathers their names in one place.
"""

from hops_calib.store.digests import (
    DEFAULT_LOCK_TIMEOUT_S,
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
    dumps,
    events_fingerprint,
    file_digest,
    json_safe,
    meta_digest,
    text_digest,
)
from hops_calib.store.fixture import (
    RUN_COLUMNS,
    Fixture,
    MeasuredFixture,
    NotPriced,
    check_fixture_id,
    measured_fixture,
    read_events,
    recorded_source,
    source_path,
)
from hops_calib.store.reader import FixtureReader, measured_index_row
from hops_calib.store.writer import FixtureStore, write_events, write_table

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_S",
    "EVENTS_FILE",
    "EVENTS_KIND",
    "FILE_DIGESTS",
    "FINGERPRINT",
    "FIXTURE_FILE",
    "INDEX",
    "INDEX_COLUMNS",
    "ITERATION_KIND",
    "JOURNAL_FILE",
    "LOCK_FILE",
    "META_DIGEST",
    "RUNS_FILE",
    "RUN_COLUMNS",
    "SPEC_FILE",
    "TABLE_KIND",
    "TIMING_KEY",
    "TRUTH_FILE",
    "Fixture",
    "FixtureFileError",
    "FixtureReader",
    "FixtureStore",
    "MeasuredFixture",
    "NotPriced",
    "StoreError",
    "check_digest",
    "check_fixture_id",
    "dumps",
    "events_fingerprint",
    "file_digest",
    "json_safe",
    "measured_fixture",
    "measured_index_row",
    "meta_digest",
    "read_events",
    "recorded_source",
    "source_path",
    "text_digest",
    "write_events",
    "write_table",
]
