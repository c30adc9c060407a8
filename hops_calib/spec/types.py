"""What a prediction may see: the spec of a run, known before it ran (`Spec`), its model's shape (`ModelShape`),
where its stages run (`Hardware`), and Megatron's rank order (`global_rank`, `coordinates_of`).

A `Spec` never holds anything measured from the run's own events (rule 1 of the design); `truth` holds those.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.spec.schedules import SCHEDULES
from hops_calib.trace.collective_bench import CollectiveTable  # the machine's collective benchmark
from hops_calib.trace.component_tables import ComponentTables  # the machine's GEMM and memory-kernel tables
from hops_calib.trace.link_bench import LinkFit  # the link benchmark's fit; a Spec carries one per hop


@dataclass(frozen=True)
class ModelShape:
    """The GPT configuration Megatron was launched with (the fields a cost model needs)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    micro_batch_size: int = 1
    global_batch_size: int = 1
    precision: str = "bf16"
    # Megatron ties input and output embeddings unless --untie-embeddings-and-output-weights.
    untie_embeddings: bool = False
    # Megatron clips the global gradient norm at --clip-grad (default 1.0), which all-reduces the norm
    # over the pipeline before every optimizer step; 0 turns clipping off.
    clip_grad: float = 1.0
    # Activation recomputation (`recomputation_of`): None, "full" (a layer's backward first redoes its whole
    # forward) or "selective" (only its attention core); for full, "uniform" (every layer, in groups of
    # recompute_num_layers) or "block" (the first recompute_num_layers layers of each model chunk).
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # How Megatron builds each layer, when it is not the legacy local GPT layer (`layer_settings_of`). The counts in
    # hops_calib/model/gpt.py are per GPU: a layer's split weights and heads divide over the tensor-parallel group.
    tensor_parallel: int = 1  # --tensor-model-parallel-size: each layer's GEMMs and heads split t ways
    sequence_parallel: bool = False  # --sequence-parallel: the norms, dropouts and residuals split t ways too
    swiglu: bool = False  # --swiglu: a gated MLP of three h x f matmuls (fc1 writes 2f)
    num_query_groups: int | None = None  # --group-query-attention --num-query-groups g: g key/value heads
    normalization: str = "LayerNorm"  # or "RMSNorm" (no bias, no mean)
    position_embedding: str = "learned_absolute"  # or "rope" (no position table; a rotation of q and k)
    # "unfused": the score matrix is written and read (attention_score_traffic); "flash": a fused attention kernel
    # (flash attention, Transformer Engine's fused attention) that keeps the scores on chip, stores none of them
    attention_kernel: str = "unfused"
    # --context-parallel-size: each sequence split cp ways (2 cp chunks, rank i holding chunks i and 2cp-1-i for
    # causal load balancing: megatron/core/utils.py get_batch_on_this_cp_rank); every kernel but attention's keys
    # sees s/cp tokens
    context_parallel: int = 1
    # A mixture of experts (megatron-core `transformer/moe/`; `hops_calib.spec.arguments.moe_settings_of`): every
    # layer's MLP is `num_experts` routed experts of `moe_ffn_hidden_size` each (--moe-ffn-hidden-size, default
    # --ffn-hidden-size), each token sent to `moe_router_topk` of them, plus a shared expert of
    # `moe_shared_expert_ffn` (--moe-shared-expert-intermediate-size; 0: none). The experts split over
    # `expert_parallel` GPUs (--expert-model-parallel-size: num_experts / ep local experts each) and each expert's
    # GEMMs over `expert_tensor_parallel` (--expert-tensor-parallel-size, Megatron's default the tensor-parallel
    # size); `moe_dispatcher` is --moe-token-dispatcher-type (alltoall or allgather), `moe_grouped_gemm` one grouped
    # GEMM for the local experts (else one GEMM each: SequentialMLP); `moe_capacity_factor` None is dropless, else
    # each expert takes at most that many times its balanced share (`moe_pad_to_capacity`: exactly that many)
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_ffn: int = 0
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    moe_dispatcher: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    moe_router_fp32: bool = False  # --moe-router-dtype fp32: the router's GEMM and logits in fp32
    # the router's load-balancing loss (--moe-aux-loss-coeff above 0 with an aux-loss --moe-router-load-balancing-type)
    # and its z-loss (--moe-z-loss-coeff above 0): their scores, counts and all-reduce
    moe_aux_loss: bool = False
    moe_z_loss: bool = False

    @property
    def moe(self) -> bool:
        """Whether the layers' MLPs are a mixture of experts."""
        return bool(self.num_experts and self.num_experts > 1)

    @property
    def local_experts(self) -> int:
        """Routed experts on one GPU: num_experts / expert_parallel (`moe_layer.py` MoELayer.__init__)."""
        return (self.num_experts or 0) // max(1, self.expert_parallel)

    @property
    def expert_ffn(self) -> int:
        """A routed expert's FFN hidden size: --moe-ffn-hidden-size, else --ffn-hidden-size."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads: the query groups under grouped-query attention, else one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    def recomputed_layers(self, layers: int) -> int:
        """How many of a model chunk's `layers` decoder layers redo their whole forward in their backward."""
        if self.recompute_granularity != "full":
            return 0
        if self.recompute_method == "block":
            return min(layers, self.recompute_num_layers or 0)
        return layers


@dataclass(frozen=True)
class Spec:
    """Everything known about a run before it ran."""

    run_id: str
    pp: int  # pipeline-parallel ranks
    vp: int  # model chunks per rank (virtual pipeline size; 1 = not interleaved)
    microbatches: int  # per iteration (global batch / (micro batch * data parallel))
    iterations: int  # iterations in the traced window
    layers_per_stage: tuple[int, ...]  # decoder layers on each rank (all its chunks)
    devices: tuple[str, ...]  # device type per stage: "h100", "a10g", "l4", "cpu", ...
    device_ids: tuple[str, ...]  # ids of the stage map, per stage
    links: tuple[LinkFit, ...]  # one per adjacent stage pair that has a benchmark
    schedule: str  # the schedule the configuration asks Megatron for (one of SCHEDULES)
    model: ModelShape
    declared_schedule: str | None = None  # label from a template or scenario name, if any
    device_names: tuple[str, ...] = ()  # human-readable device model per stage, when known
    megatron_args: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    # GPUs per node when the hardware was given as a GPU type (a log's or a run table's), else None.
    gpus_per_node: int | None = None
    collectives: tuple[CollectiveTable, ...] = ()  # the machine's collective benchmark, when it has one
    # Parallelism besides the pipeline (issue #19). Each stage runs on tp x dp GPUs (ModelShape.tensor_parallel
    # is tp): dp replicas of its tensor-parallel group, which run alike, so the simulator prices one of them.
    dp: int = 1  # data-parallel replicas: world / (tp x pp x cp)
    distributed_optimizer: bool = False  # --use-distributed-optimizer: grads reduce-scattered, params all-gathered
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce: bucketed reduction overlapped with the backward
    overlap_param_gather: bool = False  # --overlap-param-gather: the param all-gather overlapped with the forward
    # Megatron's --rank-order (tp, cp, ep, dp, pp from fastest to slowest by default): which global ranks form a
    # stage's tensor-parallel group, its data-parallel groups, and so which of them share a node
    rank_order: str = "tp-cp-ep-dp-pp"
    # Ranks time-sharing one device (a CPU capture with more ranks than cores: manifest.yaml's `cores`, the core of
    # each rank); 1 on a GPU, where every rank has its own
    ranks_per_device: float = 1.0
    # Megatron's overlap_p2p_comm (interleaved 1F1B, on by default there): the steady state's p2p calls are posted
    # ahead and waited on later (`hops_calib.sim.schedules`); False: blocking (or batched) calls
    overlap_p2p: bool = False
    # Decoder layers per virtual stage (virtual stage k is model chunk k // pp on rank k % pp) when Megatron builds
    # them unevenly over a rank's chunks (--account-for-embedding/loss-in-pipeline-split, or
    # --pipeline-model-parallel-layout); () when each rank's layers are split evenly over its chunks
    layers_per_virtual_stage: tuple[int, ...] = ()
    # The core of every global rank when ranks time-share cores (`manifest.yaml`'s `cores` of such a capture), so
    # which ranks share one is known (`core_load`); () otherwise
    cores: tuple[int, ...] = ()

    @property
    def tp(self) -> int:
        return self.model.tensor_parallel

    @property
    def cp(self) -> int:
        return self.model.context_parallel

    @property
    def gpus(self) -> int:
        """GPUs of the launch: tp x cp x dp per stage."""
        return self.pp * self.tp * self.cp * self.dp

    @property
    def ep(self) -> int:
        """Expert-parallel GPUs (--expert-model-parallel-size); 1 without experts."""
        return max(1, self.model.expert_parallel) if self.model.moe else 1

    @property
    def etp(self) -> int:
        """Expert tensor-parallel GPUs (--expert-tensor-parallel-size); the tensor-parallel size without experts."""
        return max(1, self.model.expert_tensor_parallel) if self.model.moe else self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel replicas: world / (etp x ep x pp), as megatron-core's parallel_state.
        initialize_model_parallel sizes the expert rank generator (the group the expert gradients are reduced and
        the distributed optimizer shards expert state over); dp x cp without experts."""
        if not self.model.moe:
            return self.dp * self.cp
        return expert_data_parallel_size(self.gpus, self.etp, self.ep, self.pp)

    def expert_rank(self, etp_rank: int = 0, ep_rank: int = 0, edp_rank: int = 0, pp_rank: int = 0) -> int:
        """The global rank of an expert-layer GPU: megatron-core's expert rank generator (`parallel_state.
        initialize_model_parallel`: RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1) under the launch's order)."""
        return global_rank(
            self.rank_order,
            {
                "tp": (etp_rank, self.etp),
                "ep": (ep_rank, self.ep),
                "dp": (edp_rank, self.edp),
                "pp": (pp_rank, self.pp),
            },
        )

    # the node of each stage's device when a job directory names them and has a collective benchmark to price
    # what runs within a node (hops_calib.trace DeviceInfo.node); () otherwise
    nodes: tuple[str, ...] = ()
    # The transport NCCL runs the launch's traffic between nodes over, as the launch's environment says it
    # (NCCL_NET, NCCL_IB_DISABLE: trace.megatron_args.Launch.transport); "" when it says nothing, and then the
    # links' own (`LinkFit.transport`) decide
    transport: str = ""
    # The machine's component tables (GEMM and memory-bound kernel times, one entry per device type measured), which
    # the kernel terms price with; () where it has none (those devices are priced from their datasheet)
    component_tables: tuple[ComponentTables, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layers_per_stage) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.layers_per_stage)} layer counts for pp={self.pp}")
        if len(self.devices) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.devices)} devices for pp={self.pp}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"spec {self.run_id}: unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if self.overlap_p2p and self.schedule != "interleaved_1f1b":
            raise ValueError(
                f"spec {self.run_id}: overlapped p2p runs only under interleaved_1f1b, not {self.schedule!r}"
            )
        if self.layers_per_virtual_stage:
            chunks = self.layers_per_virtual_stage
            if (
                len(chunks) != self.pp * self.vp
                or any(n < 0 for n in chunks)
                or tuple(sum(chunks[rank :: self.pp]) for rank in range(self.pp)) != tuple(self.layers_per_stage)
            ):
                raise ValueError(
                    f"spec {self.run_id}: layers_per_virtual_stage {chunks} must give pp x vp = "
                    f"{self.pp * self.vp} counts, each rank's summing to layers_per_stage "
                    f"{self.layers_per_stage}"
                )

    def rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        """The global rank of GPU (tp_rank, dp_rank, pp_rank, cp_rank) under the launch's rank order."""
        return global_rank(
            self.rank_order,
            {"tp": (tp_rank, self.tp), "dp": (dp_rank, self.dp), "pp": (pp_rank, self.pp), "cp": (cp_rank, self.cp)},
        )

    def core_load(self) -> tuple[tuple[float, ...], ...]:
        """Per pipeline rank s, how many processes of each pipeline rank q share s's core (`Pipeline.core_load`):
        the ranks of stage q (every tensor- and data-parallel copy, in the rank order) on the core of s's first
        rank. From `cores` when given; else a flat `ranks_per_device` copies of each rank's own stage (the other
        sharers unknown); () for one rank per device."""
        if self.cores:
            sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
            # processes per (core, stage): every rank counted once, under its core and its pipeline rank
            sharers = Counter(
                (core, coordinates_of(rank, self.rank_order, sizes)["pp"]) for rank, core in enumerate(self.cores)
            )
            return tuple(
                tuple(float(sharers[self.cores[self.rank(0, 0, s)], q]) for q in range(self.pp)) for s in range(self.pp)
            )
        if self.ranks_per_device != 1:
            return tuple(
                tuple(self.ranks_per_device if q == s else 0.0 for q in range(self.pp)) for s in range(self.pp)
            )
        return ()

    def node_of(self, rank: int) -> int | None:
        return rank // self.gpus_per_node if self.gpus_per_node else None

    def same_node(self, stage_a: int, stage_b: int) -> bool | None:
        """Whether two stages' corresponding GPUs (same tp and dp coordinates) share a node, when the hardware says
        (a GPU type on nodes of gpus_per_node, global rank r on node r // gpus_per_node; or a job directory's devices
        with their nodes named); else None."""
        if self.gpus_per_node:
            return all(
                self.node_of(self.rank(t, d, stage_a)) == self.node_of(self.rank(t, d, stage_b))
                for t in range(self.tp)
                for d in range(self.dp)
            )
        if self.nodes and self.nodes[stage_a] and self.nodes[stage_b]:
            return self.nodes[stage_a] == self.nodes[stage_b]
        return None

    def group_ranks(self, group: str, stage: int = 0) -> list[int]:
        """The global ranks of the first `group` of `stage`: "tp", "cp", "dp", or "dp_cp" (the data- and
        context-parallel group the gradients are reduced over: `parallel_state.get_data_parallel_group(
        with_context_parallel=True)`); under experts "ep", "etp", "tp_ep" and "edp" (`expert_rank`), and "tp_cp"."""
        if group == "tp":
            return [self.rank(k, 0, stage) for k in range(self.tp)]
        if group == "cp":
            return [self.rank(0, 0, stage, k) for k in range(self.cp)]
        if group == "dp_cp":
            return [self.rank(0, d, stage, c) for c in range(self.cp) for d in range(self.dp)]
        # the expert layers' groups (`expert_rank`): expert-parallel, expert tensor-parallel, both (the allgather
        # dispatcher's tp_ep group) and expert data-parallel
        if group == "ep":
            return [self.expert_rank(0, k, 0, stage) for k in range(self.ep)]
        if group == "etp":
            return [self.expert_rank(k, 0, 0, stage) for k in range(self.etp)]
        if group == "tp_ep":
            return [self.expert_rank(t, k, 0, stage) for k in range(self.ep) for t in range(self.etp)]
        if group == "edp":
            return [self.expert_rank(0, 0, k, stage) for k in range(self.edp)]
        if group == "tp_cp":  # the router's aux-loss reduction (`parallel_state.get_tensor_and_context_parallel_group`)
            return [self.rank(k, 0, stage, c) for c in range(self.cp) for k in range(self.tp)]
        return [self.rank(0, k, stage) for k in range(self.dp)]

    def group_nodes(self, group: str, stage: int = 0) -> tuple[int, int] | None:
        """(nodes one `group` (`group_ranks`) of `stage` spans, GPUs of one node in it), or None without nodes.

        Every group of a kind is laid out alike under a rank order, so the first one (the other coordinates 0)
        stands for all."""
        if not self.gpus_per_node:
            return None
        # asked for every collective a prediction prices (tens of thousands in a plan): kept on the instance, a
        # function of its frozen fields (not a field: equality, hashing and to_dict do not see it)
        known = self.__dict__.setdefault("_group_nodes", {})
        if (group, stage) not in known:
            nodes: dict[int, int] = {}
            for rank in self.group_ranks(group, stage):
                nodes[rank // self.gpus_per_node] = nodes.get(rank // self.gpus_per_node, 0) + 1
            known[(group, stage)] = (len(nodes), max(nodes.values()))
        return known[(group, stage)]

    def collective(self, op: str, gpus: int) -> CollectiveTable | None:
        """The machine's benchmark table of `op` on `gpus` GPUs, or None."""
        return next((t for t in self.collectives if t.op == op and t.gpus == gpus), None)

    def components(self, device_type: str) -> ComponentTables | None:
        """The machine's component tables of `device_type`, or None."""
        return next((t for t in self.component_tables if t.device == device_type), None)

    def link(self, src_stage: int, dst_stage: int) -> LinkFit | None:
        """The fitted link between two stages, in either direction, or None."""
        for fit in self.links:
            if {fit.src_stage, fit.dst_stage} == {src_stage, dst_stage}:
                return fit
        return None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in _OPTIONAL_FIELDS:  # written only when set: the text of specs that do not use them stays as it was
            if data[name] in (None, ()) or data[name] == _default_of(Spec, name):
                data.pop(name)
        for name in _OPTIONAL_SHAPE_FIELDS:
            if data["model"][name] is None or data["model"][name] == _default_of(ModelShape, name):
                data["model"].pop(name)
        for link in data["links"]:
            for name in ("intra_node", "transport"):  # written only when set, as the optional fields
                if not link[name]:
                    link.pop(name)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Spec:
        data = dict(data)
        data["links"] = tuple(LinkFit(**link) for link in data.get("links", ()))
        data["model"] = ModelShape(**data["model"])
        data["collectives"] = tuple(CollectiveTable(**table) for table in data.get("collectives", ()))
        data["component_tables"] = tuple(ComponentTables(**table) for table in data.get("component_tables", ()))
        for name in (
            "layers_per_stage",
            "devices",
            "device_ids",
            "device_names",
            "nodes",
            "cores",
            "layers_per_virtual_stage",
        ):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls.from_dict(json.loads(text))


# Spec fields added after fixtures were first written, left out of spec.json at these values.
_OPTIONAL_FIELDS = (
    "gpus_per_node",
    "collectives",
    "dp",
    "distributed_optimizer",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "rank_order",
    "ranks_per_device",
    "nodes",
    "cores",
    "transport",
    "component_tables",
    "overlap_p2p",
    "layers_per_virtual_stage",
)
_OPTIONAL_SHAPE_FIELDS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "tensor_parallel",
    "sequence_parallel",
    "swiglu",
    "num_query_groups",
    "normalization",
    "position_embedding",
    "attention_kernel",
    "context_parallel",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_ffn",
    "expert_parallel",
    "expert_tensor_parallel",
    "moe_dispatcher",
    "moe_grouped_gemm",
    "moe_capacity_factor",
    "moe_pad_to_capacity",
    "moe_router_fp32",
    "moe_aux_loss",
    "moe_z_loss",
)


def _default_of(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def expert_data_parallel_size(world: int, etp: int, ep: int, pp: int) -> int:
    """The experts' data-parallel size on `world` GPUs: world // (etp x ep x pp), the dp megatron-core's
    parallel_state.initialize_model_parallel gives the experts' RankGenerator (tp=etp, ep=ep, dp=edp, pp=pp, cp=1);
    whether etp x ep x pp divides the world is the caller's check."""
    return world // (etp * ep * pp)


def global_rank(order: str, coordinates: dict[str, tuple[int, int]]) -> int:
    """The global rank of a GPU from its (index, size) per parallel dimension, under a Megatron rank order
    ("tp-cp-ep-dp-pp": the first dimension varies fastest); dimensions not given have size 1."""
    rank, stride = 0, 1
    for dim in order.split("-"):
        index, size = coordinates.get(dim, (0, 1))
        rank += index * stride
        stride *= size
    return rank


def coordinates_of(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """A global rank's index per parallel dimension (`sizes`: size per dimension, absent ones 1) under a rank
    order: the inverse of `global_rank`."""
    found = {}
    for dim in order.split("-"):
        size = sizes.get(dim, 1)
        found[dim] = rank % size
        rank //= size
    return found


@dataclass(frozen=True)
class Hardware:
    """Where a launch's pipeline stages run: what `spec_from_args` needs besides the arguments.

    Either a device type per stage (`devices`, with the stage map's `device_ids` and optional human-readable
    `device_names`), as a job directory's hops_trace_map.json and hops.base.yaml give it, or one `gpu` type on nodes
    of `gpus_per_node` (a training log's or a run table's hardware), with Megatron's placement: with tensor and
    data parallel size 1, pipeline rank r is global rank r, on node r // gpus_per_node. `source` and `field` name
    where the stage list came from, for the error when it disagrees with --pipeline-model-parallel-size.
    """

    devices: tuple[str, ...] = ()
    device_ids: tuple[str, ...] = ()
    device_names: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()  # with `devices`: the node of each stage's device ("" where not named)
    gpu: str | None = None
    gpus_per_node: int | None = None
    source: Path | str = "hardware"
    field: str = "stages"

    def __post_init__(self) -> None:
        if (self.gpu is None) == (not self.devices):
            raise ValueError("Hardware takes either a device type per stage or one gpu type (with gpus_per_node)")
        if self.gpu is not None and (type(self.gpus_per_node) is not int or self.gpus_per_node < 1):
            raise ValueError(
                f"Hardware: gpus_per_node must be a whole number of at least 1, got {self.gpus_per_node!r}"
            )

    def node_of(self, stage: int, first_ranks: Sequence[int] | None = None) -> str | None:
        """The node stage `stage` runs on: its first GPU's global rank // gpus_per_node (`first_ranks`, default the
        stage), or the device's named node; None when unknown."""
        if self.gpu is not None:
            rank = first_ranks[stage] if first_ranks is not None else stage
            return str(rank // int(self.gpus_per_node or 1))
        return (self.nodes[stage] or None) if stage < len(self.nodes) else None

    def stages(
        self, pp: int, first_ranks: Sequence[int] | None = None
    ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(device types, device ids, device names) of the pp stages; with a GPU type, a stage is named by its first
        GPU (`first_ranks`: the global rank of each stage's (tp 0, dp 0) GPU; default r for stage r)."""
        if self.gpu is not None:
            per_node = int(self.gpus_per_node or 1)
            ranks = list(first_ranks) if first_ranks is not None else list(range(pp))
            ids = tuple(f"node{rank // per_node}_gpu{rank % per_node}" for rank in ranks)
            return (self.gpu,) * pp, ids, ()
        return self.devices, self.device_ids or tuple(f"stage{k}" for k in range(len(self.devices))), self.device_names
