"""Count retransmission-timeout stalls in the silent stretch of the TRAIN runs (evidence for candidate 014).

A stall is an iteration whose silent stretch (last backward -> first optimizer) exceeds the run's median by
more than score.STALL_EXCESS_MS (100 ms), the rule the stall-free error uses.
Usage: python experiments/scripts/tcp_stalls.py [FIXTURES]   (train split only)
"""

import sys
from collections import defaultdict

import numpy as np

from hops_calib.evaluate import open_store
from hops_calib.metrics import timeline_iteration_part_series
from hops_calib.score import STALL_EXCESS_MS

store = open_store(sys.argv[1] if len(sys.argv) > 1 else "fixtures")
by_ends: dict[str, list[int]] = defaultdict(lambda: [0, 0])
extra_ms: list[float] = []
for fixture_id in store.ids("train"):
    fixture = store.load(fixture_id)
    series = timeline_iteration_part_series(fixture.timeline())
    if series is None or not series.optimizer_traced.any():
        continue
    silent = series.silent_ms[series.optimizer_traced]
    median = float(np.median(silent))
    stalls = silent[silent > median + STALL_EXCESS_MS]
    ends = f"{fixture.spec.devices[0]}..{fixture.spec.devices[-1]}"
    by_ends[ends][0] += len(stalls)
    by_ends[ends][1] += len(silent)
    extra_ms += list(stalls - median)
for ends, (stalled, iterations) in sorted(by_ends.items()):
    print(f"{ends:12s} {stalled:3d} stalls in {iterations:4d} iterations = {stalled / iterations:.3f}")
a10g_free = [v for k, v in by_ends.items() if "a10g" not in k]
stalled = sum(v[0] for v in a10g_free)
iterations = sum(v[1] for v in a10g_free)
print(f"ends without an A10G: {stalled}/{iterations} = {stalled / iterations:.3f}; "
      f"mean stall {sum(extra_ms) / max(len(extra_ms), 1):.0f} ms over the median")
