"""What the scoring verbs (`evaluate`, `predict --all`, `observe`) print for people of the logged timers
(`hops_calib.loop.timers.timer_summary`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def timers_text(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """One line of a `timer_summary`: the scored timers' MAPE and run counts, then the ones logged unpredicted."""
    scored = ", ".join(
        f"{name} {t['mape_pct']:.2f} % (on {t['scored']} runs)" for name, t in summary.items() if t["scored"]
    )
    unscored = ", ".join(f"{name} ({t['runs']} runs)" for name, t in summary.items() if not t["scored"])
    return (
        "logged timers, MAPE of the largest over ranks: "
        + (scored or "none predicted")
        + (f"; logged, no predicted counterpart: {unscored}" if unscored else "")
    )
