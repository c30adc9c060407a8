"""Trace room: a job directory's small files (stage map, device types, manifest) and how to find job directories."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hops_calib.trace.errors import TraceError

TRACE_DIR = "megatron_trace"
STAGE_MAP = "hops_trace_map.json"
TEMPLATE = "hops.base.yaml"
MANIFEST = "manifest.yaml"
LINK_BENCH_DIR = Path("calibration") / "link_bench"
# Any of these marks a folder as a job directory (so a job missing its trace is reported, not skipped).
_JOB_MARKERS = (TRACE_DIR, STAGE_MAP, "megatron_args.txt")
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
# libyaml's loader is ~10x faster than the pure-Python one; same result on safe YAML.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_YAML_LOADER)


def is_job_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in _JOB_MARKERS)


def find_job_dirs(source: Path) -> list[Path]:
    """`source` itself when it is a job directory, else every job directory below it (sorted)."""
    if not source.exists():
        raise TraceError(source, "does not exist", hint="pass a job directory or a folder holding job directories")
    if is_job_dir(source):
        return [source]
    found: list[Path] = []
    seen: set[Path] = set()
    # Symbolic links are followed (a folder of links to job directories is a common way to pick runs); each real
    # folder is visited once, so a link back up the tree ends the walk there.
    for root, dirs, _files in os.walk(source, followlinks=True):
        here = Path(root)
        real = here.resolve()
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        if here != source and is_job_dir(here):
            found.append(here)
            dirs.clear()  # a job directory's own subfolders are not jobs
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(found)


def rank_files(job_dir: Path) -> dict[int, Path]:
    """rank -> event log path, from `megatron_trace/rank<r>.jsonl`."""
    trace = job_dir / TRACE_DIR
    if not trace.is_dir():
        raise TraceError(trace, "missing: no per-rank event logs", hint=f"a job directory needs {TRACE_DIR}/rank<r>.jsonl")
    files = {}
    for path in trace.iterdir():
        match = _RANK_FILE.fullmatch(path.name)
        if match:
            files[int(match.group(1))] = path
    if not files:
        raise TraceError(trace, "holds no rank<r>.jsonl event logs", hint="copy the tracing fork's per-rank logs here")
    return dict(sorted(files.items()))


def read_stage_map(job_dir: Path) -> tuple[str, ...]:
    """Device id per pipeline stage, from `hops_trace_map.json` ({"stages": {"0": "h100_node0_gpu0", ...}})."""
    path = job_dir / STAGE_MAP
    if not path.is_file():
        raise TraceError(path, "missing: no stage-to-device map", field="stages",
                         hint='write {"stages": {"0": "<device id>", ...}} with one entry per pipeline stage')
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TraceError(path, f"not valid JSON ({err.msg})", line=err.lineno, hint="fix the JSON syntax") from err
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise TraceError(path, "missing or empty", field="stages",
                         hint='expected {"stages": {"0": "<device id>", ...}}')
    try:
        by_stage = {int(k): v for k, v in stages.items()}
    except ValueError as err:
        raise TraceError(path, f"stage keys must be integers ({err})", field="stages") from err
    if sorted(by_stage) != list(range(len(by_stage))):
        raise TraceError(path, f"stages {sorted(by_stage)} are not 0..{len(by_stage) - 1}", field="stages",
                         hint="list every pipeline stage exactly once, numbered from 0")
    for stage, device in by_stage.items():
        if not isinstance(device, str) or not device:
            raise TraceError(path, f"device id of stage {stage} is {device!r}", field=f"stages.{stage}",
                             hint="give a non-empty device id string")
    return tuple(by_stage[s] for s in range(len(by_stage)))


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "h100", "a10g", "l4", "cpu", ...
    name: str = ""  # human-readable model, e.g. a CPU model string, when the job recorded one
    node: str = ""  # the node (machine) it sits on, when the job names one (`node:`): devices of one node share it


def _read_yaml_mapping(path: Path, keys: str, empty_ok: bool) -> dict[str, Any]:
    """An optional YAML file holding a mapping: {} when absent (or empty, with `empty_ok`); an error naming the
    file and line when it is not valid YAML, or not a mapping (`keys`: examples of what it should hold)."""
    if not path.is_file():
        return {}
    try:
        data = _load_yaml(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise TraceError(path, f"not valid YAML ({getattr(err, 'problem', err)})",
                         line=mark.line + 1 if mark else None, hint="fix the YAML syntax") from err
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise TraceError(path, "is not a YAML mapping", hint=f"expected keys such as {keys}")
    return data


def read_template(job_dir: Path) -> dict[str, Any]:
    """`hops.base.yaml` as a dict (empty when absent)."""
    return _read_yaml_mapping(job_dir / TEMPLATE, "pipeline: and hardware:", empty_ok=False)


def read_device_types(job_dir: Path, template: dict[str, Any] | None = None) -> dict[str, DeviceInfo]:
    """device id -> type (and name, node), from `hops.base.yaml` `hardware.devices[]` entries {id, gpu, name?,
    node?}."""
    path = job_dir / TEMPLATE
    template = read_template(job_dir) if template is None else template
    if not template:
        raise TraceError(path, "missing: no device types", field="hardware.devices",
                         hint="write hardware: {devices: [{id: <device id>, gpu: <type, e.g. h100 or cpu>}, ...]}")
    devices = (template.get("hardware") or {}).get("devices")
    if not isinstance(devices, list) or not devices:
        raise TraceError(path, "missing or empty", field="hardware.devices",
                         hint="list every device of the stage map as {id: ..., gpu: ...}")
    types: dict[str, DeviceInfo] = {}
    for k, entry in enumerate(devices):
        if not isinstance(entry, dict) or not entry.get("id") or not entry.get("gpu"):
            raise TraceError(path, f"entry {k} is {entry!r}", field=f"hardware.devices[{k}]",
                             hint="each device needs an id and a gpu type")
        types[str(entry["id"])] = DeviceInfo(type=str(entry["gpu"]).lower(), name=str(entry.get("name") or ""),
                                             node=str(entry.get("node") or ""))
    return types


def read_manifest(job_dir: Path) -> dict[str, Any]:
    """Provenance (`manifest.yaml`): source scenario, job ids. Empty when absent."""
    data = _read_yaml_mapping(job_dir / MANIFEST, "source_scenario: and job_id:", empty_ok=True)
    return {str(k): v for k, v in data.items()}


def run_id_of(job_dir: Path, manifest: dict[str, Any] | None = None) -> str:
    """The run's id: the manifest's `run_id` when it has one, else the job directory's name."""
    manifest = read_manifest(job_dir) if manifest is None else manifest
    run_id = manifest.get("run_id")
    return str(run_id) if run_id not in (None, "") else job_dir.resolve().name
