"""The timeline: one table shape shared by real traces and simulations.

Rule 3 of the design (both sides measured the same way) rests on this module:
`truth` turns a fixture's events into a timeline, `sim` produces one, and a
single metrics function (`hops_calib.metrics`) reads either.

One row per interval. Times are milliseconds from the start of the run
(the earliest event of the traced window for a real run, 0 for a simulation).

| column      | dtype   | meaning                                                        |
|-------------|---------|----------------------------------------------------------------|
| stage       | int64   | pipeline rank that ran the interval                            |
| chunk       | int64   | model chunk on that rank (0 unless interleaved)                |
| iteration   | int64   | training iteration (real runs keep Megatron's 1-based numbers) |
| microbatch  | int64   | microbatch index; -1 where there is none                       |
| kind        | string  | "compute" or "transfer"                                        |
| phase       | string  | one of PHASES                                                  |
| start_ms    | float64 | interval start                                                 |
| end_ms      | float64 | interval end (>= start_ms)                                     |
| peer_stage  | int64   | transfers: the receiving stage; -1 for compute                 |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a frame is built: the simulator and evaluate never build one
    import pandas as pd

FORWARD = "FORWARD"
BACKWARD = "BACKWARD"
BACKWARD_B = "BACKWARD_B"  # zero-bubble: input-gradient half of the backward
BACKWARD_W = "BACKWARD_W"  # zero-bubble: weight-gradient half of the backward
OPTIMIZER = "OPTIMIZER"
PHASES = (FORWARD, BACKWARD, BACKWARD_B, BACKWARD_W, OPTIMIZER)
BACKWARD_PHASES = (BACKWARD, BACKWARD_B, BACKWARD_W)

COMPUTE = "compute"
TRANSFER = "transfer"
KINDS = (COMPUTE, TRANSFER)

COLUMNS = {
    "stage": "int64",
    "chunk": "int64",
    "iteration": "int64",
    "microbatch": "int64",
    "kind": "string",
    "phase": "string",
    "start_ms": "float64",
    "end_ms": "float64",
    "peer_stage": "int64",
}


def empty() -> pd.DataFrame:
    """A timeline with no rows and the right dtypes."""
    import pandas as pd

    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in COLUMNS.items()})


def from_records(records: dict[str, object] | list[dict[str, object]]) -> pd.DataFrame:
    """Build a timeline from columns (dict of sequences) or rows, coercing dtypes and checking values."""
    import pandas as pd

    frame = pd.DataFrame(records)
    for name, default in (("chunk", 0), ("peer_stage", -1), ("microbatch", -1)):
        if name not in frame.columns:
            frame[name] = default
    return validate(frame)


def validate(frame: pd.DataFrame) -> pd.DataFrame:
    """Return `frame` with the timeline's columns and dtypes; raise ValueError naming what is wrong."""
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"timeline is missing columns {missing}; expected {list(COLUMNS)}")
    frame = frame[list(COLUMNS)].astype(COLUMNS)
    bad_kind = ~frame["kind"].isin(KINDS)
    if bad_kind.any():
        raise ValueError(f"timeline has unknown kind {frame.loc[bad_kind, 'kind'].iloc[0]!r}; expected {KINDS}")
    bad_phase = ~frame["phase"].isin(PHASES)
    if bad_phase.any():
        raise ValueError(f"timeline has unknown phase {frame.loc[bad_phase, 'phase'].iloc[0]!r}; expected {PHASES}")
    backwards = frame["end_ms"] < frame["start_ms"]
    if backwards.any():
        row = frame[backwards].iloc[0]
        raise ValueError(
            f"timeline interval ends before it starts: stage {row.stage} {row.phase} "
            f"microbatch {row.microbatch} ({row.start_ms} > {row.end_ms})"
        )
    return frame.reset_index(drop=True)
