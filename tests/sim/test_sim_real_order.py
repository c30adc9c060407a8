"""The simulator's 1F1B task order is the order Megatron really ran, on every shared cluster run."""

import json
from collections import defaultdict

import pytest

from hops_calib.sim.schedules import COMPUTE, build_programs
from hops_calib.timeline import OPTIMIZER, PHASES


def compute_order_per_stage_iteration(run_dir):
    """{(iteration, stage): [(phase, microbatch), ...]} in start-time order, optimizer left out."""
    events = defaultdict(list)
    for path in sorted((run_dir / "megatron_trace").glob("rank*.jsonl")):
        with path.open() as lines:
            for line in lines:
                event = json.loads(line)
                if event["event_type"] == "compute" and event["phase"] != OPTIMIZER:
                    key = (event["iteration"], event["stage"])
                    events[key].append((event["start_wall_ns"], event["phase"], event["microbatch"]))
    return {key: [(phase, mb) for _, phase, mb in sorted(found)] for key, found in events.items()}


@pytest.mark.shared
def test_megatron_1f1b_order_matches_every_real_stage_and_iteration(shared_runs):
    runs = sorted(d for d in shared_runs.iterdir() if (d / "megatron_trace").is_dir())
    assert runs, f"no run directories under {shared_runs}"
    checked = 0
    for run in runs:
        real = compute_order_per_stage_iteration(run)
        stages = 1 + max(stage for _, stage in real)
        microbatches = 1 + max(mb for order in real.values() for phase, mb in order if phase == "FORWARD")
        programs = build_programs("1f1b", stages, 1, microbatches)
        simulated = [[(PHASES[op[1]], op[3]) for op in ops if op[0] == COMPUTE] for ops in programs.per_rank]
        for (iteration, stage), order in real.items():
            assert order == simulated[stage], f"{run.name}: iteration {iteration}, stage {stage}"
            checked += 1
    assert checked >= len(runs)
