"""Where the untraced time between pipeline steps goes, on the TRAIN runs (evidence for candidates 046-048).

Three measurements, none of them a throughput fit:

1. Step gaps: the gap between consecutive compute events of the first and the last stage, by the pair of
   phases (F->B, B->F, F->F ...) and the device type. A step that follows a p2p call (the last stage's
   forward after its receive) shows the host's work before it as a gap; a step that follows the rank's own
   previous step with no p2p call in between (the last stage's backward after its forward) shows none,
   because the host dispatched it while the GPU still ran the previous one.
2. Hop gaps: what a pipeline hop costs where its consumer was idle. The consumer (the next stage for a
   forward, the previous one for a backward) had finished its previous step before the producer's step
   ended, so the gap from the producer's end to the consumer's start is the hop plus the host work after
   the receive. Producer and consumer run on different hosts, whose clocks the trace compares directly;
   forward and backward hops cross a pair in opposite directions, so a clock offset moves their gaps in
   opposite directions and the median over both cancels most of it. Per pair of device types and message
   size (s x b x h x 2 bytes), against the model's price of the same hops (transfer + host time after a
   receive).
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

from hops_calib.evaluate import load_suite, open_store
from hops_calib.model import gpt
from hops_calib.metrics import timeline_iteration_part_series
from hops_calib.model_files import load_model
from hops_calib.observe import measured_replay_error_pct
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

hop_gaps: dict[tuple[str, float], list[float]] = defaultdict(list)
priced: dict[tuple[str, float], list[float]] = defaultdict(list)
for fixture_id, spec in zip(suite.ids, suite.specs):
    if spec.vp != 1:
        continue  # interleaved: a rank's chunks make the producer of a step ambiguous here
    mib = round(gpt.boundary_activation_bytes(spec.model) / 2**20, 2)
    pipeline = model.pipeline(spec)
    for k in range(spec.pp - 1):
        pair = "-".join(sorted((spec.devices[k], spec.devices[k + 1])))
        priced[(pair, mib)].append(pipeline.forward_transfer_ms[k] + pipeline.stages[k + 1].host_ms)
    timeline = store.load(fixture_id).timeline()
    compute = timeline[timeline["kind"] == COMPUTE].sort_values(["stage", "start_ms"])
    steps = {}  # (iteration, stage, microbatch, F|B) -> (end of the rank's previous step, start, end)
    for stage, rows in compute.groupby("stage"):
        previous_end = np.nan
        for row in rows.itertuples():
            phase = row.phase[0]
            if phase in "FB":
                steps[(row.iteration, stage, row.microbatch, phase)] = (previous_end, row.start_ms, row.end_ms)
            previous_end = row.end_ms
    for (iteration, stage, microbatch, phase), (previous_end, start, _) in steps.items():
        producer_stage = stage - 1 if phase == "F" else stage + 1
        producer = steps.get((iteration, producer_stage, microbatch, phase))
        if producer is None or not previous_end < producer[2]:
            continue  # no such producer, or the consumer was still busy when the data was ready
        pair = "-".join(sorted((spec.devices[stage], spec.devices[producer_stage])))
        hop_gaps[(pair, mib)].append(start - producer[2])

print("\nhop gaps where the consumer was idle (ms), train split; model = transfer + host time after a receive")
print(f"{'devices':10s} {'MiB':>5s} {'hops':>6s} {'real median':>11s} {'model':>6s} {'model - real':>12s}")
for key in sorted(hop_gaps):
    real, model_ms = float(np.median(hop_gaps[key])), float(np.median(priced[key]))
    print(f"{key[0]:10s} {key[1]:5.2f} {len(hop_gaps[key]):6d} {real:11.2f} {model_ms:6.2f} {model_ms - real:+12.2f}")
