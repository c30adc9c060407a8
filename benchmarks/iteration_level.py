"""Benchmark: the iteration-level speed targets on the published vTrain table. Prints figures; asserts nothing.

    python benchmarks/iteration_level.py [--table ../shared/public-runs/vtrain/ground_truth_single.csv] [--repeats 3]

Prints the wall time of whole commands, start-up included (the figures the targets are about), their CPU time
(user + system: what they cost when the 2 shared cores are busy with others) and the load average:
- `python -m hops_calib ingest TABLE --fixtures NEW` of the 1,440-row table into a new store (target <= 3 s),
  and again into the same store (every run unchanged);
- `python -m hops_calib evaluate --fixtures STORE --json` on its priced train runs (target <= 2 s), with the
  count scored and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


CPU: list[float] = []  # CPU seconds of each `timed` command, in order


def timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of one `python -m hops_calib ARGS` process (its CPU seconds appended to CPU)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hops_calib", *args], capture_output=True, text=True, env=env,
                          cwd=REPO)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return elapsed, done


def _figures(seconds: list[float], cpu: list[float]) -> str:
    return (f"median {statistics.median(seconds):.2f} s wall, {statistics.median(cpu):.2f} s CPU (runs: "
            f"{', '.join(f'{s:.2f}' for s in seconds)})")


def main() -> None:
    from hops_calib.shared import shared_root

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path,
                        default=shared_root() / "public-runs" / "vtrain" / "ground_truth_single.csv")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    if not options.table.is_file():
        sys.exit(f"no table at {options.table} (the vTrain set lives in ../shared/public-runs/vtrain/)")
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        fresh, again, fresh_cpu, again_cpu = [], [], [], []
        for k in range(options.repeats):
            store = Path(tmp) / f"fx{k}"
            seconds, done = timed("ingest", str(options.table), "--fixtures", str(store))
            if done.returncode not in (0, 1):
                sys.exit(f"ingest failed ({done.returncode}): {done.stderr[-2000:]}")
            fresh.append(seconds)
            fresh_cpu.append(CPU[-1])
            again.append(timed("ingest", str(options.table), "--fixtures", str(store))[0])
            again_cpu.append(CPU[-1])
        print(f"ingest of {options.table.name} into a new store: {_figures(fresh, fresh_cpu)}; target <= 3 s")
        print(f"ingest again, every run unchanged: {_figures(again, again_cpu)}")
        print(done.stdout.strip().splitlines()[0] if done.stdout.strip() else "")  # the counts line
        times, cpu = [], []
        for _ in range(options.repeats):
            seconds, done = timed("evaluate", "--fixtures", str(Path(tmp) / "fx0"), "--json")
            if done.returncode != 0:
                sys.exit(f"evaluate failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
            times.append(seconds)
            cpu.append(CPU[-1])
        data = json.loads(done.stdout)
        left = data.get("left_out", {})
        print(f"evaluate --json on the priced train runs: {_figures(times, cpu)}; target <= 2 s; scored "
              f"{data['n_fixtures']}, left out {left.get('count', 0)}")
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} after")


if __name__ == "__main__":
    main()
