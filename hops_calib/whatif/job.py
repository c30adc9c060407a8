"""What-if: predict a configuration that has not run yet, from a job directory's configuration files alone.

The question a user asks before spending GPU hours: what would this launch do on these nodes? A job
directory holds what Megatron is launched with (`megatron_args.txt`), which device runs which stage
(`hops_trace_map.json`, `hops.base.yaml`) and the link benchmark (`calibration/link_bench/`); the event
logs are not needed and, when present, not read (the spec is built by `build_spec`, which never opens
them). Edit a copy of a directory (another --micro-batch-size, another stage order) and predict it, under
the configured schedule and the ones users compare against.

Each hop is priced by the hosts at its two ends (`whatif.cluster`): the job's own benchmark of that host pair, else
the cluster's (benchmarked or declared); a hop nothing prices is refused with what to add. Under stragglers and
failures (`whatif.perturbations`) each schedule's throughput is also given as the mean and 5th percentile of seeded
draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.model.coverage import Coverage, Extrapolation, extrapolations
from hops_calib.model.memory import StageMemory
from hops_calib.model.memory import launch_memory as memory_launch
from hops_calib.model.predict import Prediction
from hops_calib.model.terms.roofline import linear_gemm_precision
from hops_calib.sim.theory import pipeline_schedule_bubble
from hops_calib.spec import SCHEDULES, Spec
from hops_calib.whatif.cluster import Cluster
from hops_calib.whatif.link_book import Hop
from hops_calib.whatif.perturbations import Estimate, Perturbations
from hops_calib.whatif.plan import PEAK_KEY

CHOICES = (*SCHEDULES, "auto")


@dataclass(frozen=True)
class Refused:
    """A schedule asked for that cannot run this configuration: why, and what to change in the launch so it can."""

    asked: str
    reason: str
    how: str

    def sentence(self) -> str:
        return f"{self.asked} cannot run this configuration: {self.reason}; to run it, {self.how}"

    def to_dict(self) -> dict[str, str]:
        return {"asked": self.asked, "reason": self.reason, "how": self.how}


@dataclass(frozen=True)
class WhatIf:
    job_dir: Path
    spec: Spec
    model: Model
    predictions: tuple[Prediction, ...]  # one per schedule asked for that can run, in the order asked
    asked: tuple[str, ...]  # those schedules ("auto" resolves to the one it picked: Prediction.schedule)
    notes: tuple[str, ...]  # remarks of the spec build (a missing link benchmark, ...)
    # Where the configuration lies outside the calibration runs (None: not checked, no calibration runs given).
    extrapolations: tuple[Extrapolation, ...] | None = None
    calibration: str = ""  # which runs the configuration was compared with
    refused: tuple[Refused, ...] = ()  # the schedules asked for that cannot run it, in the order asked
    hops: tuple[Hop, ...] = ()  # every hop as priced: devices, hosts, link
    perturbations: Perturbations | None = None
    # per prediction, its throughput (microbatches/s) under the perturbations (`whatif.perturbations.Estimate`)
    perturbed: tuple[Any, ...] = ()
    end_collective: Any = None  # the all-reduce between the pipeline's ends (model.terms.embedding.EndCollective)
    cluster: str = ""  # the cluster file used, and where it was set ("" none)
    breakdown: tuple[dict[str, float], ...] = ()  # per stage, ms of one iteration by kind (`Model.breakdown`)
    memory: tuple[StageMemory, ...] = ()  # per stage, one GPU's peak under the first schedule predicted
    kernels: Any = None  # the kernel table of one stage when asked for (`model.kernel_table.KernelTable`)

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.memory)

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "job": str(self.job_dir),
            "run_id": spec.run_id,
            "model": self.model.name,
            "model_sha256": self.model.sha256,
            "notes": list(self.notes),
            "calibration": self.calibration,
            "extrapolations": (None if self.extrapolations is None else [e.to_dict() for e in self.extrapolations]),
            "configuration": {
                "pp": spec.pp,
                "vp": spec.vp,
                "devices": list(spec.devices),
                "microbatches": spec.microbatches,
                "iterations": spec.iterations,
                "layers_per_stage": list(spec.layers_per_stage),
                "schedule": spec.schedule,
                "hidden_size": spec.model.hidden_size,
                "seq_length": spec.model.seq_length,
                "num_layers": spec.model.num_layers,
                "tp": spec.tp,
                "cp": spec.cp,
                "dp": spec.dp,
                "gpus": spec.gpus,
                **experts_of(spec),
                "precision": linear_gemm_precision(spec),
                "sequence_parallel": spec.model.sequence_parallel,
                "distributed_optimizer": spec.distributed_optimizer,
                "overlap_grad_reduce": spec.overlap_grad_reduce,
                "recompute": spec.model.recompute_granularity,
                "attention_kernel": spec.model.attention_kernel,
                "rank_order": spec.rank_order,
            },
            "breakdown_ms_per_iteration": [{"stage": k, **parts} for k, parts in enumerate(self.breakdown)],
            "memory": [stage.to_dict() for stage in self.memory],
            "fits": self.fits,
            "memory_headroom_bytes": memory_headroom_bytes(self.memory),
            "pricing_inputs": pricing_inputs(spec),
            "cluster": self.cluster or None,
            "links": [hop.to_dict() for hop in self.hops],
            "end_collective": self.end_collective_dict(),
            "perturbations": self.perturbations.describe() if self.perturbations is not None else None,
            "predictions": [
                {
                    "asked": asked,
                    **_prediction_dict(p, spec, self.peak_flops_per_s),
                    **({"perturbed_throughput_per_s": estimate.to_dict()} if estimate else {}),
                }
                for asked, p, estimate in zip(
                    self.asked, self.predictions, self.perturbed or [None] * len(self.predictions)
                )
            ],
            "refused": [r.to_dict() for r in self.refused],
            **({"kernels": self.kernels.to_dict()} if self.kernels is not None else {}),
        }

    @property
    def peak_flops_per_s(self) -> float:
        """The devices' dense tensor peak (`peak_dtype`), averaged over the stages (MFU's denominator)."""
        return peak_flops_per_s(self.spec, self.model)

    def end_ends(self) -> tuple[str, str]:
        """The devices and hosts of the first and the last stage, in words."""
        ids = self.spec.device_ids
        hosts = {h.src_device: h.src_host for h in self.hops} | {h.dst_device: h.dst_host for h in self.hops}

        def stage(k: int) -> str:
            return f"stage {k} ({ids[k]}{' on ' + hosts[ids[k]] if hosts.get(ids[k]) else ''})"

        return stage(0), stage(len(ids) - 1)

    def end_collective_dict(self) -> dict[str, Any] | None:
        if self.end_collective is None:
            return None
        ids = self.spec.device_ids
        hosts = {h.src_device: h.src_host for h in self.hops} | {h.dst_device: h.dst_host for h in self.hops}
        return {
            **self.end_collective.to_dict(),
            "stages": [0, len(ids) - 1],
            "devices": [ids[0], ids[-1]],
            "hosts": [hosts.get(ids[0]) or None, hosts.get(ids[-1]) or None],
        }


def experts_of(spec: Spec) -> dict[str, int | None]:
    """A mixture of experts' layout, as plan's JSON names it: ep (expert-parallel GPUs), etp (each expert's
    tensor-parallel GPUs), edp (expert data-parallel replicas, world / (etp x ep x pp): `Spec.edp`), num_experts and
    moe_router_topk; ep 1 and the others None for a dense MLP."""
    moe = spec.model.moe
    return {
        "ep": spec.ep,
        "etp": spec.etp if moe else None,
        "edp": spec.edp if moe else None,
        "num_experts": spec.model.num_experts if moe else None,
        "moe_router_topk": spec.model.moe_router_topk if moe else None,
    }


def peak_dtype(spec: Spec) -> str:
    """The precision MFU is counted against: fp8 where the launch's linear GEMMs run in FP8 (Transformer Engine's
    `--fp8-format`: `model.terms.roofline.fp8_linear_gemms`), as NVIDIA reports the MFU of its FP8 runs against the
    FP8 peak (dgxc-benchmarking's READMEs: 1,979 TFLOP/s on an H100 SXM); else the launch's own precision (bf16,
    fp16; fp32 reads the TF32 peak where the device states one, as `DeviceSpec.peak_flops_per_s` does, and the one
    peak the CPU host states, an FP32 FMA rate)."""
    from hops_calib.model.terms.roofline import fp8_linear_gemms

    if fp8_linear_gemms(spec)[0]:
        return "fp8"
    precision = spec.model.precision
    return precision if precision in ("bf16", "fp16", "fp32") else "bf16"


def peak_flops_per_s(spec: Spec, model: Model) -> float:
    """The devices' dense tensor peak at `peak_dtype`, averaged over the stages (MFU's denominator; one type in
    most launches)."""
    dtype = peak_dtype(spec)
    peaks = [model.device(device).peak_flops_per_s(dtype) for device in spec.devices]
    return sum(peaks) / len(peaks) if peaks else 0.0


def memory_headroom_bytes(memory: Sequence[StageMemory]) -> dict[str, float]:
    """Per device type of the stages, what `plan --job` leaves out of its memory by default
    (`model.memory.default_headroom_bytes`; each stage's `fits_with_headroom` is checked against it), as plan's
    JSON `memory_headroom_bytes` gives it."""
    return {stage.device: stage.reserved_bytes for stage in sorted(memory, key=lambda stage: stage.device)}


def launch_memory(spec: Spec, model: Model, prediction: Prediction) -> tuple[StageMemory, ...]:
    """Per stage, one GPU's peak memory under `prediction`'s schedule (`model.memory.launch_memory`)."""
    return memory_launch(spec, lambda t: model.device(t).memory_bytes, prediction.result.peak_stage_activations)


def pricing_inputs(spec: Spec) -> dict[str, Any]:
    """What measured a launch's spec is priced with besides its configuration, so that two prices of one launch
    (a log's or a table row's run, a job directory) name what differs between them: the link benchmark (each hop's
    fit: its stages, bandwidth, latency, transport), the node's collective tables (the GPU counts they cover and a
    digest of their points, where they were read from aside), the transport the launch's environment names, and
    which hops stay within a node (the placement: a node's GPUs per node, or the job's devices' nodes)."""
    import hashlib
    import json

    points = [
        [t.op, t.gpus, [list(p) for p in t.points]] for t in sorted(spec.collectives, key=lambda t: (t.op, t.gpus))
    ]
    return {
        "link_benchmark": [
            {
                "stages": [fit.src_stage, fit.dst_stage],
                "bandwidth_gbit_s": fit.bandwidth_gbit_s,
                "latency_ms": fit.latency_ms,
                "transport": fit.transport or None,
            }
            for fit in spec.links
        ]
        or None,
        "collective_tables": {
            "ops_gpus": [[t.op, t.gpus] for t in sorted(spec.collectives, key=lambda t: (t.op, t.gpus))],
            "points_sha256": hashlib.sha256(json.dumps(points).encode()).hexdigest(),
        }
        if spec.collectives
        else None,
        "transport": spec.transport or None,
        "hops_within_a_node": [spec.same_node(k, k + 1) for k in range(spec.pp - 1)],
    }


def pricing_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The `pricing_inputs` entries in which two prices of a launch differ, by name."""
    return [name for name in a if a[name] != b.get(name)]


def end_collective_of(spec: Spec, model: Model):
    """How `model` prices `spec`'s all-reduce between the pipeline's ends (None: the model has no such term, or the
    launch reduces nothing between its ends)."""
    from hops_calib.model.terms.embedding import EmbeddingGradAllReduce, end_collective

    active = model.active(EmbeddingGradAllReduce.name)
    if active is None:
        return None
    return end_collective(spec, active.params(), tuple(model.device(t) for t in spec.devices))


def model_rates(
    prediction: Prediction, spec: Spec, peak_flops_per_s: float, throughput_per_s: float | None = None
) -> dict[str, float]:
    """The prediction's window throughput as the whole job's samples and tokens per second (every data-parallel
    replica), and the FLOP/s per GPU they imply counted both ways: model FLOPs (`gpt.model_flops_per_sample`: no
    recomputation; Megatron-LM's logged "throughput per GPU (TFLOP/s/GPU)", num_floating_point_operations in
    megatron/training/training.py) and hardware FLOPs (the recomputed forward counted as well:
    `gpt.recomputed_flops_per_sample`; Narayanan et al., SC'21, eq. 3), each as a share of the devices' peak:
    model FLOPs utilization (MFU) and hardware FLOPs utilization (HFU; Chowdhery et al. 2022, Korthikanti et al.
    2022). Without recomputation the two are equal. `throughput_per_s`: another throughput of the prediction's
    (microbatches/s; the steady state an iteration-level run is scored by) in place of the window's."""
    from hops_calib.metrics import samples_per_s
    from hops_calib.model import gpt

    throughput = prediction.metrics.throughput_per_s if throughput_per_s is None else throughput_per_s
    samples = samples_per_s(throughput, spec.model.micro_batch_size, spec.dp) or 0.0
    per_gpu = samples * gpt.model_flops_per_sample(spec.model) / spec.gpus
    chunks = [
        layers // spec.vp + (1 if c < layers % spec.vp else 0)
        for layers in spec.layers_per_stage
        for c in range(spec.vp)
    ]
    hardware = per_gpu + samples * gpt.recomputed_flops_per_sample(spec.model, chunks) / spec.gpus
    share = (lambda flops: flops / peak_flops_per_s) if peak_flops_per_s else (lambda flops: 0.0)
    return {
        "samples_per_s": samples,
        "tokens_per_s": samples * spec.model.seq_length,
        "model_tflops_per_gpu": per_gpu / 1e12,
        "mfu": share(per_gpu),
        "hardware_tflops_per_gpu": hardware / 1e12,
        "hfu": share(hardware),
    }


def _prediction_dict(prediction: Prediction, spec: Spec, peak_flops_per_s: float = 0.0) -> dict[str, Any]:
    metrics = prediction.metrics
    return {
        "schedule": prediction.schedule,
        "throughput_per_s": metrics.throughput_per_s,
        **model_rates(prediction, spec, peak_flops_per_s),
        "steady_throughput_per_s": metrics.steady_throughput_per_s,
        "iteration_time_ms": metrics.iteration_time_ms,
        "bubble_ratio": metrics.bubble_ratio,  # the idle share, as a trace of the run would measure it
        "schedule_bubble": pipeline_schedule_bubble(prediction.pipeline, prediction.schedule),
        "stall_noise_ape_pct": prediction.stall_noise_ape_pct,
        "stall_throughput_range": prediction.stall_throughput_range()._asdict(),
        PEAK_KEY: list(prediction.result.peak_stage_activations),  # per rank, in stage microbatches
        "stages": [
            {
                "stage": row.stage,
                "device": row.device,
                "utilization": metrics.utilization_per_stage[row.stage],
                "forward_ms": row.forward_ms,
                "backward_ms": row.backward_ms,
                "optimizer_ms": row.optimizer_ms,
            }
            for row in prediction.stage_phase_ms(spec)
        ],
    }


def _refusal(spec: Spec, schedule: str, args_file: str, manifest_schedule: bool = False) -> Refused | None:
    """Why `schedule` cannot run the configuration `spec` describes, and which launch flags would let it; None when
    it can. The rules are the simulator's (`check_shape`); the remedies are Megatron's flags in `args_file` (and
    the launcher's `configured_schedule` in manifest.yaml when it records one: `manifest_schedule`)."""
    from hops_calib.sim.schedules import check_shape
    from hops_calib.trace.job import MANIFEST

    p, v, m = spec.pp, spec.vp, spec.microbatches
    try:
        # auto picks 1f1b or zb_h1, both one model chunk per rank
        check_shape("1f1b" if schedule == "auto" else schedule, p, v, m)
        return None
    except ValueError as error:
        reason = str(error)
    if schedule == "auto":
        reason = (
            f"auto chooses between 1f1b and zb_h1, which run one model chunk per rank; the launch configures {v} "
            "per rank"
        )
    args = spec.megatron_args
    if schedule != "interleaved_1f1b":
        flags = [
            f"--{name.replace('_', '-')}"
            for name in ("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size")
            if args.get(name)
        ]
        manifest = (
            f" and set configured_schedule to {'1f1b' if schedule == 'auto' else schedule} in {MANIFEST}"
            if manifest_schedule
            else ""
        )
        return Refused(
            schedule,
            reason,
            f"remove {' and '.join(flags) or 'the virtual pipeline setting'} from "
            f"{args_file} (one model chunk per rank){manifest}, or ask for "
            "interleaved_1f1b",
        )
    steps = []
    if v < 2:
        layers = spec.model.num_layers
        per_chunk = [n for n in range(layers // (2 * p), 0, -1) if layers % (p * n) == 0]
        if not per_chunk:
            return Refused(
                schedule,
                reason,
                f"give every stage at least 2 layers to cut into model chunks (--num-layers "
                f"{layers} over {p} stages holds fewer) in {args_file}",
            )
        choices = " or ".join(f"{n} ({layers // (p * n)} chunks per rank)" for n in per_chunk)
        steps.append(
            f"add --num-layers-per-virtual-pipeline-stage N (decoder layers per model chunk; N = {choices}) "
            f"to {args_file}"
        )
        if manifest_schedule:
            steps.append(f"set configured_schedule to interleaved_1f1b in {MANIFEST}")
    if m % p:
        shape = spec.model
        per_microbatch = shape.global_batch_size // m  # micro batch x data parallel
        fits = -(-m // p) * p
        steps.append(
            f"set --global-batch-size to a multiple of {p * per_microbatch} in {args_file} (microbatches a "
            f"multiple of the {p} stages; {fits * per_microbatch} gives {fits} microbatches)"
        )
    return Refused(schedule, reason, " and ".join(steps))


def cp_exchange_unpriced(model: Model, device_types: Iterable[str]) -> bool:
    """Whether `model` prices a context-parallel launch on `device_types` without its KV exchange: it has no
    `context_parallel_comm` term and prices the layers by the roofline (`decoder_kernels` lists the ring itself:
    `model.layer_kernels._context_parallel_attention`)."""
    if model.active("context_parallel_comm") is not None:
        return False
    kernels = model.active("decoder_kernels")
    return not (kernels is not None and all(kernels.term.covers(model.term_params(kernels), d) for d in device_types))


def _on_nodes(spec: Spec, model: Model, notes: list[str]) -> Spec:
    """The spec with its ranks on its device type's nodes where the launch states none and spans more than one
    (`model.devices.node_notes`), with what predict says of the nodes."""
    from dataclasses import replace

    from hops_calib.model.devices import node_notes

    try:
        devices = [model.device(d) for d in spec.devices]
    except KeyError:  # an unknown device type is refused, naming the catalog, when the model prices the spec
        return spec
    said, per_node = node_notes(devices, spec.gpus_per_node)
    notes.extend(said)
    if per_node is not None and spec.gpus > per_node:
        notes.append(
            f"ranks placed on nodes of {per_node} GPUs (global rank r on node r // {per_node}, Megatron's "
            f"rank order {spec.rank_order}): groups that span nodes are priced over the nodes' NICs"
        )
        return replace(spec, gpus_per_node=per_node)
    return spec


def what_if(
    job_dir: Path | str,
    model: Model,
    schedules: Sequence[str] = (),
    calibration: Coverage | None = None,
    calibration_name: str = "",
    cluster: Cluster | None = None,
    perturbations: Perturbations | None = None,
    kernels: bool = False,
    kernel_stage: int | None = None,
) -> WhatIf:
    """Predict the run `job_dir` configures under each of `schedules` (default: the configured one), each hop priced
    by the hosts at its ends (the job's own benchmark of the pair, else `cluster`'s); with the `calibration` runs'
    coverage, also say where the configuration lies outside them; under `perturbations`, also the throughput of
    seeded perturbed draws; with `kernels`, the kernel table of virtual stage `kernel_stage` (default the slowest)."""
    from hops_calib.model.kernel_table import kernel_table, pricing_notes
    from hops_calib.model.predict import ScheduleError, predict_schedules
    from hops_calib.spec import build_spec, check_simulable
    from hops_calib.trace import find_arguments, read_manifest, require_job_dir

    job_dir = require_job_dir(job_dir)
    unknown = [s for s in schedules if s not in CHOICES]
    if unknown:
        raise InputError(
            "predict",
            f"unknown schedule {unknown[0]!r}",
            field="--schedule",
            hint=f"expected one of {', '.join(CHOICES)}",
        )
    # build_spec refuses a launch with a setting the cost model does not price (tensor parallelism, recomputation,
    # SwiGLU, ...): its prediction would be another configuration's.
    _args, args_source = find_arguments(job_dir)
    notes: list[str] = []
    spec = build_spec(job_dir, notes)
    check_simulable(spec, args_source)
    spec = _on_nodes(spec, model, notes)
    cluster = cluster.for_job(spec.device_ids, notes) if cluster is not None else None
    if spec.pp > 1 and spec.links:  # (a job with no benchmark at all is refused by the model's link term below)
        from hops_calib.whatif.link_book import relinked, unpriced_hint

        spec, hops = relinked(spec, job_dir, cluster, notes)
        if cluster is None and any(not link.intra_node for link in spec.links):
            notes.append(
                "no cluster given: each device's host is the one the job's own link benchmark names at its "
                "stage position, right only if the benchmark ran with this stage map; after moving stages, "
                "give --cluster (`hops-calib cluster` builds one from job directories) so that each hop is "
                "priced by the hosts the devices really live on"
            )
        if any(hop.link is None for hop in hops):
            raise InputError(
                str(job_dir),
                unpriced_hint(hops, cluster),
                field="--cluster",
                hint="a hop is priced by the hosts at its two ends, never by its position in the pipeline",
            )
    else:
        hops = ()
    from hops_calib.model.terms.embedding import transport_note

    note = transport_note(spec)
    if note:
        notes.append(note)
    if spec.cp > 1 and cp_exchange_unpriced(model, set(spec.devices)):
        notes.append(
            f"context parallelism (cp {spec.cp}) is priced without its KV exchange: the shipped model has no "
            "context_parallel_comm term, since on every measured cp > 1 run each exchange hides under its "
            "attention step (ledger 186-187); a copy of the model file with a [terms.context_parallel_comm] table "
            "(--model COPY) charges what outlasts each step (the CP comm column)"
        )
    wanted = tuple(dict.fromkeys(schedules)) or (spec.schedule,)
    # Every schedule that can run is predicted; the others are named with what would let them run.
    recorded = "configured_schedule" in read_manifest(job_dir)  # a launcher's own record (CPU captures)
    refusals = {s: _refusal(spec, s, args_source.name, recorded) for s in wanted}
    refused = tuple(r for r in refusals.values() if r is not None)
    asked = tuple(s for s in wanted if refusals[s] is None)
    if not asked:
        raise InputError(
            str(job_dir),
            "no schedule asked for can run this configuration: " + " | ".join(r.sentence() for r in refused),
            field="--schedule",
            hint="change the launch as said, or ask for a schedule it supports (--schedule)",
        )
    try:
        predictions = predict_schedules(spec, model, asked)
    except ScheduleError as error:
        raise InputError(
            str(job_dir),
            f"cannot be simulated under {error.schedule}: {error}",
            field="--schedule",
            hint="pick a schedule this configuration supports",
        ) from None
    except ValueError as error:
        raise InputError(
            str(job_dir),
            f"cannot be priced by model {model.name!r}: {error}",
            field="configuration",
            hint="a what-if needs what the model prices: the link benchmark in calibration/link_bench/ "
            "(pair_<i>_<j>.jsonl), device types the catalog knows",
        ) from None
    memory = launch_memory(spec, model, predictions[0])
    perturbed: tuple[Estimate, ...] = ()
    if perturbations is not None:
        try:
            perturbed = tuple(perturbations.estimate(p.pipeline, p.schedule, spec.device_ids) for p in predictions)
        except ValueError as error:
            raise InputError(
                str(job_dir),
                f"cannot be simulated under the stragglers or failures asked for: {error}",
                field="--failure-rate",
                hint="check the rates and the checkpoint interval",
            ) from None
    notes += pricing_notes(model, spec)
    table = None
    if kernels:
        try:
            table = kernel_table(model, spec, kernel_stage)
        except ValueError as error:
            raise InputError(
                "predict",
                str(error),
                field="--kernel-stage",
                hint="give a virtual stage of the job (chunk c of rank r is c x pp + r)",
            ) from None
    return WhatIf(
        job_dir=job_dir,
        spec=spec,
        model=model,
        predictions=predictions,
        asked=asked,
        notes=tuple(notes),
        breakdown=tuple(model.breakdown(spec)),
        memory=memory,
        end_collective=end_collective_of(spec, model),
        cluster=cluster.named() if cluster is not None else "",
        extrapolations=tuple(extrapolations(spec, calibration)) if calibration is not None else None,
        calibration=calibration_name,
        refused=refused,
        hops=hops,
        perturbations=perturbations,
        perturbed=perturbed,
        kernels=table,
    )
