"""Where the untraced time between pipeline steps goes, on the TRAIN runs (evidence for candidates 046-047).

Three measurements (the second now in `hops-calib observe`), none of them a throughput fit:

1. Step gaps: the gap between consecutive compute events of the first and the last stage, by the pair of
   phases (F->B, B->F, F->F ...) and the device type. A step that follows a p2p call (the last stage's
   forward after its receive) shows the host's work before it as a gap; a step that follows the rank's own
   previous step with no p2p call in between (the last stage's backward after its forward) shows none,
   because the host dispatched it while the GPU still ran the previous one.
2. Hop gaps: now printed by `hops-calib observe` (its hops table, `Observation.hops`): what a pipeline hop
   costs where its consumer was idle, by device types and message size, against the model's price.
3. The measured replay (`hops-calib observe`: every stage, optimizer and between-iteration time the trace
   measures fed to the simulator) with the model's per-step host time on every step, and only on the steps
   whose input crosses a link (`Pipeline.host_after_receive_only`): what the simulator's structure leaves.

Usage: python experiments/scripts/pipeline_gaps.py FIXTURES [--model M]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace

import numpy as np

from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import load_suite, open_store
from hops_calib.metrics import timeline_iteration_part_series
from hops_calib.research.observe import measured_replay_error_pct
from hops_calib.timeline import COMPUTE

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("fixtures")
parser.add_argument("--model", help="model file (default: the shipped baseline)")
args = parser.parse_args()

suite = load_suite(args.fixtures, "train")  # never the test split
store = open_store(args.fixtures)
model = load_model(args.model)

gaps: dict[tuple[str, str, str], list[float]] = defaultdict(list)
replay: dict[bool, list[float]] = defaultdict(list)
for fixture_id, spec in zip(suite.ids, suite.specs):
    fixture = store.load(fixture_id)
    timeline = fixture.timeline()
    compute = timeline[timeline["kind"] == COMPUTE].sort_values(["stage", "start_ms"])
    for stage, position in ((0, "first"), (spec.pp - 1, "last")):
        rows = compute[compute["stage"] == stage]
        phase = rows["phase"].str[0].to_numpy()  # F, B or O
        start, end, iteration = (rows[c].to_numpy() for c in ("start_ms", "end_ms", "iteration"))
        same = iteration[1:] == iteration[:-1]
        for a, b, gap in zip(phase[:-1][same], phase[1:][same], (start[1:] - end[:-1])[same]):
            if "O" not in (a, b):
                gaps[(position, spec.devices[stage], f"{a}->{b}")].append(float(gap))
    series = timeline_iteration_part_series(timeline)
    pipeline = model.pipeline(spec)
    for after_receive in (False, True):
        error = measured_replay_error_pct(fixture, replace(pipeline, host_after_receive_only=after_receive),
                                          timeline, series)
        if error is not None:
            replay[after_receive].append(error)

print("gap between consecutive compute events of the end stages (ms), train split")
print(f"{'stage':6s} {'device':6s} {'steps':6s} {'pairs':>6s} {'p10':>6s} {'median':>7s}")
for (position, device, steps), values in sorted(gaps.items()):
    print(f"{position:6s} {device:6s} {steps:6s} {len(values):6d} {np.percentile(values, 10):6.2f} "
          f"{np.median(values):7.2f}")
print(f"\nmeasured replay of model {model.name} (host time per step {pipeline.stages[0].host_ms:.3f} ms):")
for after_receive, errors in replay.items():
    errors_ = np.array(errors)
    where = "only after a receive" if after_receive else "on every step"
    print(f"  host time {where:21s} {len(errors_)} runs: throughput MAPE {np.abs(errors_).mean():.2f} %, "
          f"mean {errors_.mean():+.2f} %")
