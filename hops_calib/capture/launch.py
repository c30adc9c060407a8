"""Capture room: launch the pipeline ranks as pinned processes and assemble one job directory atomically.

Each rank is a `multiprocessing` spawn child with its own gloo process group
member, pinned to its own core (`os.sched_setaffinity`) with one torch thread:
on a small shared machine that is what keeps operation times stable. The job
directory is assembled under a temporary sibling name and renamed into place
only when every rank finished, so a failed capture leaves nothing behind.
"""

from __future__ import annotations

import datetime as _dt
import multiprocessing
import os
import platform
import queue
import shutil
import socket
import traceback
from pathlib import Path
from typing import Any

from hops_calib import __version__
from hops_calib.capture import jobdir
from hops_calib.capture.config import WARMUP_ITERATIONS, CaptureConfig
from hops_calib.files import atomic_write

# A rank that neither finishes nor fails within this time is stuck (for example its peer died mid-send).
_RANK_TIMEOUT_S = 3600.0
_POLL_S = 1.0


class CaptureError(RuntimeError):
    """A capture that could not run or finish; the message says which rank failed and why."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_cores(ranks: int) -> list[int]:
    """Core per rank: the cores this process may use, round-robin (ranks share cores only when they must)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return [cores[rank % len(cores)] for rank in range(ranks)]


def _worker(
    rank: int, config: CaptureConfig, port: int, job_dir: str, cores: list[int], hostname: str, results: Any
) -> None:
    """One pipeline rank: pin, join the gloo group, run the engine, write its log, run the link benchmark."""
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {cores[rank]})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from hops_calib.capture.events import EventLog, WallClock

        ids = jobdir.device_ids(cores)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.world)
        try:
            rank_stage, stage_devices = jobdir.stage_layout(config, ids)
            log = EventLog(
                rank=rank,
                device_ids=ids,
                hostname=hostname,
                with_chunks=config.vp > 1,
                rank_stage=rank_stage if config.world > config.pp else (),
                stage_devices=stage_devices if config.world > config.pp else (),
            )
            clock = WallClock()
            if config.engine == "megatron":
                from hops_calib.capture import megatron_engine as engine
            else:
                from hops_calib.capture import torch_engine as engine  # type: ignore[no-redef]
            if config.profile:
                from hops_calib.capture.profiling import PROFILE_DIR, trace_name

                facts = engine.run(
                    rank, config.pp, config, log, clock, profile_path=Path(job_dir) / PROFILE_DIR / trace_name(rank)
                )
            else:
                facts = engine.run(rank, config.pp, config, log, clock)
            # What the rank really ran on, after any library had its say: the provenance of every timing.
            facts["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            facts["torch_threads"] = torch.get_num_threads()
            log.write(Path(job_dir) / jobdir.TRACE_DIR / f"rank{rank}.jsonl")
            bench: dict[str, list[dict[str, Any]]] = {}
            if config.link_bench:
                from hops_calib.capture import link_bench

                bench = link_bench.run(
                    rank,
                    config.pp,
                    hostname,
                    iters=config.link_bench_iters,
                    stage_ranks=jobdir.stage_first_ranks(config),
                )
            results.put((rank, "ok", {"facts": facts, "bench": bench, "events": len(log.events)}))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure of the rank to the parent, then exit non-zero
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version(), "hops_calib": __version__}
    for package in ("torch", "megatron-core"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def check_installed(engine: str) -> None:
    """Raise CaptureError naming the extra to install when the engine's packages are missing."""
    from importlib.util import find_spec

    needed = ["torch"] + (["megatron.core"] if engine == "megatron" else [])
    missing = [name for name in needed if find_spec(name.split(".")[0]) is None or find_spec(name) is None]
    if missing:
        raise CaptureError(
            f"capture needs {', '.join(missing)}: install the extra with "
            "`pip install -e '.[capture]'` (torch 2.13.0 CPU build and megatron-core 0.16)"
        )


def check_out(out: Path, force: bool) -> None:
    """CaptureError unless `out` can take a new job directory: a new name whose parent is (or can become) a folder,
    or, with `force`, an earlier capture's job directory. `--force` never removes anything else (a mistyped --out
    must not wipe a project), and a capture never lands inside a fixture store or another job directory."""
    from hops_calib.store.digests import FIXTURE_FILE, INDEX
    from hops_calib.trace import TraceError, read_manifest
    from hops_calib.trace.job import is_job_dir

    resolved = out.resolve()
    if not out.name or out.name in (".", ".."):
        raise CaptureError(
            f"--out {out}: name the new job directory (its name is the run id), e.g. --out runs/cpu_1f1b_run1"
        )
    for parent in resolved.parents:
        if (parent / INDEX).is_file() or (parent / FIXTURE_FILE).is_file():
            raise CaptureError(
                f"--out {out} is inside the fixture store {parent}: a job directory there would "
                "stand among (or replace) fixtures; capture elsewhere, then ingest it into the store"
            )
        if is_job_dir(parent):
            raise CaptureError(f"--out {out} is inside the job directory {parent}; choose a folder outside it")
        if parent.exists() and not parent.is_dir():
            raise CaptureError(f"--out {out}: {parent} is a file, not a folder; choose another --out")
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise CaptureError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if not out.is_dir() or out.is_symlink():
        raise CaptureError(
            f"--out {out} is a file or a link, not a job directory: --force replaces only an earlier "
            "capture; choose another --out"
        )
    try:
        engine = read_manifest(out).get("engine")
    except TraceError:  # an unreadable manifest is not a capture's
        engine = None
    if not (is_job_dir(out) and engine):
        raise CaptureError(
            f"--out {out} holds something other than a hops-calib capture (no manifest.yaml with an "
            "engine): --force replaces only an earlier capture's job directory; choose another --out, "
            "or move that folder away yourself"
        )


def capture(config: CaptureConfig, out: Path, force: bool = False, command: str = "") -> Path:
    """Run one capture and write its job directory at `out` (its name is the run id); return `out`."""
    config = config.resolved()
    out = Path(out)
    check_out(out, force)
    check_installed(config.engine)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CaptureError(
            f"--out {out}: cannot make its folder {out.parent} ({err.strerror or err}); choose another --out"
        ) from None
    staging = out.with_name(f".{out.name}.capturing-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        _run_ranks(config, out.name, staging, command or config.command_line(str(out)))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _run_ranks(config: CaptureConfig, run_id: str, staging: Path, command: str) -> None:
    cores = _rank_cores(config.world)
    ids = jobdir.device_ids(cores)
    _rank_stage, stage_devices = jobdir.stage_layout(config, ids)
    host = jobdir.hostname()
    cpu_name = jobdir.cpu_model_name()
    started = _dt.datetime.now(_dt.UTC)
    load_before = jobdir.load_average()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_worker,
            name=f"hops-capture-rank{rank}",
            args=(rank, config, port, str(staging), cores, host, results),
        )
        for rank in range(config.world)
    ]
    for process in processes:
        process.start()
    reports: dict[int, dict[str, Any]] = {}
    waited_s = 0.0
    try:
        while len(reports) < config.world:
            try:
                rank, status, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                waited_s += _POLL_S
                # A rank that died before it could report (killed, or failed while starting up:
                # spawn re-imports the caller's __main__, which must be guarded) would be waited on forever.
                dead = [(r, p) for r, p in enumerate(processes) if r not in reports and not p.is_alive()]
                if dead:
                    rank, process = dead[0]
                    raise CaptureError(
                        f"rank {rank} exited (code {process.exitcode}) without reporting; see its error output above. "
                        'A script that calls capture() must guard it with `if __name__ == "__main__":` '
                        "because the ranks are spawned processes"
                    ) from None
                if waited_s >= _RANK_TIMEOUT_S:
                    raise CaptureError(
                        f"no rank reported within {_RANK_TIMEOUT_S:.0f} s; the capture is stuck"
                    ) from None
                continue
            if status != "ok":
                raise CaptureError(f"rank {rank} failed:\n{payload}")
            reports[rank] = payload
        for process in processes:
            process.join(timeout=60)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    failed = [p.name for p in processes if p.exitcode not in (0, None)]
    if failed:
        raise CaptureError(f"{', '.join(failed)} exited with an error after reporting")

    finished = _dt.datetime.now(_dt.UTC)
    facts = {
        "engine": config.engine,
        # Read back by ingest (spec.configured_schedule): the torch engine's schedules have no Megatron flag.
        "configured_schedule": config.resolved_schedule,
        "schedule_function": reports[0]["facts"].get("schedule_function", ""),
        **{
            key: reports[0]["facts"][key]
            for key in ("overlap_p2p_comm", "batch_p2p_comm")
            if key in reports[0]["facts"]
        },
        "host": host,
        "cpu_model": cpu_name,
        # which core it is (the model name alone may say only "AMD EPYC"): a different core is another device
        "cpu": jobdir.cpu_identity(),
        "cores": cores,
        # More ranks than cores time-slice, which inflates every compute time (about 1.8x for 4 ranks on 2 cores).
        "ranks_share_cores": len(set(cores)) < len(cores),
        "threads_per_rank": [reports[r]["facts"]["torch_threads"] for r in range(config.world)],
        "affinity_per_rank": [reports[r]["facts"]["affinity"] for r in range(config.world)],
        "backend": "gloo",
        "precision": "fp32",
        "warmup_iterations_untraced": WARMUP_ITERATIONS,
        "traced_iterations": config.iterations,
        "parameters_per_rank": [reports[r]["facts"].get("parameters") for r in range(config.world)],
        "layers_per_rank": [reports[r]["facts"].get("layers") for r in range(config.world)],
        "events_per_rank": [reports[r]["events"] for r in range(config.world)],
        **(
            {
                "experts_per_rank": [reports[r]["facts"].get("experts_per_rank") for r in range(config.world)],
                "expert_parameters_per_rank": [
                    reports[r]["facts"].get("expert_parameters") for r in range(config.world)
                ],
            }
            if config.experts
            else {}
        ),
        "load_average_before": load_before,
        "load_average_after": jobdir.load_average(),
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": finished.isoformat(timespec="seconds"),
        "versions": _versions(),
    }
    atomic_write(staging / jobdir.STAGE_MAP, jobdir.stage_map(stage_devices))
    atomic_write(staging / jobdir.TEMPLATE, jobdir.template(config, stage_devices, cpu_name))
    atomic_write(staging / jobdir.ARGS_FILE, config.megatron_args() + "\n")
    atomic_write(staging / jobdir.MANIFEST, jobdir.manifest(config, run_id, command, facts))
    if config.link_bench:
        header = f"gloo p2p benchmark, torch {facts['versions']['torch']}, host {host}"
        benches = [reports[rank]["bench"] for rank in sorted(reports)]
        for name, text in jobdir.link_bench_files(benches, header).items():
            atomic_write(staging / jobdir.LINK_BENCH_DIR / name, text)
