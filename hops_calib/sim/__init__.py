"""The simulator room: schedules (task order per stage) and the event engine; stragglers and failures as data
(`perturb`) and the critical path of a simulated run (`critical`). Pure: no I/O, no global state."""

from hops_calib.sim.engine import DeadlockError
from hops_calib.sim.pipeline import Pipeline, StageCosts
from hops_calib.sim.schedules import SCHEDULE_CHOICES
from hops_calib.sim.simulate import SimResult, auto_schedule, simulate

__all__ = ["SCHEDULE_CHOICES", "DeadlockError", "Pipeline", "SimResult", "StageCosts", "auto_schedule", "simulate"]
