"""Benchmark: PyTorch profiler (Kineto) trace reading speed (MB/s) and peak memory on a ~1 GB GENERATED trace.
Prints figures; asserts nothing; the big file lives in a temporary folder and is removed.

    python benchmarks/kineto_ingest.py [--size-gb 1.0] [--gzip]

The trace is one rank of a GENERATED GPU 1F1B run (tests/profiler_synth.py: Kineto's layout with Megatron's
schedule steps, a CPU operator, a runtime launch and a kernel per GEMM, NCCL sends, optimizer kernels), grown to
the size asked by more iterations and kernels per step. A fresh interpreter reads it (`read_kineto`) and maps it to
events and kernel rows (`assemble`), as ingest does for each rank; its wall time and peak RSS (ru_maxrss) are
printed, with the uncompressed bytes per second.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from profiler_synth import pipeline_run, write_kineto  # noqa: E402

_CHILD = """
import sys, time, resource
from pathlib import Path
from hops_calib.trace.kineto import read_kineto
from hops_calib.trace.profile import assemble
t = time.perf_counter()
profile = read_kineto(Path(sys.argv[1]))
read = time.perf_counter() - t
columns, report, kernels = assemble(profile, rank=0, stage=0, pp=2, vp=1, microbatches=int(sys.argv[2]))
total = time.perf_counter() - t
print(read, total, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(columns["start_ns"]),
      len(kernels.duration_ns))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="uncompressed size of the trace")
    parser.add_argument("--gzip", action="store_true", help="write it gzipped (.json.gz), as Megatron's handler does")
    options = parser.parse_args()
    microbatches, repeat = 8, 100  # 400 kernels per step, 16 steps per iteration and rank
    bytes_per_iteration = 5.1e6  # of one rank at these settings (measured: 804 MB for 157 iterations)
    iterations = max(2, int(options.size_gb * 1e9 / bytes_per_iteration))
    with tempfile.TemporaryDirectory(prefix="hops-kineto-bench-") as folder:
        path = Path(folder) / ("rank-0.json.gz" if options.gzip else "rank-0.json")
        started = time.perf_counter()
        run = pipeline_run(pp=2, microbatches=microbatches, iterations=iterations)[0]
        raw = write_kineto(path, run, repeat=repeat)
        print(f"generated {raw / 1e6:.0f} MB of Kineto JSON ({path.stat().st_size / 1e6:.0f} MB on disk), "
              f"{iterations} iterations, in {time.perf_counter() - started:.0f} s")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(microbatches)], env=env,
                              capture_output=True, text=True, check=True)
        read_s, total_s, peak_kb, events, kernels = done.stdout.split()
        print(f"read_kineto {float(read_s):.1f} s ({raw / 1e6 / float(read_s):.1f} MB/s uncompressed), with assemble "
              f"{float(total_s):.1f} s ({raw / 1e6 / float(total_s):.1f} MB/s); peak RSS {int(peak_kb) / 1024:.0f} MB; "
              f"{events} events, {kernels} kernel rows")
        print(f"(python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}, "
              f"ru_maxrss of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")


if __name__ == "__main__":
    main()
