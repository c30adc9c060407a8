"""Capture room: the gloo point-to-point link benchmark between adjacent ranks, in the cluster's row format.

The cluster runs ship `calibration/link_bench/pair_<i>_<j>.jsonl`: one JSON row
per (rank, message size) with `label, mode, rank, world_size, hostname, size_mb,
dtype, local_rank, warmup, iters, mean_ms, p50_ms, p99_ms, min_ms, max_ms,
std_ms`, the pair's sender as rank 0 and its receiver as rank 1. This runs the
same measurement over gloo between stage i and i+1 (blocking `send` timed on the
sender, `recv` on the receiver, host wall clock), in the capture's own worker
processes after the training loop, while the other ranks wait.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

SIZES_MB = (1, 2, 4, 16, 64)
WARMUP = 10
ITERS = 50
BYTES_PER_MB = 1 << 20


def summarize(times_ms: list[float]) -> dict[str, float]:
    """mean/p50/p99/min/max/std of one size's timings (nearest-rank percentiles)."""
    ordered = sorted(times_ms)

    def rank_percentile(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {
        "mean_ms": statistics.fmean(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": rank_percentile(0.99),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "std_ms": statistics.pstdev(ordered),
    }


def run(
    rank: int,
    world: int,
    hostname: str,
    warmup: int = WARMUP,
    iters: int = ITERS,
    sizes_mb: tuple[int, ...] = SIZES_MB,
    stage_ranks: tuple[int, ...] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Benchmark every adjacent pair of the `world` stages (`stage_ranks`: the global rank standing for each stage,
    default rank k for stage k); returns {pair label: rows of this rank} (empty for pairs it is not in)."""
    import torch
    import torch.distributed as dist

    rows: dict[str, list[dict[str, Any]]] = {}
    stage_ranks = stage_ranks or tuple(range(world))
    for stage in range(world - 1):
        sender, receiver = stage_ranks[stage], stage_ranks[stage + 1]
        label = f"pair_{stage}_{stage + 1}"
        dist.barrier()
        if rank not in (sender, receiver):
            continue
        pair_rank = 0 if rank == sender else 1
        rows[label] = []
        for size_mb in sizes_mb:
            buffer = torch.ones(size_mb * BYTES_PER_MB // 4, dtype=torch.float32)
            times_ms = []
            for step in range(warmup + iters):
                start = time.perf_counter_ns()
                if pair_rank == 0:
                    dist.send(buffer, dst=receiver)
                else:
                    dist.recv(buffer, src=sender)
                elapsed_ms = (time.perf_counter_ns() - start) / 1e6
                if step >= warmup:
                    times_ms.append(elapsed_ms)
            rows[label].append(
                {
                    "label": label,
                    "mode": "p2p",
                    "rank": pair_rank,
                    "world_size": 2,
                    "hostname": hostname,
                    "size_mb": size_mb,
                    "dtype": "float32",
                    "local_rank": 0,
                    "warmup": warmup,
                    "iters": iters,
                    **summarize(times_ms),
                }
            )
    dist.barrier()
    return rows
