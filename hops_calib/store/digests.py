"""The store's leaf: the names of the files a store keeps, the digests that prove each is the one ingest wrote
(fixture.json records them), and the store's errors. It imports nothing else of the store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.truth import EVENT_COLUMNS

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


INDEX_COLUMNS = (
    "id",
    "split",
    "group",
    "schedule",
    "declared_schedule",
    "configured_schedule",
    "pp",
    "vp",
    "microbatches",
    "iterations",
    "devices",
    "throughput_per_s",
    "steady_throughput_per_s",
    "bubble_ratio",
    "iteration_time_ms",
    "idle_ms",
    "dropped_lines",
    "content_hash",
    "source",
    "kind",
    "container",
    "tp",
    "dp",
    "gpus",
    "num_layers",
    "hidden_size",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
)


class StoreError(ValueError):
    """A store operation that cannot proceed as asked (unsafe id, unknown fixture, ...)."""


class FixtureFileError(StoreError):
    """A fixture file that is not as ingest wrote it (missing, damaged, edited): where (file, line), what, and what to
    do; the same attributes as `hops_calib.errors.InputError`, so `--json` errors carry them."""

    def __init__(self, origin: Path | str, problem: str, *, line: int | None = None, hint: str = "") -> None:
        self.origin, self.line, self.field, self.problem, self.hint = str(origin), line, None, problem, hint
        super().__init__(
            f"{origin}" + (f":{line}" if line is not None else "") + f": {problem}" + (f"; {hint}" if hint else "")
        )


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
            part = column[low : low + _FINGERPRINT_ROWS].astype(np.int64)
            if name in ("start_ns", "end_ns"):
                part -= first[stage[low : low + _FINGERPRINT_ROWS]]
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


def check_digest(path: Path, meta: dict[str, Any], hint: str, digest: str | None = None) -> None:
    """FixtureFileError unless the file (whose sha256 is `digest` when the caller has it) is the one `meta`
    (fixture.json) recorded: a fixture edited by hand would be scored as if measured."""
    if (digest or file_digest(path)) != (meta.get(FILE_DIGESTS) or {}).get(path.name):
        raise FixtureFileError(
            path,
            f"changed after ingest wrote it (its sha256 is not the one {FIXTURE_FILE} "
            "recorded): a fixture edited by hand would be scored as if measured",
            hint=hint,
        )
