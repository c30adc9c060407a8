"""Benchmark: `hops-calib plan --job` on every job the README and docs/whatif.md plan, in a fresh process each.
Prints seconds (wall and CPU) per job and the machine's load; asserts nothing.

    python benchmarks/plan_speed.py

The jobs: the README's CPU capture (traces/cpu_1f1b_l4_h512_s256_m4_run1), and docs/whatif.md's recipes run as
written: the 512-A100 175B job (gpt175b) and the 16-A100 job (gpt16). Goal: <= 10 s each on this shared 2-core
machine; the load average says how shared it was.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def recipe(name: str, folder: Path) -> Path:
    """docs/whatif.md's shell block that makes job `name`, run in `folder`: the job directory."""
    text = (REPO / "docs" / "whatif.md").read_text(encoding="utf-8")
    start = text.index(f"mkdir -p {name} ")
    setup = text[start:text.index("```", start)].rpartition("cd .. && ")[0]
    subprocess.run(["bash", "-c", setup], cwd=folder, check=True)
    return folder / name


def timed(job: Path) -> tuple[float, float, str]:
    """(wall s, CPU s, the search line) of `hops-calib plan --job JOB` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hops_calib", "plan", "--job", str(job)], capture_output=True,
                          text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        sys.exit(f"plan --job {job} failed ({done.returncode}): {done.stderr}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    found = re.search(r"(\d[\d,]*) distinct launches priced of ([\d,]+) candidates", done.stdout)
    return wall, cpu, f"{found.group(1)} of {found.group(2)} launches priced" if found else ""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [REPO / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1", recipe("gpt175b", Path(tmp)),
                recipe("gpt16", Path(tmp))]
        for job in jobs:
            load = os.getloadavg()[0]
            wall, cpu, what = timed(job)
            print(f"plan --job {job.name}: {wall:.1f} s wall, {cpu:.1f} s CPU (load {load:.1f} before); {what}")


if __name__ == "__main__":
    main()
