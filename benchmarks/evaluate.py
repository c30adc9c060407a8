"""Benchmark: `hops-calib evaluate --json` on the shared runs, start-up included. Prints figures; asserts nothing.

    python benchmarks/evaluate.py [--fixtures DIR] [--repeats 5]

Without --fixtures the 56 shared runs are ingested into a temporary store first.
Reports the wall time (median of --repeats fresh processes) of `python -m
hops_calib --help` (target: at most 0.15 s) and of `python -m hops_calib
evaluate --fixtures DIR --json` on the 36 train runs (target: at most 0.4 s, the
figures of issue #17 on the 2-core development machine), the top entries of
`python -X importtime` for both (cumulative import time, median of three), the
evaluate time with `--run-error stall-free` (which reads every run's events),
and where the time goes inside one process: imports, loading the train fixtures
(spec and truth summary only, no events), building pipelines, simulating and
measuring. For comparison, the published HOPS simulator needs about 0.5 s per run.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def fresh(*args: str, python: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds user + system, stderr) of one `python [python] -m hops_calib ARGS` process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *python, "-m", "hops_calib", *args], capture_output=True, text=True,
                          env=env, cwd=REPO)
    elapsed = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"hops-calib {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return elapsed, cpu, done.stderr


def fresh_evaluate(fixtures: Path, *extra: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one `python -m hops_calib evaluate --json` process."""
    return fresh("evaluate", "--fixtures", str(fixtures), "--json", *extra)[:2]


def importtime_top(*args: str, top: int = 12, runs: int = 3) -> None:
    """Print the `top` modules by cumulative import time (median of `runs` processes), nested as imported."""
    line = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)")
    seen: dict[str, list[int]] = {}
    depth: dict[str, int] = {}
    for _ in range(runs):
        for found in filter(None, map(line.match, fresh(*args, python=("-X", "importtime"))[2].splitlines())):
            seen.setdefault(found[3], []).append(int(found[1]))
            depth[found[3]] = len(found[2]) // 2
    medians = {name: statistics.median(us) for name, us in seen.items()}
    total = sum(us for name, us in medians.items() if depth[name] == 0)
    print(f"python -X importtime -m hops_calib {' '.join(args)}: imports {total / 1e3:.0f} ms in all; "
          f"top {top} by cumulative ms:")
    for name in sorted(medians, key=medians.get, reverse=True)[:top]:
        print(f"  {medians[name] / 1e3:7.1f}  {'  ' * depth[name]}{name}")


def breakdown(fixtures: Path) -> None:
    start = time.perf_counter()
    from hops_calib.loop.suite import load_suite
    from hops_calib.loop.model_files import load_model
    from hops_calib.sim import simulate
    imported = time.perf_counter()
    suite = load_suite(fixtures, "train")
    model = load_model()
    loaded = time.perf_counter()
    pipelines = [model.pipeline(spec) for spec in suite.specs]
    built = time.perf_counter()
    results = [simulate(p, spec.schedule) for p, spec in zip(pipelines, suite.specs)]
    simulated = time.perf_counter()
    for result in results:
        result.metrics()
    measured = time.perf_counter()
    n = len(suite.ids)
    print(f"in one process, {n} train fixtures:")
    for label, seconds in (("imports (numpy, store, sim, model)", imported - start),
                           ("load specs + truth summaries", loaded - imported),
                           ("model.pipeline for every spec", built - loaded),
                           ("simulate", simulated - built),
                           ("timeline + metrics", measured - simulated)):
        print(f"  {label:44} {seconds * 1e3:8.1f} ms")
    per_run = (measured - loaded) / n
    print(f"  predict + measure per run                    {per_run * 1e3:8.2f} ms  (HOPS: about 500 ms per run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, help="an existing fixture store (default: ingest the shared runs)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = args.fixtures
        if fixtures is None:
            from hops_calib.shared import shared_runs_dir
            from hops_calib.store import FixtureStore
            from hops_calib.store.ingest import ingest

            fixtures = Path(tmp) / "fixtures"
            report = ingest([shared_runs_dir()], FixtureStore(fixtures), split="auto")
            if not report.ok:
                sys.exit("ingest of the shared runs failed")
        fresh_evaluate(fixtures)  # warm the page cache once
        helps = [fresh("--help")[0] for _ in range(args.repeats)]
        print(f"hops-calib --help, fresh interpreter, {args.repeats} runs: wall median {statistics.median(helps):.3f} s "
              f"(min {min(helps):.3f}, max {max(helps):.3f}; target <= 0.15 s)")
        runs = [fresh_evaluate(fixtures) for _ in range(args.repeats)]
        times, cpu = [wall for wall, _ in runs], [c for _, c in runs]
        print(f"hops-calib evaluate --fixtures {fixtures} --json, fresh interpreter, {args.repeats} runs "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
        print(f"  wall min {min(times):.3f} s, median {statistics.median(times):.3f} s, max {max(times):.3f} s "
              f"(target <= 0.4 s on the 36 train runs of the shared store)")
        print(f"  CPU (user + system) median {statistics.median(cpu):.3f} s (about the wall time on an idle machine)")
        free = [fresh_evaluate(fixtures, "--run-error", "stall-free")[0] for _ in range(args.repeats)]
        print(f"  with --run-error stall-free (every run's events read for its stalls): wall median "
              f"{statistics.median(free):.3f} s")
        importtime_top("--help")
        importtime_top("evaluate", "--fixtures", str(fixtures), "--json")
        breakdown(fixtures)


if __name__ == "__main__":
    main()
