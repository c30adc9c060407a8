"""Benchmark: the iteration-level speed targets on the published vTrain table. Prints figures; asserts nothing.

    python benchmarks/iteration_level.py [--table ../shared/public-runs/vtrain/ground_truth_single.csv] [--repeats 3]

Prints the wall time of whole commands, start-up included (the figures the targets are about):
- `python -m hops_calib ingest TABLE --fixtures NEW` of the 1,440-row table into a new store (target <= 3 s),
  and again into the same store (every run unchanged);
- `python -m hops_calib evaluate --fixtures STORE --json` on its priced train runs (target <= 2 s), with the
  count scored and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hops_calib", *args], capture_output=True, text=True, env=env,
                          cwd=REPO)
    return time.perf_counter() - start, done


def main() -> None:
    from hops_calib.shared import shared_root

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path,
                        default=shared_root() / "public-runs" / "vtrain" / "ground_truth_single.csv")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    if not options.table.is_file():
        sys.exit(f"no table at {options.table} (the vTrain set lives in ../shared/public-runs/vtrain/)")
    with tempfile.TemporaryDirectory() as tmp:
        fresh, again = [], []
        for k in range(options.repeats):
            store = Path(tmp) / f"fx{k}"
            seconds, done = timed("ingest", str(options.table), "--fixtures", str(store))
            if done.returncode not in (0, 1):
                sys.exit(f"ingest failed ({done.returncode}): {done.stderr[-2000:]}")
            fresh.append(seconds)
            again.append(timed("ingest", str(options.table), "--fixtures", str(store))[0])
        print(f"ingest of {options.table.name} into a new store: median {statistics.median(fresh):.2f} s "
              f"(runs: {', '.join(f'{s:.2f}' for s in fresh)}; target <= 3 s)")
        print(f"ingest again, every run unchanged: median {statistics.median(again):.2f} s")
        print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")
        times = []
        for _ in range(options.repeats):
            seconds, done = timed("evaluate", "--fixtures", str(Path(tmp) / "fx0"), "--json")
            if done.returncode != 0:
                sys.exit(f"evaluate failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
            times.append(seconds)
        data = json.loads(done.stdout)
        left = data.get("left_out", {})
        print(f"evaluate --json on the priced train runs: median {statistics.median(times):.2f} s "
              f"(runs: {', '.join(f'{s:.2f}' for s in times)}; target <= 2 s); scored {data['n_fixtures']}, "
              f"left out {left.get('count', 0)}")


if __name__ == "__main__":
    main()
