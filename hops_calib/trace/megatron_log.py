"""Trace room: a Megatron training log (stdout of `pretrain_gpt.py`, Megatron-LM or Megatron-DeepSpeed) as a run.

What is read, and from where the format comes:

- the arguments block (Megatron-LM `megatron/training/arguments.py::_print_args`: a `---- arguments ----` ruler,
  one `  name ....... value` line per argument, an `---- end of arguments ----` ruler) as the launch, and the
  tokenizer's ` > padded vocab (size: V) with N dummy tokens (new size: P)` line for the vocabulary;
- the iteration lines (Megatron-LM `megatron/training/training.py::training_log`, printed every `--log-interval`
  iterations): ` [timestamp] iteration N/ TOTAL | key: value | ... |`; the timestamp is optional (older versions
  and Megatron-DeepSpeed print none), fields may be added, missing or reordered (only `elapsed time per iteration
  (ms)` is needed), and a field or line cut to `...` is skipped; Megatron ends every field with ` |`, so what
  follows a line's last `|` was cut (skipped), and the log's last line without its newline is cut (skipped);
- the timer blocks (megatron-core `megatron/core/timers.py::Timers.get_all_timers_string`, which `training_log`
  calls with `normalizer=args.log_interval` right after the iteration line) under each `--timing-log-option`:
  `max time across ranks (ms):` then `    name ......: 12.34`; `(min, max) time across ranks (ms):` then
  `    name ......: (10.00, 12.34)`; `times across ranks (ms):` then `  name:` and `     rank  0: 12.34` per rank;
  and the one-line form of the timers before that rewrite (Megatron-LM's `megatron/timers.py::Timers.log` until
  2022, still Megatron-DeepSpeed's): `time (ms) | name: 12.34 | name: 56.78`, the printing rank's own times
  (stored as `{"rank": ms}`; `timing_log_option` "legacy").

A launcher's per-line prefix (`[rank7]:`, `[default0]:`, as torchrun's --tee and --redirects write) is taken off
every line first.

Megatron averages the elapsed time (and the timers) over the iterations since the last log line: each kept line
is one value of the series, the mean over its interval, and keeps that meaning (`interval_iterations`). The first
iterations are slower (allocation, compilation, caches): a line whose interval holds one of the first
`warmup_iterations` iterations of the log is dropped (DEFAULT_WARMUP_ITERATIONS unless asked otherwise).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.trace.errors import TraceError
from hops_calib.trace.measured import MeasuredRun, RunHardware, collective_tables_beside
from hops_calib.trace.megatron_args import _BLOCK_END, _BLOCK_LINE, _BLOCK_START, parse_value
from hops_calib.trace.reading import MAX_ITERATION_MS, MAX_LOG_BYTES, MIN_ITERATION_MS, refuse_large, text_lines

DEFAULT_WARMUP_ITERATIONS = 2
# Megatron-LM's default --log-interval: the first line's interval when the arguments do not say.
DEFAULT_LOG_INTERVAL = 100
ELAPSED = "elapsed time per iteration (ms)"
# The throughput figures a log may print, by the name they are stored under.
REPORTED = {
    "throughput per gpu (tflop/s/gpu)": "tflops_per_gpu",  # Megatron-LM --log-throughput
    "tflops": "tflops_per_gpu",  # Megatron-DeepSpeed
    "samples per second": "samples_per_s",  # Megatron-DeepSpeed
}

# megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding, printed when the tokenizer is built (after the
# arguments block, which then shows padded_vocab_size None or not at all)
_PADDED_VOCAB = re.compile(r"padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_HEADERS = {
    "max time across ranks (ms):": "max",
    "(min, max) time across ranks (ms):": "minmax",
    "times across ranks (ms):": "all",
}
_LEGACY_TIMERS = re.compile(r"(?:^|\s)time \(ms\)\s*\|(.*)$")
_LAUNCHER_PREFIX = re.compile(r"^\[[A-Za-z_]*\d+\]:\s?")
_MAX_ENTRY = re.compile(r"^\s+(\S+) \.*: (-?\d+(?:\.\d+)?)\s*$")
_MINMAX_ENTRY = re.compile(r"^\s+(\S+) \.*: \((-?\d+(?:\.\d+)?), (-?\d+(?:\.\d+)?)\)\s*$")
_ALL_NAME = re.compile(r"^\s+(\S+):\s*$")
_ALL_RANK = re.compile(r"^\s+rank\s+(\d+): (-?\d+(?:\.\d+)?)\s*$")
_CUT = "..."


def _header(line: str) -> str | None:
    # `(min, max) ...` holds `max time ...`'s text after its own start: test the longer headers first
    for text, option in sorted(_HEADERS.items(), key=lambda item: -len(item[0])):
        if line.rstrip().endswith(text):
            return option
    return None


class _Interval:
    """One iteration line and the timer block printed after it."""

    def __init__(self, line: int, iteration: int, elapsed_ms: float, fields: dict[str, str]) -> None:
        self.line, self.iteration, self.elapsed_ms, self.fields = line, iteration, elapsed_ms, fields
        self.timers: dict[str, dict[str, float]] = {}
        self.iterations = 0


def _fields(text: str) -> dict[str, str]:
    fields = {}
    for part in text.split("|"):
        key, sep, value = part.partition(":")
        if sep:
            fields[key.strip().lower()] = value.strip()
    return fields


def _number(path: Path, line: int, name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise TraceError(
            path,
            f"is {value!r}, not a number",
            line=line,
            field=name,
            hint="the line is damaged: fix or delete it (a line cut short may end in '...')",
        )
    return number


def read_hardware_beside(path: Path) -> RunHardware | None:
    """The hardware of a log from `hops.base.yaml` beside it (`hardware.gpu` and `hardware.gpus_per_node`, or
    `hardware.devices[]` all of one `gpu` type); None when there is no such file."""
    from hops_calib.trace.job import TEMPLATE, read_template

    template_path = path.parent / TEMPLATE
    if not template_path.is_file():
        return None
    hardware = read_template(path.parent).get("hardware") or {}
    if not isinstance(hardware, dict):
        raise TraceError(
            template_path,
            "is not a mapping",
            field="hardware",
            hint="write hardware: {gpu: a100_80gb, gpus_per_node: 8}",
        )
    gpu = hardware.get("gpu")
    devices = hardware.get("devices")
    if not gpu and isinstance(devices, list):
        types = {str(d.get("gpu")).lower() for d in devices if isinstance(d, dict) and d.get("gpu")}
        if len(types) == 1:
            gpu = types.pop()
    if not gpu:
        raise TraceError(
            template_path,
            "names no device type",
            field="hardware.gpu",
            hint="write hardware: {gpu: TYPE, gpus_per_node: N} (or pass --gpu TYPE --gpus-per-node N)",
        )
    per_node = hardware.get("gpus_per_node")
    if type(per_node) is not int or per_node < 1:
        raise TraceError(
            template_path,
            f"is {per_node!r}" if per_node is not None else "is missing",
            field="hardware.gpus_per_node",
            hint="give the GPUs per node as a whole number (or pass --gpus-per-node N)",
        )
    return RunHardware(
        gpu=str(gpu).lower(),
        gpus_per_node=per_node,
        collective_tables=collective_tables_beside(path.parent, hardware.get("collective_tables"), template_path),
    )


def resolve_hardware(path: Path, given: RunHardware | None) -> RunHardware:
    """The log's hardware: `hops.base.yaml` beside it, or `given` (--gpu/--gpus-per-node); both must agree."""
    beside = read_hardware_beside(path)
    if given is not None and given.collective_tables is None:
        given = replace(given, collective_tables=collective_tables_beside(path.parent))
    if beside and given and beside != given:
        raise TraceError(
            path.parent / "hops.base.yaml",
            f"says {beside.gpu} x {beside.gpus_per_node} per node, "
            f"the command line {given.gpu} x {given.gpus_per_node}",
            field="hardware",
            hint="drop --gpu/--gpus-per-node, or make hops.base.yaml say the same",
        )
    found = beside or given
    if found is not None:
        return found
    raise TraceError(
        path,
        "the log does not say which hardware ran it",
        field="hardware",
        hint="pass --gpu TYPE --gpus-per-node N, or put a hops.base.yaml with hardware: {gpu: TYPE, "
        "gpus_per_node: N} beside the log",
    )


def is_megatron_log(path: Path, probe_lines: int = 2000) -> bool:
    """Whether a file looks like a Megatron training log: an arguments block or an iteration line near its start."""
    try:  # (regular files only, lines of at most 64 KiB: `trace.reading`)
        for number, line in text_lines(path):
            if number > probe_lines:
                break
            if _BLOCK_START.search(line) or _ITERATION.search(line):
                return True
    except TraceError:
        return False
    return False


def read_megatron_log(
    path: Path | str,
    *,
    hardware: RunHardware | None = None,
    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
    run_id: str | None = None,
) -> MeasuredRun:
    """The run a Megatron training log shows (see the module docstring); TraceError naming file, line and field."""
    path = Path(path)
    if warmup_iterations < 0:
        raise TraceError(
            path,
            f"--warmup-iterations {warmup_iterations} is negative",
            field="warmup_iterations",
            hint="give the number of first iterations to drop (0 keeps all)",
        )
    refuse_large(
        path,
        MAX_LOG_BYTES,
        "a training log",
        "ingest the log of one launch (split a longer log at its launches), or cut it to the iterations to keep",
    )
    resolved = resolve_hardware(path, hardware)
    args: dict[str, Any] | None = None
    block: dict[str, Any] = {}  # the arguments block being read: `args`, once its start is seen
    in_block = False
    block_line = 0
    intervals: list[_Interval] = []
    warnings: list[str] = []
    option: str | None = None
    timer_option: str | None = None  # the block being read
    timer_name: list[str | None] = [None]  # an `all` block's current timer
    padded_vocab: int | None = None
    # regular files only; a line over 64 KiB is no line of Megatron's and is skipped; each line keeps its newline,
    # so the log's last line without one (the log cut inside it) is seen
    for number, line in text_lines(path):
        line = _LAUNCHER_PREFIX.sub("", line, count=1)
        # the log's last line without its newline: the log was cut inside it (a value may be cut too)
        if (
            not line.endswith("\n")
            and line.strip()
            and not in_block
            and (_ITERATION.search(line) or timer_option is not None or _LEGACY_TIMERS.search(line))
            and not (_ITERATION.search(line) and line.rstrip().endswith("|"))
        ):
            warnings.append(
                f"{path}:{number}: the log ends inside this line (no newline after it, "
                "no closing '|'): a line cut short, skipped"
            )
            continue
        if in_block:
            if _BLOCK_END.search(line):
                in_block = False
                continue
            match = _BLOCK_LINE.search(line)
            if match:
                block[match.group(1)] = parse_value(match.group(2))
            continue
        if _BLOCK_START.search(line):
            if args is not None:
                raise TraceError(
                    path,
                    f"holds a second arguments block (the first at line {block_line}): two launches in one log",
                    line=number,
                    field="arguments",
                    hint="split the log at the second launch and ingest each part",
                )
            args = block = {}
            in_block, block_line = True, number
            continue
        if timer_option is not None:
            if _read_timer_line(line, timer_option, intervals, timer_name):
                continue
            timer_option, timer_name[0] = None, None
        legacy = _LEGACY_TIMERS.search(line)
        if legacy and intervals:
            if option not in (None, "legacy"):
                raise TraceError(
                    path,
                    f"one-line timers, earlier blocks under --timing-log-option {option}",
                    line=number,
                    field="timers",
                    hint="one log holds one launch: split it",
                )
            option = "legacy"
            for name, value in _fields(legacy.group(1)).items():
                if value != _CUT:
                    intervals[-1].timers[name] = {"rank": _number(path, number, name, value)}
            continue
        header = _header(line)
        if header is not None:
            if option is not None and header != option:
                raise TraceError(
                    path,
                    f"timer block under --timing-log-option {header}, earlier ones under {option}",
                    line=number,
                    field="timers",
                    hint="one log holds one launch: split it where the launch changed",
                )
            option = timer_option = header
            continue
        match = _ITERATION.search(line)
        if not match:
            vocab = _PADDED_VOCAB.search(line) if padded_vocab is None else None
            if vocab:
                padded_vocab = int(vocab.group(3))
            continue
        text = match.group(3)
        cut = not text.rstrip().endswith("|")
        if cut:  # Megatron ends every field of the line with ' |': what follows the last one was cut
            text = text[: text.rfind("|") + 1]
        fields = _fields(text)
        elapsed = fields.get(ELAPSED)
        if elapsed is None or elapsed == _CUT or elapsed.endswith(_CUT):
            warnings.append(
                f"{path}:{number}: iteration {match.group(1)} has no '{ELAPSED}' (a line cut short?): skipped"
            )
            continue
        if cut:
            warnings.append(
                f"{path}:{number}: iteration {match.group(1)} does not end with '|' (a line cut "
                "short?): its last field is skipped"
            )
        kept = {name: fields[name] for name in REPORTED if name in fields}  # a long log keeps only what is read
        intervals.append(_Interval(number, int(match.group(1)), _number(path, number, ELAPSED, elapsed), kept))
        if intervals[-1].elapsed_ms <= 0:
            raise TraceError(
                path,
                f"is {elapsed}: an iteration takes time",
                line=number,
                field=ELAPSED,
                hint="the line is damaged: fix or delete it",
            )
        if intervals[-1].elapsed_ms < MIN_ITERATION_MS:
            raise TraceError(
                path,
                f"is {elapsed[:24]} ms, less than a microsecond for one iteration",
                line=number,
                field=ELAPSED,
                hint="the line is damaged: fix or delete it",
            )
        if intervals[-1].elapsed_ms > MAX_ITERATION_MS:
            raise TraceError(
                path,
                f"is {elapsed[:40]} ms, more than a day for one iteration",
                line=number,
                field=ELAPSED,
                hint="the line is damaged: fix or delete it",
            )
    if in_block:
        raise TraceError(
            path,
            "the arguments block never ends (no '---- end of arguments ----')",
            line=block_line,
            field="arguments",
            hint="the log was cut inside the block: copy the whole block",
        )
    if args is None:
        raise TraceError(
            path,
            "holds no arguments block ('---- arguments ----'): the launch is unknown",
            field="arguments",
            hint="ingest the log Megatron wrote from its start (rank 0 prints the block before training)",
        )
    if not intervals:
        raise TraceError(
            path,
            "holds no iteration line with an elapsed time",
            field=ELAPSED,
            hint="ingest a log of a run that trained at least one --log-interval",
        )
    if args.get("padded_vocab_size") is None and padded_vocab is not None:
        args["padded_vocab_size"] = padded_vocab
    return _measured_run(path, args, resolved, intervals, warmup_iterations, option, warnings, run_id)


def _read_timer_line(line: str, option: str, intervals: list[_Interval], name: list[str | None]) -> bool:
    """Read one line of a timer block into the last interval; False when the line is not part of the block."""
    target = intervals[-1].timers if intervals else {}
    if option == "max":
        match = _MAX_ENTRY.match(line)
        if match:
            target[match.group(1)] = {"max": float(match.group(2))}
        return bool(match)
    if option == "minmax":
        match = _MINMAX_ENTRY.match(line)
        if match:
            target[match.group(1)] = {"min": float(match.group(2)), "max": float(match.group(3))}
        return bool(match)
    match = _ALL_RANK.match(line)
    if match and name[0] is not None:
        target.setdefault(name[0], {})[f"rank {int(match.group(1))}"] = float(match.group(2))
        return True
    match = _ALL_NAME.match(line)
    if match:
        name[0] = match.group(1)
        return True
    return False


def _measured_run(
    path: Path,
    args: dict[str, Any],
    hardware: RunHardware,
    intervals: list[_Interval],
    warmup: int,
    option: str | None,
    warnings: list[str],
    run_id: str | None,
) -> MeasuredRun:
    interval_length = args.get("log_interval")
    interval_length = interval_length if type(interval_length) is int and interval_length > 0 else DEFAULT_LOG_INTERVAL
    previous = None
    for item in intervals:
        if previous is not None and item.iteration <= previous:
            raise TraceError(
                path,
                f"iteration {item.iteration} after iteration {previous}",
                line=item.line,
                field="iteration",
                hint="the log holds a restart or out-of-order lines: ingest one launch's lines in order",
            )
        item.iterations = item.iteration - previous if previous is not None else min(interval_length, item.iteration)
        previous = item.iteration
    first = intervals[0].iteration - intervals[0].iterations + 1  # the log's first iteration
    kept = [item for item in intervals if item.iteration - item.iterations + 1 >= first + warmup]
    if not kept:
        raise TraceError(
            path,
            f"every logged interval holds one of the first {warmup} iterations (warm-up)",
            line=intervals[-1].line,
            field=ELAPSED,
            hint="ingest a longer log, or lower --warmup-iterations",
        )
    if len(kept) < len(intervals):
        warnings.append(
            f"dropped {len(intervals) - len(kept)} logged interval(s) holding the first {warmup} iteration(s) (warm-up)"
        )
    timers: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(name for item in kept for name in item.timers):
        keys = dict.fromkeys(key for item in kept for key in item.timers.get(name, {}))
        timers[name] = {
            key: float(np.median([item.timers[name][key] for item in kept if key in item.timers.get(name, {})]))
            for key in keys
        }
    reported: dict[str, float] = {}
    for field_name, stored in REPORTED.items():
        values = [
            _number(path, item.line, field_name, item.fields[field_name])
            for item in kept
            if item.fields.get(field_name, _CUT) != _CUT
        ]
        if values and stored not in reported:
            reported[stored] = float(np.median(values))
    return MeasuredRun(
        run_id=run_id or path.stem,
        group="",
        args=args,
        hardware=hardware,
        iteration_times_ms=tuple(item.elapsed_ms for item in kept),
        interval_iterations=tuple(item.iterations for item in kept),
        last_iterations=tuple(item.iteration for item in kept),
        timers_ms=timers,
        timing_log_option=option if timers else None,
        reported=reported,
        origin=str(path),
        warnings=tuple(warnings),
    )
