"""Trace room: a run table (CSV or Parquet, one measured run per row) as runs.

Columns (README, "Run tables"):

- Megatron's arguments in their `args.` spelling (`tensor_model_parallel_size`, `num_layers`, `fp16`, ...): an
  absent column (or an empty cell) takes Megatron-LM's default (`MEGATRON_DEFAULTS`); the shape and the vocabulary
  (`padded_vocab_size`, or `vocab_size`) have none and must be given;
- the hardware: `gpu` (a device type of the model's catalog) and `gpus_per_node`;
- the measurement: `iteration_time_ms`, or `samples_per_s` (iteration time = global batch / samples per second), or
  `tflops_per_gpu` (Megatron-LM's TFLOP/s/GPU: iteration time = `model_flops_per_iteration` / (TFLOP/s x 1e12 x
  GPUs));
- optionally `run_id` and `source`.

Settings every row shares may be given once in a sidecar `<table>.yaml` beside the table (`args: {...}`,
`hardware: {gpu: ..., gpus_per_node: ...}`); a setting both there and in a column is refused as ambiguous.
Rows that repeat one configuration form one group (`_run<k>` ids when the table names none). A row that cannot be
read is an error naming the file, its line (CSV: the header is line 1) or row (Parquet) and column; the other rows
are read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hops_calib.trace.errors import TraceError
from hops_calib.trace.measured import (
    EXTRA_PREFIX,
    KNOWN_ARGS,
    MEGATRON_DEFAULTS,
    REQUIRED_ARGS,
    VOCAB_ARGS,
    MeasuredRun,
    RunHardware,
    collective_tables_beside,
    model_flops_per_iteration,
    world_size,
)
from hops_calib.trace.megatron_args import parse_value
from hops_calib.trace.reading import MAX_ITERATION_MS, MIN_ITERATION_MS, positive_number, quoted, yaml_key_line

HARDWARE_COLUMNS = ("gpu", "gpus_per_node")
MEASUREMENT_COLUMNS = ("iteration_time_ms", "samples_per_s", "tflops_per_gpu")
META_COLUMNS = ("run_id", "source")
TABLE_SUFFIXES = (".csv", ".parquet")
# Arguments that must be whole numbers (>= 1, or >= 0 for the recompute count).
_POSITIVE_INTS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "context_parallel_size",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
    "padded_vocab_size",
    "vocab_size",
    "world_size",
    "num_layers_per_virtual_pipeline_stage",
    "max_position_embeddings",
)
_BOOLS = ("fp16", "bf16", "sequence_parallel")


@dataclass
class TableRead:
    """What a run table held: its runs, and an error per row that could not be read."""

    path: Path
    runs: list[MeasuredRun] = field(default_factory=list)
    errors: list[TraceError] = field(default_factory=list)
    mapping: str = "run table"  # or the published table's mapping it was read through
    warnings: list[str] = field(default_factory=list)  # about every run of the table (said once)


def is_run_table(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in TABLE_SUFFIXES


def _cell(value: Any) -> Any:
    """A cell as a Python value: numbers, booleans (True/False/true/false), None for an empty cell."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "item"):  # numpy scalars of a Parquet column
        value = value.item()
    if isinstance(value, str):
        text = value.strip()
        if text == "":
            return None
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return parse_value(text)
    return value


def _rows(path: Path) -> tuple[list[str], list[dict[str, Any]], Callable[[int], int], str]:
    """Columns, rows as dicts, the line (CSV) or row (Parquet) of row k, and the word for it."""
    import pandas as pd

    from hops_calib.trace.reading import MAX_TABLE_BYTES, MAX_TABLE_ROWS, open_regular, quoted

    with open_regular(path) as handle:  # a regular file only (no FIFO or device), of a bounded size
        size = os.fstat(handle.fileno()).st_size
        if size > MAX_TABLE_BYTES:
            raise TraceError(
                path,
                f"is {size / (1 << 20):.0f} MiB, more than a run table may be "
                f"({MAX_TABLE_BYTES >> 20} MiB, about {MAX_TABLE_ROWS:,} runs)",
                hint="split the table into several files and ingest them together",
            )
        try:
            if path.suffix.lower() == ".parquet":
                frame = pd.read_parquet(handle)
                where, word = (lambda k: k + 1), "row"
            else:
                frame = pd.read_csv(
                    handle, dtype=str, keep_default_na=False, skipinitialspace=True, encoding="utf-8-sig"
                )
                where, word = (lambda k: k + 2), "line"  # the header is line 1
        except Exception as err:  # noqa: BLE001 - pandas/pyarrow raise their own types; all mean an unreadable table
            raise TraceError(
                path,
                f"cannot be read as a table: {type(err).__name__}: {quoted(str(err), 80)}",
                hint="a run table is a CSV with a header line, or a Parquet file",
            ) from None
    if len(frame) > MAX_TABLE_ROWS:
        raise TraceError(
            path,
            f"holds {len(frame):,} rows, more than a run table may ({MAX_TABLE_ROWS:,})",
            hint="split the table into several files and ingest them together",
        )
    columns = [str(c).strip() for c in frame.columns]
    frame.columns = columns
    return columns, frame.to_dict(orient="records"), where, word


@dataclass
class Sidecar:
    """What `<source>.yaml` beside a table (or a log) gives every run of it."""

    path: Path
    args: dict[str, Any] = field(default_factory=dict)  # Megatron's arguments, args. spelling
    hardware: dict[str, Any] = field(default_factory=dict)  # gpu, gpus_per_node, collective_tables
    extra_columns: tuple[str, ...] = ()  # the table's own columns, kept out of the launch (as `x_` ones)


SIDECAR_KEYS = ("args", "hardware", "extra_columns")
SIDECAR_HARDWARE = ("gpu", "gpus_per_node", "collective_tables")


def unknown_names(names: list[str], known: Any) -> str:
    """`'pipeline_parallel_size' (did you mean pipeline_model_parallel_size?), ...` for names not in `known`."""
    import difflib

    parts = []
    for name in names:
        close = difflib.get_close_matches(name, sorted(known), n=2, cutoff=0.6)
        parts.append(
            quoted(name, 32 if len(names) > 1 else 16) + (f" (did you mean {' or '.join(close)}?)" if close else "")
        )
        if len(parts) == 8:
            parts.append(f"... ({len(names)} in all)")
            break
    return ", ".join(parts)


def read_sidecar(path: Path) -> Sidecar:
    """What every run of the table (or log) at `path` shares, from `<name>.yaml` beside it (empty when absent):
    `args` (Megatron's names), `hardware` (gpu, gpus_per_node, collective_tables), `extra_columns`. Unknown keys
    are refused, naming the closest known ones."""
    from hops_calib.trace.reading import parse_yaml, read_config_text

    sidecar = path.with_suffix(".yaml")
    if not sidecar.is_file():
        return Sidecar(path=sidecar)
    text = read_config_text(sidecar)  # (bounded: 64 KiB; kept for the lines of its keys)
    data = parse_yaml(sidecar, text) or {}  # (aliases expanded at most 10 000 values)
    hint = (
        "a sidecar holds `args: {name: value}` (Megatron's args. names), `hardware: {gpu: TYPE, gpus_per_node: "
        "N}` and optionally `extra_columns: [name, ...]` (the table's own columns), shared by every row"
    )
    if not isinstance(data, dict):
        raise TraceError(sidecar, f"holds a {type(data).__name__}, not a mapping", field="args/hardware", hint=hint)
    unknown = [str(k) for k in data if k not in SIDECAR_KEYS]
    if unknown:
        raise TraceError(
            sidecar,
            f"has unknown keys: {unknown_names(unknown, SIDECAR_KEYS)}",
            line=yaml_key_line(text, unknown[0]),
            field=unknown[0],
            hint=hint,
        )
    for key in ("args", "hardware"):
        if not isinstance(data.get(key) or {}, dict):
            raise TraceError(
                sidecar,
                "is not a mapping",
                line=yaml_key_line(text, key),
                field=key,
                hint=f"write {key}: {{name: value, ...}}",
            )
    args, hardware = dict(data.get("args") or {}), dict(data.get("hardware") or {})
    for where, given, known in (("args", args, KNOWN_ARGS), ("hardware", hardware, SIDECAR_HARDWARE)):
        unknown = [str(k) for k in given if k not in known]
        if unknown:
            raise TraceError(
                sidecar,
                f"has unknown {where} keys: {unknown_names(unknown, known)}",
                line=yaml_key_line(text, unknown[0]),
                field=f"{where}.{unknown[0]}",
                hint="fix the spelling (Megatron's args. names)"
                if where == "args"
                else f"hardware takes {', '.join(SIDECAR_HARDWARE)}",
            )
    extra = data.get("extra_columns") or []
    if not isinstance(extra, list) or not all(isinstance(name, str) for name in extra):
        raise TraceError(
            sidecar,
            f"is {extra!r}",
            line=yaml_key_line(text, "extra_columns"),
            field="extra_columns",
            hint="write extra_columns: [name, ...] (columns of the table that are not settings)",
        )
    return Sidecar(path=sidecar, args=args, hardware=hardware, extra_columns=tuple(extra))


def config_key(args: dict[str, Any], hardware: RunHardware) -> str:
    """The configuration a run repeats (every argument and the hardware), as text: the same on every machine (the
    folder its all-reduce tables were read from is left out; it is one per table)."""
    machine = {k: v for k, v in hardware.to_dict().items() if k != "collective_tables"}
    return json.dumps({"args": args, "hardware": machine}, sort_keys=True, default=str)


def config_slug(args: dict[str, Any]) -> str:
    """A readable name of a configuration: parallelism, depth, width, sequence, batch."""
    return (
        f"t{args.get('tensor_model_parallel_size', 1)}p{args.get('pipeline_model_parallel_size', 1)}"
        f"d{args.get('data_parallel_size', 1)}_l{args['num_layers']}_h{args['hidden_size']}"
        f"_s{args['seq_length']}_mb{args.get('micro_batch_size', 1)}_gb{args.get('global_batch_size')}"
    )


def read_run_table(
    path: Path | str,
    *,
    hardware: RunHardware | None = None,
    table_id: str | None = None,
    translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    mapping: str = "run table",
) -> TableRead:
    """The runs of a run table (module docstring). `translate` maps a published table's row to run-table columns
    (the vTrain mapping); `hardware` (--gpu/--gpus-per-node) fills the hardware columns where the table has none."""
    path = Path(path)
    table_id = table_id or path.stem
    columns, rows, where, word = _rows(path)
    sidecar = read_sidecar(path)
    shared_args, shared_hardware = sidecar.args, sidecar.hardware
    result = TableRead(path=path, mapping=mapping)
    if translate is None:
        columns = _check_columns(path, columns, sidecar, hardware, word)
        if not {"fp16", "bf16"} & (set(columns) | set(shared_args)):
            result.warnings.append(
                f"{path}: no fp16 or bf16 column, and {sidecar.path.name} gives neither: every "
                "row is priced in fp32 (Megatron's default); add args: {bf16: true} (or fp16) "
                f"to {sidecar.path.name} if the runs used 16-bit arithmetic"
            )
    if "collective_tables" not in shared_hardware and hardware is not None and hardware.collective_tables:
        shared_hardware["collective_tables"] = hardware.collective_tables
    tables = collective_tables_beside(
        path.parent, shared_hardware.pop("collective_tables", None), path.with_suffix(".yaml")
    )
    if hardware is not None:
        for key, value in ((k, v) for k, v in hardware.to_dict().items() if k != "collective_tables"):
            if shared_hardware.get(key, value) != value:
                raise TraceError(
                    path.with_suffix(".yaml"),
                    f"says {shared_hardware[key]!r}, the command line {value!r}",
                    field=f"hardware.{key}",
                    hint="give the hardware once",
                )
            shared_hardware[key] = value
    keyed: list[tuple[MeasuredRun, str]] = []
    for k, raw in enumerate(rows):
        line = where(k)
        try:
            cells = {name: _cell(raw[name]) for name in columns}
            if translate is not None:
                cells = translate(cells)
            run = _row_run(path, line, word, cells, shared_args, shared_hardware, table_id)
            run = replace(run, hardware=replace(run.hardware, collective_tables=tables))
        except TraceError as err:
            result.errors.append(err)
            continue
        keyed.append((run, config_key(run.args, run.hardware)))
    result.runs = _name_runs(table_id, keyed)
    if not rows:
        result.errors.append(TraceError(path, "holds no rows", hint="a run table has one measured run per row"))
    return result


def _check_columns(
    path: Path, columns: list[str], sidecar: Sidecar, hardware: RunHardware | None, word: str
) -> list[str]:
    """The columns of a run table that are settings or measurements; TraceError for the whole table when a column
    is unknown (a misspelling would take Megatron's default silently) or a setting without a default is given
    nowhere (neither a column nor the sidecar)."""
    line = 1 if word == "line" else None  # a CSV's header line
    extra = set(sidecar.extra_columns)
    known = KNOWN_ARGS | set(HARDWARE_COLUMNS) | set(MEASUREMENT_COLUMNS) | set(META_COLUMNS)
    unknown = [c for c in columns if c not in known and c not in extra and not c.startswith(EXTRA_PREFIX)]
    if word == "line" and len(columns) == 1 and unknown:
        delimiter = next((d for d in (";", "\t", "|") if d in columns[0]), None)
        if delimiter is not None:
            raise TraceError(
                path,
                f"has one column: its header is split by {delimiter!r}, not by commas",
                line=1,
                field="header",
                hint=f"a run table is comma-separated: save it as CSV with ',' "
                f"between the cells (e.g. pandas: read_csv(path, sep={delimiter!r}).to_csv(new, "
                "index=False))",
            )
    if unknown:
        raise TraceError(
            path,
            f"has unknown columns: {unknown_names(unknown, known)}",
            line=line,
            field=unknown[0][:16],
            hint=f"rename a misspelled column to Megatron's args. name (README, 'Run tables'); a column "
            f"of your own that is not a setting is kept out of the launch when its name starts with "
            f"'{EXTRA_PREFIX}' or {sidecar.path.name} lists it under extra_columns"
            + (
                ""
                if set(columns) & set(MEASUREMENT_COLUMNS)
                else f"; the measurement is one of {', '.join(MEASUREMENT_COLUMNS)}"
            ),
        )
    given = set(columns) | set(sidecar.args)
    side = sidecar.path.name
    for name in REQUIRED_ARGS:
        if name not in given:
            raise TraceError(
                path,
                f"has no {name} column, and {side} gives none: Megatron has no default for it",
                line=line,
                field=name,
                hint=f"add a {name} column (or args: {{{name}: N}} in {side})",
            )
    if not given & set(VOCAB_ARGS):
        raise TraceError(
            path,
            f"has no padded_vocab_size column, and {side} gives none: the vocabulary has no "
            "default (without it the embedding and the output layer would go unpriced)",
            line=line,
            field="padded_vocab_size",
            hint=f"add a padded_vocab_size column or args: "
            f"{{padded_vocab_size: N}} in {side} (Megatron's vocabulary padded to a multiple of 128 x "
            "tensor parallel size, as its log prints in ' > padded vocab ... (new size: N)')",
        )
    for name in HARDWARE_COLUMNS:
        if name not in columns and name not in sidecar.hardware and hardware is None:
            raise TraceError(
                path,
                f"has no {name} column, and neither {side} nor the command line gives it",
                line=line,
                field=name,
                hint="give the hardware: gpu and gpus_per_node columns, "
                f"hardware: {{gpu: TYPE, gpus_per_node: N}} in {side}, or --gpu TYPE --gpus-per-node N",
            )
    if not set(columns) & set(MEASUREMENT_COLUMNS):
        raise TraceError(
            path,
            "has no measurement column",
            line=line,
            field="iteration_time_ms",
            hint=f"give one of {', '.join(MEASUREMENT_COLUMNS)} (README, 'Run tables', says how "
            "samples/s and TFLOP/s/GPU convert)",
        )
    return [c for c in columns if c not in extra and not c.startswith(EXTRA_PREFIX)]


def _name_runs(table_id: str, keyed: list[tuple[MeasuredRun, str]]) -> list[MeasuredRun]:
    """Ids and groups: a run's group is its configuration; rows without a run_id are named after it (`_run<k>`
    where a configuration repeats, a short digest where two configurations share a readable name)."""
    slugs: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for run, key in keyed:
        slugs.setdefault(config_slug(run.args), set()).add(key)
        counts[key] = counts.get(key, 0) + 1
    seen: dict[str, int] = {}
    named = []
    for run, key in keyed:
        slug = config_slug(run.args)
        if len(slugs[slug]) > 1:
            slug += "_" + hashlib.sha256(key.encode()).hexdigest()[:6]
        group = f"{table_id}_{slug}"
        seen[key] = seen.get(key, 0) + 1
        run_id = run.run_id or (group + (f"_run{seen[key]}" if counts[key] > 1 else ""))
        named.append(replace(run, run_id=run_id, group=group))
    return named


def _bad(path: Path, line: int, word: str, column: str, problem: str, hint: str) -> TraceError:
    # `file:N:` reads as a line: a Parquet file's row says that it is a row
    return TraceError(
        path, problem if word == "line" else f"{word} {line}: {problem}", line=line, field=column, hint=hint
    )


def _row_run(
    path: Path,
    line: int,
    word: str,
    cells: dict[str, Any],
    shared_args: dict[str, Any],
    shared_hardware: dict[str, Any],
    table_id: str,
) -> MeasuredRun:
    known = set(HARDWARE_COLUMNS) | set(MEASUREMENT_COLUMNS) | set(META_COLUMNS)
    args = {name: value for name, value in cells.items() if name not in known and value is not None}
    for name in args:
        if name in shared_args:
            raise _bad(
                path,
                line,
                word,
                name,
                f"is given by the column and by {path.with_suffix('.yaml').name}",
                "give a setting once: in the sidecar when every row shares it, else as a column",
            )
    args = {**MEGATRON_DEFAULTS, **shared_args, **args}
    for name in _POSITIVE_INTS:
        value = args.get(name)
        if isinstance(value, float) and value.is_integer():  # "2.0": a whole number written by a float column
            value = args[name] = int(value)
        if value is not None and (type(value) is not int or value < 1):
            raise _bad(
                path,
                line,
                word,
                name,
                f"is {value!r}, expected a whole number of at least 1",
                "fix the cell (or leave it empty for Megatron's default)",
            )
    for name in _BOOLS:
        if type(args.get(name)) is not bool:
            raise _bad(path, line, word, name, f"is {args.get(name)!r}, expected true or false", "fix the cell")
    for name in REQUIRED_ARGS:
        if args.get(name) is None:
            raise _bad(
                path,
                line,
                word,
                name,
                "is empty: Megatron has no default for it",
                f"fill the cell (or give it once in {path.with_suffix('.yaml').name})",
            )
    if args.get("padded_vocab_size") is None and args.get("vocab_size") is None:
        raise _bad(
            path,
            line,
            word,
            "padded_vocab_size",
            "is empty: the vocabulary has no default",
            "fill the cell (Megatron pads the tokenizer's vocabulary to a multiple of 128 x tensor parallel size)",
        )
    args.setdefault("data_parallel_size", 1)
    gpus = world_size(args)
    if args.get("world_size") and args["world_size"] != world_size({**args, "world_size": None}):
        raise _bad(
            path,
            line,
            word,
            "world_size",
            f"is {args['world_size']}, but t x p x cp x d = {world_size({**args, 'world_size': None})}",
            "make the parallel sizes multiply to the GPUs",
        )
    args["world_size"] = gpus
    if args.get("global_batch_size") is None:
        args["global_batch_size"] = args["micro_batch_size"] * args["data_parallel_size"]
    if args["global_batch_size"] % (args["micro_batch_size"] * args["data_parallel_size"]):
        raise _bad(
            path,
            line,
            word,
            "global_batch_size",
            f"{args['global_batch_size']} is not a multiple of micro "
            f"batch {args['micro_batch_size']} x data parallel {args['data_parallel_size']}",
            "Megatron requires it to divide; fix the row",
        )
    hardware = _row_hardware(path, line, word, cells, shared_hardware)
    time_ms = _iteration_time(path, line, word, cells, args, gpus)
    run_id = cells.get("run_id")
    return MeasuredRun(
        run_id=str(run_id) if run_id is not None else "",
        group="",
        args=args,
        hardware=hardware,
        iteration_times_ms=(time_ms,),
        interval_iterations=(1,),
        reported={name: float(cells[name]) for name in MEASUREMENT_COLUMNS[1:] if cells.get(name) is not None},
        origin=f"{path}:{line}" + (f" ({cells['source']})" if cells.get("source") else ""),
    )


def _row_hardware(path: Path, line: int, word: str, cells: dict[str, Any], shared: dict[str, Any]) -> RunHardware:
    values = {}
    for name in HARDWARE_COLUMNS:
        if cells.get(name) is not None and name in shared and cells[name] != shared[name]:
            raise _bad(
                path,
                line,
                word,
                name,
                f"is {cells[name]!r}, the sidecar or command line {shared[name]!r}",
                "give the hardware once",
            )
        values[name] = cells.get(name) if cells.get(name) is not None else shared.get(name)
    if not values["gpu"] or not isinstance(values["gpu"], str):
        raise _bad(
            path,
            line,
            word,
            "gpu",
            f"is {values['gpu']!r}" if values["gpu"] else "is missing",
            "give the device type (a gpu column, the sidecar's hardware.gpu, or --gpu TYPE)",
        )
    if type(values["gpus_per_node"]) is not int or values["gpus_per_node"] < 1:
        raise _bad(
            path,
            line,
            word,
            "gpus_per_node",
            f"is {values['gpus_per_node']!r}" if values["gpus_per_node"] is not None else "is missing",
            "give the GPUs per node as a whole number (a gpus_per_node "
            "column, the sidecar's hardware.gpus_per_node, or --gpus-per-node N)",
        )
    return RunHardware(gpu=values["gpu"].lower(), gpus_per_node=values["gpus_per_node"])


def _iteration_time(path: Path, line: int, word: str, cells: dict[str, Any], args: dict[str, Any], gpus: int) -> float:
    """The measured iteration time (ms), given or converted (module docstring)."""
    for name in MEASUREMENT_COLUMNS:
        value = cells.get(name)
        if value is None:
            continue
        if not positive_number(value):
            raise _bad(
                path,
                line,
                word,
                name,
                f"is {value!r}, expected a positive number",
                "fix the cell, or leave it empty and give another measurement column",
            )
        if name == "iteration_time_ms":
            time_ms = float(value)
        elif name == "samples_per_s":
            time_ms = args["global_batch_size"] / value * 1e3
        else:
            time_ms = model_flops_per_iteration(args) / (value * 1e12 * gpus) * 1e3
        if not time_ms <= MAX_ITERATION_MS:
            raise _bad(
                path,
                line,
                word,
                name,
                f"is {value!r}: an iteration of {time_ms:.3g} ms, more than a day",
                "fix the cell (its unit?)",
            )
        if not time_ms >= MIN_ITERATION_MS:
            raise _bad(
                path,
                line,
                word,
                name,
                f"is {quoted(str(value), 24)}: an iteration of {time_ms:.3g} ms, "
                f"less than {MIN_ITERATION_MS * 1e3:.0f} microsecond (no kernel launches that fast)",
                "fix the cell (its unit?)",
            )
        return time_ms
    raise _bad(
        path,
        line,
        word,
        "iteration_time_ms",
        "no measurement in the row",
        f"give one of {', '.join(MEASUREMENT_COLUMNS)}",
    )
