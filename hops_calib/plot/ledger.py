"""Plot room: the ledger's history, the suite's errors after each accepted change and every rejected attempt.

Three panels share the ledger's entry numbers: throughput MAPE, bubble MAE and
mean utilization rho. The solid line is the model as the accepted changes left
it (its first point is the model before the first candidate); a cross is a
rejected candidate, drawn where it would have taken the model; a hollow circle an
accepted candidate that was not committed (the model file did not change there). Each accepted
candidate is annotated with its number (the id's leading digits; the whole id when
it has none). A whole-model comparison carried out in the model file
(`compare --commit`) moves the line too: to the model after when accepted, back to
the model before when a rejected move is undone. Held-out reports are diamonds: they score another split, so they are
not joined to the line. The error panels are logarithmic: a campaign goes from
hundreds of percent to a few, and the late steps matter as much as the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hops_calib.plot import style

FIGURE_SIZE_IN = (12.0, 8.4)
METRICS = (  # (aggregate field, axis label, better direction, smallest y span drawn, log scale)
    ("throughput_mape_pct", "throughput MAPE (%)", "lower is better", 2.0, True),
    ("bubble_mae_pp", "bubble MAE (pp)", "lower is better", 1.0, True),
    ("util_spearman_mean", "mean utilization rho", "higher is better", 0.1, False),
)
ACCEPTED_COLOUR, REJECTED_COLOUR, REPORT_COLOUR = "#0072B2", "#D55E00", "#009E73"


@dataclass(frozen=True)
class Attempt:
    seq: int
    candidate_id: str
    accepted: bool  # the gate's decision (a committed comparison always moves the line)
    before: dict[str, float]
    after: dict[str, float]
    # Whether the change was written to the model file: an accepted candidate evaluated without --commit leaves
    # the model as it was, so the line does not move there.
    committed: bool = True
    # A committed comparison (`compare --commit`), not a candidate: drawn on the line whatever the filter,
    # labelled `label`; `after` is the model it kept (the model before, when it undid a move).
    comparison: bool = False
    label: str = ""


@dataclass(frozen=True)
class Audit:
    seq: int
    split: str
    aggregates: dict[str, float]


def entries_on(entries: Sequence[dict[str, Any]], sizes: dict[str, int]) -> list[dict[str, Any]]:
    """The entries that scored a split of as many runs as `sizes` gives for it ({"train": 36, "test": 20}): one
    store's campaign, without another store's candidates (their errors would join the line with a false jump)."""
    return [
        e for e in entries if e.get("n_fixtures") is not None and e.get("n_fixtures") == sizes.get(str(e.get("split")))
    ]


def read_history(entries: Sequence[dict[str, Any]]) -> tuple[list[Attempt], list[Audit]]:
    """The ledger's candidate evaluations and held-out (test) reports, in order; other entries are skipped.

    A report on the train split repeats what the line already shows, so it is not drawn.
    """
    attempts, audits = [], []
    for entry in entries:
        if entry.get("kind") == "compare" and entry.get("committed") and entry.get("aggregates_after"):
            kept = entry["decision"] == "accepted"
            note = entry.get("note") or "compare"
            short = short_note(note)
            attempts.append(
                Attempt(
                    seq=int(entry["seq"]),
                    candidate_id=note,
                    accepted=True,
                    before=entry.get("aggregates_before") or {},
                    after=entry["aggregates_after"] if kept else entry.get("aggregates_before") or {},
                    comparison=True,
                    label=short if kept else f"{short} undone",
                )
            )
        elif entry.get("kind") == "evaluate" and entry.get("aggregates_after"):
            attempts.append(
                Attempt(
                    seq=int(entry["seq"]),
                    candidate_id=str((entry.get("candidate") or {}).get("id")),
                    accepted=entry.get("decision") == "accepted",
                    before=entry.get("aggregates_before") or {},
                    after=entry["aggregates_after"],
                    committed=bool(entry.get("committed", True)),
                )
            )
        elif entry.get("kind") == "report" and entry.get("split") == "test" and entry.get("aggregates"):
            audits.append(Audit(seq=int(entry["seq"]), split=str(entry.get("split")), aggregates=entry["aggregates"]))
    return attempts, audits


def label_of(attempt: Attempt) -> str:
    """What the line says at an accepted attempt: the candidate's short id, or a comparison's own label."""
    return attempt.label if attempt.comparison else short_id(attempt.candidate_id)


LABEL_CHARS = 24


def short_note(note: str) -> str:
    """A comparison's label on the plot: its note up to the first bracket, colon or semicolon ("move 053-055" of
    "move 053-055 (hops as bursts); rules stated ..."), cut to LABEL_CHARS characters. The whole note stays in the
    ledger; on the plot a long one would push the panels into a corner.
    """
    head = note
    for mark in "(;:":
        head = head.split(mark, 1)[0]
    head = head.strip() or note.strip()
    return head if len(head) <= LABEL_CHARS else head[: LABEL_CHARS - 1].rstrip() + "\u2026"


def short_id(candidate_id: str) -> str:
    """A candidate's label on the plot: its leading number ("042" of "042-realized-stalls"), else the id."""
    head = candidate_id.split("-", 1)[0]
    return head if head.isdigit() else candidate_id


def _value(aggregates: dict[str, float], field: str) -> float:
    value = aggregates.get(field)
    return float(value) if value is not None else float("nan")


def ledger_figure(
    attempts: Sequence[Attempt], audits: Sequence[Audit], title: str, dpi: float = style.DEFAULT_DPI
) -> Any:
    if not attempts and not audits:
        raise ValueError("the ledger has no evaluations or reports to plot")
    plt = style.pyplot()
    figure, axes = plt.subplots(len(METRICS), 1, figsize=FIGURE_SIZE_IN, dpi=dpi, sharex=True, layout="constrained")
    accepted = [a for a in attempts if a.accepted and a.committed]
    uncommitted = [a for a in attempts if a.accepted and not a.committed]
    rejected = [a for a in attempts if not a.accepted]
    last_seq = max([a.seq for a in attempts] + [a.seq for a in audits])
    for ax, (field, label, direction, min_span, log) in zip(axes, METRICS):
        if log:
            ax.set_yscale("log")
        if attempts:
            start = attempts[0]
            xs = [start.seq - 0.5] + [a.seq for a in accepted]
            ys = [_value(start.before, field)] + [_value(a.after, field) for a in accepted]
            # The model keeps its errors until the next accepted change: a step line says so.
            ax.step(xs + [last_seq + 0.5], ys + [ys[-1]], where="post", color=ACCEPTED_COLOUR, linewidth=1.6, zorder=2)
            ax.scatter(xs[:1], ys[:1], marker="o", s=36, facecolors="white", edgecolors=ACCEPTED_COLOUR, zorder=3)
            ax.scatter(xs[1:], ys[1:], marker="o", s=40, color=ACCEPTED_COLOUR, zorder=3)
            ax.scatter(
                [a.seq for a in rejected],
                [_value(a.after, field) for a in rejected],
                marker="X",
                s=52,
                color=REJECTED_COLOUR,
                zorder=3,
            )
            ax.scatter(
                [a.seq for a in uncommitted],
                [_value(a.after, field) for a in uncommitted],
                marker="o",
                s=40,
                facecolors="white",
                edgecolors=ACCEPTED_COLOUR,
                linewidths=1.4,
                zorder=3,
            )
            if ax is axes[0]:
                ax.annotate(
                    "start",
                    (xs[0], ys[0]),
                    xytext=(0, 7),
                    textcoords="offset points",
                    fontsize=7.5,
                    ha="center",
                    va="bottom",
                    color=ACCEPTED_COLOUR,
                )
                for attempt in accepted:
                    ax.annotate(
                        label_of(attempt),
                        (attempt.seq, _value(attempt.after, field)),
                        xytext=(0, 7),
                        textcoords="offset points",
                        fontsize=7,
                        rotation=90,
                        ha="center",
                        va="bottom",
                        color=ACCEPTED_COLOUR,
                    )
        if audits:
            ax.scatter(
                [a.seq for a in audits],
                [_value(a.aggregates, field) for a in audits],
                marker="D",
                s=36,
                color=REPORT_COLOUR,
                zorder=3,
            )
        ax.set_ylabel(f"{label}\n{direction}")
        ax.grid(True, axis="y", color="#EEEEEE", linewidth=0.8, zorder=0)
        ax.margins(x=0.04, y=0.18)
        # A change in the third decimal must not fill the panel as if it were large.
        low, high = ax.get_ylim()
        if not log and high - low < min_span:
            middle = (low + high) / 2
            ax.set_ylim(middle - min_span / 2, middle + min_span / 2)
    axes[-1].set_xlabel("ledger entry (seq)")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    figure.suptitle(title, fontsize=12, fontweight="bold")

    from matplotlib.lines import Line2D

    handles = [
        Line2D(
            [], [], color=ACCEPTED_COLOUR, marker="o", linewidth=1.6, label="model after each accepted change (train)"
        ),
        Line2D(
            [],
            [],
            color=REJECTED_COLOUR,
            marker="X",
            linestyle="none",
            markersize=8,
            label="rejected candidate (where it would have led)",
        ),
        Line2D(
            [],
            [],
            color=ACCEPTED_COLOUR,
            marker="o",
            markerfacecolor="white",
            linestyle="none",
            label="accepted, not committed (the model stayed)",
        ),
        Line2D([], [], color=REPORT_COLOUR, marker="D", linestyle="none", label="held-out report (test split)"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=9)
    return figure
