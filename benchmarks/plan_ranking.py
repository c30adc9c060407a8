"""Benchmark: does the planner rank launches as they measured? Prints figures; asserts nothing.

    python benchmarks/plan_ranking.py [--fixtures DIR]

On a store of public sweeps of one model over t, p, d and micro batch (the vTrain A100 runs, ingested with
`hops-calib ingest ../shared/public-runs/vtrain/ground_truth_single.csv --fixtures /tmp/vtrain --split auto`), only
its TRAIN split: runs are grouped by model and job (GPUs, global batch, hidden size, heads, layers, sequence
length), so within a group they differ only in the levers the planner moves; each run's launch is priced as
the planner prices it (`predict`, which `JobPlanner.evaluate` equals on a job's own launch:
tests/whatif/test_job_plan.py) and the group's predicted order of throughput is compared with the measured one by
Spearman's rank correlation. Goal: >= 0.9 per group.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path("/tmp/vtrain"),
                        help="the ingested vTrain store (its train split is read)")
    options = parser.parse_args()
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.score import spearman_rho
    from hops_calib.loop.suite import load_suite
    from hops_calib.model.predict import predict

    start = time.perf_counter()
    suite = load_suite(options.fixtures, "train")
    model = load_model()
    groups: dict[tuple, list[tuple[str, float, float]]] = {}
    for run_id, spec, truth in zip(suite.ids, suite.specs, suite.truths):
        shape = spec.model
        key = (spec.gpus, shape.global_batch_size, shape.hidden_size, shape.num_attention_heads, shape.num_layers,
               shape.seq_length)
        predicted = predict(spec, model).metrics.iteration_time_ms
        # one group runs the same samples per iteration: throughput is the inverse of the iteration time
        groups.setdefault(key, []).append((run_id, 1.0 / truth.iteration_time_ms, 1.0 / predicted))
    print(f"store {options.fixtures} (train split, {len(suite.ids)} runs), model {model.name}: "
          f"{len(groups)} groups of one model and job")
    print(f"{'GPUs':>4} {'batch':>5} {'h':>5} {'heads':>5} {'layers':>6} {'s':>5} {'runs':>4} {'spearman':>8}")
    rhos = []
    for key in sorted(groups):
        runs = groups[key]
        if len(runs) < 3:
            continue
        rho = spearman_rho([r[1] for r in runs], [r[2] for r in runs])
        rhos.append(rho)
        print(f"{key[0]:>4} {key[1]:>5} {key[2]:>5} {key[3]:>5} {key[4]:>6} {key[5]:>5} {len(runs):>4} {rho:8.3f}")
    print(f"Spearman per group: mean {statistics.mean(rhos):.3f}, median {statistics.median(rhos):.3f}, min "
          f"{min(rhos):.3f}; {sum(r >= 0.9 for r in rhos)} of {len(rhos)} groups >= 0.9 "
          f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
