"""Simulator speed: ms per simulate() call and tasks per second (prints figures; asserts nothing).

    python benchmarks/sim.py [--repeats N]

The reference case is the issue's: 6 stages, 24 microbatches, 18 iterations of 1F1B
(heterogeneous costs, transfers, optimizer and out-of-pipeline work, blocking p2p).
Three paths are timed: simulate() alone (what a calibration trial pays before metrics),
simulate() + metrics on the columns (what it pays in all), and simulate() + building the
timeline DataFrame + metrics on the frame (what plotting or reporting pays).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmark this checkout, not an installed copy

from hops_calib.metrics import timeline_metrics  # noqa: E402
from hops_calib.sim import Pipeline, StageCosts, simulate  # noqa: E402
from hops_calib.sim.schedules import build_programs  # noqa: E402


def reference_pipeline(ranks: int = 6, microbatches: int = 24, iterations: int = 18, chunks: int = 1,
                       blocking: bool = True) -> Pipeline:
    virtual = ranks * chunks
    stages = tuple(StageCosts((3.0 + 0.7 * (k % 3)) / chunks, (6.5 + 1.1 * (k % 2)) / chunks, 2.0 / chunks)
                   for k in range(virtual))
    return Pipeline(
        stages=stages, microbatches=microbatches, chunks=chunks, iterations=iterations,
        forward_transfer_ms=(0.8,) * (virtual - 1), backward_transfer_ms=(0.9,) * (virtual - 1),
        optimizer_ms=tuple(4.0 + r for r in range(ranks)), pre_optimizer_ms=120.0, post_optimizer_ms=3.0,
        blocking_p2p=blocking,
    )


def time_ms(call, repeats: int) -> float:
    """Median wall time of `call` in ms (after one warm-up call)."""
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    cases = [
        ("1f1b 6x24x18 blocking", "1f1b", reference_pipeline()),
        ("1f1b 6x24x18 fire-and-forget", "1f1b", reference_pipeline(blocking=False)),
        ("zb_h1 6x24x18", "zb_h1", reference_pipeline()),
        ("gpipe 6x24x18", "gpipe", reference_pipeline()),
        ("interleaved v=2 6x24x18", "interleaved_1f1b", reference_pipeline(chunks=2)),
    ]
    print(f"{'case':<30}{'tasks':>7}{'sim ms':>9}{'tasks/s':>12}{'+metrics':>10}{'every it.':>11}"
          f"{'engine tasks/s':>16}{'+frame':>9}")
    for label, schedule, pipeline in cases:
        result = simulate(pipeline, schedule)
        sim = time_ms(lambda: simulate(pipeline, schedule), args.repeats)
        with_metrics = time_ms(lambda: simulate(pipeline, schedule).metrics(), args.repeats)
        every_iteration = time_ms(lambda: simulate(pipeline, schedule, replicate=False), max(5, args.repeats // 5))
        with_frame = time_ms(lambda: timeline_metrics(simulate(pipeline, schedule).timeline, pipeline.microbatches,
                                                      pipeline.ranks), max(5, args.repeats // 5))
        print(f"{label:<30}{result.tasks:>7}{sim:>9.2f}{result.tasks / sim * 1e3:>12,.0f}{with_metrics:>10.2f}"
              f"{every_iteration:>11.2f}{result.tasks / every_iteration * 1e3:>16,.0f}{with_frame:>9.2f}")
    print("sim ms = simulate() (iterations 1-2 timed, the rest copied); tasks/s = compute tasks in the timeline per "
          "second of that; +metrics = simulate().metrics(); every it. = simulate(replicate=False), the engine timing "
          "all iterations, and engine tasks/s its rate; +frame = timeline DataFrame + timeline_metrics. Medians, ms.")
    print(f"program cache: {build_programs.cache_info()}")


if __name__ == "__main__":
    main()
