"""Plot room: runs as the pictures and the report group them (device mix, pipeline depth) and short run names.

Per-group aggregates use the suite's own `score.aggregate`, so a group's MAPE
is computed exactly like the suite's. For the held-out split a group is only
shown when it, and whatever is left over, hold enough runs that no single
run's error can be read off or recovered by subtraction (see `disclosable`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hops_calib.loop.score import RunScore, SuiteScore, aggregate
from hops_calib.spec import Spec

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

# The held-out report shows a group (and the pool of the rest) only when it holds at least this many runs.
MIN_DISCLOSED_RUNS = 5


def device_mix(devices: Iterable[str]) -> str:
    """The set of device types a run used, e.g. 'A10G+H100+L4' (order-free: the stage order is another question)."""
    return "+".join(sorted({d.upper() for d in devices}))


_RUN_ID = re.compile(r"^(exp\d+_\d+)_.*_(run\d+)$")


# The id a log's or table's run gets from its configuration (hops_calib.trace.run_table.config_slug)
_CONFIG_ID = re.compile(r"^.*?_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)_gb(\d+)(?:_[0-9a-f]{6})?(?:_(run\d+))?$")


def short_run_id(run_id: str, limit: int = 24) -> str:
    """A label that fits beside a point: 'exp2_9_g_only_pp4_run107' -> 'exp2_9 run107'; a run named after its
    configuration keeps all of it, less its source: 'vtrain_t1p4d1_l12_h1024_s1024_mb1_gb2' -> 'p4 l12 h1024 s1024
    mb1 gb2' (t and d when not 1)."""
    match = _RUN_ID.match(run_id)
    if match:
        return f"{match.group(1)} {match.group(2)}"
    match = _CONFIG_ID.match(run_id)
    if match and len(run_id) > limit:
        t, p, d, layers, hidden, seq, micro, batch, repeat = match.groups()
        parts = (
            ([f"t{t}"] if t != "1" else [])
            + [f"p{p}"]
            + ([f"d{d}"] if d != "1" else [])
            + [f"l{layers}", f"h{hidden}", f"s{seq}", f"mb{micro}", f"gb{batch}"]
            + ([repeat] if repeat else [])
        )
        return " ".join(parts)
    if len(run_id) <= limit:
        return run_id
    # keep both ends: a run's configuration starts the id and its repeat number ends it (run1 / run2)
    tail = limit // 2
    return run_id[: limit - tail - 1] + "…" + run_id[-tail:]


@dataclass(frozen=True)
class RunPoint:
    """One scored run and what it is grouped by."""

    score: RunScore
    device_mix: str
    pp: int
    microbatches: int
    schedule: str

    @property
    def run_id(self) -> str:
        return self.score.run_id


def run_points(specs: Sequence[Spec], scores: Sequence[RunScore]) -> list[RunPoint]:
    return [
        RunPoint(
            score=score,
            device_mix=device_mix(spec.devices),
            pp=spec.pp,
            microbatches=spec.microbatches,
            schedule=spec.schedule,
        )
        for spec, score in zip(specs, scores)
    ]


@dataclass(frozen=True)
class GroupRow:
    label: str
    suite: SuiteScore
    # Mean signed throughput error: the direction of the error (MAPE only says its size).
    mean_throughput_error_pct: float
    mean_bubble_error_pp: float | None  # None: no run of the group has events


def _row(label: str, points: Sequence[RunPoint]) -> GroupRow:
    scores = [p.score for p in points]
    return GroupRow(
        label=label,
        suite=aggregate(scores),
        mean_throughput_error_pct=float(np.mean([s.throughput_error_pct for s in scores])),
        mean_bubble_error_pp=float(np.mean(bubble))
        if (bubble := [s.bubble_error_pp for s in scores if s.bubble_error_pp is not None])
        else None,
    )


def group_rows(
    points: Sequence[RunPoint], key: Callable[[RunPoint], SupportsRichComparison], label: Callable[[object], str] = str
) -> list[GroupRow]:
    """One row per value of `key`, ordered by that value."""
    return [_row(label(value), members) for value, members in _grouped(points, key)]


def disclosable(
    points: Sequence[RunPoint],
    key: Callable[[RunPoint], SupportsRichComparison],
    label: Callable[[object], str] = str,
    min_runs: int = MIN_DISCLOSED_RUNS,
) -> list[GroupRow] | None:
    """Group rows safe to show for a held-out split, or None when no grouping is.

    Groups of at least `min_runs` runs are shown; the others are pooled into
    one 'other' row, which must itself hold at least `min_runs` runs, because
    the suite's mean minus the shown groups would otherwise give it away.
    """
    rows = []
    small: list[RunPoint] = []
    for row, members in _grouped(points, key):
        if len(members) >= min_runs:
            rows.append(_row(label(row), members))
        else:
            small.extend(members)
    if not small:
        return rows
    if len(small) < min_runs:
        return None
    kinds = len({key(p) for p in small})
    rows.append(_row(f"other ({kinds} group{'s' if kinds > 1 else ''})", small))
    return rows


def _grouped(
    points: Sequence[RunPoint], key: Callable[[RunPoint], SupportsRichComparison]
) -> list[tuple[object, list[RunPoint]]]:
    groups: dict[SupportsRichComparison, list[RunPoint]] = {}
    for point in points:
        groups.setdefault(key(point), []).append(point)
    return [(value, groups[value]) for value in sorted(groups)]
