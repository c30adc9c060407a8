"""Model room: the interface of a cost term, and what a term sees (Context) and returns (Contribution).

A term is a small pure object: a name, its parameters (defaults and bounds),
a docstring giving its physical grounding, and `contribute(context, params)`,
which returns the milliseconds it adds to the simulator's per-task costs.
Contributions of the active terms add up into one `Pipeline`.
"""

from __future__ import annotations

import inspect
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from hops_calib.model.devices import DeviceSpec
from hops_calib.spec import Spec

DEVICE_LABEL = re.compile(r"^[a-z0-9_]+$")


@dataclass(frozen=True)
class Param:
    """A tunable number of a term. `low`..`high` is its physically plausible range (and tuning's search space)."""

    name: str
    default: float
    low: float
    high: float
    unit: str
    doc: str
    log: bool = False  # search on a log scale when tuning (for ranges spanning decades)
    # A per-device parameter may be given a value for one device type as "NAME@TYPE" (e.g.
    # "forward_ms_per_layer@a10g"): a property of the device or of the instance hosting it, learned like any
    # other parameter. Devices without an override take NAME's value.
    per_device: bool = False
    # A switch, or any parameter whose meaningful values are few: the only values it may take (tuning draws
    # from them instead of the range).
    choices: tuple[float, ...] = ()
    # A parameter added to a term whose default prices the term exactly as it was without it: at that default it is
    # no part of a model's identity (`ActiveTerm.identity`), so adding it leaves every model's sha256 as it was.
    inert: bool = False

    def __post_init__(self) -> None:
        if not self.low <= self.default <= self.high:
            raise ValueError(f"parameter {self.name}: default {self.default} outside [{self.low}, {self.high}]")
        if self.choices and (
            self.default not in self.choices or not all(self.low <= c <= self.high for c in self.choices)
        ):
            raise ValueError(
                f"parameter {self.name}: choices {self.choices} must hold the default and lie in "
                f"[{self.low}, {self.high}]"
            )


@dataclass(frozen=True)
class Layout:
    """Where the model's pieces sit: virtual stage k is model chunk k // ranks on rank k % ranks (Megatron)."""

    ranks: int
    chunks: int
    layers: tuple[int, ...]  # decoder layers per virtual stage

    @property
    def virtual_stages(self) -> int:
        return self.ranks * self.chunks

    @property
    def hops(self) -> int:
        """Adjacent virtual-stage pairs: the transfers of one microbatch in one direction."""
        return self.virtual_stages - 1

    def rank_of(self, virtual_stage: int) -> int:
        return virtual_stage % self.ranks

    def chunk_of(self, virtual_stage: int) -> int:
        return virtual_stage // self.ranks

    def layers_on_rank(self, rank: int) -> int:
        return sum(self.layers[k] for k in range(rank, self.virtual_stages, self.ranks))


def layout_of(spec: Spec) -> Layout:
    """The virtual-stage layout of a spec: its layers per virtual stage when it gives them (Megatron's
    get_num_layers_to_build, megatron/core/transformer/transformer_block.py), else each rank's split evenly over its
    chunks, as Megatron requires then."""
    if spec.layers_per_virtual_stage:
        return Layout(ranks=spec.pp, chunks=spec.vp, layers=tuple(spec.layers_per_virtual_stage))
    layers: list[int] = [0] * (spec.pp * spec.vp)
    for rank, on_rank in enumerate(spec.layers_per_stage):
        if on_rank % spec.vp:
            raise ValueError(
                f"spec {spec.run_id}: rank {rank} has {on_rank} layers, not divisible into vp={spec.vp} "
                "equal chunks (Megatron refuses such a split)"
            )
        for chunk in range(spec.vp):
            layers[chunk * spec.pp + rank] = on_rank // spec.vp
    return Layout(ranks=spec.pp, chunks=spec.vp, layers=tuple(layers))


@dataclass(frozen=True)
class Context:
    """What a term may read: the spec, its layout, and the device spec of every rank. Nothing measured."""

    spec: Spec
    layout: Layout
    devices: tuple[DeviceSpec, ...]  # per rank
    # One NCCL connection's ceiling between nodes, bytes per ms: one TCP flow's where the traffic between nodes
    # runs over sockets (`embedding.over_sockets`), none (inf) over verbs or a plugin; every hop and collective
    # across nodes priced from the NIC share is held under it (`Model.context`)
    connection_cap_bytes_per_ms: float = math.inf

    def device_of(self, virtual_stage: int) -> DeviceSpec:
        return self.devices[self.layout.rank_of(virtual_stage)]


@dataclass(frozen=True)
class Contribution:
    """Milliseconds a term adds, per place in the pipeline. An empty tuple adds nothing there.

    Per virtual stage: forward_ms, backward_ms, weight_grad_ms (the part of
    backward_ms that is the weight gradient), host_ms (untraced host time before
    each of its tasks), and forward_floor_ms / backward_floor_ms: lower bounds
    under the decoder layers' compute (see `Term.scope`); attention_core_ms, the
    part of a "layers" term's forward_ms that is the attention core (scores,
    softmax, dropout, context), which selective recomputation redoes in the
    backward (`Model.pipeline` prices recomputation). Per hop k -> k+1:
    forward_transfer_ms (activation) and backward_transfer_ms (gradient). Per
    rank: optimizer_ms, and grad_reduce_ms with grad_reduce_tail_ms (the rank's data-parallel gradient reduction
    and the part of it no backward hides: `Pipeline`'s fields). Per iteration: pre_optimizer_ms (barrier work after the
    last backward) and post_optimizer_ms (on every rank, before the next iteration; post_optimizer_rank_ms: each
    rank's own part of it, where it differs by device type);
    expert_comm_ms: per virtual stage, the part of forward_ms + backward_ms that is the collectives over the
    expert groups (the MoE token dispatcher's), which the breakdown shows apart as `ep_comm`;
    stall_ms with stall_probability: an occasional delay of the pre-optimizer work
    (at most one term may price one).
    Switches (blocking_p2p, iteration_barrier, optimizer_barrier, host_after_receive_only;
    `Pipeline`'s fields of those names): None leaves the simulator's
    default, a bool sets the switch; terms that set one must agree.
    """

    forward_ms: tuple[float, ...] = ()
    backward_ms: tuple[float, ...] = ()
    weight_grad_ms: tuple[float, ...] = ()
    host_ms: tuple[float, ...] = ()
    forward_floor_ms: tuple[float, ...] = ()
    backward_floor_ms: tuple[float, ...] = ()
    attention_core_ms: tuple[float, ...] = ()
    forward_transfer_ms: tuple[float, ...] = ()
    backward_transfer_ms: tuple[float, ...] = ()
    optimizer_ms: tuple[float, ...] = ()
    grad_reduce_ms: tuple[float, ...] = ()
    grad_reduce_tail_ms: tuple[float, ...] = ()
    post_optimizer_rank_ms: tuple[float, ...] = ()  # per rank, on top of post_optimizer_ms
    expert_comm_ms: tuple[float, ...] = ()  # per virtual stage, within forward_ms + backward_ms
    pre_optimizer_ms: float = 0.0
    post_optimizer_ms: float = 0.0
    stall_ms: float = 0.0
    stall_probability: float = 0.0
    blocking_p2p: bool | None = None
    iteration_barrier: bool | None = None
    optimizer_barrier: bool | None = None
    host_after_receive_only: bool | None = None

    # The per-virtual-stage fields of the decoder layers' work and its floors: what a superseding term takes over.
    LAYER_FIELDS: ClassVar[tuple[str, ...]] = (
        "forward_ms",
        "backward_ms",
        "weight_grad_ms",
        "attention_core_ms",
        "forward_floor_ms",
        "backward_floor_ms",
        "expert_comm_ms",
    )

    SWITCHES: ClassVar[tuple[str, ...]] = (
        "blocking_p2p",
        "iteration_barrier",
        "optimizer_barrier",
        "host_after_receive_only",
    )

    # Which length each per-place field must have, as a Layout attribute name.
    LENGTHS: ClassVar[dict[str, str]] = {
        "forward_ms": "virtual_stages",
        "backward_ms": "virtual_stages",
        "weight_grad_ms": "virtual_stages",
        "host_ms": "virtual_stages",
        "forward_floor_ms": "virtual_stages",
        "backward_floor_ms": "virtual_stages",
        "attention_core_ms": "virtual_stages",
        "forward_transfer_ms": "hops",
        "backward_transfer_ms": "hops",
        "optimizer_ms": "ranks",
        "grad_reduce_ms": "ranks",
        "grad_reduce_tail_ms": "ranks",
        "post_optimizer_rank_ms": "ranks",
        "expert_comm_ms": "virtual_stages",
    }


class Term(ABC):
    """A named cost term. Subclasses set `name` and `params` and document their physics in the docstring."""

    name: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    # What the term's time is, in `predict --job`'s breakdown of a stage (`Model.breakdown`): "compute", "tp_comm"
    # (tensor-parallel collectives; the expert groups' shown apart as "ep_comm": `Contribution.expert_comm_ms`),
    # "cp_comm" (context parallelism's exchanges), "p2p", "dp_reduce" (data-parallel and embedding gradient
    # reductions), "optimizer" or "host".
    category: ClassVar[str] = "compute"
    # "layers": the term prices the GPU work of the decoder layers, which the floors (forward_floor_ms,
    # backward_floor_ms) bound from below: a stage's layers take max(sum of "layers" terms, sum of floors).
    # "stage": everything else, added on top (output layer, embedding, host time, ...).
    scope: ClassVar[str] = "stage"
    # Terms whose decoder-layer work and floors (`Contribution.LAYER_FIELDS`) this term prices in their place: on a
    # stage whose device type this term covers (`covers`), `Model` drops those fields of theirs; elsewhere they stand.
    supersedes: ClassVar[tuple[str, ...]] = ()

    def covers(self, params: Mapping[str, float], device_type: str) -> bool:
        """Whether this term prices, on `device_type`, the layer work of the terms it supersedes."""
        return bool(self.supersedes)

    @classmethod
    def summary(cls) -> str:
        """First line of the docstring: what the term adds."""
        return (inspect.getdoc(cls) or cls.name).splitlines()[0]

    @classmethod
    def param(cls, name: str) -> Param:
        """The parameter `name`, or for a per-device override "NAME@TYPE" a copy of NAME's named so."""
        base, _, device = name.partition("@")
        for param in cls.params:
            if param.name == base and (not device or param.per_device):
                if device and not DEVICE_LABEL.match(device):
                    break
                return replace(param, name=name) if device else param
        raise KeyError(name)

    @staticmethod
    def value(params: Mapping[str, float], name: str, device_type: str) -> float:
        """A parameter's value for one device type: its "NAME@TYPE" override, else NAME's value."""
        return params.get(f"{name}@{device_type}", params[name])

    @classmethod
    def defaults(cls) -> dict[str, float]:
        return {p.name: p.default for p in cls.params}

    @abstractmethod
    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        """The costs this term adds for one spec, given every parameter's value."""
