"""Benchmark: the planners' speed, and the job planner's ranking against reality. Prints figures; asserts nothing.

    python benchmarks/plan.py [--runs DIR]

1. The abstract planner on the issue's large case, `hops-calib plan --stages 64 --microbatches 1024 --chunks 4
   --weight-grad-cost 1 --memory-budget 64`: wall time and peak memory of a fresh process (target <= 2 s; it took
   8.3 s and 800 MB when every candidate was simulated).
2. `hops-calib plan --job DIR --cluster FILE` on shared runs (a 4- and a 6-stage pipeline; the cluster built from
   every run first): wall time, the space, and how it was searched.
3. Against reality: for every group of shared train runs with the same devices, model and global batch that differ
   only in what the planner searches, the pairwise agreement of its ranking with the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def fresh(*args: str) -> tuple[float, float, str]:
    """(wall seconds, peak resident MB, stdout) of one `python -m hops_calib ARGS` process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hops_calib", *args], capture_output=True, text=True, env=env,
                          cwd=REPO)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"hops-calib {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child so far
    return elapsed, peak_mb, done.stdout


def main() -> None:
    from hops_calib.shared import shared_runs_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=shared_runs_dir())
    options = parser.parse_args()

    seconds, peak_mb, out = fresh("plan", "--stages", "64", "--microbatches", "1024", "--chunks", "4",
                                  "--weight-grad-cost", "1", "--memory-budget", "64", "--json")
    chosen = json.loads(out)["chosen"]
    print(f"abstract plan, 64 stages x 1024 microbatches x 4 chunks: {seconds:.2f} s wall, {peak_mb:.0f} MB peak "
          f"(fresh process, start-up included); chose {chosen['schedule']} at bubble {chosen['bubble']:.4f}")

    if not options.runs.is_dir():
        print(f"no shared runs at {options.runs}: job planner figures skipped")
        return
    with tempfile.TemporaryDirectory() as scratch:
        cluster = Path(scratch) / "cluster.yaml"
        seconds, _, _ = fresh("cluster", str(options.runs), "--out", str(cluster))
        print(f"cluster of {options.runs}: built in {seconds:.2f} s")
        for run in ("exp2_9_g_only_pp4_run65", "exp2_1_all_nodes_run51"):
            seconds, _, out = fresh("plan", "--job", str(options.runs / run), "--cluster", str(cluster), "--json")
            plan = json.loads(out)
            best = plan["best"][0] if plan["best"] else None
            print(f"plan --job {run}: {seconds:.2f} s wall; {plan['space']} candidates, {plan['search']}; best "
                  + (f"{best['throughput_samples_per_s']:.2f} samples/s ({best['resolved_schedule']}) against the "
                     f"job's own {plan['current']['throughput_samples_per_s']:.2f}" if best else "none fits"))

    from hops_calib.whatif.job_plan import train_group_agreement
    from hops_calib.loop.model_files import load_model
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    with tempfile.TemporaryDirectory() as scratch:
        store = FixtureStore(Path(scratch) / "fixtures")
        ingest([options.runs], store)
        groups = train_group_agreement(store, options.runs, load_model())
    for group in groups:
        print(f"{group.key}: {group.agreeing} of {group.pairs} pairs ranked as measured")
        for runs, predicted, measured in group.configurations:
            print(f"    predicted {predicted:7.3f}  measured {measured:7.3f} samples/s  {runs}")
    agree, pairs = sum(g.agreeing for g in groups), sum(g.pairs for g in groups)
    print(f"pairwise ranking agreement on train groups: {agree} of {pairs} ({100 * agree / max(pairs, 1):.0f} %)")


if __name__ == "__main__":
    main()
