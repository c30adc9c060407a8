"""Trace room: readers of cluster output (event logs, Megatron arguments, stage map, devices, link benchmark, manifest).

Each reader streams its file and raises `TraceError` naming file, line, field
and the fix when the input is bad. Nothing here knows about fixtures or metrics.

The names below are imported from their module on first use: a spec needs only
`LinkFit`, and importing the package for it would load every reader (YAML among
them) into each verb's start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for the type checker (at run time each loads on first use, below)
    from hops_calib.trace.errors import TraceError
    from hops_calib.trace.events import EVENT_DTYPES, RankLogReport, read_rank_events
    from hops_calib.trace.job import (
        DeviceInfo,
        find_job_dirs,
        is_job_dir,
        rank_files,
        read_device_types,
        read_manifest,
        read_stage_map,
        read_template,
        require_job_dir,
        run_id_of,
    )
    from hops_calib.trace.link_bench import LinkFit, fit_link, read_link_fits
    from hops_calib.trace.megatron_args import (
        Launch,
        find_arguments,
        find_launch,
        parse_arguments_block,
        parse_command_line,
    )

_MODULE_OF = {
    "TraceError": "errors",
    "EVENT_DTYPES": "events",
    "RankLogReport": "events",
    "read_rank_events": "events",
    "DeviceInfo": "job",
    "find_job_dirs": "job",
    "rank_files": "job",
    "read_device_types": "job",
    "read_manifest": "job",
    "read_stage_map": "job",
    "read_template": "job",
    "run_id_of": "job",
    "is_job_dir": "job",
    "require_job_dir": "job",
    "LinkFit": "link_bench",
    "fit_link": "link_bench",
    "read_link_fits": "link_bench",
    "Launch": "megatron_args",
    "find_arguments": "megatron_args",
    "find_launch": "megatron_args",
    "parse_arguments_block": "megatron_args",
    "parse_command_line": "megatron_args",
}

__all__ = sorted(_MODULE_OF)  # noqa: PLE0605 - the lazily loaded names are the table's keys


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
