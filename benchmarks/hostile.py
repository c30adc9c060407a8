"""Benchmark: ingest of hostile and unlucky input (issue #21) finishes in seconds with bounded memory.

    python benchmarks/hostile.py [--out TABLE.txt] [--small]

For each case of tests/hostile_cases.py (a shared run copied into a temporary folder and damaged, at the
issue's sizes: a 10 MB token, 200 MB lines; --small: the tests' sizes) beside an intact run, runs
`python -m hops_calib ingest SRC --fixtures FX` in a fresh process and prints its exit code, wall time and
peak RSS (that child's ru_maxrss, from wait4), and whether the intact run was ingested. Then the clashing
run id (a copy of one run claiming another's id, into a store holding both). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from hops_calib.shared import shared_runs_dir  # noqa: E402
from hostile_cases import CASES, DAMAGED, INTACT, build, copy_runs  # noqa: E402

TIMEOUT_S = 600


# A small interpreter starts the ingest and reports its rusage: a child forked straight from this process would
# count this process's own memory (the 200 MB lines it built) in its peak RSS.
_PROBE = ("import os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[2:]); "
          "deadline = t + float(sys.argv[1])\n"
          "while True:\n"
          "    pid, status, usage = os.wait4(p.pid, os.WNOHANG)\n"
          "    if pid: break\n"
          "    if time.perf_counter() > deadline: p.kill(); pid, status, usage = os.wait4(p.pid, 0); break\n"
          "    time.sleep(0.01)\n"
          "print(time.perf_counter() - t, usage.ru_maxrss, os.waitstatus_to_exitcode(status), file=sys.__stdout__)")


def run_ingest(args: list[str]) -> tuple[int | str, float, float, str]:
    """(exit code, or 'killed' past TIMEOUT_S; wall s; peak RSS MB; stderr) of `python -m hops_calib ingest ARGS`."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HOPS_CALIB_PROGRESS="")
    done = subprocess.run([sys.executable, "-c", _PROBE, str(TIMEOUT_S), sys.executable, "-m", "hops_calib",
                           "ingest", *args], capture_output=True, text=True, env=env)
    wall, rss_kb, code = done.stdout.split()[-3:]
    return (int(code) if float(wall) <= TIMEOUT_S else "killed"), float(wall), int(rss_kb) / 1024, done.stderr


def ingested(store: Path) -> set[str]:
    return {p.name for p in store.iterdir() if (p / "fixture.json").is_file()} if store.is_dir() else set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--small", action="store_true", help="the tests' sizes instead of the issue's")
    options = parser.parse_args()
    shared = shared_runs_dir()
    if not (shared / DAMAGED).is_dir():
        sys.exit(f"needs the shared runs at {shared}")
    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            source = build(case, shared, Path(tmp), large=not options.small)
            store = Path(tmp) / "fixtures"
            code, wall, rss, message = run_ingest([str(source), "--fixtures", str(store)]
                                                  + (["--lenient"] if case.lenient else []))
            rows.append((case.name, code, wall, rss, INTACT in ingested(store), message))
        print(f"{case.name:42s} exit {code!s:>6}  {wall:6.2f} s  {rss:7.1f} MB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # a clashing run id, into a store that holds both runs
        source = copy_runs(shared, Path(tmp) / "src")
        store = Path(tmp) / "fixtures"
        run_ingest([str(source), "--fixtures", str(store)])
        other = Path(tmp) / "c" / "other"
        shutil.copytree(source / DAMAGED, other)
        with (other / "manifest.yaml").open("a") as manifest:
            manifest.write(f"run_id: {INTACT}\n")
        code, wall, rss, message = run_ingest([str(other.parent), "--fixtures", str(store)])
        rows.append(("clashing run id (another job's)", code, wall, rss, INTACT in ingested(store), message))
        print(f"{rows[-1][0]:42s} exit {code!s:>6}  {wall:6.2f} s  {rss:7.1f} MB", flush=True)
    header = f"{'case':42s}  {'exit':>4}  {'time s':>7}  {'peak RSS MB':>11}  intact run ingested"
    lines = [header, "-" * len(header)]
    lines += [f"{name:42s}  {code!s:>4}  {wall:7.2f}  {rss:11.1f}  {'yes' if ok else 'NO'}"
              for name, code, wall, rss, ok, _ in rows]
    worst_time = max(rows, key=lambda row: row[2])
    worst_rss = max(rows, key=lambda row: row[3])
    lines.append(f"worst time: {worst_time[2]:.2f} s ({worst_time[0]}); worst peak RSS: {worst_rss[3]:.1f} MB "
                 f"({worst_rss[0]}); sizes of {'the tests' if options.small else 'issue #21'}")
    table = "\n".join(lines)
    print()
    print(table)
    if options.out:
        options.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
