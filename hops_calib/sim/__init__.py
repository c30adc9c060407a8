"""The simulator room: schedules (task order per stage) and the event engine. Pure: no I/O, no global state."""

from hops_calib.sim.pipeline import Pipeline, StageCosts

__all__ = ["Pipeline", "StageCosts"]
