"""The tolerance gate: accept a candidate model only if it holds or improves the suite and regresses no run.

Accept when all of these hold (tolerances configurable, stated in every result):
- suite throughput MAPE does not grow by more than `throughput_mape_pp` (default 0: hold or improve);
- suite bubble MAE does not grow by more than `bubble_mae_pp` (default 0);
- mean utilization rho does not fall by more than `util_spearman` (default 0);
- no run's |throughput error| grows by more than `run_throughput_pp` (default 2 pp);
- no run's |bubble error| grows by more than `run_bubble_pp` (default 2 pp);
- no more measured runs are predicted not to fit in their GPUs' memory (`SuiteScore.runs_predicted_not_to_fit`:
  every measured run ran, so each such verdict is an error; no tolerance). A change that flips a run's verdict
  moves that run, so a memory change is judged even where no time moves.

A plan may loosen each tolerance up to its cap (`TOLERANCE_CAPS`, each with its reason) and no further; every
judgement under rules looser than these defaults is marked (`looser_rules`) in its JSON, its ledger entry and
`ledger show` (docs/loop-rules.md).

`run_throughput_error` says which throughput error the per-run rule reads: "window" (default: the error
the suite MAPE averages) or "stall-free" (`RunScore.stall_free_error_pct`: the real run's retransmission
stalls and the simulation's placed ones taken out of both windows, where the trace shows them; the window
error elsewhere). A run that met more stalls than the simulation places can swing by whole stalls
(3-4 % each) when a candidate moves its stall-free prediction; read stall-free, the rule judges the
model's own error on that run. The suite rules always read the window error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from hops_calib.loop.score import RunScore, SuiteScore, interval, mape_draws, run_fingerprint

RUN_THROUGHPUT_ERRORS = ("window", "stall-free")


@dataclass(frozen=True)
class Tolerances:
    throughput_mape_pp: float = 0.0
    bubble_mae_pp: float = 0.0
    util_spearman: float = 0.0
    run_throughput_pp: float = 2.0
    run_bubble_pp: float = 2.0
    run_throughput_error: str = "window"  # which per-run throughput error the per-run rule reads

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "run_throughput_error":
                if value not in RUN_THROUGHPUT_ERRORS:
                    raise ValueError(
                        f"run_throughput_error must be one of {', '.join(RUN_THROUGHPUT_ERRORS)}, got {value!r}"
                    )
            elif not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                # inf would accept anything and cannot be written to JSON (the ledger, --json); nan compares false
                raise ValueError(f"tolerance {field.name} must be >= 0 and finite, got {value}")

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)

    @property
    def stall_free(self) -> bool:
        return self.run_throughput_error == "stall-free"

    def describe(self) -> str:
        which = "stall-free throughput error" if self.stall_free else "throughput error"
        return (
            f"suite throughput MAPE may grow <= {self.throughput_mape_pp:g} pp, bubble MAE <= "
            f"{self.bubble_mae_pp:g} pp, mean rho may fall <= {self.util_spearman:g}; per run |{which}| "
            f"may grow <= {self.run_throughput_pp:g} pp, |bubble error| <= {self.run_bubble_pp:g} pp"
        )


# The most a plan may loosen each tolerance beyond the gate's defaults, and why (`ledger plan` refuses a plan past a
# cap, exit 2, and no judgement is made under one recorded before the caps). A tolerance above its default is
# "looser"; every judgement under looser rules is marked (`looser_rules`), whether or not it is within the cap.
TOLERANCE_CAPS: dict[str, tuple[float, str]] = {
    "throughput_mape_pp": (
        0.5,
        "a quarter of the measured run-to-run noise of repeated configurations (2.2 % mean "
        "throughput, the cluster runs): a plan may let the suite pay less than noise would, "
        "never a visible share of its error",
    ),
    "bubble_mae_pp": (
        0.5,
        "the same bound for the suite's bubble MAE (pp of idle share): a quarter of a stall's "
        "swing of a run's idle share",
    ),
    "util_spearman": (
        0.1,
        "half the fall one adjacent swap of a 4-stage pipeline's utilization order costs "
        "(rho 1 -> 0.8): the shallowest pipelines' stage order may not be given up",
    ),
    "run_throughput_pp": (
        4.0,
        "one retransmission stall more or fewer than the simulation places: a 200 ms TCP "
        "timeout in one iteration of a window moves a run's throughput by 3-4 %; a run's error "
        "growing by more is the model's (read it stall-free, --run-error stall-free, rather "
        "than loosen the rule)",
    ),
    "run_bubble_pp": (
        4.0,
        "the same stall in a run's idle share: one 200 ms wait in one iteration of a window "
        "moves the measured bubble by 3-4 pp",
    ),
}
# The options of `ledger plan` that set each tolerance (the command layer declares them: cli.TOLERANCE_OPTIONS).
TOLERANCE_FLAGS = {
    "throughput_mape_pp": "--tolerance-mape-pp",
    "bubble_mae_pp": "--tolerance-bubble-mae-pp",
    "util_spearman": "--tolerance-rho",
    "run_throughput_pp": "--tolerance-run-throughput-pp",
    "run_bubble_pp": "--tolerance-run-bubble-pp",
    "run_throughput_error": "--run-error",
}
CAP_HINT = (
    "a change that needs more than the cap regresses runs beyond noise: find the error it trades against "
    "(observe, per_run) and fix that first, or judge the two changes together"
)


def looser_rules(tolerances: dict[str, object] | Tolerances) -> list[dict[str, object]]:
    """The rules of `tolerances` looser than the gate's defaults: each tolerance above its default, with the
    default, the cap (`TOLERANCE_CAPS`) and whether it is beyond the cap (`beyond_cap`: a plan recorded before the
    caps; no judgement is made under it today), and the per-run rule reading the stall-free error (another reading,
    no cap). [] under the defaults or tighter rules. Reads a ledger entry's dict as well (older entries lack
    `run_throughput_error`: the window error)."""
    given = tolerances.to_dict() if isinstance(tolerances, Tolerances) else dict(tolerances)
    defaults = Tolerances().to_dict()
    marks: list[dict[str, object]] = []
    for name, (cap, reason) in TOLERANCE_CAPS.items():
        value, default = given.get(name, defaults[name]), defaults[name]
        if isinstance(value, (int, float)) and isinstance(default, (int, float)) and value > default:
            marks.append(
                {
                    "tolerance": name,
                    "value": value,
                    "default": defaults[name],
                    "cap": cap,
                    "beyond_cap": value > cap,
                    "cap_reason": reason,
                }
            )
    reading = given.get("run_throughput_error", "window")
    if reading != defaults["run_throughput_error"]:
        marks.append(
            {
                "tolerance": "run_throughput_error",
                "value": reading,
                "default": defaults["run_throughput_error"],
                "cap": None,
                "beyond_cap": False,
                "cap_reason": "another reading of the per-run rule (the runs' random stalls taken out of both "
                "sides), not a wider bound",
            }
        )
    return marks


def describe_looser(marks: Sequence[dict[str, object]]) -> str:
    """One line for `ledger show` and the text output: LOOSER than the defaults, each rule with default and cap."""
    if not marks:
        return ""
    parts = []
    for mark in marks:
        if mark["cap"] is None:
            parts.append(f"{mark['tolerance']} {mark['value']} (default {mark['default']})")
        else:
            parts.append(
                f"{mark['tolerance']} {mark['value']:g} (default {mark['default']:g}, cap {mark['cap']:g}"
                + (": BEYOND the cap" if mark["beyond_cap"] else "")
                + ")"
            )
    return "LOOSER than the defaults: " + ", ".join(parts)


def beyond_caps(tolerances: Tolerances) -> list[tuple[str, float, float, str]]:
    """The tolerances past their cap: (name, value, cap, reason) each."""
    given = tolerances.to_dict()
    return [
        (name, float(given[name]), cap, reason)
        for name, (cap, reason) in TOLERANCE_CAPS.items()
        if float(given[name]) > cap
    ]


@dataclass(frozen=True)
class Regression:
    """A run whose absolute error grew by more than the per-run tolerance."""

    run_id: str
    metric: str  # "throughput" (error %) or "bubble" (error pp)
    abs_error_before: float
    abs_error_after: float
    growth_pp: float
    allowed_pp: float
    error: str = "window"  # for throughput: which error was read (Tolerances.run_throughput_error)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        unit = "%" if self.metric == "throughput" else " pp"
        # Enough digits that a growth just over the tolerance does not print as equal to it.
        digits = 2 if round(self.growth_pp, 2) > self.allowed_pp else 4
        what = f"stall-free {self.metric}" if self.error == "stall-free" else self.metric
        return (
            f"{self.run_id}: |{what} error| {self.abs_error_before:.2f}{unit} -> "
            f"{self.abs_error_after:.2f}{unit} (+{self.growth_pp:.{digits}f} pp > {self.allowed_pp:g} pp)"
        )


@dataclass(frozen=True)
class GateResult:
    accepted: bool
    reasons: tuple[str, ...]
    regressions: tuple[Regression, ...]
    tolerances: Tolerances
    # How many of the runs the change predicts otherwise (any scored quantity): a change that holds the suite by
    # moving nothing says so, and one that holds it by trading runs against each other shows how many it moved.
    runs_moved: tuple[str, ...] | None = None  # the ids of the runs whose predictions the change moved
    # The 95 % interval of the suite MAPE's change when the configurations are resampled (paired: the same draws
    # before and after): whether the change would hold on other configurations like these, or is this set's luck.
    mape_change_interval_pp: tuple[float, float] | None = None
    # The rules that failed, by name (RULES), for a reader that should not parse `reasons`.
    failed_rules: tuple[str, ...] = ()
    # A judgement on several stores (`gate_stores`): each store's path and its own verdict (the suite rules and the
    # per-run rules held on its runs alone); () for one store.
    stores: tuple[tuple[str, GateResult], ...] = ()

    @property
    def decision(self) -> str:
        return "accepted" if self.accepted else "rejected"

    @property
    def within_noise(self) -> bool | None:
        """Whether the suite MAPE's change lies within the noise of which configurations were run: its paired
        bootstrap interval straddles zero (the rules decide all the same; this says how much the decision rests on)."""
        if self.mape_change_interval_pp is None:
            return None
        low, high = self.mape_change_interval_pp
        return low <= 0.0 <= high

    def to_dict(self) -> dict[str, object]:
        return {
            "decision": self.decision,
            "failed_rules": list(self.failed_rules),
            "reasons": list(self.reasons),
            "decided_by": (
                f"failed: {', '.join(self.failed_rules)}"
                if self.failed_rules
                else "every rule held: " + ", ".join(RULES)
            ),
            "regressions": [r.to_dict() for r in self.regressions],
            "tolerances": self.tolerances.to_dict(),
            "runs_moved": list(self.runs_moved) if self.runs_moved is not None else None,
            "n_runs_moved": len(self.runs_moved) if self.runs_moved is not None else None,
            "mape_change_interval_pp": (
                list(self.mape_change_interval_pp) if self.mape_change_interval_pp is not None else None
            ),
            "within_noise": self.within_noise,
            **(
                {
                    "stores": [
                        {"fixtures": path, **{k: v for k, v in verdict.to_dict().items() if k != "tolerances"}}
                        for path, verdict in self.stores
                    ]
                }
                if self.stores
                else {}
            ),
        }


# The gate's rules by name, in the order `reasons` gives them: the suite's throughput MAPE, bubble MAE and mean
# utilization rho, and the per-run throughput and bubble errors (GateResult.failed_rules lists the ones that failed).
RULES = (
    "suite_throughput_mape",
    "suite_bubble_mae",
    "suite_util_rho",
    "run_throughput",
    "run_bubble",
    "memory_fit",
)

# Aggregates of identical predictions can differ in the last bits (float sums in another order); a change smaller
# than this is no change, so a candidate that leaves a metric alone is not rejected for rounding.
ROUNDING = 1e-9
PAIRED_DRAWS = 1000  # configuration resamples for the interval of a change's MAPE effect


def _suite_check(
    label: str,
    unit: str,
    before: float | None,
    after: float | None,
    tolerance: float,
    higher_is_better: bool,
    count: int | None = None,
) -> tuple[bool, str]:
    if before is None or after is None:  # no run of the suite measures it (iteration-level runs only)
        return True, f"{label}: no run measures it (no events), not judged"
    on = f" on {count} run(s)" if count is not None else ""
    change = after - before
    worsening = -change if higher_is_better else change
    if abs(worsening) <= ROUNDING:  # the same predictions summed in another order: not a change
        worsening = 0.0
    passes = worsening <= tolerance
    if worsening < 0:
        verdict = "improves"
    elif worsening == 0:
        verdict = "holds"
    else:
        verdict = f"worsens by {worsening:.4g}{unit}" + (", within tolerance" if passes else "")
    bound = "fall" if higher_is_better else "grow"
    return passes, (
        f"{label}{on} {before:.4f} -> {after:.4f} (may {bound} by <= {tolerance:g}{unit}): {verdict}"
        + ("" if passes else " -> fails")
    )


def _memory_check(before: SuiteScore, after: SuiteScore) -> tuple[bool, str]:
    """The memory_fit rule: every measured run ran, so a prediction that it does not fit in its GPUs' memory is an
    error of the memory model; a change may not make more of them."""
    was, now = before.runs_predicted_not_to_fit, after.runs_predicted_not_to_fit
    if was is None or now is None:
        return True, "measured runs predicted not to fit in memory: not computed here, not judged"
    if now > was:
        return False, f"measured runs predicted not to fit in memory {was} -> {now} (may not grow) -> fails"
    verdict = "improves" if now < was else "holds"
    return True, f"measured runs predicted not to fit in memory {was} -> {now} (may not grow): {verdict}"


def gate(
    before_runs: Sequence[RunScore],
    after_runs: Sequence[RunScore],
    before: SuiteScore,
    after: SuiteScore,
    tolerances: Tolerances = Tolerances(),
) -> GateResult:
    """Compare a candidate's scores (`after`) with the current model's (`before`) on the same runs."""
    before_by_id = {r.run_id: r for r in before_runs}
    after_by_id = {r.run_id: r for r in after_runs}
    if set(before_by_id) != set(after_by_id):
        raise ValueError(
            "the gate compares the same runs before and after; the run sets differ: "
            f"{sorted(set(before_by_id) ^ set(after_by_id))}"
        )

    # Each metric on the runs that measure it; the count is said where some runs do not (a mixed suite).
    def counted(metric: str) -> int | None:
        return after.count(metric) if after.count(metric) != after.n_fixtures else None

    checks = [
        _suite_check(
            "throughput MAPE %",
            " pp",
            before.throughput_mape_pct,
            after.throughput_mape_pct,
            tolerances.throughput_mape_pp,
            higher_is_better=False,
        ),
        _suite_check(
            "bubble MAE pp",
            " pp",
            before.bubble_mae_pp,
            after.bubble_mae_pp,
            tolerances.bubble_mae_pp,
            higher_is_better=False,
            count=counted("bubble"),
        ),
        _suite_check(
            "mean utilization rho",
            "",
            before.util_spearman_mean,
            after.util_spearman_mean,
            tolerances.util_spearman,
            higher_is_better=True,
            count=counted("utilization"),
        ),
    ]
    regressions = []
    for run_id in sorted(before_by_id):
        old, new = before_by_id[run_id], after_by_id[run_id]
        throughput, error = "throughput_error_pct", "window"
        if tolerances.stall_free and old.stall_free_error_pct is not None and new.stall_free_error_pct is not None:
            throughput, error = "stall_free_error_pct", "stall-free"
        for metric, field, allowed in (
            ("throughput", throughput, tolerances.run_throughput_pp),
            ("bubble", "bubble_error_pp", tolerances.run_bubble_pp),
        ):
            if getattr(old, field) is None or getattr(new, field) is None:  # a run without events has no bubble
                continue
            was, now = abs(getattr(old, field)), abs(getattr(new, field))
            if now - was > allowed:
                regressions.append(
                    Regression(
                        run_id, metric, was, now, now - was, allowed, error if metric == "throughput" else "window"
                    )
                )
    for metric, allowed in (("throughput", tolerances.run_throughput_pp), ("bubble", tolerances.run_bubble_pp)):
        regressed = [r for r in regressions if r.metric == metric]
        what = "stall-free throughput" if metric == "throughput" and tolerances.stall_free else metric
        if regressed:
            checks.append(
                (
                    False,
                    f"{len(regressed)} run(s) whose |{what} error| grew by more than {allowed:g} pp "
                    f"-> fails: " + ", ".join(r.run_id for r in regressed),
                )
            )
        else:
            checks.append((True, f"no run's |{what} error| grew by more than {allowed:g} pp"))
    checks.append(_memory_check(before, after))
    moved = tuple(
        i
        for i in sorted(before_by_id)
        if run_fingerprint(before_by_id[i]) != run_fingerprint(after_by_id[i])
        or before_by_id[i].predicted_fits != after_by_id[i].predicted_fits
    )
    checks.append(
        (
            True,
            f"the change moves the predictions of {len(moved)} of {len(before_by_id)} runs"
            + (": it holds the suite by changing nothing the scores read" if not moved else ""),
        )
    )
    ids = sorted(before_by_id)
    groups = [after_by_id[i].group for i in ids]
    change = mape_draws(
        [after_by_id[i] for i in ids], groups, draws=PAIRED_DRAWS, seed=0, baseline=[before_by_id[i] for i in ids]
    )
    spread = interval(change)
    noise = spread[0] <= 0.0 <= spread[1]
    checks.append(
        (
            True,
            f"throughput MAPE change over resampled configurations (paired bootstrap, 95 %): "
            f"{spread[0]:+.3f} to {spread[1]:+.3f} pp: "
            + (
                "within noise (the interval straddles 0; the rules decide)"
                if noise
                else "beyond noise (the interval excludes 0)"
            ),
        )
    )
    failed = tuple(rule for rule, (ok, _) in zip(RULES, checks) if not ok)  # the first six checks are the rules
    return GateResult(
        accepted=all(ok for ok, _ in checks),
        reasons=tuple(reason for _, reason in checks),
        regressions=tuple(regressions),
        tolerances=tolerances,
        runs_moved=moved,
        mape_change_interval_pp=spread,
        failed_rules=failed,
    )


def gate_stores(
    before_runs: Sequence[RunScore],
    after_runs: Sequence[RunScore],
    stores: Sequence[tuple[str, Sequence[str]]],
    tolerances: Tolerances = Tolerances(),
) -> GateResult:
    """The gate of a judgement on several stores (`stores`: each store's path and run ids): every rule must hold on
    each store's runs alone (suite MAPE, bubble MAE where measured, rho, per-run regressions), so that no store's
    suite pays for another's; a store whose runs the change does not move holds trivially. `runs_moved` and the
    bootstrap interval are of all the runs together; `stores` keeps each store's own verdict."""
    from hops_calib.loop.score import aggregate

    before_by_id = {r.run_id: r for r in before_runs}
    after_by_id = {r.run_id: r for r in after_runs}
    whole = gate(before_runs, after_runs, aggregate(list(before_runs)), aggregate(list(after_runs)), tolerances)
    verdicts = []
    for path, ids in stores:
        old, new = [before_by_id[i] for i in ids], [after_by_id[i] for i in ids]
        verdicts.append((path, gate(old, new, aggregate(old), aggregate(new), tolerances)))
    reasons = [f"store {path}: {reason}" for path, verdict in verdicts for reason in verdict.reasons[: len(RULES) + 1]]
    reasons += [f"all {len(stores)} stores: {reason}" for reason in whole.reasons[len(RULES) :]]
    failed = tuple(rule for rule in RULES if any(rule in verdict.failed_rules for _, verdict in verdicts))
    return GateResult(
        accepted=all(verdict.accepted for _, verdict in verdicts),
        reasons=tuple(reasons),
        regressions=tuple(r for _, verdict in verdicts for r in verdict.regressions),
        tolerances=tolerances,
        runs_moved=whole.runs_moved,
        mape_change_interval_pp=whole.mape_change_interval_pp,
        failed_rules=failed,
        stores=tuple(verdicts),
    )
