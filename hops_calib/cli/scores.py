"""The scores' text shared by the verbs that score (predict, evaluate, compare, report): per-run errors, the
suite's aggregates, the runs left out, Megatron's timers; and the ledger a verb uses."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any


def resolve_ledger(path: Path | None) -> Path:
    """The ledger a verb uses: the one named, or the project's (which must exist; `hops_calib.loop.ledger.resolve`)."""
    from hops_calib.loop.ledger import resolve

    return resolve(path)


def pct(value: float | None) -> str:
    return f"{value:+.1f}" if value is not None and math.isfinite(value) else "n/a"


def num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "n/a"


def print_runs(runs) -> None:
    width = max(len(r.run_id) for r in runs)
    # The stall-free error when it was scored (evaluate --run-error stall-free); '-' where a trace cannot give it.
    free = any(r.stall_free_error_pct is not None for r in runs)
    print(
        f"{'run':{width}}  {'tput err %':>10} {'steady err %':>12} {'bubble err pp':>13} {'rho':>6}"
        + (f" {'stall-free err %':>16}" if free else "")
    )
    for r in runs:
        print(
            f"{r.run_id:{width}}  {pct(r.throughput_error_pct):>10} {pct(r.steady_throughput_error_pct):>12} "
            f"{pct(r.bubble_error_pp):>13} {num(r.util_spearman_rho):>6}"
            + (f" {pct(r.stall_free_error_pct) if r.stall_free_error_pct is not None else '-':>16}" if free else "")
        )
    signed = [r.throughput_error_pct for r in runs if math.isfinite(r.throughput_error_pct)]
    if signed:
        # the bias, which the suite's MAPE and median APE do not show
        print(
            f"median signed throughput error {statistics.median(signed):+.2f} % over {len(signed)} runs (positive: "
            "predicted too fast; the suite's median below is of the absolute error)"
        )


def _on(suite, metric: str) -> str:
    """' (on N runs)' where a metric was scored on fewer runs than the suite has (those without events)."""
    count = suite.count(metric)
    return "" if count == suite.n_fixtures else f" (on {count} runs with events)"


def print_suite(label: str, suite) -> None:
    from hops_calib.loop.score import or_nan

    print(
        f"{label}: {suite.n_fixtures} fixtures, throughput MAPE {suite.throughput_mape_pct:.2f} % (median "
        f"{suite.throughput_median_ape_pct:.2f} %), steady throughput MAPE {suite.steady_throughput_mape_pct:.2f} %, "
        + (
            f"bubble MAE {or_nan(suite.bubble_mae_pp):.2f} pp{_on(suite, 'bubble')}, mean utilization rho "
            f"{or_nan(suite.util_spearman_mean):.3f}{_on(suite, 'utilization')}; "
            if suite.bubble_mae_pp is not None
            else "no bubble or utilization (no run has events); "
        )
        + f"stall-noise floor of the throughput MAPE {suite.stall_noise_mape_pct:.2f} % (what random stalls alone "
        f"would cost an otherwise exact model on these runs; the model is "
        f"{suite.throughput_mape_pct - suite.stall_noise_mape_pct:+.2f} pp from it)"
    )
    print_timers(suite)


def print_timers(suite) -> None:
    """Megatron's logged timers against the simulation's (hops_calib/loop/timers.py), where runs logged them."""
    from hops_calib.cli.render.evaluate import timers_text

    if suite.timers:
        print("  " + timers_text(suite.timers))


def print_left_out(left_out: dict[str, Any] | None) -> None:
    """How many runs of the split the suite left out (the model does not price them), and why."""
    if not left_out or not left_out.get("count"):
        return
    print(f"left out {left_out['count']} run(s) the model does not price:")
    for reason in left_out["reasons"]:
        print(f"  {reason['count']:5d}  {reason['reason']} (e.g. {', '.join(reason['runs'])})")
