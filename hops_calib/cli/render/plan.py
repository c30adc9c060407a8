"""What `plan` prints for people: the abstract plan (`hops_calib.whatif.plan`), the launches of a real job
(`hops_calib.whatif.job_plan`) and its parallel layouts (`hops_calib.whatif.layouts`)."""

from __future__ import annotations

from hops_calib.model.memory import GB, capacity_words
from hops_calib.whatif.job_plan import JobPlan
from hops_calib.whatif.launch_pricing import Outcome
from hops_calib.whatif.layouts import Layout, LayoutPlan
from hops_calib.whatif.plan import PEAK_UNIT, Plan


def format_plan(result: Plan) -> str:
    """A plain-text table of the plan, chosen schedule first."""
    header = f"{'schedule':<18}{'flushes':>8}{'peak act.':>11}{'makespan':>11}{'bubble':>9}{'util.':>8}"
    lines = [header]
    for c in result.candidates:
        mark = "*" if c is result.chosen else " "
        lines.append(
            f"{mark}{c.schedule:<17}{c.flushes:>8}{c.peak_activations:>11g}{c.makespan:>11g}"
            f"{c.bubble:>9.3f}{c.utilization:>8.3f}"
        )
    for r in result.rejected:
        lines.append(f" {r.schedule}: not feasible, {r.reason}")
    chosen = result.chosen
    lines.append(
        f"chosen: {chosen.schedule}"
        + (f" in {chosen.flushes} flushes" if chosen.flushes > 1 else "")
        + f" (utilization {chosen.utilization:.3f})"
    )
    forms = result.closed_form
    lines.append(
        "closed form, balanced stages: 1F1B bubble (p-1)/(m+p-1) = "
        f"{forms['bubble_1f1b']:.3f}"
        + (
            f", interleaved (p-1)/(v m+p-1) = {forms['bubble_interleaved']:.3f}"
            if "bubble_interleaved" in forms
            else ""
        )
    )
    lines.append(f"peak act.: activations on the fullest device, in {PEAK_UNIT}")
    if "microbatches_for_target_bubble" in result.closed_form:
        lines.append(
            f"balanced 1F1B reaches bubble <= {result.closed_form['target_bubble']:g} with "
            f"{result.closed_form['microbatches_for_target_bubble']:g} microbatches"
        )
    return "\n".join(lines)


def format_job_plan(plan: JobPlan) -> str:
    """The plan as text: the best launches with their numbers and launch changes, then the job's own."""
    lines = [
        f"{plan.job}: model {plan.model}; search {plan.search}; {plan.evaluated:,} distinct launches priced "
        f"of {plan.space:,} candidates; "
        f"ranked by {'nominal throughput' if plan.rank_by == 'throughput' else plan.rank_by + ' throughput'}",
        f"cluster: {plan.cluster or 'none'}; calibration runs: {plan.store or 'not checked'}",
    ]
    capacity, headroom = plan.capacity_bytes or {}, plan.headroom_bytes or {}
    if capacity:
        lines.append(
            "memory per GPU: "
            + "; ".join(
                f"{kind} {capacity_words(capacity[kind])} less {headroom.get(kind, 0) / GB:.2f} GB headroom = "
                f"{(capacity[kind] - headroom.get(kind, 0)) / GB:.2f} GB for every pick"
                for kind in sorted(capacity)
            )
            + " (headroom: the CUDA context, about 1 GB, and NCCL's buffers, NCCL_BUFFSIZE 4 MiB per peer, channel "
            "and communicator, 0.54 GB; none on a CPU; --memory-headroom GB sets it)"
        )
    lines.append(
        "schedules: "
        + (
            "every runtime's (--any-runtime: ZB-H1 and GPipe have no Megatron-LM flag)"
            if plan.any_runtime
            else "Megatron-LM's (1F1B, interleaved 1F1B); --any-runtime adds ZB-H1, GPipe and auto"
        )
    )
    if plan.band_source:
        lines.append(f"uncertainty of samples/s: {plan.band_source}")
    lines += [f"note: {note}" for note in plan.notes]
    header = (
        f"{'#':>2} {'samples/s':>10} {'steady':>8} {'idle %':>7} {'sched. bubble %':>16} {'peak GB/GPU':>12}"
        + (f" {'expected':>9} {'p5':>7}" if plan.best and plan.best[0].expected_samples_per_s is not None else "")
        + "  launch"
    )
    lines.append(header)

    def usable(cap: float) -> str:
        """Which device's capacity less its headroom `cap` is, in words ("" where none is)."""
        kinds = [kind for kind in sorted(capacity) if abs(capacity[kind] - headroom.get(kind, 0) - cap) < 1]
        if not kinds:
            return ""
        kind = kinds[0]
        return f", {kind}'s {capacity_words(capacity[kind])} less {headroom.get(kind, 0) / GB:.2f} GB headroom"

    def row(tag: str, o: Outcome) -> list[str]:
        extra = (
            f" {o.expected_samples_per_s:9.3f} {o.p5_samples_per_s:7.3f}"
            if o.expected_samples_per_s is not None
            else ""
        )
        resolved = f" (auto -> {o.resolved})" if o.launch.schedule == "auto" else ""
        out = [
            f"{tag:>2} {o.samples_per_s:10.3f} {o.steady_samples_per_s:8.3f} {100 * o.idle_share:7.1f} "
            f"{100 * o.schedule_bubble:16.1f} {max(o.peak_memory_bytes) / GB:12.2f}{extra}  "
            f"{o.launch.label()}{resolved}; layers {'-'.join(map(str, o.layers_per_stage))}"
            + (f"; d {o.dp}" if o.settings is not None and o.launch.levers is not None else "")
            + (f", expert d {o.edp}" if o.edp is not None and o.launch.levers is not None else "")
            + f"; {o.precision.upper()}"
            + (
                f"; {o.samples_per_s * (1 - o.band):.3f}-{o.samples_per_s * (1 + o.band):.3f} samples/s"
                if o.band
                else ""
            )
        ]
        out += [f"{'':>5}change: {flag}" for flag in o.flags] or [f"{'':>5}(the job's own launch)"]
        if not o.fits:
            over = [
                f"stage {r} {peak / GB:.2f} > {cap / GB:.2f} GB{usable(cap)}"
                for r, (peak, cap) in enumerate(zip(o.peak_memory_bytes, o.memory_bytes))
                if peak > cap
            ]
            out.append(f"{'':>5}DOES NOT FIT in memory: " + "; ".join(over))
        if o.outside:
            out.append(f"{'':>5}outside the calibration runs (extrapolated): " + "; ".join(o.outside))
        return out

    for k, outcome in enumerate(plan.best, start=1):
        lines += row(str(k), outcome)
    if not plan.best:
        lines.append("no launch runs, is priced and fits in memory (see below): nothing to recommend")
    if plan.best_megatron is not None and plan.best_megatron.launch not in [o.launch for o in plan.best]:
        lines.append("best that Megatron-LM runs as it is (1F1B or interleaved 1F1B):")
        lines += row("M", plan.best_megatron)
    if plan.current is not None:
        lines += row("now", plan.current)
    if plan.over_memory:
        lines.append(f"{plan.over_memory} launch(es) left out: peak memory above a device's capacity")
    for count, reasons, example in plan.refusal_kinds()[:5]:
        lines.append(
            f"{count} launch(es) "
            + ("unpriced" if example.startswith("no link") else "cannot run")
            + (f": {example}" if reasons == 1 else f", {reasons} cases of one reason, e.g.: {example}")
        )
    widths = [
        100 * (o.expected_ci95[1] - o.expected_ci95[0]) / 2 / o.expected_samples_per_s
        for o in (*plan.best, *([plan.current] if plan.current else []))
        if o.expected_ci95 is not None and o.expected_samples_per_s is not None
    ]
    if widths:
        lines.append(
            f"expected: the run's work over its expected wall time (failures in closed form, random "
            f"stragglers over the draws): its 95 % interval is within +-{max(widths):.2f} %"
            + ("" if max(widths) <= 0.5 else "; give more --samples to narrow it")
        )
    agree, compared = plan.auto_agreement
    if compared:
        lines.append(f"auto (HopsHetero rule) picked the faster of 1f1b/zb_h1 in {agree} of {compared} launches")
    lines.append(
        "samples/s: predicted window throughput (microbatches x micro batch size x data-parallel replicas "
        "per second); steady: over the median iteration; idle %: the simulated timeline's idle share (HOPS's bubble, what a trace of "
        "the launch would measure, with the silent stretch before the optimizer); sched. bubble %: the "
        "schedule's own closed form on balanced stages (the launch's mean stage costs): (p-1)/(v m+p-1) for 1F1B, "
        "GPipe and interleaved 1F1B, less for ZB-H1; peak GB/GPU: weights, gradients, optimizer "
        "state and peak activations on the fullest GPU (GB: 10^9 bytes; GiB: 2^30 bytes); FP8, BF16, FP16, FP32: the precision of the "
        "launch's linear GEMMs (FP8: Transformer Engine's, with 16-bit weights)"
    )
    return "\n".join(lines)


def format_layout_plan(plan: LayoutPlan) -> str:
    lines = [
        f"{plan.job}: {plan.gpus} {plan.device} GPUs, {plan.gpus_per_node} per node; {plan.priced} layouts "
        f"priced ({plan.over_memory} would not fit the GPUs' memory, left out), {plan.refused} refused "
        "(Megatron's shape rules or what the model does not price)"
    ]
    header = (
        f"{'#':>3} {'t':>3} {'p':>3} {'d':>4} {'mb':>3} {'samples/s':>10} {'MFU %':>6} {'iter ms':>10} {'GB/GPU':>7}"
    )
    lines.append(header)

    def row(rank: str, layout: Layout) -> str:
        return (
            f"{rank:>3} {layout.tp:>3} {layout.pp:>3} {layout.dp:>4} {layout.micro_batch_size:>3} "
            f"{layout.samples_per_s:>10.2f} {100 * layout.mfu:>6.1f} {layout.iteration_ms:>10.1f} "
            f"{layout.peak_memory_bytes / GB:>7.1f}" + ("" if layout.fits else "  does not fit")
        )

    for k, layout in enumerate(plan.best, 1):
        lines.append(row(str(k), layout))
    current = plan.current
    lines.append(row("job", current) if not current.refused else f"job {current.name}: {current.refused}")
    lines.append(
        "samples/s: every data-parallel replica's; MFU: model FLOPs (3x forward, LM head, no recomputation) "
        "over the GPUs' peak; GB/GPU (GB: 10^9 bytes): the most any stage's GPU holds (weights, gradients, optimizer state, "
        "activations at the schedule's peak) against the device's capacity, with no room counted for the "
        "CUDA context, NCCL buffers or fragmentation (a few GB: prefer a layout with that headroom). The "
        "launch's other settings are kept; ranks are placed on nodes as the launch places them."
    )
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
