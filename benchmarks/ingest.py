"""Benchmark: ingest speed on the 56 shared runs, and peak memory on a ~2 GB trace. Prints figures; asserts nothing.

    python benchmarks/ingest.py [--size-gb 2.0] [--skip-big]

1. Wall time of `hops-calib ingest <shared runs> --fixtures <tmp>` in a fresh
   interpreter (start-up included), then of the unchanged re-ingest.
2. A ~2 GB job directory built in a temporary folder by repeating the iterations
   of one real run (shifted in time and iteration number); wall time and peak
   RSS of ingesting it (the child's ru_maxrss).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hops_calib.shared import shared_runs_dir  # noqa: E402


def run_cli(args: list[str]) -> tuple[float, float, int, str]:
    """(wall s, CPU s, peak RSS MB, stdout) of `python -m hops_calib ARGS` in a fresh process."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "dt = time.perf_counter() - t; u = resource.getrusage(resource.RUSAGE_CHILDREN); "
             "print(dt, u.ru_utime + u.ru_stime, u.ru_maxrss, p.returncode); "
             "print(p.stdout, end=''); sys.stderr.write(p.stderr)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "hops_calib", *args],
                          capture_output=True, text=True, env=env, check=True)
    head, _, out = done.stdout.partition("\n")
    seconds, cpu, rss_kb, code = head.split()
    if int(code) != 0:
        raise SystemExit(f"hops-calib {' '.join(args)} exited {code}:\n{done.stderr[-2000:]}")
    return float(seconds), float(cpu), int(rss_kb) // 1024, out


def build_big_run(source: Path, target: Path, size_gb: float) -> tuple[int, int]:
    """Copy `source` to `target` and repeat its iterations until the rank logs hold ~size_gb. Returns (events, bytes)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("megatron_trace"))
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    trace_in, trace_out = source / "megatron_trace", target / "megatron_trace"
    trace_out.mkdir()
    logs = sorted(trace_in.glob("rank*.jsonl"))
    events = {p.name: [orjson.loads(line) for line in p.read_bytes().splitlines() if line.strip()] for p in logs}
    all_events = [e for rank in events.values() for e in rank]
    first_it = min(e["iteration"] for e in all_events)
    n_iter = max(e["iteration"] for e in all_events) - first_it + 1
    span_ns = max(e["end_wall_ns"] for e in all_events) - min(e["start_wall_ns"] for e in all_events)
    period_ns = span_ns + span_ns // n_iter  # one more iteration's worth of gap between repeats

    def repetition(rank_events: list[dict], k: int) -> bytes:
        shift = k * period_ns
        lines = []
        for event in rank_events:
            event = dict(event)
            event["iteration"] += k * n_iter
            event["start_wall_ns"] += shift
            event["end_wall_ns"] += shift
            lines.append(orjson.dumps(event))
        return b"\n".join(lines) + b"\n"

    bytes_per_repeat = sum(len(repetition(rank_events, 0)) for rank_events in events.values())
    repeats = max(1, round(size_gb * 1e9 / bytes_per_repeat))
    written = 0
    for name, rank_events in events.items():
        with (trace_out / name).open("wb") as out:
            for k in range(repeats):
                data = repetition(rank_events, k)
                out.write(data)
                written += len(data)
    args = target / "megatron_args.txt"
    text = args.read_text()
    train_iters = int(re.search(r"--train-iters (\d+)", text).group(1))
    args.write_text(text.replace(f"--train-iters {train_iters}", f"--train-iters {train_iters + (repeats - 1) * n_iter}"))
    return len(all_events) * repeats, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--skip-big", action="store_true")
    options = parser.parse_args()
    runs = shared_runs_dir()
    if not runs.is_dir():
        raise SystemExit(f"shared runs not found at {runs}; set HOPS_CALIB_SHARED")
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f} "
          "(other work on the machine inflates wall times; CPU time is the steadier figure)")
    with tempfile.TemporaryDirectory(prefix="hops-bench-") as tmp:
        tmp_path = Path(tmp)
        n_runs = sum(1 for p in runs.iterdir() if p.is_dir())
        size_mb = sum(p.stat().st_size for p in runs.rglob("rank*.jsonl")) / 1e6
        store = tmp_path / "fixtures"
        seconds, cpu, rss, out = run_cli(["ingest", str(runs), "--fixtures", str(store)])
        print(f"ingest {n_runs} shared runs ({size_mb:.1f} MB of rank logs): {seconds:.2f} s wall, {cpu:.2f} s CPU, "
              f"peak RSS {rss} MB  [{out.strip()}]")
        seconds, cpu, rss, out = run_cli(["ingest", str(runs), "--fixtures", str(store)])
        print(f"re-ingest, unchanged: {seconds:.2f} s wall, {cpu:.2f} s CPU, peak RSS {rss} MB")
        seconds, cpu, _, _ = run_cli(["fixtures", "list", "--fixtures", str(store), "--json"])
        print(f"fixtures list --json: {seconds:.2f} s wall, {cpu:.2f} s CPU")
        load = ("import time; t = time.perf_counter(); from hops_calib.store import FixtureStore; "
                f"s = FixtureStore({str(store)!r}); fx = s.load_all(); "
                "print(len(fx), time.perf_counter() - t)")
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        count, inner = done.stdout.split()
        print(f"load all {count} fixtures (spec + truth): {float(inner):.2f} s in-process incl. imports, "
              f"{time.perf_counter() - t:.2f} s wall incl. interpreter start")
        if options.skip_big:
            return
        source = max((p for p in runs.iterdir() if p.is_dir()),
                     key=lambda p: sum(f.stat().st_size for f in (p / "megatron_trace").iterdir()))
        big = tmp_path / "big" / f"{source.name}_x"
        t = time.perf_counter()
        n_events, n_bytes = build_big_run(source, big, options.size_gb)
        print(f"built {n_bytes / 1e9:.2f} GB trace ({n_events / 1e6:.1f} M events) from {source.name} "
              f"in {time.perf_counter() - t:.0f} s")
        seconds, cpu, rss, out = run_cli(["ingest", str(big), "--fixtures", str(tmp_path / "big-fixtures")])
        print(f"ingest {n_bytes / 1e9:.2f} GB trace: {seconds:.1f} s wall, {cpu:.1f} s CPU, peak RSS {rss} MB  "
              f"[{out.strip()}]")


if __name__ == "__main__":
    main()
