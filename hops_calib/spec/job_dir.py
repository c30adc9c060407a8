"""The spec of a job directory, from its configuration files alone (`build_spec`), and the cores its ranks share
(`shared_cores`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeGuard

from hops_calib.spec.arguments import _require_int, check_simulable, spec_from_args
from hops_calib.spec.assumptions import require_modelled, unknown_flags_note
from hops_calib.spec.schedules import declared_schedule_of
from hops_calib.spec.types import Hardware, Spec


def _lists_cores(cores: Any) -> TypeGuard[list[int]]:
    """Whether `manifest.yaml`'s `cores` lists a core (an integer) for each rank."""
    return isinstance(cores, list) and bool(cores) and all(type(c) is int for c in cores)


def shared_cores(cores: Any, gpus: int) -> tuple[int, ...]:
    """The core of every rank (`manifest.yaml`'s `cores`, one per rank of a launch of `gpus`) when some ranks
    share a core, which `Spec.core_load` then prices by processor sharing; () otherwise."""
    if not _lists_cores(cores) or len(cores) != gpus:
        return ()
    return tuple(cores) if len(set(cores)) < len(cores) else ()


def _ranks_per_core(cores: Any) -> float:
    """Ranks per core of a capture whose manifest lists each rank's core (`cores`), when ranks share cores; else 1."""
    if not _lists_cores(cores):
        return 1.0
    return len(cores) / len(set(cores))


def core_sharing_note(manifest: dict[str, Any], path: Path) -> str | None:
    """A note when `ranks_share_cores` disagrees with `cores`, else None. The capture writes the flag from `cores`
    (true when two ranks list one core: hops_calib/capture/launch.py) and nothing reads it back: the spec prices
    the sharing from `cores` alone (`shared_cores`), so the note says which the prediction follows."""
    from hops_calib.trace.reading import read_config_text, yaml_key_line

    cores, said = manifest.get("cores"), manifest.get("ranks_share_cores")
    if said is None or not _lists_cores(cores):
        return None
    shared = len(set(cores)) < len(cores)
    if said is shared:
        return None
    groups = {c: [r for r, core in enumerate(cores) if core == c] for c in dict.fromkeys(cores)}
    how = (
        "; ".join(f"ranks {', '.join(map(str, ranks))} share core {c}" for c, ranks in groups.items() if len(ranks) > 1)
        if shared
        else "every rank has a core of its own"
    )
    line = yaml_key_line(read_config_text(path), "ranks_share_cores")
    said_text = str(said).lower() if isinstance(said, bool) else repr(said)
    return (
        f"{path}{f':{line}' if line else ''}: field 'ranks_share_cores' says {said_text}, but its cores "
        f"{cores} say {how}: priced as `cores` says ({'processor sharing' if shared else 'a core per rank'}); "
        f"the capture writes the flag from `cores`, so fix `cores` if it is wrong, else set ranks_share_cores: "
        f"{str(shared).lower()}"
    )


def build_spec(job_dir: Path | str, notes: list[str] | None = None, *, simulable: bool = False) -> Spec:
    """The spec of a job directory, from its configuration files alone (through `spec_from_args`).

    Reads `megatron_args.txt` (or a rank log's arguments block), `hops_trace_map.json`,
    `hops.base.yaml`, `calibration/link_bench/` and `manifest.yaml`; never the
    event logs in `megatron_trace/` (rule 1: a prediction sees no measurement of
    the run it predicts). Remarks that do not stop the build go to `notes`. With `simulable`, the launch must also
    be one the simulator times (`check_simulable`, naming the file its arguments came from): ingest and predict ask
    it; a plan, which searches other launches of the job, does not.
    """
    from hops_calib.trace import (
        TraceError,
        find_launch,
        read_device_types,
        read_link_fits,
        read_manifest,
        read_stage_map,
        read_template,
        run_id_of,
    )
    from hops_calib.trace.job import LINK_BENCH_DIR, MANIFEST, STAGE_MAP, TEMPLATE
    from hops_calib.trace.megatron_args import ARGS_FILE

    job_dir = Path(job_dir)
    notes = [] if notes is None else notes
    manifest = read_manifest(job_dir)
    run_id = run_id_of(job_dir, manifest)
    launch = find_launch(job_dir)  # read once: the arguments and torchrun's placement
    args, args_source = launch.args, launch.source
    require_modelled(args, args_source)  # before the job's other files: the launch is refused whatever they say
    if args_source.name == ARGS_FILE:  # a command line as a user writes it (a rank log's block: Megatron's own names)
        note = unknown_flags_note(args, args_source)
        if note:
            notes.append(note)
    pp = _require_int(args, "pipeline_model_parallel_size", args_source, default=1, minimum=1)

    device_ids = read_stage_map(job_dir)
    template = read_template(job_dir)
    template_stages = (
        (template.get("pipeline") or {}).get("stages") if isinstance(template.get("pipeline"), dict) else None
    )
    if isinstance(template_stages, list) and len(device_ids) == pp:
        if len(template_stages) != pp:
            raise TraceError(
                job_dir / TEMPLATE,
                f"lists {len(template_stages)} stages but {args_source.name} says --pipeline-model-parallel-size {pp}",
                field="pipeline.stages",
                hint="the template and the launch configuration describe different pipelines (a "
                "template from another job?): fix pipeline.stages, or the launch configuration",
            )
        order = [entry.get("device") if isinstance(entry, dict) else None for entry in template_stages]
        if all(order) and tuple(order) != tuple(device_ids):
            raise TraceError(
                job_dir / TEMPLATE,
                f"puts the devices in the order {order}, {STAGE_MAP} in {list(device_ids)}",
                field="pipeline.stages",
                hint="the two must agree; after reordering stages (a what-if), reorder both; each hop "
                "is priced by the hosts at its ends, so give predict --cluster (`hops-calib "
                "cluster` builds one from job directories) or re-run the link benchmark",
            )
    device_types = read_device_types(job_dir, template)
    missing = [d for d in device_ids if d not in device_types]
    if missing:
        raise TraceError(
            job_dir / TEMPLATE,
            f"has no entry for device {missing[0]!r} of the stage map",
            field="hardware.devices",
            hint="add {id: <device id>, gpu: <type>} for every mapped device",
        )
    hardware = Hardware(
        devices=tuple(device_types[d].type for d in device_ids),
        device_ids=device_ids,
        device_names=tuple(device_types[d].name for d in device_ids),
        nodes=tuple(device_types[d].node for d in device_ids),
        source=job_dir / STAGE_MAP,
    )

    links = read_link_fits(job_dir / LINK_BENCH_DIR, pp, notes) if len(device_ids) == pp else ()
    transport = launch.transport()  # the training launch's own environment, where it says, over the benchmark's
    other = sorted({fit.transport for fit in links if fit.transport and fit.transport != transport})
    if transport and other:
        notes.append(
            f"{LINK_BENCH_DIR} ran over {', '.join(other)}, {args_source.name}'s environment sets "
            f"{transport}: the links are priced as the launch's transport"
        )
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR, read_collective_tables

    cores = manifest.get("cores")
    world = args.get("world_size")
    if isinstance(cores, list) and cores and type(world) is int and len(cores) != world:
        # a capture's copy relaunched on more ranks: the cores it lists no longer say how ranks share them
        raise TraceError(
            job_dir / MANIFEST,
            f"lists {len(cores)} cores (one per rank of the capture) for a launch of {world} ranks",
            field="cores",
            hint=f"list each of the {world} ranks' core (e.g. [0, 1, 0, 1, ...] for {world} ranks on 2 "
            "cores: ranks sharing a core are served by processor sharing; ranks_share_cores: true beside "
            "it), or remove `cores` to price each rank a device of its own",
        )
    note = core_sharing_note(manifest, job_dir / MANIFEST)
    if note:
        notes.append(note)
    scenario = str(manifest.get("source_scenario") or "")
    spec = spec_from_args(
        args,
        args_source,
        run_id=run_id,
        hardware=hardware,
        links=links,
        collectives=read_collective_tables(job_dir / ALLREDUCE_DIR),
        configured=manifest.get("configured_schedule"),
        schedule_source=job_dir / MANIFEST,
        ranks_per_device=_ranks_per_core(cores),
        declared_schedule=declared_schedule_of(template, [run_id, scenario.rsplit("/", 1)[-1]]),
        notes=notes,
    )
    sharing = shared_cores(cores, spec.gpus)
    if sharing:  # which ranks share a core: priced by processor sharing
        spec = dataclasses.replace(spec, cores=sharing)
    per_node = launch.gpus_per_node
    if per_node is not None and spec.gpus_per_node is None:
        # A multi-node torchrun launch places global rank r on node r // nproc-per-node: the groups that span nodes
        # (a data-parallel group across nodes, say) are priced over the NICs, not the node's NVLink table.
        spec = dataclasses.replace(spec, gpus_per_node=per_node)
        notes.append(
            f"{args_source.name}: torchrun --nnodes > 1 with --nproc-per-node {per_node}: global rank r on "
            f"node r // {per_node} (Megatron's rank order {spec.rank_order}), collectives of groups that "
            "span nodes priced over the nodes' NICs"
        )
    if not spec.links and pp > 1 and len(device_ids) == pp and spec.gpus_per_node is None and launch.one_node_gpus:
        # a one-node torchrun launch without a link benchmark: every hop stays on the node, over its NVLink
        spec = dataclasses.replace(spec, gpus_per_node=launch.one_node_gpus)
    if transport:
        spec = dataclasses.replace(spec, transport=transport)
    from hops_calib.trace.component_tables import COMPONENTS_DIR, read_component_tables

    components = read_component_tables(job_dir / COMPONENTS_DIR)
    if components:  # the machine's GEMM and memory tables, which the kernel terms price with
        spec = dataclasses.replace(spec, component_tables=components)
    if not spec.links and pp > 1 and len(device_ids) == pp and spec.gpus_per_node:
        notes.append(
            f"no link benchmark in {LINK_BENCH_DIR}: each hop priced by NVLink within a node and by the "
            "GPU's share of its node's NICs across nodes (the launch's placement)"
        )
    elif not spec.links and pp > 1 and len(device_ids) == pp:
        notes.append(
            f"no link benchmark in {LINK_BENCH_DIR}: the spec has no link fits, so predict, evaluate and "
            f"report refuse this run until its benchmark (pair_<i>_<i+1>.jsonl) is added and it is ingested "
            f"again (stages on one node, hardware.devices[].node, are priced from {ALLREDUCE_DIR}/ when it "
            "holds the node's all-reduce tables)"
        )
    if simulable:
        check_simulable(spec, args_source)
    return spec
