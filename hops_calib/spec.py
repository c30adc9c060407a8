"""What a prediction may see: the spec of a run, known before it ran.

A `Spec` is built from the launch configuration, the stage-to-device map, the
device types and the link benchmark (a separate job). It never holds anything
measured from the run's own events (rule 1 of the design); `truth` holds those.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from hops_calib.trace.collective_bench import CollectiveTable  # the machine's collective benchmark
from hops_calib.trace.events import MAX_INDEX  # the largest microbatch and model chunk a trace numbers
from hops_calib.trace.link_bench import LinkFit  # the link benchmark's fit; a Spec carries one per hop

# The HOPS tracing fork of Megatron starts tracing at iteration 3: iterations
# 1-2 are warm-up and absent from the event logs. CPU captures follow the same
# convention, so the traced iteration count is derivable from --train-iters.
TRACE_FIRST_ITERATION = 3

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb_h1")


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
    # The core of every global rank when ranks time-share cores (`manifest.yaml`'s `cores` of such a capture), so
    # which ranks share one is known (`core_load`); () otherwise
    cores: tuple[int, ...] = ()

    @property
    def tp(self) -> int:
        return self.model.tensor_parallel

    @property
    def gpus(self) -> int:
        """GPUs of the launch: tp x dp per stage."""
        return self.pp * self.tp * self.dp
    # the node of each stage's device when a job directory names them and has a collective benchmark to price
    # what runs within a node (hops_calib.trace DeviceInfo.node); () otherwise
    nodes: tuple[str, ...] = ()
    # The transport NCCL runs the launch's traffic between nodes over, as the launch's environment says it
    # (NCCL_NET, NCCL_IB_DISABLE: trace.megatron_args.Launch.transport); "" when it says nothing, and then the
    # links' own (`LinkFit.transport`) decide
    transport: str = ""

    def __post_init__(self) -> None:
        if len(self.layers_per_stage) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.layers_per_stage)} layer counts for pp={self.pp}")
        if len(self.devices) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.devices)} devices for pp={self.pp}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"spec {self.run_id}: unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")

    def rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        """The global rank of GPU (tp_rank, dp_rank, pp_rank) under the launch's rank order."""
        return global_rank(self.rank_order, {"tp": (tp_rank, self.tp), "dp": (dp_rank, self.dp),
                                             "pp": (pp_rank, self.pp)})

    def core_load(self) -> tuple[tuple[float, ...], ...]:
        """Per pipeline rank s, how many processes of each pipeline rank q share s's core (`Pipeline.core_load`):
        the ranks of stage q (every tensor- and data-parallel copy, in the rank order) on the core of s's first
        rank. From `cores` when given; else a flat `ranks_per_device` copies of each rank's own stage (the other
        sharers unknown); () for one rank per device."""
        if self.cores:
            sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
            # processes per (core, stage): every rank counted once, under its core and its pipeline rank
            sharers = Counter((core, coordinates_of(rank, self.rank_order, sizes)["pp"])
                              for rank, core in enumerate(self.cores))
            return tuple(tuple(float(sharers[self.cores[self.rank(0, 0, s)], q]) for q in range(self.pp))
                         for s in range(self.pp))
        if self.ranks_per_device != 1:
            return tuple(tuple(self.ranks_per_device if q == s else 0.0 for q in range(self.pp))
                         for s in range(self.pp))
        return ()

    def node_of(self, rank: int) -> int | None:
        return rank // self.gpus_per_node if self.gpus_per_node else None

    def same_node(self, stage_a: int, stage_b: int) -> bool | None:
        """Whether two stages' corresponding GPUs (same tp and dp coordinates) share a node, when the hardware says
        (a GPU type on nodes of gpus_per_node, global rank r on node r // gpus_per_node; or a job directory's devices
        with their nodes named); else None."""
        if self.gpus_per_node:
            return all(self.node_of(self.rank(t, d, stage_a)) == self.node_of(self.rank(t, d, stage_b))
                       for t in range(self.tp) for d in range(self.dp))
        if self.nodes and self.nodes[stage_a] and self.nodes[stage_b]:
            return self.nodes[stage_a] == self.nodes[stage_b]
        return None

    def group_nodes(self, group: str, stage: int = 0) -> tuple[int, int] | None:
        """(nodes one `group` ("tp" or "dp") of `stage` spans, GPUs of one node in it), or None without nodes.

        Every group of a kind is laid out alike under a rank order, so the first one (the other coordinates 0)
        stands for all."""
        if not self.gpus_per_node:
            return None
        size = self.tp if group == "tp" else self.dp
        ranks = [self.rank(k, 0, stage) if group == "tp" else self.rank(0, k, stage) for k in range(size)]
        nodes: dict[int, int] = {}
        for rank in ranks:
            nodes[rank // self.gpus_per_node] = nodes.get(rank // self.gpus_per_node, 0) + 1
        return len(nodes), max(nodes.values())

    def collective(self, op: str, gpus: int) -> CollectiveTable | None:
        """The machine's benchmark table of `op` on `gpus` GPUs, or None."""
        return next((t for t in self.collectives if t.op == op and t.gpus == gpus), None)

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
        for name in ("layers_per_stage", "devices", "device_ids", "device_names", "nodes", "cores"):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls.from_dict(json.loads(text))


# Spec fields added after fixtures were first written, left out of spec.json at these values.
_OPTIONAL_FIELDS = ("gpus_per_node", "collectives", "dp", "distributed_optimizer", "overlap_grad_reduce",
                    "overlap_param_gather", "rank_order", "ranks_per_device", "nodes", "cores", "transport")
_OPTIONAL_SHAPE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "tensor_parallel",
                          "sequence_parallel", "swiglu", "num_query_groups", "normalization", "position_embedding",
                          "attention_kernel")


def _default_of(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


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


# ---------------------------------------------------------------------------
# Building a spec from a job directory (its configuration files only).

# Labels a hand-written template or a scenario name may use, mapped to SCHEDULES.
SCHEDULE_ALIASES = {
    "1f1b": "1f1b",
    "one_f_one_b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "gpipe": "gpipe",
    "zero_bubble": "zb_h1",
    "zb_h1": "zb_h1",
    "zb": "zb_h1",
}
# Scenario-name tokens that name a schedule. "interleaved" is deliberately absent: in the
# cluster scenario names it means an alternating device order, not the interleaved schedule.
_NAME_TOKENS = (("zero_bubble", "zb_h1"), ("gpipe", "gpipe"))


def normalize_schedule_label(label: str) -> str:
    """A declared schedule label as one of SCHEDULES when it is a known alias, else lower-cased as given."""
    key = str(label).strip().lower().replace("-", "_")
    return SCHEDULE_ALIASES.get(key, key)


def declared_schedule_of(template: dict[str, Any], names: list[str]) -> str | None:
    """The schedule a run was labelled with: `pipeline.schedule` of hops.base.yaml, else a token of its names."""
    label = (template.get("pipeline") or {}).get("schedule") if template else None
    if label:
        return normalize_schedule_label(label)
    for name in names:
        padded = f"_{name.lower()}_"
        for token, schedule in _NAME_TOKENS:
            if f"_{token}_" in padded:
                return schedule
    return None


def split_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline rank, as Megatron splits them.

    `--decoder-first/last-pipeline-num-layers` pin the first/last rank; the
    remaining layers are spread evenly over the other ranks (they must divide).
    """
    if pp == 1:
        return (num_layers,)
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    pinned = [c for c in counts if c is not None]
    free = counts.count(None)
    rest = num_layers - sum(pinned)
    if rest < 0 or (free == 0 and rest != 0) or (free and rest % free):
        pins = [f"{label} stage {count}" for label, count in (("first", first), ("last", last)) if count is not None]
        raise ValueError(f"{num_layers} layers cannot be split evenly over {pp} stages"
                         + (f" with {' and '.join(pins)} pinned: {rest} left for {free} stages" if pins else ""))
    return tuple(c if c is not None else rest // free for c in counts)


def _flag(key: str) -> str:
    """The command-line flag of an argument's `args.` name: num_layers -> --num-layers."""
    return "--" + key.replace("_", "-")


def _require_int(args: dict[str, Any], name: str, source: Any, default: int | None = None, minimum: int = 0) -> int:
    from hops_calib.trace.errors import TraceError

    flag = _flag(name)
    value = args.get(name, default)
    if type(value) is not int or value < minimum:
        expected = "a non-negative integer" if minimum == 0 else f"a whole number of at least {minimum}"
        raise TraceError(source, f"is {value!r}, expected {expected}" if name in args else "is missing",
                         field=flag, hint=f"give {flag} {expected}" if name in args
                         else f"the spec needs it; add {flag} to the launch command")
    return value


def configured_schedule(configured: Any, vp: int, source: Path | str = "manifest.yaml") -> str:
    """The schedule the launch configured: Megatron's from its flags, or the launcher's own when it records one.

    Megatron runs non-interleaved 1F1B unless virtual pipeline stages are configured. A launcher whose
    schedules have no Megatron flag (`hops-calib capture --engine torch`: GPipe, ZB-H1) writes the schedule it
    configured as `configured_schedule` in manifest.yaml (`source`); cluster manifests have no such key (None).
    """
    from hops_calib.trace import TraceError

    from_flags = "interleaved_1f1b" if vp > 1 else "1f1b"
    if configured is None:
        return from_flags
    if configured not in SCHEDULES:
        raise TraceError(source, f"is {configured!r}", field="configured_schedule",
                         hint=f"expected one of {', '.join(SCHEDULES)}, or remove the key")
    if (configured == "interleaved_1f1b") != (vp > 1):
        raise TraceError(source, f"is {configured!r} but the arguments configure {vp} model chunk(s) "
                         "per stage", field="configured_schedule",
                         hint="interleaved 1F1B needs virtual pipeline stages, and only it uses them")
    return configured


# Microbatches per iteration, and model chunks per stage, a configuration may have to be ingested or predicted as
# it is: as many as a trace numbers; predict --job times 32768 microbatches in about 2 s. (plan --job searches
# other micro-batch sizes instead: it bounds its own tasks.)
MAX_PER_ITERATION = MAX_INDEX + 1


def check_simulable(spec: Spec, source: Path | str) -> None:
    """TraceError naming `source` (the launch's arguments) when the spec has more microbatches per iteration or
    model chunks per stage than MAX_PER_ITERATION: no trace numbers them, and simulating them would run for hours."""
    from hops_calib.trace.errors import TraceError

    for count, what, flag in ((spec.microbatches, "microbatches per iteration", "--global-batch-size"),
                              (spec.vp, "model chunks per stage", "--virtual-pipeline-model-parallel-size")):
        if count > MAX_PER_ITERATION:
            raise TraceError(source, f"gives {count} {what}, more than the {MAX_PER_ITERATION} a trace can "
                             "number and the simulator times", field=flag,
                             hint=f"give a configuration of at most {MAX_PER_ITERATION} {what}")


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
            raise ValueError(f"Hardware: gpus_per_node must be a whole number of at least 1, got "
                             f"{self.gpus_per_node!r}")

    def node_of(self, stage: int, first_ranks: Sequence[int] | None = None) -> str | None:
        """The node stage `stage` runs on: its first GPU's global rank // gpus_per_node (`first_ranks`, default the
        stage), or the device's named node; None when unknown."""
        if self.gpu is not None:
            rank = first_ranks[stage] if first_ranks is not None else stage
            return str(rank // int(self.gpus_per_node or 1))
        return (self.nodes[stage] or None) if stage < len(self.nodes) else None

    def stages(self, pp: int, first_ranks: Sequence[int] | None = None
               ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(device types, device ids, device names) of the pp stages; with a GPU type, a stage is named by its first
        GPU (`first_ranks`: the global rank of each stage's (tp 0, dp 0) GPU; default r for stage r)."""
        if self.gpu is not None:
            per_node = int(self.gpus_per_node or 1)
            ranks = list(first_ranks) if first_ranks is not None else list(range(pp))
            ids = tuple(f"node{rank // per_node}_gpu{rank % per_node}" for rank in ranks)
            return (self.gpu,) * pp, ids, ()
        return self.devices, self.device_ids or tuple(f"stage{k}" for k in range(len(self.devices))), \
            self.device_names


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def recomputation_of(args: dict[str, Any], source: Path | str) -> tuple[str | None, str | None, int | None]:
    """(granularity, method, number of layers) of a launch's activation recomputation, as Megatron reads them.

    `--recompute-granularity full|selective` with `--recompute-method uniform|block` and `--recompute-num-layers N`
    (Megatron-LM); `--recompute-activations` is selective; the older `--checkpoint-activations` (Megatron-LM before
    2022 and Megatron-DeepSpeed) is full and uniform, in groups of `--checkpoint-num-layers` (default 1). Full
    recomputation needs a method (Megatron has no default for it), and block a number of layers. Selective
    recomputation takes no method. (None, None, None) when nothing is recomputed.
    """
    from hops_calib.trace import TraceError

    granularity = args.get("recompute_granularity")
    method = args.get("recompute_method")
    number = args.get("recompute_num_layers")
    if granularity is None and args.get("recompute_activations"):
        granularity = "selective"
    if granularity is None and args.get("checkpoint_activations"):
        granularity, method = "full", method or "uniform"
        if number is None:
            number = args.get("checkpoint_num_layers", 1)
    if granularity is None:
        return None, None, None
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise TraceError(source, f"is {granularity!r}", field="--recompute-granularity",
                         hint=f"Megatron takes {' or '.join(RECOMPUTE_GRANULARITIES)}")
    if granularity == "selective":
        if method is not None:
            raise TraceError(source, f"is {method!r} with --recompute-granularity selective", field="--recompute-method",
                             hint="Megatron takes a recompute method only for full recomputation: drop it")
        return granularity, None, None
    if method not in RECOMPUTE_METHODS:
        raise TraceError(source, f"is {method!r} with --recompute-granularity full", field="--recompute-method",
                         hint=f"full recomputation needs --recompute-method {' or '.join(RECOMPUTE_METHODS)}")
    if number is None and method == "uniform":
        number = 1
    if type(number) is not int or number < 1:
        raise TraceError(source, f"is {number!r} with --recompute-method {method}", field="--recompute-num-layers",
                         hint="give the number of layers per recomputed group (uniform) or per model chunk (block), "
                              "at least 1")
    return granularity, method, number


def spec_from_args(args: dict[str, Any], source: Path | str, *, run_id: str, hardware: Hardware,
                   links: Sequence[LinkFit] = (), collectives: Sequence[CollectiveTable] = (),
                   configured: str | None = None, schedule_source: Path | str = "manifest.yaml",
                   declared_schedule: str | None = None, iterations: int | None = None,
                   notes: list[str] | None = None, ranks_per_device: float = 1.0) -> Spec:
    """The spec of a Megatron launch, from its arguments alone (pure: reads no file).

    `args` are Megatron's arguments in their `args.` spelling (as `trace.megatron_args` parses a command line or a
    log's arguments block), read from `source` (named in errors). `hardware` places the stages; `links` are the
    link benchmark's fits and `collectives` the collective benchmark's tables of the machine (both measured apart
    from the run). `configured` is a schedule a launcher recorded (manifest.yaml's `configured_schedule`, named
    by `schedule_source`), else Megatron's from the flags. `iterations` is the window to simulate; None takes
    the traced window of --train-iters (the tracing fork traces from iteration TRACE_FIRST_ITERATION). A launch
    the cost model does not price is refused (`require_modelled`), as is any inconsistent setting: TraceError
    naming the source, the flag and what to do.
    """
    from hops_calib.trace import TraceError

    notes = [] if notes is None else notes
    require_modelled(args, source)  # a run the cost model cannot price is refused, in ingest and what-if alike

    pp = _require_int(args, "pipeline_model_parallel_size", source, default=1, minimum=1)
    tp = _require_int(args, "tensor_model_parallel_size", source, default=1, minimum=1)
    num_layers = _require_int(args, "num_layers", source, minimum=1)

    if args.get("virtual_pipeline_model_parallel_size"):
        vp = _require_int(args, "virtual_pipeline_model_parallel_size", source)
    elif args.get("num_layers_per_virtual_pipeline_stage"):
        per_virtual = _require_int(args, "num_layers_per_virtual_pipeline_stage", source)
        if per_virtual == 0 or num_layers % (pp * per_virtual):
            raise TraceError(source, f"{per_virtual} does not divide {num_layers} layers over {pp} stages",
                             field="--num-layers-per-virtual-pipeline-stage",
                             hint="num_layers must be a multiple of pp * layers per virtual stage")
        vp = num_layers // (pp * per_virtual)
    else:
        vp = 1

    world = args.get("world_size")
    if type(world) is int and world > 0:
        if world % (tp * pp):
            raise TraceError(source, f"{world} is not a multiple of tp*pp = {tp * pp}", field="world_size",
                             hint="launch tp x pp x dp GPUs")
        dp = world // (tp * pp)
        given = args.get("data_parallel_size")
        if type(given) is int and given > 0 and given != dp:
            raise TraceError(source, f"{given}, but world size {world} / (tp {tp} x pp {pp}) = {dp}",
                             field="--data-parallel-size", hint="make the parallel sizes multiply to the GPUs")
    else:
        dp = _require_int(args, "data_parallel_size", source, default=1) or 1
    micro_batch = _require_int(args, "micro_batch_size", source, default=1, minimum=1)
    global_batch = _require_int(args, "global_batch_size", source, default=micro_batch * dp, minimum=1)
    if global_batch % (micro_batch * dp):
        raise TraceError(source, f"{global_batch} is not a multiple of micro batch {micro_batch} x dp {dp}",
                         field="--global-batch-size", hint="Megatron requires it to divide")
    microbatches = global_batch // (micro_batch * dp)
    if iterations is None:
        train_iters = _require_int(args, "train_iters", source)
        iterations = train_iters - TRACE_FIRST_ITERATION + 1
        if iterations < 1:
            raise TraceError(source, f"is {train_iters}: the trace starts at iteration {TRACE_FIRST_ITERATION}",
                             field="--train-iters",
                             hint=f"a traced run needs at least {TRACE_FIRST_ITERATION} iterations")
    elif type(iterations) is not int or iterations < 1:
        raise ValueError(f"spec {run_id}: iterations must be a whole number of at least 1, got {iterations!r}")

    first, last = (_require_int(args, name, source) if args.get(name) is not None else None
                   for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"))
    try:
        layers = split_layers(num_layers, pp, first, last)
    except ValueError as err:
        raise TraceError(source, str(err), field="--num-layers",
                         hint="make the layers divide evenly, or fix --decoder-first/last-pipeline-num-layers") from err

    rank_order = rank_order_of(args, source)
    sizes = {"tp": (0, tp), "dp": (0, dp), "pp": (0, pp)}
    first_ranks = [global_rank(rank_order, {**sizes, "pp": (k, pp)}) for k in range(pp)]
    devices, device_ids, names = hardware.stages(pp, first_ranks)
    if len(devices) != pp:
        raise TraceError(hardware.source, f"maps {len(devices)} stages but {Path(source).name} says "
                         f"--pipeline-model-parallel-size {pp}", field=hardware.field,
                         hint="the stage counts of the configuration and the stage map must agree")

    links = tuple(links) + _intra_node_links(pp, vp, hardware, links, collectives, first_ranks)
    schedule = configured_schedule(configured, vp, schedule_source)
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    granularity, method, recompute_layers = recomputation_of(args, source)
    hidden = _require_int(args, "hidden_size", source, minimum=1)
    heads = _require_int(args, "num_attention_heads", source, minimum=1)
    seq = _require_int(args, "seq_length", source, minimum=1)
    if hidden % heads:
        raise TraceError(source, f"{heads} does not divide --hidden-size {hidden}", field="--num-attention-heads",
                         hint="Megatron splits the hidden size evenly over the attention heads")
    positions = args.get("max_position_embeddings")
    if type(positions) is int and positions < seq:
        raise TraceError(source, f"{seq} is more than --max-position-embeddings {positions}",
                         field="--seq-length", hint="learned absolute positions cover at most "
                         "--max-position-embeddings tokens: Megatron refuses a longer sequence")
    # Megatron's args.padded_vocab_size (a log's arguments block, a run table) is the vocabulary it allocated, already
    # a multiple of --make-vocab-size-divisible-by x t; the cost model pads vocab_size to a multiple of 128, which
    # leaves it as it is.
    vocab_key = "padded_vocab_size" if args.get("padded_vocab_size") is not None else "vocab_size"
    vocab = _require_int(args, vocab_key, source, default=0, minimum=1 if vocab_key in args else 0)
    ffn = _require_int(args, "ffn_hidden_size", source, default=4 * hidden, minimum=1)
    model = ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=vocab,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        precision=precision,
        untie_embeddings=bool(args.get("untie_embeddings_and_output_weights", False)),
        clip_grad=float(args.get("clip_grad", 1.0)),
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=recompute_layers,
        **layer_settings_of(args, source, tp, heads, ffn),
    )
    zero = args.get("zero_stage") or 0
    return Spec(
        run_id=run_id,
        pp=pp,
        vp=vp,
        microbatches=microbatches,
        iterations=iterations,
        layers_per_stage=layers,
        devices=tuple(devices),
        device_ids=tuple(device_ids),
        links=tuple(links),
        schedule=schedule,
        model=model,
        declared_schedule=declared_schedule,
        device_names=tuple(names) if any(names) else (),
        megatron_args=args,
        gpus_per_node=hardware.gpus_per_node,
        collectives=tuple(collectives),
        dp=dp,
        distributed_optimizer=bool(args.get("use_distributed_optimizer")) or zero in (1, 2),
        overlap_grad_reduce=bool(args.get("overlap_grad_reduce")),
        overlap_param_gather=bool(args.get("overlap_param_gather")),
        rank_order=rank_order,
        ranks_per_device=ranks_per_device,
        nodes=tuple(hardware.nodes) if collectives and hardware.gpu is None and any(hardware.nodes) else (),
    )


def _intra_node_links(pp: int, vp: int, hardware: Hardware, links: Sequence[LinkFit],
                      collectives: Sequence[CollectiveTable], first_ranks: Sequence[int]) -> tuple[LinkFit, ...]:
    """Links for the hops within one node that the link benchmark did not measure, from the node's smallest
    all-reduce table (`trace.collective_bench.ring_link`: the ring formula; a 2-GPU table is a pair)."""
    tables = sorted((t for t in collectives if t.op == "all_reduce"), key=lambda t: t.gpus)
    if not tables:
        return ()
    from hops_calib.trace.collective_bench import ring_link

    pairs = [(k, k + 1) for k in range(pp - 1)] + ([(pp - 1, 0)] if vp > 1 and pp > 2 else [])
    have = {frozenset((fit.src_stage, fit.dst_stage)) for fit in links}
    return tuple(ring_link(tables[0], a, b) for a, b in pairs
                 if frozenset((a, b)) not in have and hardware.node_of(a, first_ranks) is not None
                 and hardware.node_of(a, first_ranks) == hardware.node_of(b, first_ranks))


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
    how = ("; ".join(f"ranks {', '.join(map(str, ranks))} share core {c}" for c, ranks in groups.items()
                     if len(ranks) > 1) if shared else "every rank has a core of its own")
    line = yaml_key_line(read_config_text(path), "ranks_share_cores")
    said_text = str(said).lower() if isinstance(said, bool) else repr(said)
    return (f"{path}{f':{line}' if line else ''}: field 'ranks_share_cores' says {said_text}, but its cores "
            f"{cores} say {how}: priced as `cores` says ({'processor sharing' if shared else 'a core per rank'}); "
            f"the capture writes the flag from `cores`, so fix `cores` if it is wrong, else set ranks_share_cores: "
            f"{str(shared).lower()}")


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
    template_stages = (template.get("pipeline") or {}).get("stages") if isinstance(template.get("pipeline"),
                                                                                   dict) else None
    if isinstance(template_stages, list) and len(device_ids) == pp:
        if len(template_stages) != pp:
            raise TraceError(job_dir / TEMPLATE, f"lists {len(template_stages)} stages but {args_source.name} says "
                             f"--pipeline-model-parallel-size {pp}", field="pipeline.stages",
                             hint="the template and the launch configuration describe different pipelines (a "
                                  "template from another job?): fix pipeline.stages, or the launch configuration")
        order = [entry.get("device") if isinstance(entry, dict) else None for entry in template_stages]
        if all(order) and tuple(order) != tuple(device_ids):
            raise TraceError(job_dir / TEMPLATE, f"puts the devices in the order {order}, {STAGE_MAP} in "
                             f"{list(device_ids)}", field="pipeline.stages",
                             hint="the two must agree; after reordering stages (a what-if), reorder both; each hop "
                                  "is priced by the hosts at its ends, so give predict --cluster (`hops-calib "
                                  "cluster` builds one from job directories) or re-run the link benchmark")
    device_types = read_device_types(job_dir, template)
    missing = [d for d in device_ids if d not in device_types]
    if missing:
        raise TraceError(job_dir / TEMPLATE, f"has no entry for device {missing[0]!r} of the stage map",
                         field="hardware.devices", hint="add {id: <device id>, gpu: <type>} for every mapped device")
    hardware = Hardware(devices=tuple(device_types[d].type for d in device_ids), device_ids=device_ids,
                        device_names=tuple(device_types[d].name for d in device_ids),
                        nodes=tuple(device_types[d].node for d in device_ids), source=job_dir / STAGE_MAP)

    links = read_link_fits(job_dir / LINK_BENCH_DIR, pp, notes) if len(device_ids) == pp else ()
    transport = launch.transport()  # the training launch's own environment, where it says, over the benchmark's
    other = sorted({fit.transport for fit in links if fit.transport and fit.transport != transport})
    if transport and other:
        notes.append(f"{LINK_BENCH_DIR} ran over {', '.join(other)}, {args_source.name}'s environment sets "
                     f"{transport}: the links are priced as the launch's transport")
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR, read_collective_tables

    cores = manifest.get("cores")
    world = args.get("world_size")
    if isinstance(cores, list) and cores and type(world) is int and len(cores) != world:
        # a capture's copy relaunched on more ranks: the cores it lists no longer say how ranks share them
        raise TraceError(job_dir / MANIFEST, f"lists {len(cores)} cores (one per rank of the capture) for a launch of "
                         f"{world} ranks", field="cores",
                         hint=f"list each of the {world} ranks' core (e.g. [0, 1, 0, 1, ...] for {world} ranks on 2 "
                              "cores: ranks sharing a core are served by processor sharing; ranks_share_cores: true beside "
                              "it), or remove `cores` to price each rank a device of its own")
    note = core_sharing_note(manifest, job_dir / MANIFEST)
    if note:
        notes.append(note)
    scenario = str(manifest.get("source_scenario") or "")
    spec = spec_from_args(args, args_source, run_id=run_id, hardware=hardware, links=links,
                          collectives=read_collective_tables(job_dir / ALLREDUCE_DIR),
                          configured=manifest.get("configured_schedule"), schedule_source=job_dir / MANIFEST,
                          ranks_per_device=_ranks_per_core(cores),
                          declared_schedule=declared_schedule_of(template, [run_id, scenario.rsplit("/", 1)[-1]]),
                          notes=notes)
    sharing = shared_cores(cores, spec.gpus)
    if sharing:  # which ranks share a core: priced by processor sharing
        spec = dataclasses.replace(spec, cores=sharing)
    per_node = launch.gpus_per_node
    if per_node is not None and spec.gpus_per_node is None:
        # A multi-node torchrun launch places global rank r on node r // nproc-per-node: the groups that span nodes
        # (a data-parallel group across nodes, say) are priced over the NICs, not the node's NVLink table.
        spec = dataclasses.replace(spec, gpus_per_node=per_node)
        notes.append(f"{args_source.name}: torchrun --nnodes > 1 with --nproc-per-node {per_node}: global rank r on "
                     f"node r // {per_node} (Megatron's rank order {spec.rank_order}), collectives of groups that "
                     "span nodes priced over the nodes' NICs")
    if transport:
        spec = dataclasses.replace(spec, transport=transport)
    if not spec.links and pp > 1 and len(device_ids) == pp and spec.gpus_per_node:
        notes.append(f"no link benchmark in {LINK_BENCH_DIR}: each hop priced by NVLink within a node and by the "
                     "GPU's share of its node's NICs across nodes (the launch's placement)")
    elif not spec.links and pp > 1 and len(device_ids) == pp:
        notes.append(f"no link benchmark in {LINK_BENCH_DIR}: the spec has no link fits, so predict, evaluate and "
                     f"report refuse this run until its benchmark (pair_<i>_<i+1>.jsonl) is added and it is ingested "
                     f"again (stages on one node, hardware.devices[].node, are priced from {ALLREDUCE_DIR}/ when it "
                     "holds the node's all-reduce tables)")
    if simulable:
        check_simulable(spec, args_source)
    return spec


# ---------------------------------------------------------------------------
# What the cost model assumes of a launch: the settings it prices, and nothing else.

@dataclass(frozen=True)
class Assumption:
    """One Megatron launch setting the cost model assumes: the model prices `modelled`, nothing else.

    `keys` are the setting's names in the parsed arguments (a command line's `--no-<key>` form counts as <key> =
    False); `default` is Megatron-LM's when the launch does not name it; `fits(value, args)` says whether the model
    prices the value. Settings not listed here (logging, seeds, paths, learning rate, ...) do not change what an
    iteration computes, or are priced (`--untie-embeddings-and-output-weights`, `--clip-grad`,
    `--no-gradient-accumulation-fusion`, the split of layers, the shape, the batch), and are not checked.
    """

    flag: str  # the command-line flag a user edits
    keys: tuple[str, ...]
    default: Any
    modelled: str  # what the model prices, in words
    fits: Any  # Callable[[value, args], bool]

    def value(self, args: dict[str, Any]) -> tuple[str | None, Any]:
        """(the key it was found under, or None when unset, and the value Megatron runs with)."""
        for key in self.keys:
            if key in args:
                return key, args[key]
            if f"no_{key}" in args:
                return f"no_{key}", not args[f"no_{key}"]
        return None, self.default


def _is(*values: Any):
    return lambda value, args: value in values


_off = _is(False, None)  # a switch left off (a rank log's block prints False; None where a version prints that)


def _interleaved(args: dict[str, Any]) -> bool:
    return bool(args.get("num_layers_per_virtual_pipeline_stage")) or (
        args.get("virtual_pipeline_model_parallel_size") or 1) > 1


# The Megatron GPT the cost terms count (hops_calib/model/gpt.py and the terms' physics): tensor, sequence, data and
# pipeline parallelism; Megatron's local or Transformer Engine layer with LayerNorm or RMSNorm, multi-head or
# grouped-query attention with learned absolute or rotary positions, unfused or fused (flash) attention, a GeLU or
# SwiGLU MLP; activations stored or recomputed (`recomputation_of`); 16- or 32-bit arithmetic; blocking p2p calls.
# What it does not price is listed here, each with what it prices instead.
ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption("--context-parallel-size", ("context_parallel_size",), 1,
               "context parallel size 1 (each GPU holds whole sequences)", _is(1)),
    # DeepSpeed-Ulysses sequence parallelism (Megatron-DeepSpeed) splits the sequence over GPUs: context
    # parallelism by another name, with all-to-alls the model does not price.
    Assumption("--ds-sequence-parallel-size", ("ds_sequence_parallel_size",), 1,
               "no DeepSpeed-Ulysses sequence parallelism (its all-to-alls are not priced)", _is(1, None)),
    Assumption("--num-experts", ("num_experts",), None, "a dense MLP, no mixture of experts", _is(None, 0, 1)),
    Assumption("--expert-model-parallel-size", ("expert_model_parallel_size",), 1,
               "no expert parallelism", _is(1)),
    Assumption("--multi-latent-attention", ("multi_latent_attention",), False,
               "multi-head or grouped-query attention, no multi-latent attention", _off),
    Assumption("--normalization", ("normalization",), "LayerNorm", "LayerNorm or RMSNorm",
               lambda value, args: str(value).lower() in ("layernorm", "rmsnorm")),
    Assumption("--position-embedding-type", ("position_embedding_type",), "learned_absolute",
               "learned absolute or rotary (rope) position embeddings", _is("learned_absolute", "rope")),
    Assumption("--transformer-impl", ("transformer_impl",), "transformer_engine",
               "Megatron's local layer or Transformer Engine's (--transformer-impl local|transformer_engine)",
               _is("local", "transformer_engine")),
    Assumption("--fp8-format", ("fp8_format", "fp8"), None, "bf16, fp16 or fp32 arithmetic, no FP8",
               _is(None, False)),
    # Megatron-LM's older FP8 switches (before --fp8-format): the same FP8 arithmetic
    Assumption("--fp8-hybrid", ("fp8_hybrid",), False, "bf16, fp16 or fp32 arithmetic, no FP8", _is(None, False)),
    Assumption("--fp8-e4m3", ("fp8_e4m3",), False, "bf16, fp16 or fp32 arithmetic, no FP8", _is(None, False)),
    Assumption("--hybrid-override-pattern", ("hybrid_override_pattern",), None,
               "transformer layers only, no hybrid (Mamba) layer pattern", _is(None)),
    # Transformer Engine's userbuffers overlap hides TP communication behind GEMMs; the model puts it on the
    # critical path.
    Assumption("--tp-comm-overlap", ("tp_comm_overlap",), False,
               "tensor-parallel communication on the critical path, no --tp-comm-overlap", _off),
    # ZeRO stage 1 and 2 shard what Megatron's distributed optimizer shards (optimizer state; gradients
    # reduce-scattered); stage 3 also shards the weights, gathering them per layer.
    Assumption("--zero-stage", ("zero_stage",), 0, "ZeRO stage 0, 1 or 2 (priced as the distributed optimizer)",
               _is(None, 0, 1, 2)),
    Assumption("--no-overlap-p2p-communication", ("overlap_p2p_comm", "overlap_p2p_communication"), True,
               "blocking p2p calls, which interleaved runs get with --no-overlap-p2p-communication",
               lambda value, args: value is False or not _interleaved(args)),
)


def attention_kernel_of(args: dict[str, Any]) -> str:
    """Whether a launch's attention writes the score matrix ("unfused") or runs a fused kernel that keeps it on
    chip ("flash"). Megatron's local layer is unfused unless --use-flash-attn (Megatron-DeepSpeed also spells it
    --use-flash-attn-v1/-v2/-triton/-builder); Transformer Engine's layer picks its flash or cuDNN fused attention
    (TE's default) unless --attention-backend unfused|local asks otherwise."""
    backend = str(args.get("attention_backend") or "auto").lower().rsplit(".", 1)[-1]
    if backend in ("unfused", "local"):
        return "unfused"
    if backend in ("flash", "fused"):
        return "flash"
    if any(args.get(name) for name in ("use_flash_attn", "use_flash_attn_v1", "use_flash_attn_v2",
                                       "use_flash_attn_triton", "use_flash_attn_builder")):
        return "flash"
    return "flash" if args.get("transformer_impl", "transformer_engine") == "transformer_engine" else "unfused"


def layer_settings_of(args: dict[str, Any], source: Path | str, tp: int, heads: int, ffn: int
                      ) -> dict[str, Any]:
    """The ModelShape fields of a launch's layer besides its sizes: tensor and sequence parallelism, SwiGLU, grouped
    query attention, the norm, the positions and the attention kernel, in Megatron-LM's spelling or
    Megatron-DeepSpeed's older one (--num-key-value-heads, --use-rotary-position-embeddings, --normalization
    rmsnorm). TraceError for a setting Megatron itself refuses (heads or groups that t does not divide)."""
    from hops_calib.trace import TraceError

    groups = None
    if args.get("group_query_attention") or args.get("num_key_value_heads"):
        key = "num_query_groups" if args.get("group_query_attention") else "num_key_value_heads"
        groups = _require_int(args, key, source, minimum=1)
        if heads % groups:
            raise TraceError(source, f"{groups} does not divide --num-attention-heads {heads}",
                             field=_flag(key), hint="each query group takes a whole number of heads")
        if groups == heads:
            groups = None  # as many groups as heads is multi-head attention
    for name, size in (("--num-attention-heads", heads), ("--num-query-groups", groups or heads),
                       ("--ffn-hidden-size", ffn)):
        if size % tp:
            raise TraceError(source, f"{size} is not divisible by --tensor-model-parallel-size {tp}", field=name,
                             hint="Megatron splits heads, query groups and the MLP over the tensor-parallel group: "
                                  "pick a size they divide by")
    rope = args.get("position_embedding_type", "learned_absolute") == "rope" or bool(
        args.get("use_rotary_position_embeddings"))
    return {
        "tensor_parallel": tp,
        # Megatron turns sequence parallelism off at tensor parallel size 1: it splits along the TP group
        "sequence_parallel": bool(args.get("sequence_parallel")) and tp > 1,
        "swiglu": bool(args.get("swiglu")),
        "num_query_groups": groups,
        "normalization": "RMSNorm" if str(args.get("normalization", "LayerNorm")).lower() == "rmsnorm"
        else "LayerNorm",
        "position_embedding": "rope" if rope else "learned_absolute",
        "attention_kernel": attention_kernel_of(args),
    }


RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp")


def rank_order_of(args: dict[str, Any], source: Path | str) -> str:
    """Megatron's rank order of a launch: --rank-order when given, tp-pp-dp under --use-tp-pp-dp-mapping, else
    its default tp-cp-ep-dp-pp (tensor-parallel ranks adjacent, then data-parallel, then pipeline)."""
    from hops_calib.trace import TraceError

    order = args.get("rank_order")
    if order is None:
        return "tp-cp-ep-pp-dp" if args.get("use_tp_pp_dp_mapping") else "tp-cp-ep-dp-pp"
    dims = str(order).lower().split("-")
    if sorted(d for d in dims if d in ("tp", "dp", "pp")) != ["dp", "pp", "tp"] or set(dims) - {"tp", "cp", "ep",
                                                                                                "dp", "pp"}:
        raise TraceError(source, f"is {order!r}", field="--rank-order",
                         hint="name each of tp, dp and pp once (cp and ep optional), fastest first, joined by '-': "
                              "e.g. tp-cp-ep-dp-pp (Megatron's default)")
    return "-".join(dims)


@dataclass(frozen=True)
class Unmodelled:
    """A launch setting the cost model does not price: the flag, the value the launch runs with, what is priced."""

    flag: str
    key: str | None  # the name it was found under in the arguments (None: unset, Megatron's default applies)
    value: Any
    modelled: str
    setting: str = ""  # Megatron's name of the setting (the arguments block's)

    def sentence(self) -> str:
        if self.key is None:
            return (f"no {self.flag}, so Megatron's default {self.setting} = {self.value!r} applies (the model "
                    f"prices {self.modelled})")
        if not self.names_flag:  # found under a name of its own (a block's key for a --no-... flag)
            return f"{self.key} = {self.value!r} (the model prices {self.modelled}; the flag for it is {self.flag})"
        shown = "" if self.value is True else f" {self.value}"
        return f"{self.flag}{shown} (the model prices {self.modelled})"

    @property
    def names_flag(self) -> bool:
        """Whether the setting was found under the flag's own name (`--swiglu` / `swiglu`)."""
        return self.key is None or _flag(self.key) == self.flag

    @property
    def field(self) -> str:
        """What the launch file calls it: the flag, or the arguments block's key."""
        return self.flag if self.names_flag else str(self.key)


def unmodelled(args: dict[str, Any]) -> list[Unmodelled]:
    """The settings of a launch's parsed arguments (`megatron_args.txt` or a rank log's block) that the cost model
    does not price, in the order of ASSUMPTIONS; empty when it prices them all."""
    found = []
    for assumption in ASSUMPTIONS:
        key, value = assumption.value(args)
        if not assumption.fits(value, args):
            found.append(Unmodelled(assumption.flag, key, value, assumption.modelled, assumption.keys[0]))
    return found


def _line_naming(source: Path, key: str | None) -> int | None:
    """1-based line of `source` that names the setting `key` (a command line's flag, a block's key); None if none
    does."""
    if key is None:
        return None
    flag = _flag(key)
    from hops_calib.trace import TraceError
    from hops_calib.trace.reading import text_lines

    try:
        for number, line in text_lines(Path(source)):
            line = line.rstrip("\r\n")
            if f"{flag} " in f"{line} " or f"{flag}=" in line or f" {key} ." in line:
                return number
    except TraceError:
        return None
    return None


# A command line's flag spelt within a letter or two of an argument the project knows (`trace.measured.KNOWN_ARGS`:
# what the spec reads, what ASSUMPTIONS refuse, common settings) may be a typo that silently prices another launch
# (`--sequence-paralel` prices no sequence parallelism): its note names the flag it nearly spells.
TYPO_SIMILARITY = 0.92  # difflib ratio: one or two letters in a long flag name


def unknown_flags(args: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(given, meant or None) for each argument the project neither prices nor knows (`KNOWN_ARGS`, ASSUMPTIONS'
    keys, a known `--no-<key>`), with the known one it nearly spells, if any. Not refused: the list of known
    arguments need not hold every Megatron flag; `unknown_flags_note` tells the user."""
    from difflib import get_close_matches

    from hops_calib.trace.measured import KNOWN_ARGS

    known = KNOWN_ARGS | {key for assumption in ASSUMPTIONS for key in assumption.keys}
    found: list[tuple[str, str | None]] = []
    for given in args:
        if given in known or given.removeprefix("no_") in known:
            continue
        meant = get_close_matches(given, known, n=1, cutoff=TYPO_SIMILARITY) if len(given) >= 6 else []
        found.append((given, meant[0] if meant else None))
    return found


def unknown_flags_note(args: dict[str, Any], source: Path | str) -> str | None:
    """The note for a command line's flags the model neither prices nor knows (`unknown_flags`), or None: "ignored:
    --frobnicate" with the file and line, and the flag a near-miss may mean."""
    found = unknown_flags(args)
    if not found:
        return None
    lines = {given: _line_naming(Path(source), given) for given, _ in found}
    one_line = len(set(lines.values())) == 1
    named = ", ".join(_flag(given) + ("" if one_line or lines[given] is None else f" (line {lines[given]})")
                      + (f" (did you mean {_flag(meant)}?)" if meant else "") for given, meant in found)
    where = Path(source).name + (f":{lines[found[0][0]]}" if one_line and lines[found[0][0]] is not None else "")
    return (f"ignored: {named} ({where}): flags the model neither prices nor knows, so the prediction is the "
            "launch's without them (spell a flag as Megatron does for it to count)")


def require_modelled(args: dict[str, Any], source: Path | str) -> None:
    """Refuse a launch (`args` read from `source`) with a setting the cost model does not price: a TraceError
    naming the file, the line and flag of the first such setting, every one of them, and what is priced.

    `build_spec` calls it, so ingest and `predict --job` (what-if) refuse the same launches.
    """
    from hops_calib.trace.errors import TraceError
    from hops_calib.trace.megatron_args import ARGS_FILE

    # A near-miss of a flag the project knows is a typo Megatron would refuse, and a prediction would price another
    # launch (`--sequence-paralel`: no sequence parallelism); refused, on a command line as a user writes it (a rank
    # log's arguments block holds the names Megatron itself parsed). A flag near nothing known is only noted.
    typos = [(given, meant) for given, meant in unknown_flags(args) if meant] \
        if Path(source).name == ARGS_FILE else []
    if typos:
        given, meant = typos[0]
        raise TraceError(source, "has flags the model does not know but that nearly spell ones it knows: "
                         + "; ".join(f"{_flag(g)} ({_flag(m)}?)" for g, m in typos),
                         line=_line_naming(Path(source), given), field=_flag(given),
                         hint=f"did you mean {_flag(meant)}? Megatron would refuse the unknown flag; spell it as "
                              "Megatron does, so that the prediction prices what the launch runs")
    found = unmodelled(args)
    if not found:
        return

    first = found[0]
    raise TraceError(source, "configures what the simulator does not model: "
                     + "; ".join(u.sentence() for u in found), line=_line_naming(Path(source), first.key),
                     field=first.field,
                     hint="a prediction would price another configuration than this launch; change the launch to "
                          "what the model prices, or extend the model (hops_calib/model) and hops_calib.spec."
                          "ASSUMPTIONS together")
