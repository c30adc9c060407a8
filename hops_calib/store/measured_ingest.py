"""Store room: ingest runs measured at iteration level (Megatron training logs, run tables, the vTrain table).

A source file becomes one table folder (`fixture_store` docstring): its runs, each with its own id, group and
split, written at once. A row that cannot be read is rejected naming file, line (row) and column; the other rows
are stored. A source whose bytes (and ingest mode) are unchanged, with its folder intact, is skipped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hops_calib import __version__
from hops_calib.metrics import IterationMetrics
from hops_calib.store.collectives import HARDWARE_KEY as COLLECTIVES_KEY
from hops_calib.store.collectives import load_collectives, source_digest, store_collectives
from hops_calib.store.digests import FIXTURE_FILE, RUNS_FILE, StoreError, check_digest, dumps, text_digest
from hops_calib.store.fixture import check_fixture_id, recorded_source, source_path
from hops_calib.store.guard import stored_content_hash
from hops_calib.store.measured_spec import not_priced
from hops_calib.store.split import assigned_split, group_of
from hops_calib.store.writer import FixtureStore, write_table
from hops_calib.trace.dgxc import COMPANIONS as DGXC_COMPANIONS
from hops_calib.trace.dgxc import TABLE_ID as DGXC_TABLE_ID
from hops_calib.trace.dgxc import is_dgxc_table, read_dgxc_table
from hops_calib.trace.errors import TraceError
from hops_calib.trace.measured import KNOWN_ARGS, QUIET_ARGS, VOCAB_ARGS, MeasuredRun, RunHardware
from hops_calib.trace.megatron_log import is_megatron_log, read_megatron_log
from hops_calib.trace.run_table import TableRead, is_run_table, read_run_table, read_sidecar
from hops_calib.trace.vtrain import is_vtrain_table, read_vtrain_table
from hops_calib.truth import IterationTruth

# Part of every source's content hash: bump when what is stored for the same input changes.
# v2: the runs' all-reduce tables are kept in the store (`store.collectives`), named by digest in their hardware.
MEASURED_INGEST_VERSION = 2


@dataclass
class MeasuredContext:
    """What the store already holds, shared by every source of one ingest (and kept up to date by it)."""

    event_ids: set[str]  # runs with their own (events) folder
    table_runs: dict[str, str]  # run id -> the table folder holding it
    tables: dict[str, dict[str, Any]]  # table folder -> its fixture.json ({} when it cannot be trusted)
    group_split: dict[str, str]
    batch: dict[str, Path] = field(default_factory=dict)  # ids (runs and folders) claimed by this ingest
    collectives: dict[str, str] = field(default_factory=dict)  # a source's all-reduce table folder -> stored digest
    # A configuration (launch settings and machine, `configuration_of`) -> the group its runs form, over every
    # source: the same configuration from another table or log joins it (and so its split).
    config_group: dict[str, str] = field(default_factory=dict)
    # (configuration, measurement) -> (run id, table folder, origin): a run measured so is stored once.
    measurements: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)
    device_types: frozenset[str] | None = None  # the catalog's device types (None: not checked)
    stored_groups: frozenset[str] = frozenset()  # the groups the store held before this ingest (their split kept)


def is_measured_source(path: Path) -> bool:
    """A file ingest reads as runs measured at iteration level (a run table, or a Megatron training log)."""
    return path.is_file() and (is_run_table(path) or is_megatron_log(path))


def expected_runs(path: Path) -> int:
    """How many runs a source holds, for progress (a table's rows, one for a log), without reading it whole."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # noqa: BLE001 - an unreadable file is reported when it is read
            return 1
    if path.suffix.lower() == ".csv":
        with path.open("rb") as handle:  # (newlines counted in blocks: a line may be long)
            return max(sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 20), b"")) - 1, 1)
    return 1


def source_kind(path: Path) -> str:
    if is_vtrain_table(path):
        return "vtrain"
    if is_dgxc_table(path):
        return "dgxc"
    if is_run_table(path):
        return "run table"
    return "megatron log"


def read_context(store: FixtureStore, stored: dict[str, dict[str, Any]]) -> MeasuredContext:
    """The table folders of the store (their runs' ids, groups and splits); a folder whose files are not as
    ingest wrote them keeps its groups' splits from the index (as a run with events does)."""
    context = MeasuredContext(
        event_ids=set(stored),
        table_runs={},
        tables={},
        group_split={m["group"]: m["split"] for m in stored.values() if "group" in m},
    )
    for folder in store.table_folders():
        try:
            meta, runs = store.table(folder.name)
        except StoreError:
            context.tables[folder.name] = {}
            index = store.index() if (store.root / "index.parquet").is_file() else None
            if index is not None and "container" in index:
                mine = index[index["container"] == folder.name]
                for run_id, group, split in zip(mine["id"], mine["group"], mine["split"]):
                    context.table_runs[run_id] = folder.name
                    context.group_split.setdefault(group, split)
            continue
        context.tables[folder.name] = meta
        for run_id, group, split, args, hardware, truth, origin in zip(
            runs["id"], runs["group"], runs["split"], runs["args"], runs["hardware"], runs["truth"], runs["origin"]
        ):
            context.table_runs[run_id] = folder.name
            context.group_split.setdefault(group, split)
            try:
                key = configuration_of(json.loads(args), json.loads(hardware))
                measured = json.loads(truth)
                measured = measurement_of(measured["iteration_periods_ms"], measured["interval_iterations"])
            except (ValueError, KeyError, TypeError):
                continue
            context.config_group.setdefault(key, group)
            context.measurements.setdefault((key, measured), (run_id, folder.name, origin))
    return context


# Launch settings that do not change what a run measures per iteration (when and how long it ran, how it logs).
_NOT_CONFIGURATION = (
    frozenset({"train_iters", "log_interval", "seed", "lr", "timing_log_level", "timing_log_option", "tokenizer_type"})
    | QUIET_ARGS
)


def configuration_of(args: dict[str, Any], hardware: dict[str, Any]) -> str:
    """A run's configuration as text, the same whichever source gave it (a table, its Parquet copy, a log): the
    launch settings a run table may hold (`KNOWN_ARGS`, less when and how it logged), unset and off ones left out,
    and the machine (device type, GPUs per node)."""
    settings = {
        name: value
        for name, value in args.items()
        if name in KNOWN_ARGS and name not in _NOT_CONFIGURATION and value is not None and value is not False
    }
    machine = {"gpu": str(hardware.get("gpu")).lower(), "gpus_per_node": hardware.get("gpus_per_node")}
    return json.dumps({"args": settings, "hardware": machine}, sort_keys=True, default=str)


def measurement_of(periods_ms: Any, intervals: Any) -> str:
    """What a run measured (its iteration times and the iterations each covers), as text."""
    return json.dumps([[float(t) for t in periods_ms], [int(n) for n in intervals]])


def reader_digest(kind: str) -> str:
    """sha256 (16 hex) of the reader module of a published table (its mapping: what is stated, measured, assumed),
    so that a table ingested under another mapping is read again though its bytes are the same; "" for the rest."""
    from hops_calib.trace import dgxc, vtrain

    module = {"vtrain": vtrain, "dgxc": dgxc}.get(kind)
    if module is None or module.__file__ is None:
        return ""
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]


def source_hash(path: Path, mode: str) -> str:
    """sha256 of the source's bytes, the files beside it that it reads (sidecar, hops.base.yaml; a dgxc table's
    models.csv and settings.csv) and the mode."""
    outer = hashlib.sha256(f"hops-calib measured ingest v{MEASURED_INGEST_VERSION} {mode}\n".encode())
    companions = tuple(path.parent / name for name in DGXC_COMPANIONS) if mode.startswith("dgxc ") else ()
    for part in (path, path.with_suffix(".yaml"), path.parent / "hops.base.yaml", *companions):
        if part.is_file():
            outer.update(part.name.encode() + b"\0")
            with part.open("rb") as handle:
                outer.update(hashlib.file_digest(handle, "sha256").digest())
    return outer.hexdigest()


def _read_source(path: Path, kind: str, hardware: RunHardware | None, warmup: int) -> TableRead:
    if kind == "vtrain":
        return read_vtrain_table(path)
    if kind == "dgxc":
        return read_dgxc_table(path)
    if kind == "run table":
        return read_run_table(path, hardware=hardware)
    run = read_megatron_log(path, hardware=hardware, warmup_iterations=warmup)
    args = _with_sidecar(path, dict(run.args))
    _check_log_args(path, args)
    return TableRead(path=path, runs=[replace(run, args=args, group=group_of(run.run_id))], mapping=kind)


def _with_sidecar(path: Path, args: dict[str, Any]) -> dict[str, Any]:
    """A log's arguments with the settings its sidecar `<log>.yaml` gives (`args: {...}`: what the log does not
    print, such as the vocabulary of a log cut before the tokenizer's line); a setting the log prints otherwise is
    refused as ambiguous."""
    sidecar = read_sidecar(path)
    if sidecar.hardware or sidecar.extra_columns:
        raise TraceError(
            sidecar.path,
            "gives hardware or extra_columns to a training log",
            field="hardware",
            hint=f"a log's hardware goes into hops.base.yaml beside it (hardware: {{gpu: TYPE, "
            f"gpus_per_node: N}}) or --gpu/--gpus-per-node; {sidecar.path.name} holds args only",
        )
    for name, value in sidecar.args.items():
        if args.get(name) is not None and args[name] != value:
            raise TraceError(
                sidecar.path,
                f"says {value!r}, the log's arguments block {args[name]!r}",
                field=f"args.{name}",
                hint="give a setting once: drop it from the sidecar",
            )
        args[name] = value
    return args


def _check_log_args(path: Path, args: dict[str, Any]) -> None:
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
    ):
        if type(args.get(name)) is not int or args[name] < 1:
            raise TraceError(
                path,
                f"is {args.get(name)!r} in the arguments block",
                field=name,
                hint="the launch needs it as a whole number: ingest the log from its start",
            )
    if all(args.get(name) is None for name in VOCAB_ARGS):
        raise TraceError(
            path,
            "the log prints no vocabulary (no padded_vocab_size in its arguments block, no "
            "tokenizer line ' > padded vocab (size: V) with N dummy tokens (new size: P)'): without it "
            "the embedding and the output layer would go unpriced",
            field="padded_vocab_size",
            hint=f"ingest the log from its start (Megatron prints the tokenizer's line before training), "
            f"or write args: {{padded_vocab_size: P}} into {path.with_suffix('.yaml').name} beside it "
            "(P: the vocabulary padded to a multiple of 128 x tensor parallel size)",
        )
    if not args.get("data_parallel_size"):
        world = args.get("world_size")
        t, p = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
        args["data_parallel_size"] = world // (t * p) if type(world) is int and world >= t * p else 1


def _record(run: MeasuredRun, split: str, collectives: dict[str, str], root: Path) -> dict[str, Any]:
    args = run.args
    hardware = run.hardware.to_dict()
    folder = hardware.pop("collective_tables", None)
    if folder is not None:  # the tables themselves are in the store, named by their digest
        hardware[COLLECTIVES_KEY] = collectives[folder]
    microbatches = args["global_batch_size"] // (args["micro_batch_size"] * (args.get("data_parallel_size") or 1))
    truth = IterationTruth(
        metrics=IterationMetrics(
            microbatches_per_iteration=microbatches,
            iteration_periods_ms=run.iteration_times_ms,
            interval_iterations=run.interval_iterations,
        ),
        last_iterations=run.last_iterations,
        timers_ms=run.timers_ms,
        timing_log_option=run.timing_log_option,
        reported=run.reported,
    )
    texts = {"args": dumps(args).strip(), "hardware": dumps(hardware).strip(), "truth": dumps(truth.to_dict()).strip()}
    content = stored_content_hash(
        root, text_digest(f"measured v{MEASURED_INGEST_VERSION}\n" + "\n".join(texts.values())), split
    )
    return {
        "id": run.run_id,
        "split": split,
        "group": run.group,
        "content_hash": content,
        "origin": run.origin,
        **texts,
        "warnings": json.dumps(list(run.warnings)),
    }


def ingest_measured(
    path: Path,
    store: FixtureStore,
    context: MeasuredContext,
    outcome_type: Any,
    *,
    split: str,
    test_fraction: float,
    hardware: RunHardware | None,
    warmup: int,
    emit: Callable[[Any], None],
    forced: bool = True,
    stated_groups: dict[str, str] | None = None,
) -> bool:
    """Ingest one source file into its table folder; each run (and each bad row) is an outcome passed to `emit`.
    `stated_groups`: the groups the source's file names, with their split. Returns whether the store changed."""
    kind = source_kind(path)
    table_id = {"vtrain": "vtrain", "dgxc": DGXC_TABLE_ID}.get(kind, path.stem)
    mode = f"{kind} warmup={warmup} hardware={hardware.to_dict() if hardware else None}"
    if reader := reader_digest(kind):  # a published table's mapping: read again when it changes
        mode += f" reader={reader}"
    try:
        check_fixture_id(store.root, table_id, origin=str(path))
        if table_id in context.event_ids:
            raise StoreError(
                f"{path}: its runs would go to the folder {table_id}, which holds a run with events; rename the file"
            )
        if table_id in context.batch:  # (ingest reads a source listed twice, however spelled, once)
            raise StoreError(
                f"{path}: {context.batch[table_id]} is ingested into the same folder {table_id}; rename one of them"
            )
        context.batch[table_id] = path
        digest = source_hash(path, mode)
        previous = context.tables.get(table_id)
        if previous and previous.get("source") and source_path(previous["source"], store.root) != path.resolve():
            raise StoreError(
                f"{path}: the store's folder {table_id} holds the runs of "
                f"{source_path(previous['source'], store.root)}, another "
                "file of the same name; rename this one (its runs go to a folder named after it)"
            )
        if (
            previous
            and previous.get("content_hash") == digest
            and _intact(store, table_id)
            and _same_collectives(store, previous)
            and ("rejected" in previous or not previous.get("rejected_rows"))
        ):
            for message in previous.get("rejected") or []:  # the bad rows are still bad: said every time
                emit(outcome_type(source=path, error=message))
            for fixture in store.measured_fixtures(table_id):
                emit(
                    outcome_type(
                        source=path,
                        run_id=fixture.id,
                        status="unchanged",
                        split=fixture.split,
                        kind="iteration",
                        split_from=f"kept: its configuration group is stored in {fixture.split}",
                    )
                )
            return False
        read = _read_source(path, kind, hardware, warmup)
        used = {run.hardware.collective_tables for run in read.runs if run.hardware.collective_tables is not None}
        for name in sorted(used - set(context.collectives)):
            context.collectives[name] = store_collectives(store.root, name)
    except (TraceError, StoreError) as err:
        emit(outcome_type(source=path, error=str(err)))
        return False
    rejected = [str(err) for err in read.errors]
    for message in rejected:
        emit(outcome_type(source=path, error=message))
    records, outcomes = [], []
    for k, run in enumerate(read.runs):
        outcome = outcome_type(
            source=path,
            run_id=run.run_id,
            kind="iteration",
            warnings=(list(read.warnings) if k == 0 else []) + list(run.warnings),
        )
        try:
            check_fixture_id(store.root, run.run_id, origin=run.origin)
            holder = context.table_runs.get(run.run_id)
            if (
                run.run_id in context.event_ids
                or (holder is not None and holder != table_id)
                or (run.run_id != table_id and run.run_id in context.batch)
            ):
                raise StoreError(
                    f"{run.origin}: run id {run.run_id!r} is already a fixture of this store (from "
                    "another source); give the run another run_id"
                )
            _check_device(run, context.device_types, kind)
            run = _same_configuration(run, table_id, context)
            kept = context.group_split.get(run.group)
            if kept and run.group in context.stored_groups:
                outcome.split_from = f"kept: its configuration group is stored in {kept}"
            if forced and split != "auto" and kept and kept != split:
                raise StoreError(
                    f"run {run.run_id} belongs to group {run.group!r}, which is stored in the {kept} "
                    f"split; --split {split} would make the group straddle train and test"
                )
            outcome.split = kept or assigned_split(run.group, split, test_fraction, stated_groups)
            context.group_split.setdefault(run.group, outcome.split)
            records.append(_record(run, outcome.split, context.collectives, store.root))
            context.batch[run.run_id] = path
            outcome.status = "updated" if holder == table_id else "new"
            stored_hardware = {k: v for k, v in run.hardware.to_dict().items() if k != "collective_tables"}
            tables = (
                load_collectives(store.root, context.collectives[run.hardware.collective_tables])
                if run.hardware.collective_tables
                else ()
            )
            outcome.not_priced = not_priced(run.run_id, run.args, stored_hardware, run.origin, tables)
        except (StoreError, TraceError) as err:
            outcome.status, outcome.error = "rejected", str(err)
            rejected.append(str(err) if str(err).startswith(str(path)) else f"{run.run_id}: {err}")
        outcomes.append(outcome)
    if records:
        meta = {
            "id": table_id,
            "content_hash": digest,
            "ingest_version": MEASURED_INGEST_VERSION,
            "hops_calib_version": __version__,
            "ingested_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": recorded_source(path, store.root),
            "source_kind": kind,
            "mapping": read.mapping,
            "runs": len(records),
            "rejected_rows": len(rejected),
            "rejected": rejected,
            "collective_sources": {folder: context.collectives[folder] for folder in sorted(used)},
        }
        try:
            with store.writing(table_id) as folder:
                write_table(folder, records, meta)
        except (OSError, StoreError) as err:
            for outcome in outcomes:
                outcome.status, outcome.error = "rejected", str(err)
    for run_id in [r for r, holder in context.table_runs.items() if holder == table_id]:
        del context.table_runs[run_id]
    context.table_runs.update({record["id"]: table_id for record in records})
    for outcome in outcomes:
        emit(outcome)
    return bool(records)


def _same_collectives(store: FixtureStore, meta: dict[str, Any]) -> bool:
    """Whether the all-reduce tables a table folder's runs were priced with are still those of their source folders
    and in the store (else ingest reads the source again)."""
    for folder, digest in (meta.get("collective_sources") or {}).items():
        try:
            if source_digest(folder) != digest:
                return False
            load_collectives(store.root, digest)
        except (TraceError, StoreError, OSError):
            return False
    return True


def _check_device(run: MeasuredRun, known: frozenset[str] | None, kind: str) -> None:
    """TraceError for a run on a device type the catalog does not know (no model could price it)."""
    if known is None or run.hardware.gpu in known:
        return
    # a log's hardware is hops.base.yaml's beside it (the command line's --gpu is checked before)
    origin = Path(run.origin).parent / "hops.base.yaml" if kind == "megatron log" else run.origin
    raise TraceError(
        origin,
        f"is {run.hardware.gpu!r}, which is not a device type of the catalog (known: {', '.join(sorted(known))})",
        field="hardware.gpu" if kind == "megatron log" else "gpu",
        hint="name one of them (a100: A100 SXM4 80 GB), or add the type with its constants and their "
        "sources to hops_calib/model/devices.toml",
    )


def _same_configuration(run: MeasuredRun, table_id: str, context: MeasuredContext) -> MeasuredRun:
    """The run in the group its configuration already has in the store or this ingest (from any source), so repeats
    from two sources share a split; StoreError when another source already holds the same measurement of it (a
    copy of the same table, say)."""
    key = configuration_of(run.args, run.hardware.to_dict())
    measured = measurement_of(run.iteration_times_ms, run.interval_iterations)
    found = context.measurements.get((key, measured))
    if found is not None and found[1] != table_id:
        raise StoreError(
            f"{run.origin}: a duplicate of run {found[0]} ({found[2]}): the same configuration and the "
            "same measurement, from another source; ingest one copy of a table or log (drop this row, "
            "or give it the run's own measurement)"
        )
    context.measurements.setdefault((key, measured), (run.run_id, table_id, run.origin))
    group = context.config_group.setdefault(key, run.group)
    return replace(run, group=group) if group != run.group else run


def _intact(store: FixtureStore, table_id: str) -> bool:
    folder = store.folder(table_id)
    try:
        check_digest(folder / RUNS_FILE, store.meta(table_id), "")
        return (folder / FIXTURE_FILE).is_file()
    except (StoreError, OSError):
        return False
