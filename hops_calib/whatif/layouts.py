"""What-if room: how to split a job over its GPUs, tensor x pipeline x data parallel (`plan --job DIR --parallel`).

The question a user brings (issue #19): "TP 4 x PP 8 x DP 16 on 512 A100s, or TP 8 x PP 4?". This searches every
layout of the job's GPUs Megatron accepts for its model and global batch: t dividing the heads (and the FFN and
query groups), at most the GPUs of one node (tensor parallelism stays on NVLink); p dividing the layers; d the rest;
a micro-batch size that divides the batch of each replica. Each layout is priced by the calibrated model from the
job's launch with only t, p (and the micro-batch size) changed, on the job's one GPU type, with ranks placed on nodes
as the launch places them (torchrun --nproc-per-node), the node's collective tables where the job has them; memory
per GPU is checked against the device's. Everything else the launch sets (sequence parallelism, the distributed
optimizer, recomputation, the schedule) is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress
from hops_calib.whatif.launch_space import divisors

MAX_LAYOUTS = 2000  # a bound on the work (a 512-GPU job has a few hundred)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    samples_per_s: float = 0.0
    mfu: float = 0.0
    iteration_ms: float = 0.0
    peak_memory_bytes: float = 0.0
    memory_bytes: float = 0.0
    fits: bool = True
    refused: str = ""  # why Megatron or the model cannot run it ("" when priced)

    @property
    def name(self) -> str:
        return f"t{self.tp} p{self.pp} d{self.dp} mb{self.micro_batch_size}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batch_size": self.micro_batch_size,
            "samples_per_s": self.samples_per_s,
            "mfu": self.mfu,
            "iteration_ms": self.iteration_ms,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            **({"refused": self.refused} if self.refused else {}),
        }


@dataclass(frozen=True)
class LayoutPlan:
    job: str
    gpus: int
    gpus_per_node: int
    device: str
    current: Layout
    best: tuple[Layout, ...]
    priced: int
    refused: int
    notes: tuple[str, ...] = field(default=())
    over_memory: int = 0  # priced layouts whose busiest GPU would not fit

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "job": self.job,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "device": self.device,
            "current": self.current.to_dict(),
            "best": [b.to_dict() for b in self.best],
            "priced": self.priced,
            "refused": self.refused,
            "over_memory": self.over_memory,
            "notes": list(self.notes),
        }


def candidate_layouts(
    args: dict[str, Any], gpus: int, gpus_per_node: int, micro_batch_sizes: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """(t, p, d, micro batch) of every layout of `gpus` GPUs the launch's shape allows: t dividing the heads, at most
    a node's GPUs; p dividing the layers; the global batch a whole number of microbatches per replica."""
    heads, layers = int(args["num_attention_heads"]), int(args["num_layers"])
    batch = int(args.get("global_batch_size") or 0)
    out = []
    for t in divisors(min(gpus, gpus_per_node)):
        if heads % t or gpus % t:
            continue
        for p in divisors(layers):
            if (gpus // t) % p:
                continue
            d = gpus // (t * p)
            for mb in micro_batch_sizes:
                if batch and batch % (mb * d) == 0:
                    out.append((t, p, d, mb))
    return out


DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4)  # beside the job's own


def search_layouts(
    job_dir: Path | str,
    model: Model,
    *,
    top: int = 5,
    micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
    progress: Progress = QUIET,
) -> LayoutPlan:
    """The fastest layouts of the job's GPUs that fit (see the module's docstring), and the job's own."""
    from hops_calib.model.memory import stage_memory
    from hops_calib.model.predict import predict
    from hops_calib.model.terms.embedding import transport_note
    from hops_calib.spec import Hardware, build_spec, spec_from_args
    from hops_calib.trace import TraceError, find_arguments
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR, read_collective_tables
    from hops_calib.whatif.job import model_rates

    job_dir = Path(job_dir)
    notes: list[str] = []
    own = build_spec(job_dir, notes)  # the job as it is: refuses what the model does not price, names the file
    note = transport_note(own)
    if note:
        notes.append(note)
    types = set(own.devices)
    if len(types) != 1:
        raise InputError(
            str(job_dir),
            f"runs on several device types ({', '.join(sorted(types))}): a layout search "
            "over t, p and d needs one GPU type",
            field="--parallel",
            hint="plan --job without --parallel searches orders and splits on mixed devices",
        )
    device = next(iter(types))
    args, source = find_arguments(job_dir)
    gpus = own.gpus
    per_node = own.gpus_per_node or gpus  # a one-node launch: every GPU on one node
    sizes = sorted(set(micro_batch_sizes) | {own.model.micro_batch_size})
    tables = read_collective_tables(job_dir / ALLREDUCE_DIR)
    catalog_bytes = model.device(device).memory_bytes
    peak = model.device(device).peak_bf16_flops_per_s
    layouts = candidate_layouts(args, gpus, per_node, sizes)
    if len(layouts) > MAX_LAYOUTS:
        raise InputError(
            str(job_dir),
            f"{len(layouts)} layouts to price, more than {MAX_LAYOUTS}",
            field="--parallel",
            hint="give fewer micro-batch sizes",
        )
    found: list[Layout] = []
    progress.start(len(layouts))
    for t, p, d, mb in layouts:
        changed = {
            **args,
            "tensor_model_parallel_size": t,
            "pipeline_model_parallel_size": p,
            "micro_batch_size": mb,
            "world_size": gpus,
        }
        for key in (
            "data_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "virtual_pipeline_model_parallel_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        ):
            changed.pop(key, None)  # what followed from the old layout
        try:
            spec = spec_from_args(
                changed,
                source,
                run_id=f"{own.run_id}_t{t}p{p}d{d}mb{mb}",
                hardware=Hardware(gpu=device, gpus_per_node=per_node),
                collectives=tables,
                iterations=own.iterations,
            )
            # what the launch's command line says besides Megatron's arguments: its environment's transport
            spec = replace(spec, transport=own.transport)
            prediction = predict(spec, model)
        except (TraceError, ValueError) as error:
            found.append(Layout(t, p, d, mb, refused=str(getattr(error, "problem", None) or error).split(";")[0]))
            progress.advance(f"t{t} p{p} d{d}")
            continue
        rates = model_rates(prediction, spec, peak)  # as predict --job reports them
        memory = stage_memory(spec, [catalog_bytes] * spec.pp, prediction.result.peak_stage_activations)
        most = max(stage.total_bytes for stage in memory)
        found.append(
            Layout(
                t,
                p,
                d,
                mb,
                samples_per_s=rates["samples_per_s"],
                mfu=rates["mfu"],
                iteration_ms=prediction.metrics.iteration_time_ms,
                peak_memory_bytes=most,
                memory_bytes=catalog_bytes,
                fits=most <= catalog_bytes,
            )
        )
        progress.advance(f"t{t} p{p} d{d}")
    priced = [layout for layout in found if not layout.refused]
    current = next(
        layout
        for layout in found
        if (layout.tp, layout.pp, layout.dp, layout.micro_batch_size)
        == (own.tp, own.pp, own.dp, own.model.micro_batch_size)
    )
    best = sorted((layout for layout in priced if layout.fits), key=lambda layout: -layout.samples_per_s)[:top]
    return LayoutPlan(
        job=str(job_dir),
        gpus=gpus,
        gpus_per_node=per_node,
        device=device,
        current=current,
        best=tuple(best),
        priced=len(priced),
        refused=len(found) - len(priced),
        notes=tuple(notes),
        over_memory=sum(1 for layout in priced if not layout.fits),
    )
