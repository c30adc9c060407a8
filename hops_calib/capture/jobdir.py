"""Capture room: the small files of a captured job directory (stage map, template, arguments, manifest, link bench).

The layout is the cluster one (docs/megatron-trace-format.md), so `ingest` reads
a capture like any cluster run:

    <run>/megatron_trace/rank<r>.jsonl          written by each rank (events.py)
    <run>/hops_trace_map.json                   {"stages": {"<rank>": "<device id>"}}
    <run>/hops.base.yaml                        pipeline.schedule, hardware.devices [{id, gpu: cpu, name}]
    <run>/megatron_args.txt                     the equivalent Megatron-LM command line
    <run>/manifest.yaml                         provenance: tool, command, host, versions, times, load
    <run>/calibration/link_bench/pair_<i>_<j>.jsonl   gloo p2p benchmark between ranks i and j
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hops_calib.capture.config import CaptureConfig

# The layout's names are the reader's (ingest), so writer and reader cannot drift apart; launch writes through them.
from hops_calib.trace.job import LINK_BENCH_DIR as LINK_BENCH_DIR
from hops_calib.trace.job import MANIFEST as MANIFEST
from hops_calib.trace.job import STAGE_MAP as STAGE_MAP
from hops_calib.trace.job import TEMPLATE as TEMPLATE
from hops_calib.trace.job import TRACE_DIR as TRACE_DIR
from hops_calib.trace.megatron_args import ARGS_FILE as ARGS_FILE

DEVICE_TYPE = "cpu"


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The host CPU's model string (first `model name` of /proc/cpuinfo), else platform.processor()."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """What tells one CPU core from another, from the first processor of /proc/cpuinfo: vendor, family and model
    numbers (a "model name" may say only "AMD EPYC"), the clock it reports, and the widest vector instructions
    (a core's FLOP per cycle). {} where the file is unreadable (another OS)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: a VM's vCPUs are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    widest = next((isa for isa in ("avx512f", "avx2", "avx", "sse2") if isa in flags), None)
    found: dict[str, Any] = {
        "vendor": fields.get("vendor_id"),
        "vector": widest,
        "bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
        "amx": "amx_tile" in flags,
    }
    for key, name in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping")):
        if fields.get(key, "").isdigit():
            found[name] = int(fields[key])
    with contextlib.suppress(KeyError, ValueError):
        found["mhz"] = round(float(fields["cpu MHz"]), 1)
    return {key: value for key, value in found.items() if value is not None} if fields else {}


def hostname() -> str:
    return socket.gethostname()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (what `uptime` prints), rounded; [] where unavailable."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def device_ids(cores: list[int]) -> tuple[str, ...]:
    """One device id per rank, named like the cluster's `<type>_node<k>_gpu<g>`: the core the rank is pinned to."""
    if len(set(cores)) == len(cores):
        return tuple(f"{DEVICE_TYPE}_node0_core{core}" for core in cores)
    # More ranks than cores: ranks share cores, and each still needs its own id.
    return tuple(f"{DEVICE_TYPE}_node0_core{core}_rank{rank}" for rank, core in enumerate(cores))


RANK_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's initialize_model_parallel default


def stage_first_ranks(config: CaptureConfig) -> tuple[int, ...]:
    """The global rank of each stage's first GPU (tensor-parallel rank 0 of replica 0), in Megatron's rank order."""
    from hops_calib.spec import global_rank

    return tuple(
        global_rank(RANK_ORDER, {"tp": (0, config.tp), "dp": (0, config.dp), "pp": (k, config.pp)})
        for k in range(config.pp)
    )


def stage_layout(config: CaptureConfig, ids: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(the stage of every global rank, the stage map's device per stage: its first rank's device id)."""
    from hops_calib.spec import coordinates_of

    sizes = {"tp": config.tp, "dp": config.dp, "pp": config.pp}
    rank_stage = tuple(coordinates_of(rank, RANK_ORDER, sizes)["pp"] for rank in range(config.world))
    return rank_stage, tuple(ids[rank] for rank in stage_first_ranks(config))


def stage_map(ids: tuple[str, ...]) -> str:
    return json.dumps({"stages": {str(stage): device for stage, device in enumerate(ids)}}, indent=2) + "\n"


def template(config: CaptureConfig, ids: tuple[str, ...], cpu_name: str) -> str:
    """`hops.base.yaml`: the cluster template's shape, with the schedule that really runs and the CPU devices."""
    body = {
        "simulation": {"batches": config.iterations, "microbatches": config.microbatches, "seed": config.seed},
        "pipeline": {
            "schedule": config.resolved_schedule,
            "virtual_pipeline_size": config.vp,
            "precision": "fp32",
            "model": {"hidden_dim": config.hidden, "seq_len": config.seq},
            "stages": [{"device": device, "layers": config.layers // config.pp} for device in ids],
        },
        "hardware": {
            "devices": [
                {"id": device, "gpu": DEVICE_TYPE, "name": cpu_name, "node": f"{DEVICE_TYPE}_node0", "socket": 0}
                for device in ids
            ],
            "interconnect": {"same_node": "gloo_tcp_loopback"},
        },
    }
    header = (
        f"# Written by hops-calib capture: a {config.engine} {config.resolved_schedule} run on {config.world} "
        f"CPU ranks ({config.pp} stages x tp {config.tp} x dp {config.dp}; {config.vp} model chunk(s) each), "
        "one thread per rank.\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False)


def manifest(config: CaptureConfig, run_id: str, command: str, facts: dict[str, Any]) -> str:
    body = {
        "source_scenario": f"hops-calib capture ({config.engine} engine, CPU)",
        "job_id": run_id,
        "link_bench_job_id": run_id if config.link_bench else None,
        "link_bench_source": "same worker processes, after the training loop" if config.link_bench else None,
        "description": (
            f"CPU capture: GPT {config.layers} layers, hidden {config.hidden}, seq {config.seq}, "
            f"{config.microbatches} microbatches, pp {config.pp}, vp {config.vp}, "
            + (f"tp {config.tp}, dp {config.dp}, " if config.world > config.pp else "")
            + f"schedule {config.resolved_schedule}; iterations 1-2 untraced warm-up"
        ),
        "command": command,
        **facts,
    }
    return yaml.safe_dump(body, sort_keys=False)


def link_bench_text(rows: list[dict[str, Any]], header: str) -> str:
    """Rows of both ranks of one pair, after one log line (as the cluster files carry NCCL's)."""
    return header + "\n" + "".join(json.dumps(row) + "\n" for row in rows)


def link_bench_files(benches: Sequence[dict[str, list[dict[str, Any]]]], header: str) -> dict[str, str]:
    """The pair files of a link benchmark (`pair_<i>_<j>.jsonl` -> text) from each rank's rows by pair label (in
    rank order, as `link_bench.run` returns them): both ranks' rows of a pair, by message size, then rank."""
    files = {}
    for label in sorted({label for bench in benches for label in bench}):
        rows = [row for bench in benches for row in bench.get(label, [])]
        rows.sort(key=lambda row: (row["size_mb"], row["rank"]))
        files[f"{label}.jsonl"] = link_bench_text(rows, header)
    return files
