"""Which parameters price which quantity of which run, found by perturbing each one (observe's `terms`).

For every parameter of every active term (a per-device value NAME@TYPE counts as its own parameter), the model is
nudged (+10 % of the value, or toward the middle of its bounds from a bound or zero; another of its choices) and
every run predicted again: the parameter prices a quantity (a stage's forward or backward per microbatch, a part
of the iteration: its median or its value in any iteration, so the random stalls' parameters price the silent
stretch) of a run when that quantity's prediction moves. No list of parameters is kept by hand: every parameter
of every active term is nudged. A parameter that prices a quantity on some runs
but not on a contributor's runs is inert there (a max() that never selects it, a device type absent): tuning it
for those runs is in vain. Pure computation on predictions: no trace is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from hops_calib.model import TERMS, Model, resolve_params

RELATIVE = 1e-9  # a change smaller than this (relative) is float noise, not a move


def _nudged(param, value: float) -> float | None:
    """Another value of `param` within its bounds near `value`; None when it has no other."""
    if param.choices:
        others = [c for c in param.choices if c != value]
        return others[0] if others else None
    for candidate in (
        value * 1.1,
        value * 0.9,
        (param.low + param.high) / 2.0,
        param.low + 0.1 * (param.high - param.low),
    ):
        if param.low <= candidate <= param.high and candidate != value:
            return candidate
    return None


class Moves(dict):
    """(run id, quantity, stage) -> how far the nudge moved that prediction, ms (its first value: a stage's time, a
    part's median), for one parameter nudged from `old` to `new` within `low`..`high` (`choices`: a categorical)."""

    def __init__(self, old: float, new: float, low: float, high: float, choices: bool) -> None:
        super().__init__()
        self.old, self.new, self.low, self.high, self.choices = old, new, low, high, choices


def perturbations(model: Model) -> Iterable[tuple[str, str, Model]]:
    """(term, parameter name, the model with that parameter nudged) for every active term's parameters."""
    for term, name, nudged, _ in _nudges(model):
        yield term, name, nudged


def _nudges(model: Model) -> Iterable[tuple[str, str, Model, Moves]]:
    devices = {d.type for d in model.devices}
    for active in model.terms:
        term = TERMS.get(active.name)
        if term is None:
            continue
        by_name = {p.name: p for p in term.params}
        for name, value in active.params().items():
            param = by_name.get(name.partition("@")[0])
            new = _nudged(param, value) if param is not None else None
            if param is None or new is None:
                continue
            nudged = resolve_params(
                active.name, {name: new}, origin="observe", base=active.params(), device_types=devices
            )
            yield (
                active.name,
                name,
                model.with_term(nudged),
                Moves(value, new, param.low, param.high, bool(param.choices)),
            )


def quantities(spec, prediction) -> dict[tuple[str, int | None], tuple[float, ...]]:
    """The quantities observe compares, predicted (`Prediction.phase_ms`): per stage forward / backward ms, and the
    iteration's parts, each part as its median and its mean over iterations (a stall placed in some iterations moves
    the window and those iterations, not the median: its parameters price the part all the same)."""
    values: dict[tuple[str, int | None], tuple[float, ...]] = {}
    for (quantity, stage), value in prediction.phase_ms(spec).items():
        if stage is not None and quantity not in ("forward", "backward"):
            continue  # observe compares stages by forward and backward only
        key = (quantity.partition(".")[0], stage)
        values[key] = values.get(key, ()) + (value,)
    series = prediction.result.iteration_part_series()  # every iteration: a stall moved to another one moves too
    for quantity, stage in list(values):
        every = getattr(series, f"{quantity}_ms", None) if series is not None and stage is None else None
        if every is not None:
            values[(quantity, stage)] += tuple(map(float, every))
    return values


def _moved(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) != len(b) or any(abs(x - y) > RELATIVE * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


def pricing(runs, model: Model, progress=None, measure=None) -> dict[tuple[str, str], Moves]:
    """(term, parameter) -> the (run id, quantity, stage) whose prediction moves when the parameter is nudged, each
    with how far it moved (`Moves`).

    `runs`: observe's RunRows (their spec and prediction). `progress(done, total)` after each parameter.
    `measure(spec, model)`: the quantities compared (default `quantities` of the prediction)."""
    from hops_calib.model.predict import predict

    if measure is None:

        def measure(spec, nudged):
            return quantities(spec, predict(spec, nudged))

        base = {run.id: quantities(run.spec, run.prediction) for run in runs}
    else:
        base = {run.id: measure(run.spec, model) for run in runs}
    nudges = list(_nudges(model))
    found: dict[tuple[str, str], Moves] = {}
    for done, (term, name, nudged, moved) in enumerate(nudges, start=1):
        for run in runs:
            try:
                after = measure(run.spec, nudged)
            except ValueError:
                continue
            moved.update(
                {
                    (run.id, q, s): float(v[0] - base[run.id][(q, s)][0])
                    for (q, s), v in after.items()
                    if (q, s) in base[run.id] and _moved(base[run.id][(q, s)], v)
                }
            )
        found[(term, name)] = moved
        if progress is not None:
            progress(done, len(nudges))
    return found


def terms_of(
    found: dict[tuple[str, str], Moves],
    quantity: str,
    members: Sequence[tuple[str, int | None]],
    residuals: Sequence[float] = (),
) -> list[dict[str, Any]]:
    """The parameters of every term pricing `quantity` anywhere in the suite, each with whether it applies to
    `members` ((run id, stage) pairs; stage None for a part of the iteration): whether nudging it moved that quantity
    there. A pricing term's parameter that moves it nowhere (a max() that never selects it, a shared value every
    device overrides) is listed too, with applies false: tuning it is in vain.

    With `residuals` (each member's predicted minus real, ms) the parameters are ranked by `removable_share`: the
    share of the residuals' sum of squares that moving the parameter alone, within its bounds, could remove, taking
    each member's move as linear in the parameter (`_removable`); `suggested_value` is the value that puts them at
    their least (a first guess that `tune TERM --only PARAM --objective components` fits). `suggested`: the first
    applying parameter that removes any share without running into a bound (`at_bound`: the least lies past it, so
    the parameter would soak up an error that is not its own), else the first that removes any."""
    members = list(members)
    r = np.array(residuals, dtype=float) if len(residuals) == len(members) else None
    pricing_terms = {term for (term, _), moved in found.items() if any(q == quantity for _, q, _ in moved)}
    rows = []
    for (term, name), moved in found.items():
        if term not in pricing_terms:
            continue
        shifts = [moved.get((run, quantity, stage)) for run, stage in members]
        applies = sum(m is not None for m in shifts)
        row: dict[str, Any] = {
            "term": term,
            "param": name,
            "applies": applies > 0,
            "members_moved": applies,
            "members": len(members),
        }
        if r is not None:
            row.update(_removable(moved, np.array([m or 0.0 for m in shifts]), r))
        rows.append(row)
    rows.sort(key=lambda row: (not row["applies"], -row.get("removable_share", 0.0), row["term"], row["param"]))
    if r is not None:
        useful = [row for row in rows if row["applies"] and row["removable_share"] > 0]
        first = next((row for row in useful if not row["at_bound"]), useful[0] if useful else None)
        for row in rows:
            row["suggested"] = row is first
    return rows


def _removable(moved: Moves, m: np.ndarray, r: np.ndarray) -> dict[str, Any]:
    """`removable_share`, `direction`, `suggested_value` and `at_bound` of one parameter (`terms_of`): the step
    (in nudges) that puts the residuals r + step x m at their least squares, kept within the parameter's bounds (a
    categorical takes its other choice or stays)."""
    mm, rr = float(m @ m), float(r @ r)
    if mm <= 0 or rr <= 0:
        return {"removable_share": 0.0, "direction": None, "suggested_value": None, "at_bound": False}
    delta = moved.new - moved.old
    if moved.choices:
        step = 1.0 if float((r + m) @ (r + m)) < rr else 0.0
    else:
        ends = sorted(((moved.low - moved.old) / delta, (moved.high - moved.old) / delta))
        step = min(max(-float(r @ m) / mm, ends[0]), ends[1])
    value = moved.old + step * delta
    left = r + step * m
    near = 1e-9 * max(1.0, abs(moved.low), abs(moved.high))
    bound = next((b for b in (moved.low, moved.high) if abs(value - b) <= near), None)
    at_bound = not moved.choices and step != 0 and bound is not None
    if at_bound and bound is not None:
        value = bound
    return {
        "removable_share": max(0.0, 1.0 - float(left @ left) / rr),
        "direction": "raise" if value > moved.old else "lower" if value < moved.old else None,
        "suggested_value": (moved.new if step else None) if moved.choices else float(value),
        "at_bound": at_bound,
    }
