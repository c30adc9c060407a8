"""Hostile and unlucky input for ingest: one real shared run, copied and damaged, beside an intact one.

Used by tests/store/test_hostile_input.py (small sizes) and benchmarks/hostile.py (the sizes of issue #21). Each case
damages the copy of `DAMAGED` in a source folder that also holds a copy of `INTACT`, and says what ingest must
answer: the exit code and words of the message. The other run must be ingested whatever the case.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DAMAGED = "exp2_13_a10g_pair_pp2_run135"  # the issue's $J
INTACT = "exp2_14_l4_pair_pp2_run137"
ALIAS_BOMB = """a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def copy_runs(shared_runs: Path, into: Path, names: tuple[str, ...] = (DAMAGED, INTACT)) -> Path:
    """Writable copies of shared runs in `into` (the shared files are read-only); returns `into`."""
    for name in names:
        shutil.copytree(shared_runs / name, into / name)
    for path in [into, *into.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return into


def _insert_bytes(path: Path, marker: bytes, extra: bytes) -> None:
    data = path.read_bytes()
    at = data.index(marker) + len(marker)
    path.write_bytes(data[:at] + extra + data[at:])


def _edit_first_event(path: Path, **changes) -> None:
    lines = path.read_text().splitlines(keepends=True)
    event = json.loads(lines[0])
    event.update(changes)
    lines[0] = json.dumps(event) + "\n"
    path.write_text("".join(lines))


def _replace_with_link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _template_bomb(job: Path, size: int) -> None:
    path = job / "hops.base.yaml"
    text = path.read_text()
    assert "hardware:\n  devices:\n" in text
    path.write_text(ALIAS_BOMB + text.replace("hardware:\n  devices:\n", "hardware:\n  devices: *h\n  listed:\n", 1))


def _manifest_bomb(job: Path, size: int) -> None:
    (job / "manifest.yaml").write_text(ALIAS_BOMB + "run_id: exp2_13_a10g_pair_pp2_run135\n")


def _run_id_bomb(job: Path, size: int) -> None:
    (job / "manifest.yaml").write_text(ALIAS_BOMB + "run_id: *h\n")


def _long_token(job: Path, size: int) -> None:
    path = job / "megatron_args.txt"
    path.write_text(path.read_text().rstrip("\n") + " --data-path " + "a" * size + "\n")


def _many_microbatches(job: Path, size: int) -> None:
    path = job / "megatron_args.txt"
    text = path.read_text()
    path.write_text(re.sub(r"--global-batch-size \d+", f"--global-batch-size {size}", text))


def _one_line_array(job: Path, size: int) -> None:
    path = job / "megatron_trace" / "rank0.jsonl"
    with path.open("w") as handle:
        handle.write("[")
        chunk = "1," * (1 << 19)
        for _ in range(max(1, size // len(chunk))):
            handle.write(chunk)
        handle.write("1]\n")


def _long_hostname(job: Path, size: int) -> None:
    _edit_first_event(job / "megatron_trace" / "rank0.jsonl", hostname="h" * size)


def _index_parquet(root: Path) -> None:
    (root / DAMAGED).rename(root / "index.parquet")


def _dot_named(root: Path) -> None:
    (root / DAMAGED).rename(root / f".{DAMAGED}")


def _link_to_root(root: Path) -> None:
    (root / "everything").symlink_to("/")


def _up_link(root: Path) -> None:
    (root / DAMAGED / "up").symlink_to("..")
    (root / "up").symlink_to("..")
    shutil.copytree(root / DAMAGED, root.parent / "sibling_run1", symlinks=True)  # outside the source: not read


def _duplicate_rank(job: Path, size: int) -> None:
    shutil.copy(job / "megatron_trace" / "rank0.jsonl", job / "megatron_trace" / "rank00.jsonl")


@dataclass(frozen=True)
class Case:
    name: str
    exit_code: int
    says: tuple[str, ...]  # words of the message (stderr), each present
    damage_job: Callable[[Path, int], None] | None = None  # (job copy, size)
    damage_source: Callable[[Path], None] | None = None  # (source folder holding both copies)
    small: int = 0  # size for the tests
    large: int = 0  # size for the benchmark (the issue's)
    lenient: bool = False
    damaged_ingested: bool = False  # the damaged run itself lands (the damage is beside it)


def _utf8(name: str, marker: bytes) -> Case:
    return Case(f"non-UTF-8 {name}", 6, (f"{name}:", "is not UTF-8 text", "byte 0xff"),
                damage_job=lambda job, size: _insert_bytes(job / name, marker, b"\xff\xfe"))


CASES: tuple[Case, ...] = (
    _utf8("megatron_args.txt", b"--num-layers"),
    _utf8("hops.base.yaml", b"hardware:"),
    _utf8("manifest.yaml", b"description: "),
    _utf8("hops_trace_map.json", b'"0": "'),
    Case("timestamp >= 2^63", 6, ("rank0.jsonl:1:", "field 'start_wall_ns'", "past 2^62"),
         damage_job=lambda job, size: _edit_first_event(job / "megatron_trace" / "rank0.jsonl",
                                                        start_wall_ns=2**63, end_wall_ns=2**63 + 5)),
    Case("job directory named index.parquet", 6, ("'index.parquet'", "the name of the store's own index.parquet"),
         damage_source=_index_parquet),
    Case("rank0.jsonl and rank00.jsonl", 6, ("holds two logs of rank 0", "rank0.jsonl and rank00.jsonl"),
         damage_job=_duplicate_rank),
    Case("YAML alias bomb in hops.base.yaml", 6, ("hops.base.yaml:", "expands to more than 1000000 values"),
         damage_job=_template_bomb),
    Case("YAML alias bomb in manifest.yaml", 6, ("manifest.yaml:", "expands to more than 10000 values"),
         damage_job=_manifest_bomb),
    Case("YAML alias bomb as the run_id", 6, ("manifest.yaml:", "expands to more than 10000 values"),
         damage_job=_run_id_bomb),
    Case("rank0.jsonl -> /dev/zero", 6, ("rank0.jsonl: is a character device", "/dev/zero"),
         damage_job=lambda job, size: _replace_with_link(job / "megatron_trace" / "rank0.jsonl", "/dev/zero")),
    Case("rank0.jsonl -> /dev/urandom (--lenient)", 6, ("rank0.jsonl: is a character device", "/dev/urandom"),
         damage_job=lambda job, size: _replace_with_link(job / "megatron_trace" / "rank0.jsonl", "/dev/urandom"),
         lenient=True),
    Case("rank0.jsonl is a FIFO", 6, ("rank0.jsonl: is a FIFO",),
         damage_job=lambda job, size: _fifo(job / "megatron_trace" / "rank0.jsonl")),
    Case("huge token in megatron_args.txt", 6, ("megatron_args.txt: is larger than 64 KiB",),
         damage_job=_long_token, small=200_000, large=10_000_000),
    Case("10^12 microbatches configured", 6, ("megatron_args.txt: field '--global-batch-size'",
                                              "more than the 32768 a trace can number"),
         damage_job=_many_microbatches, small=10**12, large=10**12),
    Case("huge single-line JSON array", 6, ("rank0.jsonl:1:", "longer than 64 KiB"),
         damage_job=_one_line_array, small=2_000_000, large=200_000_000),
    Case("huge hostname line", 6, ("rank0.jsonl:1:", "longer than 64 KiB"),
         damage_job=_long_hostname, small=2_000_000, large=200_000_000),
    Case("long hostname in a short line", 6, ("rank0.jsonl:1:", "field 'hostname'", "at most 255"),
         damage_job=_long_hostname, small=1000, large=60_000),
    Case("symbolic link to /", 0, ("did not follow", "everything -> /"), damage_source=_link_to_root,
         damaged_ingested=True),
    Case("links up -> ..", 0, ("did not follow", "up -> .."), damage_source=_up_link, damaged_ingested=True),
    Case("dot-named job directory", 0, ("skipped 1 job directory whose name starts with a dot",
                                        f".{DAMAGED}"), damage_source=_dot_named),
)


def build(case: Case, shared_runs: Path, root: Path, large: bool = False) -> Path:
    """A source folder under `root` with the two runs, the case's damage done; returns it."""
    source = copy_runs(shared_runs, root / "src")
    if case.damage_job:
        case.damage_job(source / DAMAGED, case.large if large else case.small)
    if case.damage_source:
        case.damage_source(source)
    return source
