"""The schedules a spec may ask for (SCHEDULES) and the labels a template or a scenario name gives them.

A leaf: the simulator reads SCHEDULES without loading how a spec is built."""

from __future__ import annotations

from typing import Any

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb_h1")


# Labels a hand-written template or a scenario name may use, mapped to SCHEDULES.
SCHEDULE_ALIASES = {
    "1f1b": "1f1b",
    "one_f_one_b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "gpipe": "gpipe",
    "zero_bubble": "zb_h1",
    "zb_h1": "zb_h1",
    "zb": "zb_h1",
}
# Scenario-name tokens that name a schedule. "interleaved" is deliberately absent: in the
# cluster scenario names it means an alternating device order, not the interleaved schedule.
_NAME_TOKENS = (("zero_bubble", "zb_h1"), ("gpipe", "gpipe"))


def normalize_schedule_label(label: str) -> str:
    """A declared schedule label as one of SCHEDULES when it is a known alias, else lower-cased as given."""
    key = str(label).strip().lower().replace("-", "_")
    return SCHEDULE_ALIASES.get(key, key)


def declared_schedule_of(template: dict[str, Any], names: list[str]) -> str | None:
    """The schedule a run was labelled with: `pipeline.schedule` of hops.base.yaml, else a token of its names."""
    label = (template.get("pipeline") or {}).get("schedule") if template else None
    if label:
        return normalize_schedule_label(label)
    for name in names:
        padded = f"_{name.lower()}_"
        for token, schedule in _NAME_TOKENS:
            if f"_{token}_" in padded:
                return schedule
    return None
