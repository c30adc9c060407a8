"""Plot room: timelines, one panel per source (the real trace, a prediction) on one time axis.

Each panel shows the first iterations of a timeline (the `hops_calib.timeline`
table, real or simulated alike): one lane per stage, compute bars coloured by
phase, sends as thin black marks along the lane's lower edge, idle time as the
bare grey lane, and a dashed line where each iteration begins. Panels share the
time axis, so a prediction that runs too fast ends visibly early.

A real run with per-kernel truth (read from a profiler trace: `Truth.kernels`)
gets a thin strip under each compute bar of its lanes (one lane per stage: the
rank of the pipeline the timeline is of), split into its kernel classes (gemm,
attention, ...) in order of time: each the class's mean time per step of that
stage and phase (`kernel_classes_per_step`), scaled down together where they would
overrun the bar (`kernel_segments`, as the Chrome export nests them). Aggregates,
not the kernels themselves: a fixture keeps durations by kernel and shape, not
each kernel's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from hops_calib.plot import style
from hops_calib.timeline import COMPUTE, FORWARD, OPTIMIZER, PHASES, TRANSFER

LANE_HALF = 0.42  # lane: the stage's whole row; what is not covered by a bar is idle
BAR_TOP, BAR_BOTTOM = -0.34, 0.26  # compute bars (y grows downwards: stage 0 on top)
KERNEL_BAR_BOTTOM, KERNEL_TOP, KERNEL_BOTTOM = 0.10, 0.13, 0.27  # with kernel truth: shorter bars, the strip under
MIN_KERNEL_SHARE = 0.02  # a kernel class drawing less of a panel's kernel time is drawn (and named) as "other"
SEND_TOP, SEND_BOTTOM = 0.30, 0.42  # sends: a thin strip at the bottom of the lane
LABEL_FONT_PT = 6.5  # microbatch numbers, inside the bars wide enough to hold them
LATER_CHUNK = "later model chunk"  # legend key of hatched bars
MIN_EDGE_PX = 5.0  # a white edge separates neighbouring bars, but would swallow a narrower one
MIN_TASK_PX = 6.0  # the default window gives a typical forward at least this many pixels (narrower ones read as moire)
DEFAULT_ITERATIONS = 2
PLOT_WIDTH_SHARE = 0.86  # the plot area is about 86 % of the figure's width


@dataclass(frozen=True)
class Panel:
    """One timeline to draw: a label, the table, and a note with its headline numbers."""

    label: str
    timeline: pd.DataFrame
    note: str = ""
    # Number shown for the panel's first iteration (real traces start at Megatron's iteration 3;
    # a simulation numbers from 1, and is labelled like the run it predicts).
    first_iteration_label: int | None = None
    # Per-kernel truth of a real run read from a profiler trace (`Truth.kernels`): its kernel classes are drawn
    # under the bars (a strip per lane), and nested under them in the Chrome export
    kernels: tuple = ()


@dataclass(frozen=True)
class Window:
    rows: pd.DataFrame  # the window's rows, times shifted so the window starts at 0
    iterations: tuple[int, ...]  # the iteration numbers in it, ascending
    iteration_starts_ms: tuple[float, ...]  # first event of each (the metrics' definition of an iteration start)
    end_ms: float


@dataclass(frozen=True)
class Shown:
    """What a figure draws: the first `iterations` iterations, or, with `span_ms`, only their first span_ms."""

    iterations: int
    span_ms: float | None = None
    forwards: int | None = None  # with span_ms: the first stage's forwards that start inside it

    def describe(self, of_iterations: int, microbatches: int) -> str:
        if self.span_ms is None:
            return f"first {min(self.iterations, of_iterations)} of {of_iterations} iterations"
        return (
            f"first {self.span_ms:,.0f} ms of 1 of {of_iterations} iterations: microbatches 0-"
            f"{max((self.forwards or 0) - 1, 0)} of {microbatches}"
        )


def shown_window(timelines: Sequence[pd.DataFrame], iterations: int | None, width_in: float, dpi: float) -> Shown:
    """The window a figure draws. Asked for K iterations (`iterations`), those; by default DEFAULT_ITERATIONS, fewer
    when a typical (median) forward would be narrower than MIN_TASK_PX, and only the start of the first one (the
    warm-up and the first steady microbatches) when even one iteration is too many to read."""
    if iterations is not None:
        return Shown(iterations)
    forward_ms = float(
        np.median(
            np.concatenate(
                [
                    (t["end_ms"] - t["start_ms"]).to_numpy()[
                        ((t["kind"] == COMPUTE) & (t["phase"] == FORWARD)).to_numpy()
                    ]
                    for t in timelines
                ]
            )
            if timelines
            else np.array([np.nan])
        )
    )
    plot_px = width_in * PLOT_WIDTH_SHARE * dpi
    if not forward_ms > 0:
        return Shown(DEFAULT_ITERATIONS)
    for k in range(DEFAULT_ITERATIONS, 0, -1):
        windows = [iteration_window(t, k) for t in timelines]
        end_ms = max(window.end_ms for window in windows) * 1.01
        if forward_ms * plot_px / end_ms >= MIN_TASK_PX:
            return Shown(k)
    span_ms = forward_ms * plot_px / MIN_TASK_PX
    # the loop's last windows are the first iteration's
    forwards = max(
        int(((r["kind"] == COMPUTE) & (r["phase"] == FORWARD) & (r["stage"] == 0) & (r["start_ms"] < span_ms)).sum())
        for r in (window.rows for window in windows)
    )
    return Shown(1, span_ms, forwards)


def iteration_window(timeline: pd.DataFrame, iterations: int, span_ms: float | None = None) -> Window:
    """The first `iterations` iterations of `timeline`, shifted to start at 0 ms; with `span_ms`, only the tasks
    that start inside its first span_ms (cut at its end)."""
    if iterations < 1:
        raise ValueError(f"--iterations is {iterations}; show at least one iteration")
    if timeline.empty:
        raise ValueError("the timeline has no rows to draw")
    numbers = np.sort(timeline["iteration"].unique())[:iterations]
    rows = timeline[timeline["iteration"].isin(numbers)]
    origin = float(rows["start_ms"].min())
    rows = rows.assign(start_ms=rows["start_ms"] - origin, end_ms=rows["end_ms"] - origin)
    if span_ms is not None:
        rows = rows[rows["start_ms"] < span_ms]
        rows = rows.assign(end_ms=rows["end_ms"].clip(upper=span_ms))
        numbers = numbers[np.isin(numbers, rows["iteration"].unique())]
    starts = rows.groupby("iteration")["start_ms"].min().reindex(numbers)
    return Window(
        rows=rows,
        iterations=tuple(int(n) for n in numbers),
        iteration_starts_ms=tuple(float(s) for s in starts),
        end_ms=float(rows["end_ms"].max()),
    )


def kernel_classes_per_step(
    kernels: Sequence[Any], stage: np.ndarray, phase: np.ndarray, iteration: np.ndarray
) -> dict[tuple[int, str], dict[str, float]]:
    """(stage, phase) -> kernel class -> its mean ms per step, of a timeline's compute steps (`stage`, `phase`,
    `iteration` of each): the class's `per_iteration_ms` over the phase's steps per iteration."""
    iterations = max(len(set(iteration.tolist())), 1)
    steps: dict[tuple[int, str], int] = {}  # (stage, phase) -> steps in the timeline
    for key in zip(stage.tolist(), (str(p) for p in phase.tolist())):
        steps[key] = steps.get(key, 0) + 1
    per_step: dict[tuple[int, str], dict[str, float]] = {}
    for kernel in kernels:
        key = (kernel.stage, kernel.phase)
        if key in steps:
            classes = per_step.setdefault(key, {})
            classes[kernel.kernel_class] = classes.get(kernel.kernel_class, 0.0) + (
                kernel.per_iteration_ms * iterations / steps[key]
            )
    return per_step


def kernel_segments(
    classes: dict[str, float], start: float, duration: float, unit: float = 1.0, digits: int | None = None
) -> tuple[list[tuple[str, float, float, float]], bool]:
    """The kernel classes of one step laid end to end inside its bar (start, duration, in ms x `unit`), largest
    first: (class, start, width, its ms per step) each, and whether they were scaled down to fit the bar; widths
    rounded to `digits` where given, never past the bar's end."""
    total = sum(classes.values()) * unit
    scale = min(1.0, duration / total) if total > 0 else 0.0
    at, end = start, start + duration
    out = []
    for label, ms in sorted(classes.items(), key=lambda item: -item[1]):
        width = ms * unit * scale
        if digits is not None:
            width, at = min(round(width, digits), round(end - at, digits)), round(at, digits)
        if width <= 0:
            continue
        out.append((label, at, width, ms))
        at += width
    return out, scale < 1.0


def figure_size(stages: int, panels: int = 2) -> tuple[float, float]:
    """Width and height in inches: a fixed width, and a height that grows with the stages drawn."""
    panel_height = 0.4 * stages + 0.85
    return 12.0, round(panels * panel_height + 1.35, 2)


def _stage_labels(devices: Sequence[str]) -> list[str]:
    return [f"stage {stage} · {device.upper()}" for stage, device in enumerate(devices)]


def _draw_kernels(ax: Any, window: Window, panel: Panel) -> dict[str, float]:
    """The strip of kernel classes under each compute bar (module docstring); class -> ms drawn (for the legend)."""
    whole = panel.timeline[panel.timeline["kind"] == COMPUTE]
    per_step = kernel_classes_per_step(
        panel.kernels, whole["stage"].to_numpy(), whole["phase"].to_numpy(), whole["iteration"].to_numpy()
    )
    compute = window.rows[window.rows["kind"] == COMPUTE]
    segments: dict[tuple[int, str], list[tuple[float, float]]] = {}
    drawn: dict[str, float] = {}
    for stage, phase, start, end in zip(
        compute["stage"].tolist(), compute["phase"].tolist(), compute["start_ms"].tolist(), compute["end_ms"].tolist()
    ):
        classes = per_step.get((int(stage), str(phase)))
        if not classes:
            continue
        for label, at, width, _ms in kernel_segments(classes, start, end - start)[0]:
            segments.setdefault((int(stage), label), []).append((at, width))
            drawn[label] = drawn.get(label, 0.0) + width
    total = sum(drawn.values())
    shown = {label for label, ms in drawn.items() if ms >= MIN_KERNEL_SHARE * total and label != style.OTHER_KERNELS}
    for (stage, label), spans in segments.items():
        colour = style.kernel_colour(label if label in shown else style.OTHER_KERNELS)
        ax.broken_barh(
            spans, (stage + KERNEL_TOP, KERNEL_BOTTOM - KERNEL_TOP), facecolors=colour, linewidth=0, zorder=2
        )
    legend: dict[str, float] = {}
    for label, ms in drawn.items():
        key = label if label in shown else style.OTHER_KERNELS
        legend[key] = legend.get(key, 0.0) + ms
    return legend


def _draw_panel(
    ax: Any, window: Window, panel: Panel, stages: int, x_max: float, px_per_ms: float, dpi: float
) -> tuple[set[str], dict[str, float]]:
    """Draw one panel; returns the phases it drew and the kernel classes with the ms drawn of each (the legend)."""
    rows = window.rows
    drawn: set[str] = set()
    kernels = _draw_kernels(ax, window, panel) if panel.kernels else {}
    bar_bottom = KERNEL_BAR_BOTTOM if kernels else BAR_BOTTOM
    for stage in range(stages):
        ax.broken_barh(
            [(0.0, window.end_ms)],
            (stage - LANE_HALF, 2 * LANE_HALF),
            facecolors=style.IDLE_COLOUR,
            linewidth=0,
            zorder=1,
        )
    compute = rows[rows["kind"] == COMPUTE]
    later_chunk = (compute["chunk"] > 0).rename("later_chunk")
    for (stage, phase, later), bars in compute.groupby(["stage", "phase", later_chunk], sort=False, observed=True):
        starts, widths = bars["start_ms"].to_numpy(), (bars["end_ms"] - bars["start_ms"]).to_numpy()
        colour = style.PHASE_COLOURS[phase]
        width_px = widths * px_per_ms
        edges = np.where(width_px >= MIN_EDGE_PX, "white", colour)
        # Interleaved schedules run several model chunks per rank: the later ones are hatched.
        ax.broken_barh(
            list(zip(starts, widths)),
            (stage + BAR_TOP, bar_bottom - BAR_TOP),
            facecolors=colour,
            edgecolors=list(edges),
            linewidth=0.4,
            zorder=2,
            hatch="///" if later else None,
        )
        drawn.add(str(phase))
        if later:
            drawn.add(LATER_CHUNK)
        if phase == OPTIMIZER:
            continue
        # Microbatch numbers make the schedule's order readable, but only when every bar of the lane and
        # phase holds its number: a lane numbered here and there reads as a pattern that is not there.
        microbatches = bars["microbatch"].to_numpy()
        char_px = 0.62 * LABEL_FONT_PT * dpi / 72
        needed_px = char_px * np.array([len(str(m)) for m in microbatches]) + 4
        if (microbatches >= 0).all() and (width_px >= needed_px).all():
            for start, width, microbatch in zip(starts, widths, microbatches):
                ax.text(
                    start + width / 2,
                    stage + (BAR_TOP + bar_bottom) / 2,
                    str(microbatch),
                    ha="center",
                    va="center",
                    fontsize=LABEL_FONT_PT,
                    color="white",
                    zorder=3,
                )
    sends = rows[rows["kind"] == TRANSFER]
    for stage, marks in sends.groupby("stage", sort=False):
        widths = (marks["end_ms"] - marks["start_ms"]).to_numpy()
        ax.broken_barh(
            list(zip(marks["start_ms"].to_numpy(), widths)),
            (stage + SEND_TOP, SEND_BOTTOM - SEND_TOP),
            facecolors=style.TRANSFER_COLOUR,
            edgecolors=style.TRANSFER_COLOUR,
            linewidth=0.5,
            zorder=2,
        )
    first_label = panel.first_iteration_label if panel.first_iteration_label is not None else window.iterations[0]
    boundaries = window.iteration_starts_ms
    for ordinal, start in enumerate(boundaries):
        ax.axvline(start, color=style.GUIDE_COLOUR, linestyle="--", linewidth=0.9, zorder=4)
        # The label takes the room up to the next boundary: long, short, or none when iterations are thin.
        room_px = ((boundaries[ordinal + 1] if ordinal + 1 < len(boundaries) else x_max) - start) * px_per_ms
        number = first_label + ordinal
        label = f"iteration {number}" if room_px >= 80 else str(number) if room_px >= 22 else ""
        ax.text(
            start + 3 / px_per_ms, -0.55, label, fontsize=8, color=style.GUIDE_COLOUR, ha="left", va="bottom", zorder=4
        )
    ax.set_ylim(stages - 0.5, -0.95)
    ax.set_yticks(range(stages))
    ax.tick_params(axis="y", length=0)
    ax.spines["left"].set_visible(False)
    title = panel.label + (f"  —  {panel.note}" if panel.note else "")
    ax.set_title(title, loc="left", fontsize=10.5)
    return drawn, kernels


def timeline_figure(
    title: str,
    devices: Sequence[str],
    panels: Sequence[Panel],
    iterations: int | Shown = DEFAULT_ITERATIONS,
    dpi: float = style.DEFAULT_DPI,
) -> Any:
    """A figure with one panel per entry of `panels`, stacked, sharing a time axis in ms, over the window
    `iterations` (K iterations, or a `shown_window`)."""
    plt = style.pyplot()
    stages = len(devices)
    shown = iterations if isinstance(iterations, Shown) else Shown(iterations)
    windows = [iteration_window(panel.timeline, shown.iterations, shown.span_ms) for panel in panels]
    x_max = (shown.span_ms if shown.span_ms is not None else max(window.end_ms for window in windows)) * 1.01
    width_in, height_in = figure_size(stages, len(panels))
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(width_in, height_in), sharex=True, dpi=dpi, layout="constrained", squeeze=False
    )
    px_per_ms = width_in * PLOT_WIDTH_SHARE * dpi / x_max
    drawn: set[str] = set()
    kernels: dict[str, float] = {}
    for ax, window, panel in zip(axes[:, 0], windows, panels):
        phases, classes = _draw_panel(ax, window, panel, stages, x_max, px_per_ms, dpi)
        drawn |= phases
        for label, ms in classes.items():
            kernels[label] = kernels.get(label, 0.0) + ms
        ax.set_yticklabels(_stage_labels(devices))
    bottom = axes[-1, 0]
    bottom.set_xlim(0, x_max)
    bottom.set_xlabel("time since the first event of the window (ms)")
    # a bold 12 pt character is about 0.6 em wide: wrap the title to the figure's width so a long run id stays whole
    import textwrap

    figure.suptitle(
        "\n".join(textwrap.wrap(title, max(40, int(width_in * 72 / (12 * 0.62))))), fontsize=12, fontweight="bold"
    )

    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Artist] = [
        Patch(facecolor=style.PHASE_COLOURS[p], label=style.PHASE_LABELS[p]) for p in PHASES if p in drawn
    ]
    handles.append(Line2D([], [], color=style.TRANSFER_COLOUR, linewidth=3, label="send to the next/previous stage"))
    if LATER_CHUNK in drawn:
        handles.append(Patch(facecolor=style.GUIDE_COLOUR, edgecolor="white", hatch="///", label="later model chunk"))
    handles.append(Patch(facecolor=style.IDLE_COLOUR, label="idle"))
    handles.append(Line2D([], [], color=style.GUIDE_COLOUR, linestyle="--", label="iteration start"))
    # One row while it fits the figure's width (zero-bubble runs add two backward kinds), else two.
    ncol = len(handles) if len(handles) <= 6 else (len(handles) + 1) // 2
    if kernels:  # the classes drawn under the bars, largest first ("other" last), on two rows with the rest
        order = sorted(kernels, key=lambda label: (label == style.OTHER_KERNELS, -kernels[label]))
        handles += [
            Patch(
                facecolor=style.kernel_colour(label),
                label=f"{label} kernels (strip under a step)" if k == 0 else f"{label} kernels",
            )
            for k, label in enumerate(order)
        ]
        ncol = (len(handles) + 1) // 2
    figure.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=9)
    return figure
