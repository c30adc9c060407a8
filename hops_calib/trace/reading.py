"""Trace room: bounded reading of a job directory's files, so no input can hang ingest or exhaust memory.

Only regular files are read (a FIFO, `/dev/zero` or `/dev/urandom` behind a
name or a symbolic link is refused without blocking); a configuration file is
read whole only up to MAX_CONFIG_BYTES (MAX_LAYOUT_BYTES for the files that
grow with the stages), a line only up to MAX_LINE_BYTES, YAML only up to a
number of values with its aliases expanded (a few nested aliases expand a
small file without bound) and MAX_NESTING levels. The bounds sit far above
what real jobs write: the 56 shared cluster runs and the CPU captures have
configuration files of at most 1.8 KB and lines of at most 367 bytes.
"""

from __future__ import annotations

import io
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hops_calib.trace.errors import TraceError

MAX_CONFIG_BYTES = 64 << 10  # megatron_args.txt, manifest.yaml (real: <= 751 bytes)
# hops.base.yaml, hops_trace_map.json: they grow with the stages and devices (real: <= 1.8 KB for 5 stages, about
# 350 bytes a stage), so thousands of stages fit
MAX_LAYOUT_BYTES = 4 << 20
MAX_LINE_BYTES = 64 << 10  # one line of an event log, link benchmark or rank log (real: <= 367 bytes)
MAX_NESTING = 32  # levels of YAML mappings and lists (real: 3)
MAX_YAML_NODES = 10_000  # values of manifest.yaml with its aliases expanded (kept in fixture.json; real: <= 6)
MAX_LAYOUT_NODES = 1_000_000  # values of hops.base.yaml, aliases expanded (real: <= 153 for 5 stages, ~25 a stage)
# a run table (CSV or Parquet, one measured run per row): the published vTrain table is 1,440 rows in 80 KB; a sweep
# of 100,000 runs is about 10 MB
MAX_TABLE_BYTES = 64 << 20
MAX_TABLE_ROWS = 100_000
# one measured training iteration: a day (real: under 2 s for the vTrain runs, under 1 s for the cluster runs); a
# longer one is a damaged or mis-scaled number (1e308 ms overflowed the metrics to a throughput of 0)
MAX_ITERATION_MS = 86_400_000.0
# and at least a microsecond: an iteration launches a forward and a backward kernel per layer, and one kernel launch
# alone takes microseconds (the fastest real ones: 58 ms, vTrain); 1e-300 ms is a damaged number
MIN_ITERATION_MS = 1e-3
MAX_HOSTNAME = 255  # characters of an event's hostname (DNS names have at most 253)
# an all-reduce table (nccl-tests output, one row per message size): the published A100 ones are 56 KB for 1,024
# sizes; 4 MiB holds 70,000 sizes
MAX_COLLECTIVE_TABLE_BYTES = 4 << 20
# a training log: Megatron prints about 90 bytes per line, a logged iteration with its timers about 800 bytes, so
# 64 MiB is over 80,000 logged iterations; read a line at a time, its iterations kept (benchmarks/limits.py: a 64 MB
# log of 740,000 lines ingests in 37 s at 417 MB peak memory)
MAX_LOG_BYTES = 64 << 20
QUOTED_BYTES = 16  # the most of a file's content an error message quotes


def positive_number(value: object) -> bool:
    """Whether a parsed value is a positive, finite number: not a bool, and not an integer too large for a float
    (`math.isfinite` raises OverflowError on one: a 400-digit cell is a damaged value, not a crash)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path) -> io.BufferedReader:
    """`path` opened for binary reading; TraceError when it is missing, unreadable, or not a regular file (a FIFO
    is opened without blocking and refused, a device such as /dev/zero is refused before a byte is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TraceError(
            path,
            "is missing" + (" (a symbolic link to nothing)" if os.path.islink(path) else ""),
            hint="copy the file from the job",
        ) from None
    except OSError as err:
        raise TraceError(path, f"cannot be read ({err.strerror or err})", hint="check the file's permissions") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            target = f" (a symbolic link to {os.readlink(path)})" if os.path.islink(path) else ""
            raise TraceError(
                path,
                f"is {_kind(mode)}{target}, not a regular file",
                hint="ingest reads only regular files: copy the job's file itself here",
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def quoted(text: str, limit: int = QUOTED_BYTES) -> str:
    """At most `limit` characters of a file's content, for an error message (a file that is not the expected one
    may hold anything: a message never echoes more than a few bytes of it)."""
    text = str(text)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def size_of(path: Path) -> int:
    """The size of a regular file (0 when it cannot be read: the reader then says why)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def refuse_large(path: Path, limit: int, what: str, hint: str) -> None:
    """TraceError before a byte is read when the file at `path` is larger than `limit`."""
    size = size_of(path)
    if size > limit:
        raise TraceError(
            path,
            f"is {size / 2**20:.1f} MiB, more than the {limit >> 20} MiB {what} may be (a "
            "bound against input that would exhaust memory or time)",
            hint=hint,
        )


def refuse_link_out(path: Path, root: Path) -> None:
    """TraceError when `path` is a symbolic link (or lies under one) that leads out of `root`: a file found inside a
    source's folder (an all-reduce table of its tables folder) is read from that folder, never through a link to a
    file elsewhere. (A source named on the command line is read where it leads: it is the file named.)"""
    try:
        target = Path(os.path.realpath(path))
        inside = Path(os.path.realpath(root))
    except OSError:
        return
    if target != inside and inside not in target.parents:
        raise TraceError(
            path,
            f"is a symbolic link out of {root} (to {target})",
            field="file",
            hint="copy the file itself into the folder; ingest does not follow links out of it",
        )


def decode_utf8(path: Path, data: bytes, first_line: int = 1) -> str:
    """`data` as UTF-8 text; TraceError naming the line and column of the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise TraceError(
            path,
            f"is not UTF-8 text (byte 0x{data[err.start]:02x} at column {column})",
            line=line,
            hint="save the file as UTF-8, or copy it again from the job (a damaged copy?)",
        ) from None


def read_config_bytes(path: Path, limit: int = MAX_CONFIG_BYTES) -> bytes:
    with open_regular(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise TraceError(
            path,
            f"is larger than {size}, far more than a job's configuration needs (the largest real one is 1.8 KB)",
            hint="copy the job's own file here (this one is another file, or damaged)",
        )
    return data


def read_config_text(path: Path, limit: int = MAX_CONFIG_BYTES) -> str:
    """A small configuration file's text: a regular file of at most `limit` bytes, UTF-8."""
    return decode_utf8(path, read_config_bytes(path, limit))


def bounded_lines(handle: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """(1-based number, line bytes) of each line; None instead of the bytes for a line longer than `limit`, which is
    skipped without being held in memory."""
    number, readline, cap = 0, handle.readline, limit + 1
    while True:
        raw = readline(cap)
        if not raw:
            return
        number += 1
        if len(raw) == cap and raw[-1] != 10:  # (10: b"\n")
            while raw and not raw.endswith(b"\n"):  # skip the rest of the long line, a block at a time
                raw = handle.readline(1 << 16)
            yield number, None
            continue
        yield number, raw


def long_line(path: Path, number: int, limit: int = MAX_LINE_BYTES) -> TraceError:
    return TraceError(
        path,
        f"the line is longer than {limit >> 10} KiB (the longest line of a real job's files is "
        "367 bytes): not a line the job wrote",
        line=number,
        hint="copy the job's own file here (this one is damaged, or another file)",
    )


# a terminal's colour and cursor codes (ECMA-48 CSI sequences, and the two-byte escapes): a log written through a
# terminal or `tee` from one carries them around its lines
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")


def clean_line(text: str) -> str:
    """A log line as the program wrote it: without terminal colour codes and without the carriage return of a
    Windows line end (`\r\n` reads as `\n`; a last line cut after its `\r` loses it too)."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if text.endswith("\r\n"):
        return text[:-2] + "\n"
    return text[:-1] if text.endswith("\r") else text


def text_lines(path: Path, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of a log-like file (undecodable bytes replaced, `clean_line`), skipping lines
    over `limit`; read a line at a time, so memory stays a line's whatever the file's size."""
    with open_regular(path) as handle:
        for number, raw in bounded_lines(handle, limit):
            if raw is not None:
                yield number, clean_line(raw.decode("utf-8", errors="replace"))


def strict_lines(path: Path) -> Iterator[str]:
    """A table's lines as text: a regular file, UTF-8 (the first bad byte named by line), lines of at most
    MAX_LINE_BYTES (TraceError naming the line otherwise)."""
    with open_regular(path) as handle:
        for number, raw in bounded_lines(handle):
            if raw is None:
                raise long_line(path, number)
            yield decode_utf8(path, raw, number)


def csv_rows(
    path: Path, header: tuple[str, ...], expected: str, max_rows: int | None = None
) -> Iterator[tuple[int, list[str]]]:
    """(line, cells) of a benchmark's CSV table after its header (`strict_lines`), blank lines skipped; TraceError
    naming the line for another header (`expected` says whose columns), a row of another width, more than `max_rows`
    rows, or text that is not CSV."""
    import csv

    rows = csv.reader(strict_lines(path))
    try:
        first = next(rows, None)
        if first is None or tuple(cell.strip() for cell in first) != header:
            shown = quoted(",".join(first)) if first is not None else "nothing"
            raise TraceError(
                path,
                f"does not start with {expected} header (it starts {shown})",
                line=1,
                field="header",
                hint=f"expected {expected} columns {','.join(header)}",
            )
        for number, row in enumerate(rows, start=2):
            if not row or not "".join(row).strip():
                continue
            if max_rows is not None and number > max_rows + 1:
                raise TraceError(
                    path,
                    f"has more than {max_rows} rows",
                    line=number,
                    hint="a benchmark table holds one row per measured size or shape: split or thin it",
                )
            if len(row) != len(header):
                raise TraceError(
                    path,
                    f"has {len(row)} columns, expected {len(header)}",
                    line=number,
                    hint="a torn or edited row: re-run the benchmark or delete the line",
                )
            yield number, row
    except csv.Error as err:
        raise TraceError(
            path, f"is not a CSV table ({quoted(str(err), 60)})", hint="give the benchmark's CSV output"
        ) from None


def _nesting_error(path: Path, line: int | None) -> TraceError:
    return TraceError(
        path,
        "nests mappings or lists too deeply" + (f" (more than {MAX_NESTING} levels)" if line else ""),
        line=line,
        hint="a job's configuration is a few levels deep: copy the job's own file here",
    )


def yaml_key_line(text: str, key: str) -> int | None:
    """1-based line of a YAML document's text that sets `key` (`key:`, or `- key:` in a list), the first; None when
    none does."""
    import re

    pattern = re.compile(rf"^\s*-?\s*{re.escape(key)}\s*:")
    return next((k for k, line in enumerate(text.splitlines(), start=1) if pattern.match(line)), None)


def load_yaml(path: Path, max_bytes: int = MAX_CONFIG_BYTES, max_nodes: int = MAX_YAML_NODES) -> Any:
    """A YAML file's data, safely: at most `max_bytes`, at most `max_nodes` values once aliases (`*name`) are
    expanded, at most MAX_NESTING levels; TraceError (file, line) otherwise, and for text that is not YAML."""
    return parse_yaml(path, read_config_text(path, max_bytes), max_nodes)


def parse_yaml(path: Path, text: str, max_nodes: int = MAX_YAML_NODES) -> Any:
    """`load_yaml` of a file's text already read (`read_config_text`), for a caller that also needs the text."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster, same result on safe YAML
    try:
        _check_expansion(path, yaml.parse(text, Loader=loader), max_nodes)
        return yaml.load(text, Loader=loader)
    except TraceError:
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise TraceError(
            path,
            f"not valid YAML ({getattr(err, 'problem', None) or err})",
            line=mark.line + 1 if mark else None,
            hint="fix the YAML syntax",
        ) from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise TraceError(path, f"holds a value that cannot be read ({err})", hint="fix the value") from None


def _check_expansion(path: Path, events: Iterator[Any], max_nodes: int) -> None:
    """TraceError when the YAML events nest deeper than MAX_NESTING or expand (aliases counted at the size of what
    they name) to more than `max_nodes` values: a few nested aliases in a small file make billions."""
    import yaml

    sizes: dict[str, int] = {}  # anchor -> values its node expands to
    open_nodes: list[list[Any]] = []  # [anchor, values so far] of each collection being read
    total = 0
    for event in events:
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_nodes.append([event.anchor, 1])
            if len(open_nodes) > MAX_NESTING:
                raise _nesting_error(path, event.start_mark.line + 1)
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, size = open_nodes.pop()
        elif isinstance(event, yaml.AliasEvent):
            if any(node[0] == event.anchor for node in open_nodes):
                raise TraceError(
                    path,
                    f"the alias *{event.anchor} stands inside the value it names (a value that holds itself)",
                    line=event.start_mark.line + 1,
                    hint="write the value out; a configuration holds no value inside itself",
                )
            anchor, size = None, sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        else:
            continue
        if anchor:
            sizes[anchor] = size
        if open_nodes:
            open_nodes[-1][1] += size
            size = open_nodes[-1][1]
        else:
            total += size
            size = total
        if size > max_nodes:
            raise TraceError(
                path,
                f"expands to more than {max_nodes} values once its aliases (*name) are written out",
                line=event.start_mark.line + 1,
                hint="write the values out instead of nesting aliases (a few nested ones expand a "
                "small file without bound)",
            )


def load_json(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """A JSON file's data: at most `max_bytes`, UTF-8, nesting Python can parse; TraceError (file, line) otherwise."""
    import json

    text = read_config_text(path, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(path, f"not valid JSON ({err.msg})", line=err.lineno, hint="fix the JSON syntax") from None
    except RecursionError:
        raise _nesting_error(path, None) from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise TraceError(path, f"holds a value that cannot be read ({err})", hint="fix the value") from None
