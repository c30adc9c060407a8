"""Plot room: parity plots, predicted against real, one point per run, for throughput and bubble.

A perfect model puts every point on the dashed identity line; the shaded band
is within 10 % of the real value. Colour and marker shape both encode the
run's device mix, and the worst runs of each panel are labelled with short ids
so they can be looked up (`hops-calib predict ID`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hops_calib.loop.score import SuiteScore
from hops_calib.plot import style
from hops_calib.plot.groups import RunPoint, short_run_id

SPREAD_COLOUR = "#777777"  # the random-stall spread of a prediction
BAND = 0.10  # the shaded band: predictions within 10 % of the real value
LOG_SPAN = 4.0  # throughput axes turn logarithmic when the values span more than this factor
FIGURE_SIZE_IN = (12.0, 7.2)
# Point colours: Okabe-Ito, yellow last (weakest on white; points carry a dark edge for it).
POINT_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#F0E442")


def _limits(values: np.ndarray, log: bool) -> tuple[float, float]:
    lo, hi = float(np.min(values)), float(np.max(values))
    if log:
        return lo / 1.3, hi * 1.3
    pad = max((hi - lo) * 0.08, abs(hi) * 0.05, 1e-9)
    return max(lo - pad, 0.0) if lo >= 0 else lo - pad, hi + pad


def _panel(
    ax: Any,
    real: np.ndarray,
    predicted: np.ndarray,
    points: Sequence[RunPoint],
    mixes: list[str],
    errors: np.ndarray,
    label_worst: int,
    log: bool,
    unit_label: str,
    what: str,
    spread: np.ndarray | None = None,
) -> None:
    lo, hi = _limits(np.concatenate([real, predicted]), log)
    grid = np.geomspace(lo, hi, 200) if log else np.linspace(lo, hi, 200)
    ax.fill_between(grid, grid * (1 - BAND), grid * (1 + BAND), color="#BBBBBB", alpha=0.45, linewidth=0, zorder=1)
    ax.plot(grid, grid, color=style.GUIDE_COLOUR, linestyle="--", linewidth=1.0, zorder=2)
    if spread is not None and np.any(spread > 0):
        shown = spread > 0
        ax.errorbar(
            real[shown],
            predicted[shown],
            yerr=spread[shown],
            fmt="none",
            ecolor=SPREAD_COLOUR,
            elinewidth=1.0,
            capsize=2.5,
            zorder=2.5,
        )
    for index, mix in enumerate(mixes):
        chosen = np.array([p.device_mix == mix for p in points])
        ax.scatter(
            real[chosen],
            predicted[chosen],
            s=38,
            marker=style.MARKERS[index % len(style.MARKERS)],
            color=POINT_COLOURS[index % len(POINT_COLOURS)],
            edgecolors="#222222",
            linewidths=0.5,
            zorder=3,
            label=mix,
        )
    worst = np.argsort(-np.abs(errors), kind="stable")[:label_worst]
    for rank, i in enumerate(worst):
        # Alternate the label side so neighbouring outliers do not print over each other.
        dx, dy = ((10, -16), (10, 10), (-10, 10), (-10, -16))[rank % 4]
        ax.annotate(
            short_run_id(points[i].run_id),
            (real[i], predicted[i]),
            xytext=(dx, dy),
            textcoords="offset points",
            ha="left" if dx > 0 else "right",
            fontsize=8,
            zorder=4,
            arrowprops={"arrowstyle": "-", "color": "#444444", "linewidth": 0.6},
            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )
    if log:
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            # Plain numbers at 1-2-5 steps: '20' reads faster than '2x10^1'.
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_box_aspect(1)
    ax.set_xlabel(f"real {what} ({unit_label})")
    ax.set_ylabel(f"predicted {what} ({unit_label})")
    ax.grid(True, which="major", color="#EEEEEE", linewidth=0.8, zorder=0)


def parity_figure(
    points: Sequence[RunPoint], suite: SuiteScore, title: str, label_worst: int = 3, dpi: float = style.DEFAULT_DPI
) -> Any:
    """Two parity panels (throughput, bubble) for `points`, titled with the suite's aggregates."""
    if not points:
        raise ValueError("no runs to plot")
    plt = style.pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=FIGURE_SIZE_IN, dpi=dpi, layout="constrained")
    mixes = sorted({p.device_mix for p in points})
    scores = [p.score for p in points]
    real_tput = np.array([s.real_throughput_per_s for s in scores])
    pred_tput = np.array([s.predicted_throughput_per_s for s in scores])
    both = np.concatenate([real_tput, pred_tput])
    log = bool(both.min() > 0 and both.max() / both.min() > LOG_SPAN)
    spread = pred_tput * np.array([s.stall_noise_ape_pct for s in scores]) / 100.0
    _panel(
        left,
        real_tput,
        pred_tput,
        points,
        mixes,
        np.array([s.throughput_error_pct for s in scores]),
        label_worst,
        log,
        "microbatches/s" + (", log scale" if log else ""),
        "throughput",
        spread,
    )
    floor = f"; stall-noise floor {suite.stall_noise_mape_pct:.1f} %" if suite.stall_noise_mape_pct > 0 else ""
    left.set_title(
        f"Throughput: MAPE {suite.throughput_mape_pct:.1f} % (median {suite.throughput_median_ape_pct:.1f} %{floor})",
        loc="left",
    )
    # Bubble only where there are events: a run measured at iteration level has none.
    timed = [i for i, s in enumerate(scores) if s.bubble_error_pp is not None]
    if timed:
        _panel(
            right,
            100 * np.array([scores[i].real_bubble_ratio for i in timed]),
            100 * np.array([scores[i].predicted_bubble_ratio for i in timed]),
            [points[i] for i in timed],
            mixes,
            np.array([scores[i].bubble_error_pp for i in timed]),
            label_worst,
            False,
            "% of stage time idle",
            "bubble",
        )
        on = "" if len(timed) == len(scores) else f" on the {len(timed)} runs with events"
        right.set_title(f"Idle share (measured bubble): MAE {suite.bubble_mae_pp:.1f} pp{on}", loc="left")
    else:
        right.set_axis_off()
        right.text(
            0.5,
            0.5,
            "no bubble: every run was measured at iteration level (no events)",
            ha="center",
            va="center",
            fontsize=10,
            wrap=True,
            transform=right.transAxes,
        )
    figure.suptitle(title, fontsize=12, fontweight="bold")

    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles, labels = left.get_legend_handles_labels()
    handles += [Line2D([], [], color=style.GUIDE_COLOUR, linestyle="--"), Patch(facecolor="#BBBBBB", alpha=0.45)]
    labels += ["prediction = real", f"within ±{BAND:.0%} of real"]
    if np.any(spread > 0):
        handles.append(Line2D([], [], color=SPREAD_COLOUR, marker="_", markersize=8, linewidth=1.0))
        labels.append("± random stalls alone")
    figure.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(labels), 8),
        fontsize=9,
        title="device mix (colour and shape)",
        title_fontsize=9,
    )
    return figure
