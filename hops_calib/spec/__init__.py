"""Spec room: what a prediction may see, the spec of a run, known before it ran.

A `Spec` is built from the launch configuration, the stage-to-device map, the
device types and the link benchmark (a separate job). It never holds anything
measured from the run's own events (rule 1 of the design); `truth` holds those.

    types        Spec, ModelShape, Hardware, and Megatron's rank order
    schedules    the schedules a spec may ask for, and the labels naming them
    arguments    Megatron's arguments read into a spec (`spec_from_args`, pure)
    assumptions  the launch settings the cost model prices, and the refusal of others
    stage_layers which decoder layers each pipeline stage builds, as Megatron splits them
    job_dir      the spec of a job directory (`build_spec`), and the cores its ranks share

The names below are imported from their module on first use: the simulator needs
only SCHEDULES, and importing the package for it would load the trace readers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULE_OF = {
    "SCHEDULES": "schedules",
    "SCHEDULE_ALIASES": "schedules",
    "declared_schedule_of": "schedules",
    "normalize_schedule_label": "schedules",
    "Hardware": "types",
    "ModelShape": "types",
    "Spec": "types",
    "coordinates_of": "types",
    "expert_data_parallel_size": "types",
    "global_rank": "types",
    "CollectiveTable": "types",
    "LinkFit": "types",
    "MAX_INDEX": "arguments",
    "MAX_PER_ITERATION": "arguments",
    "RANK_ORDERS": "arguments",
    "RECOMPUTE_GRANULARITIES": "arguments",
    "RECOMPUTE_METHODS": "arguments",
    "TRACE_FIRST_ITERATION": "arguments",
    "attention_kernel_of": "arguments",
    "check_simulable": "arguments",
    "configured_schedule": "arguments",
    "layer_settings_of": "arguments",
    "rank_order_of": "arguments",
    "recomputation_of": "arguments",
    "spec_from_args": "arguments",
    "split_layers": "stage_layers",
    "stage_layers_of": "arguments",
    "ASSUMPTIONS": "assumptions",
    "Assumption": "assumptions",
    "FSDP_STRATEGIES": "assumptions",
    "fsdp_strategy": "assumptions",
    "TYPO_SIMILARITY": "assumptions",
    "Unmodelled": "assumptions",
    "require_modelled": "assumptions",
    "unknown_flags": "assumptions",
    "unknown_flags_note": "assumptions",
    "unmodelled": "assumptions",
    "build_spec": "job_dir",
    "core_sharing_note": "job_dir",
    "shared_cores": "job_dir",
}

__all__ = [
    "ASSUMPTIONS",
    "FSDP_STRATEGIES",
    "MAX_INDEX",
    "MAX_PER_ITERATION",
    "RANK_ORDERS",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "SCHEDULES",
    "SCHEDULE_ALIASES",
    "TRACE_FIRST_ITERATION",
    "TYPO_SIMILARITY",
    "Assumption",
    "CollectiveTable",
    "Hardware",
    "LinkFit",
    "ModelShape",
    "Spec",
    "Unmodelled",
    "attention_kernel_of",
    "build_spec",
    "check_simulable",
    "configured_schedule",
    "coordinates_of",
    "core_sharing_note",
    "declared_schedule_of",
    "expert_data_parallel_size",
    "fsdp_strategy",
    "global_rank",
    "layer_settings_of",
    "normalize_schedule_label",
    "rank_order_of",
    "recomputation_of",
    "require_modelled",
    "shared_cores",
    "spec_from_args",
    "split_layers",
    "stage_layers_of",
    "unknown_flags",
    "unknown_flags_note",
    "unmodelled",
]

if TYPE_CHECKING:  # what a type checker sees; at run time `__getattr__` imports each on first use
    from hops_calib.spec.arguments import (
        MAX_INDEX,
        MAX_PER_ITERATION,
        RANK_ORDERS,
        RECOMPUTE_GRANULARITIES,
        RECOMPUTE_METHODS,
        TRACE_FIRST_ITERATION,
        attention_kernel_of,
        check_simulable,
        configured_schedule,
        layer_settings_of,
        rank_order_of,
        recomputation_of,
        spec_from_args,
        stage_layers_of,
    )
    from hops_calib.spec.assumptions import (
        ASSUMPTIONS,
        FSDP_STRATEGIES,
        TYPO_SIMILARITY,
        Assumption,
        Unmodelled,
        fsdp_strategy,
        require_modelled,
        unknown_flags,
        unknown_flags_note,
        unmodelled,
    )
    from hops_calib.spec.job_dir import build_spec, core_sharing_note, shared_cores
    from hops_calib.spec.schedules import SCHEDULE_ALIASES, SCHEDULES, declared_schedule_of, normalize_schedule_label
    from hops_calib.spec.stage_layers import split_layers
    from hops_calib.spec.types import (
        CollectiveTable,
        Hardware,
        LinkFit,
        ModelShape,
        Spec,
        coordinates_of,
        expert_data_parallel_size,
        global_rank,
    )


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
