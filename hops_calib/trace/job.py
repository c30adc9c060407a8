"""Trace room: a job directory's small files (stage map, device types, manifest) and how to find job directories."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.trace.errors import TraceError
from hops_calib.trace.reading import (
    MAX_CONFIG_BYTES,
    MAX_LAYOUT_BYTES,
    MAX_LAYOUT_NODES,
    MAX_YAML_NODES,
    load_json,
    load_yaml,
)

TRACE_DIR = "megatron_trace"
STAGE_MAP = "hops_trace_map.json"
TEMPLATE = "hops.base.yaml"
MANIFEST = "manifest.yaml"
LINK_BENCH_DIR = Path("calibration") / "link_bench"
# Any of these marks a folder as a job directory (so a job missing its trace is reported, not skipped).
_JOB_MARKERS = (TRACE_DIR, STAGE_MAP, "megatron_args.txt", "torch_profile", "nsys")  # (profiler traces: rank_traces)
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


def is_job_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in _JOB_MARKERS)


# What a job directory to predict or plan holds (README, "Predict a configuration before it runs"): the one wording of
# `predict --job`, `plot timeline --job` and `plan --job`.
JOB_DIR_HINT = (
    f"give a Megatron job directory: megatron_args.txt, {STAGE_MAP} and {TEMPLATE} (the GPU type), and "
    f"{LINK_BENCH_DIR.as_posix()}/ only where neither torchrun's node placement (--nnodes, "
    "--nproc-per-node) nor --cluster prices the hops (no traces needed)"
)


def require_job_dir(path: Path | str, field: str = "--job") -> Path:
    """`path` as a Path when it is a directory; else TraceError naming it and what a job directory holds."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(path, "is not a directory", field=field, hint=JOB_DIR_HINT)
    return path


def find_job_dirs(source: Path, notes: list[str] | None = None) -> list[Path]:
    """`source` itself when it is a job directory, else every job directory below it (sorted).

    The walk never leaves the source tree: a symbolic link to a job directory is taken as that job (once, however
    many links name it; a folder of links to runs is a common way to pick them), a link to any other folder (`/`,
    `up -> ..`) is not followed. Job directories whose names start with a dot are skipped; they, and the links not
    followed, are named in `notes`.
    """
    if not source.exists():
        raise TraceError(source, "does not exist", hint="pass a job directory or a folder holding job directories")
    if is_job_dir(source):
        return [source]
    found: list[Path] = []
    seen: set[Path] = set()
    hidden: list[str] = []
    unfollowed: list[str] = []
    for root, dirs, _files in os.walk(source):  # (followlinks=False: links are looked at below, never walked)
        here = Path(root)
        walk = []
        for name in sorted(dirs):
            path = here / name
            try:
                real = path.resolve()
                job = is_job_dir(real)
            except (OSError, RuntimeError):  # a link loop
                real, job = path, False
            if name.startswith("."):
                if job:
                    hidden.append(str(path))
            elif job:
                if real not in seen:
                    seen.add(real)
                    found.append(path)
            elif path.is_symlink():
                unfollowed.append(f"{path} -> {os.readlink(path)}")
            else:
                walk.append(name)
        dirs[:] = walk
    if notes is not None:
        if hidden:
            notes.append(
                f"skipped {len(hidden)} job director{'y' if len(hidden) == 1 else 'ies'} whose name starts "
                f"with a dot (hidden): {', '.join(hidden[:5])}{', ...' if len(hidden) > 5 else ''}; rename "
                "to ingest"
            )
        if unfollowed:
            notes.append(
                f"did not follow {len(unfollowed)} symbolic link(s) to folders that are not job "
                f"directories: {', '.join(unfollowed[:5])}{', ...' if len(unfollowed) > 5 else ''} (links "
                "are followed only to job directories, so the search stays inside the source)"
            )
    return sorted(found)


def rank_files(job_dir: Path) -> dict[int, Path]:
    """rank -> event log path, from `megatron_trace/rank<r>.jsonl`."""
    trace = job_dir / TRACE_DIR
    if not trace.is_dir():
        raise TraceError(
            trace, "missing: no per-rank event logs", hint=f"a job directory needs {TRACE_DIR}/rank<r>.jsonl"
        )
    files: dict[int, Path] = {}
    for path in sorted(trace.iterdir()):
        match = _RANK_FILE.fullmatch(path.name)
        if match:
            rank = int(match.group(1))
            if rank in files:
                raise TraceError(
                    trace,
                    f"holds two logs of rank {rank}: {files[rank].name} and {path.name}",
                    field="rank<r>.jsonl",
                    hint="keep one log per rank (remove the copy)",
                )
            files[rank] = path
    if not files:
        raise TraceError(trace, "holds no rank<r>.jsonl event logs", hint="copy the tracing fork's per-rank logs here")
    return dict(sorted(files.items()))


def read_stage_map(job_dir: Path) -> tuple[str, ...]:
    """Device id per pipeline stage, from `hops_trace_map.json` ({"stages": {"0": "h100_node0_gpu0", ...}})."""
    path = job_dir / STAGE_MAP
    if not os.path.lexists(path):
        raise TraceError(
            path,
            "missing: no stage-to-device map",
            field="stages",
            hint='write {"stages": {"0": "<device id>", ...}} with one entry per pipeline stage',
        )
    data = load_json(path, MAX_LAYOUT_BYTES)
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise TraceError(
            path, "missing or empty", field="stages", hint='expected {"stages": {"0": "<device id>", ...}}'
        )
    try:
        by_stage = {int(k): v for k, v in stages.items()}
    except ValueError as err:
        raise TraceError(path, f"stage keys must be integers ({err})", field="stages") from err
    if sorted(by_stage) != list(range(len(by_stage))):
        raise TraceError(
            path,
            f"stages {sorted(by_stage)} are not 0..{len(by_stage) - 1}",
            field="stages",
            hint="list every pipeline stage exactly once, numbered from 0",
        )
    for stage, device in by_stage.items():
        if not isinstance(device, str) or not device:
            raise TraceError(
                path,
                f"device id of stage {stage} is {device!r}",
                field=f"stages.{stage}",
                hint="give a non-empty device id string",
            )
    return tuple(by_stage[s] for s in range(len(by_stage)))


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "h100", "a10g", "l4", "cpu", ...
    name: str = ""  # human-readable model, e.g. a CPU model string, when the job recorded one
    node: str = ""  # the node (machine) it sits on, when the job names one (`node:`): devices of one node share it


def _read_yaml_mapping(
    path: Path, keys: str, empty_ok: bool, max_bytes: int = MAX_CONFIG_BYTES, max_nodes: int = MAX_YAML_NODES
) -> dict[str, Any]:
    """An optional YAML file holding a mapping: {} when absent (or empty, with `empty_ok`); an error naming the
    file and line when it is not valid YAML, or not a mapping (`keys`: examples of what it should hold)."""
    if not os.path.lexists(path):
        return {}
    data = load_yaml(path, max_bytes, max_nodes)
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise TraceError(path, "is not a YAML mapping", hint=f"expected keys such as {keys}")
    return data


def read_template(job_dir: Path) -> dict[str, Any]:
    """`hops.base.yaml` as a dict (empty when absent)."""
    return _read_yaml_mapping(
        job_dir / TEMPLATE,
        "pipeline: and hardware:",
        empty_ok=False,
        max_bytes=MAX_LAYOUT_BYTES,
        max_nodes=MAX_LAYOUT_NODES,
    )


def read_device_types(job_dir: Path, template: dict[str, Any] | None = None) -> dict[str, DeviceInfo]:
    """device id -> type (and name, node), from `hops.base.yaml` `hardware.devices[]` entries {id, gpu, name?,
    node?}."""
    path = job_dir / TEMPLATE
    template = read_template(job_dir) if template is None else template
    if not template:
        raise TraceError(
            path,
            "missing: no device types",
            field="hardware.devices",
            hint="write hardware: {devices: [{id: <device id>, gpu: <type, e.g. h100 or cpu>}, ...]}",
        )
    devices = (template.get("hardware") or {}).get("devices")
    if not isinstance(devices, list) or not devices:
        raise TraceError(
            path,
            "missing or empty",
            field="hardware.devices",
            hint="list every device of the stage map as {id: ..., gpu: ...}",
        )
    types: dict[str, DeviceInfo] = {}
    for k, entry in enumerate(devices):
        if not isinstance(entry, dict) or not entry.get("id") or not entry.get("gpu"):
            raise TraceError(
                path,
                f"entry {k} is {entry!r}",
                field=f"hardware.devices[{k}]",
                hint="each device needs an id and a gpu type",
            )
        types[str(entry["id"])] = DeviceInfo(
            type=str(entry["gpu"]).lower(), name=str(entry.get("name") or ""), node=str(entry.get("node") or "")
        )
    return types


def read_manifest(job_dir: Path) -> dict[str, Any]:
    """Provenance (`manifest.yaml`): source scenario, job ids. Empty when absent."""
    data = _read_yaml_mapping(job_dir / MANIFEST, "source_scenario: and job_id:", empty_ok=True)
    # kept in fixture.json: YAML's dates and other non-JSON values are kept as their text
    return json.loads(json.dumps({str(k): v for k, v in data.items()}, default=str))


def run_id_of(job_dir: Path, manifest: dict[str, Any] | None = None) -> str:
    """The run's id: the manifest's `run_id` when it has one, else the job directory's name."""
    manifest = read_manifest(job_dir) if manifest is None else manifest
    run_id = manifest.get("run_id")
    return str(run_id) if run_id not in (None, "") else job_dir.resolve().name
