"""Trace room: readers of cluster output (event logs, Megatron arguments, stage map, devices, link benchmark, manifest).

Each reader streams its file and raises `TraceError` naming file, line, field
and the fix when the input is bad. Nothing here knows about fixtures or metrics.
"""

from hops_calib.trace.errors import TraceError
from hops_calib.trace.events import EVENT_DTYPES, RankLogReport, read_rank_events
from hops_calib.trace.job import (
    DeviceInfo,
    find_job_dirs,
    rank_files,
    read_device_types,
    read_manifest,
    read_stage_map,
    read_template,
    run_id_of,
)
from hops_calib.trace.link_bench import LinkFit, fit_link, read_link_fits
from hops_calib.trace.megatron_args import find_arguments, parse_arguments_block, parse_command_line

__all__ = [
    "EVENT_DTYPES", "DeviceInfo", "LinkFit", "RankLogReport", "TraceError", "find_arguments", "find_job_dirs",
    "fit_link", "parse_arguments_block", "parse_command_line", "rank_files", "read_device_types", "read_link_fits",
    "read_manifest", "read_rank_events", "read_stage_map", "read_template", "run_id_of",
]
