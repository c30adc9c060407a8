"""GENERATED profiler traces for tests and benchmarks: a GPU pipeline run written as a PyTorch profiler (Kineto)
Chrome trace and as an Nsight Systems SQLite export, following the formats as documented (no real GPU trace can
be made on this machine; ../shared/docs/profiler-traces.md gives every field and its source).

`pipeline_run(pp, microbatches, iterations)` lays out a non-interleaved 1F1B run on the device (each stage's
forward and backward a train of GEMM kernels on stream 7, a p2p send per step on stream 20, the optimizer's
multi-tensor kernels), with causal hops between stages; each step's host span launches its kernels before they
run. `write_kineto` and `write_nsys` write one rank of it. The expected intervals (device time) are returned with
the run, so a test checks what a reader makes of the files against what was written, not against typed numbers.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

BASE_NS = 1_790_000_000_000_000_000  # Unix ns of the traces' time base (2026-09)
US = 1_000
HIDDEN, SEQ = 1024, 2048
# (name as the kernel, short name, operator, Input Dims, duration share of the step)
_GEMMS = (("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "sm90_xmma_gemm", "aten::mm",
           [[SEQ, HIDDEN], [HIDDEN, 3 * HIDDEN]], 0.3),
          ("flash_fwd_kernel", "flash_fwd_kernel", "aten::_flash_attention_forward", [[1, 16, SEQ, 64]], 0.2),
          ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "sm90_xmma_gemm", "aten::mm",
           [[SEQ, HIDDEN], [HIDDEN, 4 * HIDDEN]], 0.3),
          ("vectorized_elementwise_kernel", "vectorized_elementwise_kernel", "aten::add", [[SEQ, HIDDEN]], 0.2))


@dataclass
class Step:
    kind: str  # "F", "B", "OPT"
    iteration: int
    microbatch: int
    device_start: int
    device_end: int
    host_start: int = 0
    host_end: int = 0
    send_to: int | None = None  # stage the step's output goes to


@dataclass
class RankRun:
    rank: int
    pp: int
    steps: list[Step] = field(default_factory=list)
    windows: list[tuple[int, int, int]] = field(default_factory=list)  # (iteration, host start, host end)


def pipeline_run(pp: int = 2, microbatches: int = 4, iterations: int = 2, first_iteration: int = 3,
                 forward_us: int = 4000, backward_us: int = 8000, optimizer_us: int = 3000,
                 hop_us: int = 300) -> list[RankRun]:
    """Device intervals of a 1F1B run, every dependency honoured (a stage's forward after the previous stage's,
    its backward after the next stage's), host spans 40 us ahead of their kernels."""
    runs = [RankRun(rank=s, pp=pp) for s in range(pp)]
    t0 = BASE_NS + 10_000 * US
    for k in range(iterations):
        iteration = first_iteration + k
        orders = []
        for stage in range(pp):
            warmup = min(pp - stage - 1, microbatches)
            order = [("F", m) for m in range(warmup)]
            f, b = warmup, 0
            while f < microbatches:
                order += [("F", f), ("B", b)]
                f, b = f + 1, b + 1
            order += [("B", m) for m in range(b, microbatches)]
            orders.append(order)
        done: dict[tuple[str, int, int], int] = {}
        free = [t0] * pp
        position = [0] * pp
        pending = sum(len(order) for order in orders)
        while pending:
            progressed = False
            for stage in range(pp):
                if position[stage] >= len(orders[stage]):
                    continue
                kind, m = orders[stage][position[stage]]
                need = (kind, stage - 1, m) if kind == "F" and stage > 0 else (
                    (kind, stage + 1, m) if kind == "B" and stage < pp - 1 else None)
                if kind == "B" and stage == pp - 1:
                    need = ("F", stage, m)
                if need is not None and need not in done:
                    continue
                start = max(free[stage], done.get(need, 0) + (hop_us * US if need and need[1] != stage else 0))
                end = start + (forward_us if kind == "F" else backward_us) * US
                done[(kind, stage, m)] = end
                free[stage] = end
                send = (stage + 1 if kind == "F" and stage < pp - 1 else
                        stage - 1 if kind == "B" and stage > 0 else None)
                runs[stage].steps.append(Step(kind, iteration, m, start, end, send_to=send))
                position[stage] += 1
                pending -= 1
                progressed = True
            assert progressed
        grads_done = max(free) + 2000 * US  # the silent stretch (DP reduction in a real run)
        for stage in range(pp):
            runs[stage].steps.append(Step("OPT", iteration, microbatches - 1, grads_done,
                                          grads_done + optimizer_us * US))
        end = grads_done + optimizer_us * US + 500 * US
        for stage in range(pp):
            runs[stage].windows.append((iteration, t0 - 100 * US, end))
        t0 = end + 200 * US
    for run in runs:
        for step in run.steps:
            step.host_start = step.device_start - 40 * US
            step.host_end = step.host_start + (step.device_end - step.device_start) // 2
    return runs


@dataclass
class Kernel:
    name: str
    short: str
    op: str
    dims: Any
    start: int
    end: int
    launch: int
    stream: int
    correlation: int


def kernels_of(run: RankRun, repeat: int = 1) -> Iterator[tuple[Step, Kernel]]:
    """The kernels of each step (device times inside the step's interval, launched inside its host span)."""
    correlation = run.rank * 10_000_000 + 1
    for step in run.steps:
        span = step.device_end - step.device_start
        host = step.host_end - step.host_start
        if step.kind == "OPT":
            parts = [("multi_tensor_apply_kernel", "multi_tensor_apply_kernel", "aten::_foreach_add_", [], 1.0)]
        else:
            parts = list(_GEMMS) * repeat
            total = sum(p[4] for p in parts)
            parts = [(a, b, c, d, share / total) for a, b, c, d, share in parts]
        at = step.device_start
        for k, (name, short, op, dims, share) in enumerate(parts):
            end = step.device_end if k == len(parts) - 1 else at + int(span * share)
            launch = step.host_start + (host * k) // len(parts)
            yield step, Kernel(name, short, op, dims, at, end, launch, 7, correlation)
            correlation += 1
            at = end
        if step.send_to is not None:  # the p2p send after the step: NCCL kernel on its own stream
            launch = step.host_end + 20 * US
            yield step, Kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_SendRecv",
                               "record_param_comms", [[SEQ, 1, HIDDEN]], step.device_end + 10 * US,
                               step.device_end + 200 * US, launch, 20, correlation)
            correlation += 1


def _x(cat: str, name: str, ts_ns: int, dur_ns: int, pid: Any, tid: Any, args: dict[str, Any] | None = None) -> str:
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": round((ts_ns - BASE_NS) / 1000, 3),
             "dur": round(dur_ns / 1000, 3)}
    if args is not None:
        event["args"] = args
    return json.dumps(event)


def kineto_events(run: RankRun, pid: int = 4242, repeat: int = 1) -> Iterator[str]:
    """One rank's trace events (JSON texts) in Kineto's layout (cat, pid/tid, args as in profiler-traces.md §1.3-1.7)."""
    tid, external = pid, 1
    for iteration, start, end in run.windows:
        yield _x("user_annotation", f"ProfilerStep#{iteration}", start, end - start, pid, tid, {"External id": external})
        external += 1
    steps_done: set[int] = set()
    for step, kernel in kernels_of(run, repeat):
        if id(step) not in steps_done:
            steps_done.add(id(step))
            if step.kind == "OPT":
                yield _x("user_annotation", "Optimizer.step#FusedAdam.step", step.host_start,
                         step.host_end - step.host_start, pid, tid, {"External id": external})
            else:
                name = "forward_step" if step.kind == "F" else "backward_step"
                line = 311 if step.kind == "F" else 446
                yield _x("python_function", f"megatron/core/pipeline_parallel/schedules.py({line}): {name}",
                         step.host_start, step.host_end - step.host_start, pid, tid,
                         {"Python parent id": 1, "Python id": external})
            external += 1
        op_args: dict[str, Any] = {"External id": external, "Record function id": 0, "Ev Idx": external}
        if kernel.op == "record_param_comms":
            op_args.update({"Collective name": "send", "dtype": "BFloat16", "In msg nelems": SEQ * HIDDEN,
                            "Out msg nelems": SEQ * HIDDEN, "Group size": run.pp, "Process Group Name": "14",
                            "Process Group Description": "PIPELINE_MODEL_PARALLEL_GROUP",
                            "Process Group Ranks": str(list(range(run.pp))), "Input Dims": kernel.dims})
            yield _x("user_annotation", f"nccl:send {run.rank}->{step.send_to}", kernel.launch - 5 * US, 30 * US,
                     pid, tid, {"External id": external + 1})
        elif kernel.dims:
            op_args.update({"Input Dims": kernel.dims, "Input type": ["c10::BFloat16"] * len(kernel.dims)})
        yield _x("cpu_op", kernel.op, kernel.launch - 2 * US, 12 * US, pid, tid, op_args)
        yield _x("cuda_runtime", "cudaLaunchKernel", kernel.launch, 6 * US, pid, tid,
                 {"cbid": 211, "correlation": kernel.correlation, "External id": external})
        yield _x("kernel", kernel.name, kernel.start, kernel.end - kernel.start, 0, kernel.stream,
                 {"External id": external, "queued": 0, "device": 0, "context": 1, "stream": kernel.stream,
                  "correlation": kernel.correlation, "registers per thread": 128, "shared memory": 0,
                  "grid": [132, 1, 1], "block": [256, 1, 1]})
        external += 2


def write_kineto(path: Path, run: RankRun, *, world: int | None = None, repeat: int = 1, gz: bool | None = None,
                 copies: int = 1) -> int:
    """Write one rank's Kineto trace (gzip when the name ends in .gz); return the bytes written uncompressed.
    `copies` repeats the event list (a large file for benchmarks: the same events again, later in the file)."""
    head = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                                                       "totalGlobalMem": 85520809984, "computeMajor": 9,
                                                       "computeMinor": 0, "numSms": 132}],
            "distributedInfo": {"backend": "nccl", "rank": run.rank, "world_size": world or run.pp, "pg_count": 1,
                                "pg_config": [{"pg_name": "14", "pg_desc": "PIPELINE_MODEL_PARALLEL_GROUP",
                                               "backend_config": "cuda:nccl", "pg_size": run.pp,
                                               "ranks": list(range(run.pp))}], "nccl_version": "2.21.5"},
            "record_shapes": 1, "with_stack": 1, "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS}
    opener = gzip.open if (gz if gz is not None else path.name.endswith(".gz")) else open
    written = 0
    with opener(path, "wt", encoding="utf-8") as out:  # type: ignore[operator]
        text = "{\n" + ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in head.items()) + ',\n  "traceEvents": [\n'
        out.write(text)
        written += len(text)
        first = True
        for _copy in range(copies):
            for event in kineto_events(run, repeat=repeat):
                line = ("  " if first else ",\n  ") + event
                first = False
                out.write(line)
                written += len(line)
        tail = '\n  ],\n  "traceName": "generated"\n}\n'
        out.write(tail)
        written += len(tail)
    return written


# --- Nsight Systems SQLite export (schema of nsys 2024.6-2026.2 as profiler-traces.md §2.1-2.3 documents it) -----
_NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE TARGET_INFO_GPU (id INTEGER NOT NULL, name TEXT, busLocation TEXT, uuid TEXT, smCount INTEGER,
  totalMemory INTEGER, memoryBandwidth INTEGER, clockRate INTEGER, computeMajor INTEGER, computeMinor INTEGER,
  cuDevice INTEGER);
CREATE TABLE TARGET_INFO_CUDA_DEVICE (gpuId INTEGER, cudaId INTEGER, pid INTEGER, uuid TEXT, numMultiprocessors INTEGER);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT, localTime TEXT, systemClockNs INTEGER);
CREATE TABLE ANALYSIS_DETAILS (globalVid INTEGER, duration INTEGER, startTime INTEGER, stopTime INTEGER);
CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
  contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
  demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER, launchType INTEGER,
  cacheConfig INTEGER, registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
  gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL,
  staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT NULL,
  localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER, graphNodeId INTEGER,
  sharedMemoryLimitConfig INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
  globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
  contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL,
  copyKind INTEGER NOT NULL, deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER, srcDeviceId INTEGER,
  srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, migrationCause INTEGER, graphNodeId INTEGER,
  virtualAddress INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
  category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER,
  domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
  int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData BLOB);
"""
NSYS_SESSION_NS = 155_000_000_000  # session-relative clock of a 2026 export: startTime == systemClockNs


def write_nsys(path: Path, run: RankRun, pid: int = 4242) -> None:
    """One rank's Nsight Systems export (GENERATED). Times on the session clock (2026.2 layout: ANALYSIS_DETAILS
    startTime == TARGET_INFO_SESSION_START_TIME.systemClockNs, UTC = utcEpochNs + t - systemClockNs); NVTX ranges
    as the hops-calib tracer names them (`iteration N`, Megatron's `...schedules.forward_step`), the optimizer as
    emit_nvtx names record_function ranges, NCCL's own `ncclSend` ranges in domain "NCCL"."""
    if path.exists():
        path.unlink()
    global_pid = (1 << 48) | (pid << 24)
    global_tid = global_pid | pid
    first = min(start for _i, start, _e in run.windows)
    shift = NSYS_SESSION_NS - (first - 1_000 * US)  # Unix ns -> session ns

    def session(ns: int) -> int:
        return ns + shift

    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        return strings.setdefault(text, len(strings) + 1)

    db = sqlite3.connect(path)
    try:
        db.executescript(_NSYS_SCHEMA)
        db.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                       [("EXPORT_PRODUCT_VERSION", "2026.2.1"), ("EXPORT_SCHEMA_VERSION", "3.25.0"),
                        ("GENERATED_BY", "hops-calib tests/profiler_synth.py (not a real nsys report)")])
        db.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                       [(33, "NvtxCategory", "NVTX category"), (34, "NvtxMark", "NVTX mark"),
                        (59, "NvtxPushPopRange", "NVTX PushPop Range"), (60, "NvtxStartEndRange", "NVTX StartEnd Range"),
                        (75, "NvtxDomainCreate", "NVTX domain create")])
        db.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA H100 80GB HBM3', '0000:18:00.0', 'GPU-synthetic', 132,"
                   " 85520809984, 3352320000000, 1980000, 9, 0, 0)")
        db.execute("INSERT INTO TARGET_INFO_CUDA_DEVICE VALUES (0, 0, ?, 'GPU-synthetic', 132)", (pid,))
        last = max(end for _i, _s, end in run.windows)
        db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '2026-09-21T00:00:00Z', '', ?)",
                   (first - 1_000 * US, NSYS_SESSION_NS))
        db.execute("INSERT INTO ANALYSIS_DETAILS VALUES (?, ?, ?, ?)",
                   (global_pid, session(last) - NSYS_SESSION_NS, NSYS_SESSION_NS, session(last)))
        db.execute("INSERT INTO PROCESSES VALUES (?, ?, 'python')", (global_pid, pid))
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) VALUES (?, NULL, 75, "
                   "'NCCL', ?, 1)", (session(first), global_tid))
        nvtx, kernels, runtime = [], [], []
        for iteration, start, end in run.windows:
            nvtx.append((session(start), session(end), 59, f"iteration {iteration}", None, global_tid, 0))
        seen: set[int] = set()
        launch_name = sid("cudaLaunchKernel_v7000")
        for step, kernel in kernels_of(run):
            if id(step) not in seen:
                seen.add(id(step))
                name = ("Optimizer.step#FusedAdam.step" if step.kind == "OPT" else
                        "megatron.core.pipeline_parallel.schedules." + ("forward_step" if step.kind == "F"
                                                                         else "backward_step"))
                nvtx.append((session(step.host_start), session(step.host_end), 59, name, None, global_tid, 0))
            if kernel.op == "record_param_comms":
                nvtx.append((session(kernel.launch - 5 * US), session(kernel.launch + 25 * US), 59, None,
                             sid("ncclSend"), global_tid, 1))
            kernels.append((session(kernel.start), session(kernel.end), 0, 1, kernel.stream, kernel.correlation,
                            global_pid, sid(kernel.name), sid(kernel.short), None, 0, 0, 128, 132, 1, 1, 256, 1, 1,
                            0, 0, 0, 0, kernel.correlation, 0, None, 0))
            runtime.append((session(kernel.launch), session(kernel.launch + 6 * US), 1, global_tid,
                            kernel.correlation, launch_name, 0, None))
        db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid, domainId) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", nvtx)
        db.executemany(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({', '.join('?' * 27)})", kernels)
        db.executemany(f"INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES ({', '.join('?' * 8)})", runtime)
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, streamId, correlationId, "
                   "globalPid, bytes, copyKind) VALUES (?, ?, 0, 1, 7, 0, ?, 4096, 1)",
                   (session(first), session(first) + 2 * US, global_pid))
        db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(v, k) for k, v in strings.items()])
        db.commit()
    finally:
        db.close()


def job_dir(root: Path, name: str, runs: list[RankRun], *, kind: str = "kineto", microbatches: int = 4,
            iterations: int = 2) -> Path:
    """A job directory of GENERATED traces: megatron_args.txt, stage map, template, link benchmark, manifest, and
    one trace per rank (torch_profile/rank-<r>.json.gz or nsys/rank<r>.sqlite)."""
    job = root / name
    pp = len(runs)
    job.mkdir(parents=True)
    (job / "megatron_args.txt").write_text(
        f"pretrain_gpt.py --pipeline-model-parallel-size {pp} --num-layers {2 * pp} --hidden-size {HIDDEN} "
        f"--num-attention-heads 16 --seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 1 "
        f"--global-batch-size {microbatches} --train-iters {iterations + 2} --vocab-size 50304 --bf16 "
        "--tensor-model-parallel-size 1 --transformer-impl local --mock-data --log-interval 1\n")
    devices = [f"h100_node{s}_gpu0" for s in range(pp)]
    (job / "hops_trace_map.json").write_text(json.dumps({"stages": {str(s): d for s, d in enumerate(devices)}}))
    (job / "hops.base.yaml").write_text("hardware:\n  devices:\n" + "".join(
        f"    - {{id: {d}, gpu: h100, node: node{s}}}\n" for s, d in enumerate(devices)))
    (job / "manifest.yaml").write_text(f"run_id: {name}\ngenerated: tests/profiler_synth.py (not a real run)\n")
    bench = job / "calibration" / "link_bench"
    bench.mkdir(parents=True)
    for s in range(pp - 1):
        rows = [json.dumps({"label": f"pair_{s}_{s + 1}", "mode": "p2p", "rank": r, "world_size": 2,
                            "hostname": f"node{s + r}", "size_mb": size, "dtype": "float32", "warmup": 10,
                            "iters": 50, "mean_ms": 0.1 + size * 0.4, "p50_ms": 0.1 + size * 0.4,
                            "p99_ms": 0.2 + size * 0.4, "min_ms": 0.1 + size * 0.4, "max_ms": 0.3 + size * 0.4,
                            "std_ms": 0.01}) for size in (1, 2, 4, 16, 64) for r in (0, 1)]
        (bench / f"pair_{s}_{s + 1}.jsonl").write_text("\n".join(rows) + "\n")
    for run in runs:
        if kind == "kineto":
            folder = job / "torch_profile"
            folder.mkdir(exist_ok=True)
            write_kineto(folder / f"rank-{run.rank}.json.gz", run)
        else:
            folder = job / "nsys"
            folder.mkdir(exist_ok=True)
            write_nsys(folder / f"rank{run.rank}.sqlite", run)
    return job


def main(argv: list[str] | None = None) -> int:
    """`python tests/profiler_synth.py {kineto,nsys} OUT [--pp P --microbatches M --iterations N]`: write one
    GENERATED job directory OUT (its name is the run id) that `hops-calib ingest OUT` reads."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python tests/profiler_synth.py",
        description="Write a GENERATED job directory of profiler traces that follow the documented formats (a "
                    "non-interleaved 1F1B run on H100s; ../shared/docs/profiler-traces.md): torch_profile/ "
                    "(Kineto JSON) or nsys/ (an Nsight Systems SQLite export). Its timings are made up: use it to "
                    "see what the readers make of such a file, not to calibrate.")
    parser.add_argument("kind", choices=("kineto", "nsys"), help="which profiler's files to write")
    parser.add_argument("out", type=Path, help="the job directory to create (must not exist); its name is the run id")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages, one rank each (default 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (default 4)")
    parser.add_argument("--iterations", type=int, default=2, help="profiled iterations (default 2)")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists; give a new directory")
    if not (1 <= args.pp <= 64 and 1 <= args.microbatches <= 256 and 1 <= args.iterations <= 64):
        parser.error("--pp must be 1-64, --microbatches 1-256, --iterations 1-64")
    runs = pipeline_run(pp=args.pp, microbatches=args.microbatches, iterations=args.iterations)
    job = job_dir(args.out.parent, args.out.name, runs, kind=args.kind, microbatches=args.microbatches,
                  iterations=args.iterations)
    print(f"wrote {job} (GENERATED {args.kind} traces of {args.pp} ranks); next: hops-calib ingest {job} "
          "--fixtures STORE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
