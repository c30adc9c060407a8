"""Observe's contributors: one quantity within one group of runs or stages, and the throughput MAPE it carries
(what predicting it exactly, or taking its bias out, would remove), merged where the same runs carry it, with the
counterfactual errors they are computed from. See `hops_calib.research.observe`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hops_calib.research.observe_rows import (
    LABELS,
    PART_QUANTITIES,
    STAGE_QUANTITIES,
    RunRow,
    StageRow,
    run_groups,
    stage_groups,
)

# How each group reads in a sentence ("... on runs whose ends are a10g..l4").
RUN_PHRASES = {
    "all": "all runs",
    "devices": "runs on {}",
    "ends": "runs whose ends are {}",
    "shape": "runs of shape {}",
    "microbatches": "runs with {} microbatches",
    "pp": "runs of pipeline depth {}",
    "parallel": "runs at tensor x data parallel {}",
    "micro_batch": "runs of micro batch {}",
    "tp": "runs of tensor parallel {}",
    "dp": "runs of data parallel {}",
    "hidden": "runs of hidden size {}",
    "seq": "runs of sequence length {}",
}
STAGE_PHRASES = {
    "all": "all stages",
    "device": "{} stages",
    "position": "{} stages",
    "shape": "stages of shape {}",
    "microbatches": "stages of runs with {} microbatches",
    "pp": "stages of runs of pipeline depth {}",
    "ends": "stages of runs whose ends are {}",
}
DOMINANT_RUNS = 3
CARRIED = 0.8  # groupings whose contribution these same runs carry (this share of it) are one finding


# --- counterfactuals: the errors a run would have with one quantity predicted exactly ----------------


def _errors_pct(run: RunRow, throughput_per_s: float, steady_per_s: float) -> tuple[float, float]:
    real = run.real_metrics
    return (
        (throughput_per_s - real.throughput_per_s) / real.throughput_per_s * 100.0,
        (steady_per_s - real.steady_throughput_per_s) / real.steady_throughput_per_s * 100.0,
    )


def part_fixed_errors(run: RunRow, part: str, shift_ms: float | None = None) -> tuple[float, float] | None:
    """Throughput and steady-throughput error % of `run` with part `part` of its iteration predicted exactly (or,
    with `shift_ms`, predicted `shift_ms` shorter: a group's bias taken out)."""
    residual = run.part_residual_ms(part) if shift_ms is None else shift_ms
    if residual is None:
        return None
    predicted = run.prediction.metrics
    repeats = run.spec.iterations if part == "span" else run.spec.iterations - 1
    window = predicted.window_ms - repeats * residual
    period = predicted.iteration_time_ms - residual
    if not (window > 0 and period > 0):
        return None
    return _errors_pct(
        run,
        predicted.throughput_per_s * predicted.window_ms / window,
        predicted.steady_throughput_per_s * predicted.iteration_time_ms / period,
    )


def stages_fixed_errors(
    run: RunRow, quantity: str, stages: frozenset[int], shift_ms: float | None = None
) -> tuple[float, float] | None:
    """Errors of `run` simulated again with `quantity` (forward / backward) of `stages` at the real medians (or,
    with `shift_ms`, at the predicted value less `shift_ms`: a group's bias taken out).

    Each of a rank's model chunks is scaled by target / predicted, so their mean is the target.
    """
    from hops_calib.sim import simulate

    pipeline = run.prediction.pipeline
    costs = list(pipeline.stages)
    changed = False
    for k, cost in enumerate(costs):
        row = run.stages[k % pipeline.ranks]
        real = row.real(quantity)
        if row.stage not in stages or real is None:
            continue
        predicted = row.predicted(quantity)
        if shift_ms is not None:
            real = max(predicted - shift_ms, 0.0)
        factor = real / predicted if predicted > 0 else None
        if quantity == "forward":
            costs[k] = replace(
                cost, forward_ms=cost.forward_ms * factor if factor is not None else real / pipeline.chunks
            )
        else:
            costs[k] = replace(
                cost,
                backward_ms=cost.backward_ms * factor if factor is not None else real / pipeline.chunks,
                weight_grad_ms=cost.weight_grad_ms * factor if factor is not None else 0.0,
            )
        changed = True
    if not changed:
        return None
    metrics = simulate(replace(pipeline, stages=tuple(costs)), run.prediction.schedule).metrics()
    return _errors_pct(run, metrics.throughput_per_s, metrics.steady_throughput_per_s)


# --- contributors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contributor:
    """One quantity within one group, and the MAPE it carries (pp over the whole suite)."""

    quantity: str
    level: str  # "run" (a part of the iteration) or "stage" (a per-microbatch time)
    dimension: str
    group: str
    aliases: tuple[tuple[str, str], ...]  # other (dimension, group) pairs with exactly the same members
    n_runs: int
    n_stages: int | None
    real_ms_mean: float
    predicted_ms_mean: float
    residual_ms_mean: float  # predicted - real, signed
    residual_pct: float  # residual_ms_mean / real_ms_mean x 100: the same sign as residual_ms_mean (nan: real <= 0)
    contribution_pp: float  # throughput MAPE (window) removed if predicted exactly
    steady_contribution_pp: float  # the same on steady-throughput MAPE
    dominant_runs: tuple[dict[str, Any], ...]  # {id, contribution_pp, throughput_error_pct}
    # Bias against noise: the residual's spread over the members, and the spread of the real quantity between
    # repeats of one configuration (None without repeats), ms.
    residual_spread_ms: float = math.nan
    noise_ms: float | None = None
    # The throughput MAPE (window, pp of the suite) that taking the bias out would save: every member's quantity
    # predicted `residual_ms_mean` shorter (what one term shifting the quantity can do), the runs scored again as
    # for the contribution. Negative only where errors cancel: the bias offsets another error of those runs.
    fixable_mape_pp: float = math.nan
    noise_mape_pp: float = 0.0  # the contribution's share that the repeat noise explains (no term can fix it)
    members: tuple[tuple[str, int | None], ...] = ()  # (run id, stage) of the members; stage None for a part
    residuals: tuple[float, ...] = ()  # each member's residual, predicted minus real, ms (ranks `terms`)
    # research.pricing.terms_of: the parameters pricing it, whether each applies, ranked by the share of the
    # residual each could remove (`removable_share`; the first one `suggested`)
    terms: tuple[dict[str, Any], ...] = ()
    same_runs: tuple[str, ...] = ()  # other groupings of this quantity carried by the same runs, merged into this one
    noise_from: str | None = None  # "repeats in the group", "the suite's repeats (relative)", or None (no repeats)
    carriers: tuple[str, ...] = ()  # the fewest runs carrying >= CARRIED of the contribution (merge key)
    # A term of the predicted iteration on runs without events (`research.observe_iteration`): the fitted share of
    # the term its members' iteration residuals imply (bias_ms = scale x predicted_ms_mean), and `implied` true:
    # real_ms_mean is what that scale implies, no event measures it.
    scale: float = math.nan
    implied: bool = False

    @property
    def where(self) -> str:
        phrases = STAGE_PHRASES if self.level == "stage" else RUN_PHRASES
        text = phrases[self.dimension].format(self.group)
        if self.aliases:
            text += " (= " + " = ".join(phrases[d].format(g) for d, g in self.aliases) + ")"
        return text

    def sentence(self) -> str:
        if self.level == "iteration":
            return self._iteration_sentence()
        direction = "over" if self.residual_ms_mean > 0 else "under"
        members = f"{self.n_runs} runs" + (f", {self.n_stages} stages" if self.n_stages is not None else "")
        text = (
            f"{LABELS[self.quantity]} {direction}-predicted by {abs(self.residual_ms_mean):.1f} ms "
            f"({_signed(self.residual_pct, '%')} of real) on {self.where}; {members}; "
        )
        if self.contribution_pp >= 0:
            text += f"predicting it exactly removes {self.contribution_pp:.1f} pp of throughput MAPE"
        else:
            text += (
                f"predicting it exactly alone adds {-self.contribution_pp:.1f} pp of throughput MAPE "
                "(its error offsets another)"
            )
        text += f" (steady {self.steady_contribution_pp:+.1f} pp)"
        if self.dominant_runs:
            text += "; mostly " + ", ".join(f"{r['id']} ({r['contribution_pp']:.1f} pp)" for r in self.dominant_runs)
        if math.isfinite(self.fixable_mape_pp):
            text += (
                f"; fixable {self.fixable_mape_pp:.2f} pp, repeat noise {self.noise_mape_pp:.2f} pp (bias "
                f"{self.residual_ms_mean:+.1f} ms, spread {self.residual_spread_ms:.1f} ms, between repeats "
                + (
                    f"{self.noise_ms:.1f} ms"
                    + (", the suite's" if self.noise_from and "suite" in self.noise_from else "")
                    + ")"
                    if self.noise_ms is not None
                    else "n/a: no repeats)"
                )
            )
        if self.terms:
            applies = [f"{t['term']}.{t['param']}" for t in self.terms if t["applies"]]
            inert = [f"{t['term']}.{t['param']}" for t in self.terms if not t["applies"]]
            text += (
                self._suggestion()
                + "; priced by "
                + (", ".join(applies) or "none of its runs' parameters")
                + (f" (inert here: {', '.join(inert)})" if inert else "")
            )
        if self.same_runs:
            text += "; the same runs as " + "; ".join(self.same_runs)
        return text

    def _iteration_sentence(self) -> str:
        direction = "over" if self.residual_ms_mean > 0 else "under"
        text = (
            f"{LABELS[self.quantity]} {direction}-predicted by {abs(self.residual_ms_mean):.1f} ms per iteration "
            f"({_signed(100 * self.scale, '%')} of its predicted {self.predicted_ms_mean:.1f} ms, fitted to the "
            f"iteration residuals) on {self.where}; {self.n_runs} runs; taking that out saves "
            f"{self.fixable_mape_pp:.2f} pp of throughput MAPE (at most {self.contribution_pp:.2f} pp were each "
            "run's whole error in it)"
        )
        if self.dominant_runs:
            text += "; mostly " + ", ".join(f"{r['id']} ({r['contribution_pp']:.2f} pp)" for r in self.dominant_runs)
        text += f"; residual spread left {self.residual_spread_ms:.1f} ms, between repeats " + (
            f"{self.noise_ms:.1f} ms (noise {self.noise_mape_pp:.2f} pp)"
            if self.noise_ms is not None
            else "n/a: no repeats"
        )
        if self.terms:
            applies = [f"{t['term']}.{t['param']}" for t in self.terms if t["applies"]]
            text += self._suggestion() + "; priced by " + (", ".join(applies) or "none of its runs' parameters")
        elif self.quantity == "bubble":
            text += "; no term prices it alone: the schedule's idle time follows the stages' costs"
        if self.same_runs:
            text += "; the same runs as " + "; ".join(self.same_runs)
        return text

    def suggested(self) -> dict[str, Any] | None:
        """The parameter `terms` suggests changing (the one that could remove the most of the residual), or None."""
        return next((t for t in self.terms if t.get("suggested")), None)

    def _suggestion(self) -> str:
        first = self.suggested()
        if first is None:
            return ""
        value = first.get("suggested_value")
        return (
            f"; suggested: {first['direction'] or 'change'} {first['term']}.{first['param']}"
            + (
                f" toward about {value:.4g}" + (" (its bound)" if first.get("at_bound") else "")
                if value is not None
                else ""
            )
            + f" (could remove {100 * first['removable_share']:.0f} % of the residual's square)"
            + (
                "; its value was calibrated on other stores too: judge a change of it with --fixtures "
                + " --fixtures ".join(first.get("judge_on") or ["(see tune's hint)"])
                + ", or take the device's own NAME@TYPE"
                if first.get("judged_here") is False
                else ""
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **{
                k: v
                for k, v in vars(self).items()
                if k not in ("dominant_runs", "aliases", "members", "carriers", "residuals")
            },
            "carried_by": list(self.carriers),
            "bias_ms": self.residual_ms_mean,
            "terms": [dict(t) for t in self.terms],
            "same_runs": list(self.same_runs),
            "aliases": [{"dimension": d, "group": g} for d, g in self.aliases],
            "label": LABELS[self.quantity],
            "where": self.where,
            "suggested_parameter": (f"{first['term']}.{first['param']}" if (first := self.suggested()) else None),
            "dominant_runs": [dict(r) for r in self.dominant_runs],
            "sentence": self.sentence(),
        }


def _signed(value: float, unit: str) -> str:
    """Signed, one decimal below 10 (so that a small residual does not read "-0 %"), none above."""
    if not math.isfinite(value):
        return "n/a"
    return f"{value:+.1f} {unit}" if abs(value) < 9.95 else f"{value:+.0f} {unit}"


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else float("nan")


@dataclass(frozen=True)
class _Member:
    """One run's share of a contributor: its residuals and its counterfactual errors."""

    run: RunRow
    real_ms: list[float]
    predicted_ms: list[float]
    fixed: tuple[float, float]
    stages: tuple[int | None, ...] = (None,)  # the stage of each value (None: a part of the iteration)


def _contributor(
    quantity: str,
    level: str,
    dimension: str,
    group: str,
    aliases: list[tuple[str, str]],
    members: list[_Member],
    n_suite: int,
    n_stages: int | None,
) -> Contributor:
    now = np.array(
        [[abs(m.run.score.throughput_error_pct), abs(m.run.score.steady_throughput_error_pct)] for m in members]
    )
    fixed = np.abs(np.array([m.fixed for m in members]))
    per_run = (now - fixed) / n_suite
    real = [v for m in members for v in m.real_ms]
    predicted = [v for m in members for v in m.predicted_ms]
    bias = _mean(p - r for p, r in zip(predicted, real))
    unbiased = np.abs(np.array([_unbiased_errors(m, quantity, level, bias) for m in members]))
    fixable = float(((now - unbiased) / n_suite)[:, 0].sum())
    order = np.argsort(-per_run[:, 0], kind="stable")
    dominant = tuple(
        {
            "id": members[i].run.id,
            "run_id": members[i].run.id,
            "contribution_pp": float(per_run[i, 0]),
            "throughput_error_pct": members[i].run.score.throughput_error_pct,
        }
        for i in order[:DOMINANT_RUNS]
        if per_run[i, 0] > 0
    )
    return Contributor(
        quantity=quantity,
        level=level,
        dimension=dimension,
        group=group,
        aliases=tuple(aliases),
        n_runs=len(members),
        n_stages=n_stages,
        real_ms_mean=_mean(real),
        predicted_ms_mean=_mean(predicted),
        residual_ms_mean=_mean(p - r for p, r in zip(predicted, real)),
        residual_pct=(
            _mean(p - r for p, r in zip(predicted, real)) / _mean(real) * 100.0
            if real and _mean(real) > 0
            else math.nan
        ),
        contribution_pp=float(per_run[:, 0].sum()),
        steady_contribution_pp=float(per_run[:, 1].sum()),
        dominant_runs=dominant,
        carriers=_carriers([m.run.id for m in members], per_run[:, 0]),
        **_bias_and_noise(members, float(per_run[:, 0].sum()), fixable),
    )


def _unbiased_errors(member: _Member, quantity: str, level: str, bias_ms: float) -> tuple[float, float]:
    """A member run's throughput and steady errors % with the group's bias taken out of its quantity (its errors as
    they are where that cannot be computed)."""
    run = member.run
    if level == "run":
        errors = part_fixed_errors(run, quantity, shift_ms=bias_ms)
    else:
        errors = stages_fixed_errors(
            run, quantity, frozenset(s for s in member.stages if s is not None), shift_ms=bias_ms
        )
    return errors if errors is not None else (run.score.throughput_error_pct, run.score.steady_throughput_error_pct)


def _carriers(ids: list[str], per_run: np.ndarray) -> tuple[str, ...]:
    """The fewest runs whose contributions add up to CARRIED of the group's positive contribution (empty when the
    group removes nothing)."""
    positive = np.clip(per_run, 0.0, None)
    total = float(positive.sum())
    if total <= 0:
        return ()
    order = np.argsort(-positive, kind="stable")
    carried, out = 0.0, []
    for i in order:
        out.append(ids[i])
        carried += float(positive[i])
        if carried >= CARRIED * total:
            break
    return tuple(sorted(out))


def _bias_and_noise(members: list[_Member], contribution_pp: float, fixable_pp: float) -> dict[str, Any]:
    """The residual's mean (bias) and spread over the members, the real quantity's spread between repeats of one
    configuration (pooled over configurations run more than once: noise; a configuration is the runs' stored
    group), and the contribution's share the noise explains, by the residual's mean square:
    min(repeat spread^2, residual spread^2) / (bias^2 + spread^2).
    `fixable_pp`: the MAPE taking the bias out saves (`_unbiased_errors`)."""
    residuals = np.array([p - r for m in members for p, r in zip(m.predicted_ms, m.real_ms)])
    bias, spread = float(np.mean(residuals)), float(np.std(residuals))
    repeats: dict[tuple[str, int | None], list[float]] = {}
    for m in members:
        for stage, real in zip(m.stages, m.real_ms):
            repeats.setdefault((m.run.score.group, stage), []).append(real)
    groups = [np.array(v) for v in repeats.values() if len(v) > 1]
    noise = (
        float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)))
        if groups
        else None
    )
    square = bias**2 + spread**2
    noise_share = min(noise**2, spread**2) / square if noise is not None and square > 0 else 0.0
    return {
        "residual_spread_ms": spread,
        "noise_ms": noise,
        "noise_mape_pp": contribution_pp * noise_share,
        "fixable_mape_pp": fixable_pp,
        "noise_from": "repeats in the group" if noise is not None else None,
        "members": tuple((m.run.id, stage) for m in members for stage in m.stages),
        "residuals": tuple(float(p - r) for m in members for p, r in zip(m.predicted_ms, m.real_ms)),
    }


def with_suite_noise(contributor: Contributor, relative_noise: float | None) -> Contributor:
    """A group without repeats of its own takes the suite's repeat spread of its quantity, relative to the real
    value (the `all` grouping's noise over its mean), scaled to the group's mean real value."""
    if contributor.noise_ms is not None or relative_noise is None or not math.isfinite(contributor.real_ms_mean):
        return contributor
    noise = relative_noise * abs(contributor.real_ms_mean)
    square = contributor.residual_ms_mean**2 + contributor.residual_spread_ms**2
    share = min(noise**2, square) / square if square > 0 else 0.0
    return replace(
        contributor,
        noise_ms=noise,
        noise_from="the suite's repeats (relative)",
        noise_mape_pp=contributor.contribution_pp * share,
    )


def _groupings(keys: list[dict[str, str]]) -> dict[tuple[str, str], tuple[list[int], list[tuple[str, str]]]]:
    """(dimension, group) -> (indices of the items in it, other groups with exactly these items).

    'all' comes first; a group holding every item is 'all' again and is dropped, and groups with the same
    items are reported once, under the first dimension, naming the others as aliases.
    """
    groups: dict[tuple[str, str], list[int]] = {("all", "all"): list(range(len(keys)))}
    for index, item in enumerate(keys):
        for dimension, value in item.items():
            groups.setdefault((dimension, value), []).append(index)
    by_members: dict[tuple[int, ...], tuple[tuple[str, str], list[tuple[str, str]]]] = {}
    for key, members in groups.items():
        if key != ("all", "all") and len(members) == len(keys):
            continue
        first = by_members.setdefault(tuple(members), (key, []))
        if first[0] != key:
            first[1].append(key)
    return {key: (list(members), aliases) for members, (key, aliases) in by_members.items()}


def part_contributors(runs: list[RunRow]) -> list[Contributor]:
    contributors = []
    for part in PART_QUANTITIES:
        fixed = {run.id: part_fixed_errors(run, part) for run in runs}
        for (dimension, group), (indices, aliases) in _groupings([run_groups(r.spec) for r in runs]).items():
            members = []
            for run in (runs[i] for i in indices):
                # (a run without parts has no residual: its fixed errors are None)
                errors, real, predicted = fixed[run.id], run.real_parts, run.predicted_parts
                if errors is not None and real is not None and predicted is not None:
                    members.append(_Member(run, [real.as_dict()[part]], [predicted.as_dict()[part]], errors))
            if members:
                contributors.append(_contributor(part, "run", dimension, group, aliases, members, len(runs), None))
    return contributors


def stage_contributors(runs: list[RunRow]) -> list[Contributor]:
    places = [(run, row) for run in runs for row in run.stages]
    keys = [stage_groups(run.spec, row.stage) for run, row in places]
    cache: dict[tuple[str, str, frozenset[int]], tuple[float, float] | None] = {}
    contributors = []
    for quantity in STAGE_QUANTITIES:
        for (dimension, group), (indices, aliases) in _groupings(keys).items():
            by_run: dict[str, list[StageRow]] = {}
            for i in indices:
                run, row = places[i]
                if row.real(quantity) is not None:
                    by_run.setdefault(run.id, []).append(row)
            members = []
            for run in runs:
                rows = by_run.get(run.id)
                if not rows:
                    continue
                key = (run.id, quantity, frozenset(r.stage for r in rows))
                if key not in cache:
                    cache[key] = stages_fixed_errors(run, quantity, key[2])
                errors = cache[key]
                if errors is not None:  # (each row kept has a real value: by_run keeps only those)
                    members.append(
                        _Member(
                            run,
                            [real for r in rows if (real := r.real(quantity)) is not None],
                            [r.predicted(quantity) for r in rows],
                            errors,
                            tuple(r.stage for r in rows),
                        )
                    )
            if members:
                contributors.append(
                    _contributor(
                        quantity,
                        "stage",
                        dimension,
                        group,
                        aliases,
                        members,
                        len(runs),
                        sum(len(m.real_ms) for m in members),
                    )
                )
    return contributors


# What a contributor's numbers mean, in observe --json (`fields`), as AGENTS.md says.
CONTRIBUTOR_FIELDS = {
    "bias_ms": "the residual's mean over the members: predicted minus real, ms (positive: the model predicts the "
    "quantity too long, so too low a throughput; negative: too short)",
    "residual_pct": "bias_ms over the real mean, % (the same sign)",
    "mean_error_pct": "the mean throughput error, predicted minus real throughput over real, % (by_configuration, "
    "stall_free, runs[]: throughput_error_pct): the opposite sign of bias_ms (positive: the model "
    "predicts the runs too fast, their quantities too short)",
    "contribution_pp": "throughput MAPE (window, pp of the suite) removed if the quantity were predicted exactly on "
    "the members; negative where its error offsets another",
    "fixable_mape_pp": "throughput MAPE (pp of the suite) that taking the bias out would save: every member's quantity "
    "predicted bias_ms shorter, the runs scored again; negative only where errors cancel (the bias "
    "offsets another error of those runs: removing it alone makes MAPE worse)",
    "noise_mape_pp": "the contribution's share explained by the spread between repeats of one configuration (no term "
    "can fix it)",
    "terms": "every parameter of the terms pricing the quantity (found by nudging each); applies false: nudging it "
    "moves the quantity of none of the members (tuning it there is in vain); ranked by removable_share, the "
    "share of the members' residuals (sum of squares) that moving the parameter alone could remove, its "
    "moves taken as linear in it; suggested true on the first not at_bound (the parameter to change), direction raise or "
    "lower, suggested_value the value that linear move puts the residuals at their least (within bounds; "
    "at_bound: only a bound reaches it, so this parameter alone is a poor fit; a first guess: `tune TERM "
    "--only PARAM --objective components` fits it); on the suggested entry, judged_here: whether a change of it may "
    "be judged on this store alone (the ledger's calibration record, as tune and evaluate check it; absent without a "
    "ledger), and where not, judge_on: the stores its value was calibrated on (pass them all as --fixtures, or take "
    "the device's own NAME@TYPE)",
    "suggested_parameter": "TERM.PARAM of the terms entry marked suggested (null: no parameter moves the members)",
    "level": "run: a part of the iteration, stage: a per-microbatch time (both measured by events); iteration: a term "
    "of the predicted iteration on runs without events (compute, recompute, tp_comm, ep_comm, dp_reduce exposed, "
    "p2p, ends_allreduce, optimizer, host, bubble: they add up to the predicted iteration time)",
    "scale": "level iteration: the term's share that the members' iteration residuals imply, fitted (relative to "
    "the real iteration time, through the origin, least absolute deviations, within -1..1: the term between "
    "twice and none of its predicted value): bias_ms = scale x predicted_ms_mean",
    "implied": "true where no event measures the quantity (level iteration): real_ms_mean is the predicted value "
    "less bias_ms; contribution_pp is then at most what the term could remove (each member's whole "
    "residual taken out of it, never below zero), fixable_mape_pp what removing the fitted scale saves",
}


def _fixable(contributor: Contributor) -> float:
    return contributor.fixable_mape_pp if math.isfinite(contributor.fixable_mape_pp) else contributor.contribution_pp


def merge_same_runs(ranked: list[Contributor]) -> list[Contributor]:
    """One finding per quantity and set of runs carrying it: a grouping of a quantity whose contribution the same
    runs carry (`carriers`: the fewest runs holding CARRIED of it) as one ranked above it (the same runs sliced
    another way: by shape, depth, ends, ...) is merged into it, named in its `same_runs`. Groupings that remove
    nothing are kept apart by their members."""
    kept: dict[tuple[str, str, frozenset], int] = {}
    out: list[Contributor] = []
    for contributor in ranked:
        key = (
            contributor.level,
            contributor.quantity,
            frozenset(contributor.carriers) if contributor.carriers else frozenset(contributor.members),
        )
        if key in kept:
            first = out[kept[key]]
            out[kept[key]] = replace(first, same_runs=first.same_runs + (contributor.where,))
            continue
        kept[key] = len(out)
        out.append(contributor)
    return out
