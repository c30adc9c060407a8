"""A user's own training script for Megatron-core on CPU ranks (gloo), traced by the hops-calib plugin: nothing of
Megatron is changed, the script only calls `plugin.install(JOB)` before its traced block.

    python tests/plugin_run.py JOB_DIR [ITERATIONS]

Each rank first runs ITERATIONS iterations untraced (the schedule Megatron returns before the plugin is
installed), then installs the plugin and runs ITERATIONS traced ones (iterations 1-2 are warm-up, logged from 3
as the fork does), timing every iteration with perf_counter: the medians of iterations 3.. of both blocks give the
plugin's overhead, written to JOB_DIR/overhead.rank<r>.json. Rank 0 then writes the job's remaining files
(megatron_args.txt, hops.base.yaml, manifest.yaml) and the gloo link benchmark the ranks ran after the traced
block (calibration/link_bench/, as `hops-calib capture` writes it), so that `hops-calib ingest JOB_DIR` reads it
and `hops-calib evaluate` prices its hops.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hops_calib.capture.config import CaptureConfig  # noqa: E402

CONFIG = CaptureConfig(pp=2, microbatches=4, iterations=4, layers=2, hidden=128, heads=4, seq=64, vocab=1024,
                       link_bench=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(rank: int, port: int, job: str, iterations: int) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CONFIG.world)
    from megatron.core import pipeline_parallel

    from hops_calib.capture import megatron_engine, plugin

    model = megatron_engine.build(CONFIG)

    def block(forward_backward) -> list[float]:
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            model.train_step(forward_backward, CONFIG)
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    plain = block(pipeline_parallel.get_forward_backward_func())
    tracer = plugin.install(job, first_iteration=1)
    traced = block(pipeline_parallel.get_forward_backward_func())
    tracer.close()
    skip = 2  # warm-up iterations (untraced in the log)
    Path(job, f"overhead.rank{rank}.json").write_text(json.dumps({
        "plain_ms": plain, "traced_ms": traced, "plain_median_ms": statistics.median(plain[skip:]),
        "traced_median_ms": statistics.median(traced[skip:])}) + "\n")
    # the link benchmark `hops-calib capture` runs, so that the job prices its p2p hops (a CPU run needs one)
    from hops_calib.capture import link_bench

    bench = link_bench.run(rank, CONFIG.pp, socket.gethostname(), iters=20)
    Path(job, f"link_bench.rank{rank}.json").write_text(json.dumps(bench) + "\n")
    dist.destroy_process_group()


def main() -> None:
    job = Path(sys.argv[1])
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else CONFIG.train_iters
    job.mkdir(parents=True, exist_ok=True)
    from hops_calib.capture import jobdir

    config = CaptureConfig(**{**CONFIG.__dict__, "iterations": iterations - 2})
    (job / "megatron_args.txt").write_text(config.megatron_args() + "\n")
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank, args=(r, port, str(job), iterations)) for r in range(CONFIG.world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    stages = json.loads((job / "hops_trace_map.json").read_text())["stages"]
    ids = tuple(stages[str(s)] for s in range(CONFIG.pp))
    (job / "hops.base.yaml").write_text(jobdir.template(config, ids, jobdir.cpu_model_name()))
    benches = [json.loads(job.joinpath(f"link_bench.rank{rank}.json").read_text()) for rank in range(CONFIG.world)]
    bench_dir = job / jobdir.LINK_BENCH_DIR
    bench_dir.mkdir(parents=True, exist_ok=True)
    for name, text in jobdir.link_bench_files(benches, "gloo p2p benchmark, tests/plugin_run.py").items():
        (bench_dir / name).write_text(text)
    for path in job.glob("link_bench.rank*.json"):
        path.unlink()
    (job / "manifest.yaml").write_text(f"run_id: {job.name}\nsource_scenario: tests/plugin_run.py (the hops-calib "
                                       "plugin on an unmodified Megatron-core run)\n")


if __name__ == "__main__":
    main()
