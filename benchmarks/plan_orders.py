"""Benchmark: `plan --job` (without --parallel) on a 512-GPU job of 8 pipeline stages, whose 8 stage devices have
40,320 orders. Prints figures; asserts nothing.

    python benchmarks/plan_orders.py [--timeout S]

The job is README's GPU job-directory recipe (t 8 x p 8 x d 8 on 64 nodes of 8 A100s, built as written). Three
cases, each a fresh `python -m hops_calib plan --job DIR --json` process (start-up included):

1. as the recipe writes it: 8 A100s nothing tells apart (no host, no link benchmark: hops priced from torchrun's
   placement), so every order prices the same;
2. with a cluster file putting the 8 stage devices on 8 hosts in two racks of 4, links declared 200 Gbit/s within a
   rack and 100 across: a device is interchangeable with the others of its rack (70 orders of racks);
3. with a cluster file whose 28 host pairs each have their own rate: no two devices are interchangeable.

For each: wall time (or that it did not end within --timeout), the space, the distinct stage orders searched, the
launches priced, how it searched, and the best launch against the job's own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from job_copies import readme_gpu_job  # noqa: E402  (README's recipe, run as the tests run it)


def cluster_file(path: Path, rate) -> Path:
    """A cluster of 8 hosts, host k holding the stage map's device gpuk, each link declared at rate(i, j) Gbit/s."""
    lines = ["nodes:"]
    lines += [f"  - {{host: host{k}, devices: [{{id: gpu{k}, gpu: a100}}]}}" for k in range(8)]
    lines.append("links:")
    lines += [f"  - {{hosts: [host{i}, host{j}], latency_ms: 0.01, bandwidth_gbit_s: {rate(i, j)}}}"
              for i, j in itertools.permutations(range(8), 2)]
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(job: Path, timeout: float, *extra: str) -> tuple[float, dict | None]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("HOPS_CALIB_CLUSTER", None)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "hops_calib", "plan", "--job", str(job), "--json", *extra],
                              capture_output=True, text=True, env=env, cwd=job.parent, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, None
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"plan --job {job} {' '.join(extra)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one plan may take (default 900)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        job, _ = readme_gpu_job(scratch)
        racks = cluster_file(scratch / "racks.yaml", lambda i, j: 200 if i // 4 == j // 4 else 100)
        distinct = cluster_file(scratch / "distinct.yaml", lambda i, j: 50 + 5 * min(i, j) + max(i, j))
        for label, extra in (("8 alike A100s (the recipe)", ()),
                             ("8 hosts in two racks of 4 (cluster)", ("--cluster", str(racks))),
                             ("8 hosts, every link its own rate (cluster)", ("--cluster", str(distinct)))):
            seconds, out = plan(job, options.timeout, *extra)
            if out is None:
                print(f"{label}: did not end within {options.timeout:.0f} s")
                continue
            best, own = (out["best"] or [None])[0], out["current"]
            orders = out.get("orders", "?")
            print(f"{label}: {seconds:.1f} s wall; {out['space']:,} launches, {orders} distinct stage order(s); "
                  f"{out['evaluated']:,} priced; search {out['search']}")
            print("    best " + (f"{best['throughput_samples_per_s']:.2f} samples/s ({best['resolved_schedule']}, "
                                 f"micro batch {best['micro_batch_size']})" if best else "none")
                  + (f", the job's own {own['throughput_samples_per_s']:.2f}" if own else ", the job's own unpriced"))


if __name__ == "__main__":
    main()
