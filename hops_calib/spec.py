"""What a prediction may see: the spec of a run, known before it ran.

A `Spec` is built from the launch configuration, the stage-to-device map, the
device types and the link benchmark (a separate job). It never holds anything
measured from the run's own events (rule 1 of the design); `truth` holds those.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# The HOPS tracing fork of Megatron starts tracing at iteration 3: iterations
# 1-2 are warm-up and absent from the event logs. CPU captures follow the same
# convention, so the traced iteration count is derivable from --train-iters.
TRACE_FIRST_ITERATION = 3

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb_h1")


@dataclass(frozen=True)
class LinkFit:
    """Point-to-point link between two stages: time(bytes) = latency + bytes / bandwidth.

    Fitted from the sender's p50 in the link benchmark. Bandwidth in bytes per
    millisecond keeps the cost formula unit-free: ms = latency_ms + bytes / bytes_per_ms.
    """

    src_stage: int
    dst_stage: int
    latency_ms: float
    bytes_per_ms: float
    # Provenance: which benchmark rows made the fit (file name, sizes used).
    source: str = ""

    @property
    def bandwidth_gbit_s(self) -> float:
        return self.bytes_per_ms * 8 * 1e3 / 1e9

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


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

    def __post_init__(self) -> None:
        if len(self.layers_per_stage) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.layers_per_stage)} layer counts for pp={self.pp}")
        if len(self.devices) != self.pp:
            raise ValueError(f"spec {self.run_id}: {len(self.devices)} devices for pp={self.pp}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"spec {self.run_id}: unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")

    def link(self, src_stage: int, dst_stage: int) -> LinkFit | None:
        """The fitted link between two stages, in either direction, or None."""
        for fit in self.links:
            if {fit.src_stage, fit.dst_stage} == {src_stage, dst_stage}:
                return fit
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Spec":
        data = dict(data)
        data["links"] = tuple(LinkFit(**link) for link in data.get("links", ()))
        data["model"] = ModelShape(**data["model"])
        for name in ("layers_per_stage", "devices", "device_ids", "device_names"):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        return cls.from_dict(json.loads(text))
