"""Model room: the kernel table of one pipeline stage, what `predict --job DIR --kernels` prints: each kernel the stage
launches per microbatch (`hops_calib.model.kernels`) with its shape, FLOPs, bytes, time and what bounds it
(`hops_calib.model.kernel_pricing`, with the `decoder_kernels` term's values in the model, or its defaults when the
model does not activate it), and its tensor-parallel collectives priced as `tensor_parallel_comm` prices them. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hops_calib.model.collectives import collective_ms
from hops_calib.model.kernel_pricing import peak_flops_per_s
from hops_calib.model.kernels import (
    COLLECTIVE,
    DGRAD,
    FORWARD,
    PHASES,
    fp8_weight_kernels,
    stage_kernels,
)
from hops_calib.model.model import Model
from hops_calib.model.moe_kernels import EXPERT_GROUPS
from hops_calib.model.terms import TERMS, Term, layout_of
from hops_calib.model.terms.decoder_kernels import kernel_settings, pricer_of
from hops_calib.model.terms.parallel import (
    _rates,
    hidden_bytes,
    overlap_exposed_ms,
    tp_comm_overlap,
    tp_overlap_pairs,
)
from hops_calib.spec import Spec


@dataclass(frozen=True)
class KernelRow:
    name: str
    phase: str
    op: str
    kind: str
    shape: str
    dtype: str
    count: int  # launches per microbatch (the stage's layers for a layer's kernel)
    flops: float  # per launch, executed
    bytes: float  # per launch
    ms: float  # per launch
    bound: str
    efficiency: float | None
    waves: int | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.name,
            "phase": self.phase,
            "op": self.op,
            "kind": self.kind,
            "shape": self.shape,
            "dtype": self.dtype,
            "count": self.count,
            "flops": self.flops,
            "bytes": self.bytes,
            "ms": self.ms,
            "total_ms": self.ms * self.count,
            "bound": self.bound,
            "efficiency": self.efficiency,
            "waves": self.waves,
            "source": self.source,
        }


@dataclass(frozen=True)
class KernelTable:
    stage: int  # virtual stage
    device: str
    layers: int
    rows: tuple[KernelRow, ...]
    notes: tuple[str, ...]

    def total_ms(self, phase: str, collectives: bool = False) -> float:
        """Milliseconds per microbatch of the phase's kernels (`collectives`: of its collectives instead)."""
        return sum(r.ms * r.count for r in self.rows if r.phase == phase and (r.op == COLLECTIVE) == collectives)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "device": self.device,
            "layers": self.layers,
            "totals_ms": {phase: self.total_ms(phase) for phase in PHASES},
            "collectives_ms": {phase: self.total_ms(phase, collectives=True) for phase in PHASES},
            "launches": sum(r.count for r in self.rows),
            "notes": list(self.notes),
            "kernels": [r.to_dict() for r in self.rows],
        }


def slowest_stage(model: Model, spec: Spec) -> int:
    """The virtual stage whose forward plus backward the model prices longest (the pipeline's bottleneck)."""
    stages = model.pipeline(spec).stages
    return max(range(len(stages)), key=lambda k: stages[k].forward_ms + stages[k].backward_ms)


def pricing_notes(model: Model, spec: Spec) -> list[str]:
    """Where the model's kernel term prices each device type of `spec` from: the machine's component tables, or the
    datasheet through the default curves (said for every device without a table). Empty when the model does not
    activate `decoder_kernels`."""
    active = model.active("decoder_kernels")
    if active is None:
        return []
    notes = []
    for device_type in sorted(set(spec.devices)):
        sources = pricer_of(spec, model.device(device_type), model.term_params(active)).sources()
        if (
            spec.components(device_type) is None
            or Term.value(model.term_params(active), "use_tables", device_type) != 1.0
        ):
            notes.append(
                f"{device_type} has no component tables here: decoder_kernels prices its GEMMs from its "
                f"datasheet by the default curve {sources['gemm']}, its memory-bound kernels by "
                f"{sources['memory']} (`hops-calib bench` measures a machine's tables)"
            )
        else:
            notes.append(
                f"{device_type}: GEMMs priced from the {sources['gemm']}; memory-bound kernels from the "
                f"{sources['memory']}"
            )
    return notes


def kernel_table(model: Model, spec: Spec, stage: int | None = None) -> KernelTable:
    """The kernels of virtual stage `stage` (default: the slowest, `slowest_stage`) per microbatch, priced."""
    layout = layout_of(spec)
    if stage is None:
        stage = slowest_stage(model, spec)
    if not 0 <= stage < layout.virtual_stages:
        raise ValueError(f"stage {stage} is outside the job's virtual stages 0-{layout.virtual_stages - 1}")
    term = TERMS["decoder_kernels"]
    active = model.active("decoder_kernels")
    params = model.term_params(active) if active else term.defaults()
    notes = (
        []
        if active
        else [
            (
                "the model does not activate decoder_kernels: the table prices with the term's "
                "defaults (datasheet curves); the stage's predicted times come from the model's own "
                "terms"
            )
        ]
    )
    rank = layout.rank_of(stage)
    device = model.device(spec.devices[rank])
    pricer = pricer_of(spec, device, params)
    comm = model.active("tensor_parallel_comm")
    comm_params = model.term_params(comm) if comm else TERMS["tensor_parallel_comm"].defaults()
    rates = _rates(model.context(spec), comm_params, device.type)
    kernels = stage_kernels(
        spec.model,
        kernel_settings(spec, params),
        layout.layers[stage],
        first=stage == 0,
        last=stage == layout.virtual_stages - 1,
    )
    rows = []
    for kernel, count in kernels.rows():
        if not count:
            continue
        if kernel.op == COLLECTIVE:
            ms = collective_ms(spec, device, kernel.kind, kernel.bytes, kernel.group or "tp", stage=rank, **rates)
            owner = (
                f"tensor_parallel_comm (the {kernel.group} group's all-to-all or ring over NVLink and the NICs)"
                if kernel.group in EXPERT_GROUPS
                else "tensor_parallel_comm (the node's all-reduce table, else the ring)"
            )
            rows.append(
                KernelRow(
                    kernel.name,
                    kernel.phase,
                    kernel.op,
                    kernel.kind,
                    "",
                    kernel.dtype,
                    count,
                    0.0,
                    kernel.bytes,
                    ms,
                    "overlapped collective" if kernel.overlapped else "collective",
                    None,
                    None,
                    owner,
                )
            )
            continue
        priced = pricer.price(kernel)
        rows.append(
            KernelRow(
                kernel.name,
                kernel.phase,
                kernel.op,
                kernel.kind,
                kernel.shape,
                kernel.dtype,
                count,
                kernel.flops,
                kernel.bytes,
                priced.ms,
                priced.bound,
                priced.efficiency,
                priced.waves,
                priced.source,
            )
        )
    notes += pricing_notes(model, spec) if active else []
    for phase in (FORWARD, DGRAD):
        exposed = cp_ring_exposed_ms(rows, phase)
        if exposed is not None:
            notes.append(
                f"context parallelism ({phase}): the KV exchanges run under the attention steps; "
                f"{exposed:.4f} ms per layer stays exposed (each exchange past its step's attention)"
            )
    if tp_comm_overlap(spec) and layout.layers[stage]:
        hidden = hidden_bytes(spec)
        peak = peak_flops_per_s(device, "fp8" if kernel_settings(spec).fp8 else "bf16") / 1e3
        overlap_ms = {
            phase: sum(
                overlap_exposed_ms(
                    collective_ms(spec, device, op, hidden, "tp", stage=rank, **rates), flops / peak, method, spec.tp
                )
                for op, flops, method in pairs
            )
            for phase, pairs in tp_overlap_pairs(spec).items()
        }
        notes.append(
            f"--tp-comm-overlap: the layers' collectives run under their GEMMs (TE's userbuffers); "
            f"tensor_parallel_comm prices {overlap_ms['FORWARD']:.4f} ms forward and "
            f"{overlap_ms['BACKWARD']:.4f} ms backward per layer as exposed, not the rows' whole times"
        )
    shape = spec.model
    if shape.moe and layout.layers[stage]:
        placed = spec.group_nodes("ep", rank)
        where = f" on {placed[0]} node(s)" if placed else ""
        notes.append(
            f"mixture of experts: {shape.num_experts} experts, top-{shape.moe_router_topk}, "
            f"{shape.local_experts} on each GPU (ep {spec.ep}{where}, etp {spec.etp}, expert data-parallel "
            f"{spec.edp}), {shape.moe_dispatcher} dispatcher; the experts' GEMMs at "
            f"{params.get('expert_load_imbalance', 1.0):g} x their balanced tokens (expert_load_imbalance), "
            "their collectives priced as tensor_parallel_comm prices them"
        )
    casts = fp8_weight_kernels(spec.model, kernel_settings(spec))
    if casts and layout.layers[stage]:
        ms = layout.layers[stage] * sum(pricer.price(k).ms for k in casts)
        notes.append(
            f"FP8: the {len(casts)} linear weights of each layer are cast to FP8 with their transpose once "
            f"per iteration (TE caches them from the first microbatch): {ms:.3f} ms per iteration for the "
            "stage, not in the per-microbatch rows"
        )
    return KernelTable(
        stage=stage, device=device.type, layers=layout.layers[stage], rows=tuple(rows), notes=tuple(notes)
    )


def cp_ring_exposed_ms(rows: list[KernelRow] | tuple[KernelRow, ...], phase: str) -> float | None:
    """The p2p ring's exposed time per layer in `phase`: exchange k travels while attention step k runs (TE's
    `AttnFuncWithCPAndKVP2P` posts the next step's send/recv before computing), so what is left of each exchange past
    its step's kernel is exposed: sum of max(0, exchange_k - step_k). None without a ring."""
    exchanges = [r.ms for r in rows if r.kind == "send_recv" and r.phase == phase]
    steps = [r.ms for r in rows if r.op == "attention" and r.phase == phase and ".cp_step" in r.name]
    if not exchanges:
        return None
    return sum(max(0.0, x - s) for x, s in zip(exchanges, steps))
