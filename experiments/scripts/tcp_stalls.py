"""Count retransmission-timeout stalls in the silent stretch of the TRAIN runs (evidence for candidate 014).

A stall is an iteration whose silent stretch (last backward -> first optimizer) exceeds the run's median by
more than score.STALL_EXCESS_MS (100 ms), the rule the stall-free error uses. Also printed: the stall rate by
hidden size on the ends without an A10G (does a bigger all-reduce stall more often?) and the least-squares line
of a stall's excess over its run's median silent stretch (does a stall cost less when the transfer is longer?).
Usage: python experiments/scripts/tcp_stalls.py [FIXTURES]   (train split only)
"""

import sys
from collections import defaultdict

import numpy as np

from hops_calib.loop.score import STALL_EXCESS_MS
from hops_calib.loop.suite import open_store
from hops_calib.metrics import timeline_iteration_part_series

store = open_store(sys.argv[1] if len(sys.argv) > 1 else "fixtures")
by_ends: dict[str, list[int]] = defaultdict(lambda: [0, 0])
by_hidden: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # ends without an A10G
extra_ms: list[float] = []
stretch_ms: list[float] = []  # each stall's run's median silent stretch
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
    if "a10g" not in ends:
        by_hidden[fixture.spec.model.hidden_size][0] += len(stalls)
        by_hidden[fixture.spec.model.hidden_size][1] += len(silent)
    extra_ms += list(stalls - median)
    stretch_ms += [median] * len(stalls)
for ends, (stalled, iterations) in sorted(by_ends.items()):
    print(f"{ends:12s} {stalled:3d} stalls in {iterations:4d} iterations = {stalled / iterations:.3f}")
a10g_free = [v for k, v in by_ends.items() if "a10g" not in k]
stalled = sum(v[0] for v in a10g_free)
iterations = sum(v[1] for v in a10g_free)
print(f"ends without an A10G: {stalled}/{iterations} = {stalled / iterations:.3f}; "
      f"mean stall {sum(extra_ms) / max(len(extra_ms), 1):.0f} ms over the median")
pooled = stalled / iterations
for hidden, (k, n) in sorted(by_hidden.items()):
    print(f"hidden {hidden:5d}: {k:3d} stalls in {n:4d} iterations = {k / n:.3f} (pooled rate expects {pooled * n:.1f})")
slope, intercept = np.polyfit(stretch_ms, extra_ms, 1)
print(f"a stall's excess = {intercept:.0f} ms {slope:+.2f} x its run's median silent stretch "
      f"(r = {np.corrcoef(stretch_ms, extra_ms)[0, 1]:.2f}, {len(extra_ms)} stalls)")
