"""What `predict --job` prints for people: the launch, its links and coverage, each schedule's numbers side by side,
the stages, the iteration by kind, the memory per GPU and the kernels, from a `WhatIf` (`hops_calib.whatif.job`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hops_calib.model.kernel_table import KernelTable
from hops_calib.model.kernels import COLLECTIVE, DGRAD, FORWARD, RECOMPUTE, WGRAD
from hops_calib.model.memory import GB, StageMemory, capacity_words
from hops_calib.model.predict import STALL_RANGE_LEVEL
from hops_calib.model.terms.roofline import linear_gemm_precision
from hops_calib.sim.theory import pipeline_schedule_bubble
from hops_calib.spec.arguments import TRACE_FIRST_ITERATION
from hops_calib.whatif.job import WhatIf, experts_of, model_rates, peak_dtype, pricing_inputs
from hops_calib.whatif.plan import PEAK_UNIT


def what_if_text(result: WhatIf) -> str:
    spec, model = result.spec, result.model
    shape = spec.model
    parallel = (
        f" x tp {spec.tp}"
        + (f" x cp {spec.cp}" if spec.cp > 1 else "")
        + f" x dp {spec.dp} = {spec.gpus} {'ranks' if host_only(spec.devices) else 'GPUs'}"
        if spec.gpus > spec.pp
        else ""
    )
    experts = experts_of(spec)
    moe = (
        f"; {experts['num_experts']} experts, top-{experts['moe_router_topk']}, over ep {experts['ep']}"
        + (f" x etp {experts['etp']}" if experts["etp"] != 1 else "")
        + f", expert dp {experts['edp']}"
        if shape.moe
        else ""
    )
    lines = [
        f"{result.job_dir}: {spec.pp} stages{parallel}{moe} ({'-'.join(spec.devices)}), {spec.microbatches} "
        "microbatches x "
        f"{spec.iterations} iterations (the launch's less the {TRACE_FIRST_ITERATION - 1} warm-up ones a trace "
        f"skips), h={shape.hidden_size} s={shape.seq_length} layers={shape.num_layers} "
        f"({'-'.join(str(n) for n in spec.layers_per_stage)}), linear GEMMs in {linear_gemm_precision(spec).upper()}"
        f"; configured schedule {spec.schedule}"
        + (f" v={spec.vp}" if spec.vp > 1 else "")
        + f"; model {model.name} ({model.sha256[:12]}); predicted from the "
        "configuration alone"
    ]
    lines += [f"note: {note}" for note in result.notes]
    if result.hops:
        lines.append(
            "links, by the hosts at each hop's ends: "
            + "; ".join(
                f"{hop.src_stage}-{hop.dst_stage} ({hop.src_device} on {hop.src_host} -> "
                f"{hop.dst_device} on {hop.dst_host}) {hop.link.bandwidth_gbit_s:.1f} Gbit/s from "
                f"{hop.link.source.split(':')[0]}"
                for hop in result.hops
                if hop.link is not None
            )
        )
    if result.end_collective is not None:
        end = result.end_collective
        first, last = result.end_ends()
        priced = f"at {end.link.bandwidth_gbit_s:.1f} Gbit/s and {end.link.latency_ms:.3f} ms" if end.link else ""
        stall = (
            f" + {end.ms - end.transfer_ms:.1f} ms expected retransmission stall ({100 * end.stall_probability:.1f}"
            " % chance)"
            if end.ms > end.transfer_ms
            else ""
        )
        lines.append(
            f"between the ends, before the optimizer: the tied-embedding gradient all-reduce {first} <-> {last}, "
            f"{end.nbytes / 2**20:.1f} MiB {priced + ', ' if priced else ''}priced by {end.source()}: "
            f"{end.transfer_ms:.1f} ms{stall} every iteration, while every rank waits"
        )
    lines.append(f"cluster: {result.cluster or 'none'}")
    if result.extrapolations is None:
        lines.append(f"calibration coverage not checked: {result.calibration}")
    elif result.extrapolations:
        lines.append(
            f"outside the calibration runs ({result.calibration}), priced by parameters nothing there pinned: "
            + "; ".join(e.sentence() for e in result.extrapolations)
        )
    else:
        lines.append(f"within the calibration runs' coverage ({result.calibration})")
    heads = [
        p.schedule if asked == p.schedule else f"{asked}: {p.schedule}"
        for asked, p in zip(result.asked, result.predictions)
    ]
    width = max(14, *(len(head) + 2 for head in heads))
    rates = {id(p): model_rates(p, spec, result.peak_flops_per_s) for p in result.predictions}
    peak = peak_dtype(spec)
    # the stall rows only where a prediction prices a random stall (no TCP retransmission risk: they say nothing)
    priced_stalls = any(p.stall_noise_ape_pct != 0.0 for p in result.predictions)
    stalls = [
        ("  random stalls: +-", lambda p: f"{p.stall_noise_ape_pct:.1f} %"),
        ("  range from stalls", lambda p: "{:.3f}-{:.3f}".format(*p.stall_throughput_range()[:2])),
        ("  share of runs in it", lambda p: f"{100 * p.stall_throughput_range().share:.0f} %"),
    ]
    rows = [
        ("throughput /s (window)", lambda p: f"{p.metrics.throughput_per_s:.3f}"),
        *(stalls if priced_stalls else []),
        ("steady throughput /s", lambda p: f"{p.metrics.steady_throughput_per_s:.3f}"),
        ("samples /s (all replicas)", lambda p: f"{rates[id(p)]['samples_per_s']:.2f}"),
        ("tokens /s (all replicas)", lambda p: f"{rates[id(p)]['tokens_per_s']:.0f}"),
        ("TFLOP/s/GPU model (MFU)", lambda p: f"{rates[id(p)]['model_tflops_per_gpu']:.3g}"),
        (f"  MFU % of {peak} peak", lambda p: f"{100 * rates[id(p)]['mfu']:.1f}"),
        ("TFLOP/s/GPU hardware (HFU)", lambda p: f"{rates[id(p)]['hardware_tflops_per_gpu']:.3g}"),
        (f"  HFU % of {peak} peak", lambda p: f"{100 * rates[id(p)]['hfu']:.1f}"),
        ("iteration time ms", lambda p: f"{p.metrics.iteration_time_ms:.1f}"),
        ("idle share % (bubble)", lambda p: f"{100 * p.metrics.bubble_ratio:.1f}"),
        ("schedule bubble %", lambda p: f"{100 * pipeline_schedule_bubble(p.pipeline, p.schedule):.1f}"),
        ("peak activations (stage mb)", lambda p: f"{max(p.result.peak_stage_activations):g}"),
    ]
    lines.append(f"{'':28}" + "".join(f"{head:>{width}}" for head in heads))
    for label, cell in rows:
        lines.append(f"{label:28}" + "".join(f"{cell(p):>{width}}" for p in result.predictions))
    if result.perturbed and result.perturbations is not None:
        for label, value in (
            ("perturbed: expected /s", lambda e: f"{e.expected:.3f}"),
            ("  95 % interval", lambda e: f"{e.low:.3f}-{e.high:.3f}"),
            ("perturbed: 5th pct /s", lambda e: f"{e.p5:.3f}"),
        ):
            lines.append(f"{label:28}" + "".join(f"{value(e):>{width}}" for e in result.perturbed))
        lines.append(
            f"(perturbed: {result.perturbations.describe()}; expected: the run's work over its expected "
            "wall time, failures in closed form, random stragglers over the draws, with the 95 % interval "
            "of that Monte-Carlo mean)"
        )
    stall_words = (
        f"+-: the mean |error| random TCP retransmission stalls alone would give a real run; range: the "
        f"throughput at least {100 * STALL_RANGE_LEVEL:.0f} % of real runs would show from them alone, whole "
        "stall counts, and the share it really holds; "
        if priced_stalls
        else ""  # the stall rows are printed only where a prediction prices a random stall
    )
    lines.append(
        f"(throughput: microbatches per second, {shape.micro_batch_size} sample(s) each; "
        + stall_words
        + "idle share: the simulated timeline's idle share, HOPS's "
        "bubble, what a trace of the run would measure (the silent stretch before the optimizer included); "
        "schedule bubble: the schedule's own closed form on balanced stages (the launch's mean stage costs): "
        "(p-1)/(v m+p-1) for 1F1B, GPipe and interleaved 1F1B, less for ZB-H1 (its weight gradients fill "
        "the bubble); peak activations: the most "
        f"the busiest rank holds, in {PEAK_UNIT})"
    )
    lines.append(
        "(TFLOP/s per GPU counted two ways: model FLOPs, recomputation not counted, as Megatron-LM logs "
        "'throughput per GPU (TFLOP/s/GPU)', over the peak: model FLOPs utilization, MFU; hardware FLOPs, "
        "the recomputed forward counted as well, as Narayanan et al. (SC'21, eq. 3) count it, over the peak: "
        "hardware FLOPs utilization, HFU"
        + (
            f"; this launch recomputes ({shape.recompute_granularity}), so HFU > MFU)"
            if shape.recompute_granularity
            else "; this launch recomputes nothing, so the two are equal)"
        )
    )
    lines += [f"not predicted: {refused.sentence()}" for refused in result.refused]
    shown = result.predictions[0]
    lines.append("")
    lines.append(f"per stage under {shown.schedule}:")
    lines.append(f"{'stage':>5} {'device':8}{'util':>7}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}")
    for row in shown.stage_phase_ms(spec):
        optimizer = f"{row.optimizer_ms:.2f}" if row.optimizer_ms is not None else "n/a"
        lines.append(
            f"{row.stage:>5} {row.device:8}{shown.metrics.utilization_per_stage[row.stage]:7.3f}"
            f"{row.forward_ms:9.2f}{row.backward_ms:9.2f}{optimizer:>9}"
        )
    gather = result.breakdown[0]["dp_param_gather"] if result.breakdown else 0.0
    shared = bool(spec.cores)
    lines.append(
        "(opt ms: the rank's optimizer phase: its step, the breakdown's optimizer column below"
        + (
            f", plus the distributed optimizer's all-gather of the updated weights after it, {gather:.2f} ms "
            "on stage 0, which the breakdown counts in DP reduce and exposed"
            if gather
            else ""
        )
        + (
            "; fwd, bwd and opt ms are as the simulation served them to ranks sharing a core (processor "
            "sharing: longer while another rank of the core computes), the breakdown their work alone"
            if shared
            else ""
        )
        + ")"
    )
    lines += _breakdown_lines(result)
    lines += pricing_lines(pricing_inputs(spec))
    if result.kernels is not None:
        lines += kernel_table_text(result.kernels)
    return "\n".join(lines)


_PARTS = (
    ("compute", "compute"),
    ("recompute", "of it recomp"),
    ("tp_comm", "TP comm"),
    ("ep_comm", "EP comm"),
    ("cp_comm", "CP comm"),
    ("p2p", "p2p"),
    ("dp_reduce", "DP reduce"),
    ("dp_reduce_exposed", "exposed"),
    ("ends_allreduce", "ends AR"),
    ("optimizer", "optimizer"),
    ("host", "host"),
)


def host_only(devices: Sequence[str]) -> bool:
    """Every device a CPU host's (the catalog's `cpu`: a capture's ranks are processes on its cores), so the words
    are ranks and host memory, not GPUs, CUDA contexts and NCCL buffers."""
    return bool(devices) and all(device == "cpu" for device in devices)


def _breakdown_lines(result: WhatIf) -> list[str]:
    return breakdown_lines(result.breakdown, result.memory)


def breakdown_lines(breakdown: Sequence[Mapping[str, float]], memory: Sequence[StageMemory]) -> list[str]:
    """Per stage: one GPU's work of an iteration by kind, and its peak memory against the device's."""
    unit = "rank" if host_only([stage.device for stage in memory]) else "GPU"
    lines = [
        "",
        f"per stage, one {unit}, ms of one iteration by kind (work summed over its tasks, not the critical path; "
        "of it recomp: the part of compute the recomputed forward adds; "
        "EP comm: the MoE token dispatcher's collectives over the expert groups; CP comm: what context "
        "parallelism's KV exchanges add beyond the attention steps they hide under (context_parallel_comm; 0 without it); "
        "exposed: the part of the DP reduction no backward hides; ends AR: the tied-embedding all-reduce between the "
        "first and last stage before the optimizer, every rank waiting for it):",
        f"{'stage':>5}" + "".join(f"{label:>13}" for _key, label in _PARTS),
    ]
    for k, parts in enumerate(breakdown):
        lines.append(f"{k:>5}" + "".join(f"{parts[key]:13.2f}" for key, _label in _PARTS))
    return [*lines, "", *memory_lines(memory)]


def memory_lines(memory: Sequence[StageMemory]) -> list[str]:
    """Per stage, one GPU's peak memory by what holds it against its device's, in GB; each device's capacity also
    in GiB; the stages that would not fit, and those that fit with less left than `plan --job`'s default headroom."""
    host = host_only([stage.device for stage in memory])
    lines = [
        f"peak memory per {'rank' if host else 'GPU'}, GB (weights, gradients, optimizer state, activations at the "
        "schedule's peak; "
        + (
            "the process's own allocator and fragmentation not counted):"
            if host
            else "CUDA context, NCCL buffers and fragmentation not counted):"
        ),
        f"{'stage':>5}{'weights':>10}{'grads':>10}{'optim':>10}{'activ':>10}{'total':>10}{'device':>10}",
    ]
    for stage in memory:
        lines.append(
            f"{stage.stage:>5}{stage.weights_bytes / GB:10.2f}{stage.gradients_bytes / GB:10.2f}"
            f"{stage.optimizer_bytes / GB:10.2f}{stage.activations_bytes / GB:10.2f}"
            f"{stage.total_bytes / GB:10.2f}{stage.device_bytes / GB:10.2f}" + ("" if stage.fits else "  DOES NOT FIT")
        )
    capacities = {(stage.device, stage.device_bytes): None for stage in memory if stage.device_bytes}
    if capacities:
        lines.append(
            f"(device: {'the host' if host else 'the GPU'}'s memory, "
            + "; ".join(f"{device} {capacity_words(nbytes)}" for device, nbytes in capacities)
            + "; GB: 10^9 bytes; GiB: 2^30 bytes)"
        )
    if not all(stage.fits for stage in memory):
        worst = min(memory, key=lambda stage: stage.headroom_bytes)
        lines.append(
            f"this launch would not fit: stage {worst.stage} needs {worst.total_bytes / GB:.1f} GB of "
            f"{capacity_words(worst.device_bytes)}; more tensor or pipeline parallelism, the distributed "
            "optimizer, recomputation or a smaller micro batch would lower it"
        )
    tight = [stage for stage in memory if stage.fits and not stage.fits_with_headroom]
    if tight:
        reserved = sorted({stage.reserved_bytes for stage in tight})
        spare = (
            f"stage {tight[0].stage} fits with {tight[0].headroom_bytes / GB:.2f} GB to spare"
            if len(tight) == 1
            else "stages "
            + ", ".join(f"{stage.stage} ({stage.headroom_bytes / GB:.2f} GB)" for stage in tight)
            + " fit with that much to spare"
        )
        lines.append(
            f"note: {spare}, less than the {' or '.join(f'{r / GB:g}' for r in reserved)} GB plan leaves for "
            "the CUDA context and NCCL's buffers (plan --memory-headroom): tight for a real run"
        )
    return lines


def timer_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A run's logged timers beside the simulation's (`loop.timers.timer_rows`)."""
    if not rows:
        return []
    lines = ["", "Megatron's logged timers, ms per iteration, the largest over ranks (logged / predicted / error):"]
    for row in rows:
        predicted = (
            f"{row['predicted_ms']:10.2f}{row['error_pct']:+9.1f} %"
            if row["predicted_ms"] is not None
            else f"{'-':>10}  (no predicted counterpart)"
        )
        lines.append(f"  {row['timer']:32}{row['logged_ms']:10.2f}{predicted}")
    return lines


def pricing_lines(inputs: Mapping[str, Any]) -> list[str]:
    """What the launch is priced with besides its configuration (`whatif.job.pricing_inputs`)."""
    links = inputs["link_benchmark"]
    tables = inputs["collective_tables"]
    return [
        "",
        "priced with: link benchmark "
        + (
            ", ".join(f"{a}-{b} {link['bandwidth_gbit_s']:.1f} Gbit/s" for link in links for a, b in [link["stages"]])
            if links
            else "none"
        )
        + "; collective tables "
        + (
            f"{', '.join(f'{op} x{gpus}' for op, gpus in tables['ops_gpus'])} (points {tables['points_sha256'][:12]})"
            if tables
            else "none"
        )
        + f"; transport {inputs['transport'] or 'not stated'}; hops within a node "
        + (
            ", ".join("yes" if same else "no" if same is not None else "?" for same in inputs["hops_within_a_node"])
            or "none (one stage)"
        )
        + (
            " (?: the hardware names no nodes, so whether a hop stays on one is not known)"
            if None in inputs["hops_within_a_node"]
            else ""
        ),
    ]


def kernel_table_text(table: KernelTable) -> list[str]:
    """The table as text lines: one row per kernel, then the totals by phase."""
    lines = [
        (
            f"kernels of virtual stage {table.stage} ({table.device}, {table.layers} layers), per microbatch: "
            "time per launch x launches; bound: what sets the time"
        )
    ]
    lines.append(
        f"  {'kernel':44} {'phase':9} {'M x N x K':22} {'n':>4} {'GFLOP':>9} {'MB':>9} {'ms':>9} {'x n ms':>9}  bound"
    )
    for r in table.rows:
        eff = f" ({100 * r.efficiency:.0f} %)" if r.efficiency is not None and r.op != COLLECTIVE else ""
        lines.append(
            f"  {r.name[:44]:44} {r.phase:9} {r.shape[:22]:22} {r.count:>4} {r.flops / 1e9:>9.3f} "
            f"{r.bytes / 1e6:>9.2f} {r.ms:>9.4f} {r.ms * r.count:>9.3f}  {r.bound}{eff}"
        )
    lines.append(
        "  kernels (ms per microbatch): "
        + ", ".join(f"{phase} {table.total_ms(phase):.3f}" for phase in (FORWARD, DGRAD, WGRAD, RECOMPUTE))
        + "; tensor-parallel collectives: "
        + ", ".join(f"{phase} {table.total_ms(phase, collectives=True):.3f}" for phase in (FORWARD, DGRAD, RECOMPUTE))
    )
    lines += [f"  note: {note}" for note in table.notes]
    return lines
