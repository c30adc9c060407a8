"""Model room: the peak memory of one GPU of each pipeline stage, in bytes, from the launch alone.

What `predict --job` shows and a planner checks against each device's memory (`DeviceSpec.memory_bytes`). Counted
per GPU of a stage (its share of the tensor-parallel split), at the schedule's peak of stored activations:

- weights: the GPU's parameters (`gpt.stage_parameters`) in the training precision (2 bytes, fp32 4);
- gradients: Megatron's gradient buffer, one element per parameter (`gradient_bytes`: fp32 under bf16, which
  Megatron accumulates and reduces in fp32, or with --accumulate-allreduce-grads-in-fp32; else 16-bit);
- optimizer state: Adam's two fp32 moments, plus fp32 master weights under 16-bit training (12 bytes per
  parameter; 8 in fp32), split over the d data-parallel replicas under the distributed optimizer (ZeRO-1;
  Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12 = 16 B per parameter with 16-bit gradients, 18 with fp32 ones);
- activations: a layer's stored activations per microbatch (`gpt.layer_activation_bytes`: Korthikanti et al. 2022,
  with tensor and sequence parallelism, SwiGLU, GQA and flash attention) times the stage's layers times the stage
  microbatches the schedule holds at its peak (`SimResult.peak_stage_activations`). Full recomputation keeps only
  each recomputed layer's input (`gpt.boundary_activation_bytes`: s x b x h, s/t under sequence parallelism) and
  rebuilds one layer's activations at a time in the backward (its working set is added once); selective
  recomputation drops the attention core's scores (5as^2b / t). The last stage holds one microbatch's fp32
  logits (s x b x V/t x 4).

Not counted: the CUDA context and NCCL buffers, allocator fragmentation, temporary GEMM workspaces (a few hundred
MB to a few GB on a real GPU): leave headroom (`StageMemory.headroom_bytes` says how much is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hops_calib.model import gpt
from hops_calib.spec import ModelShape, Spec

# The unit of every memory figure in text output: GB, 10^9 bytes, as GPU datasheets count ("A100 80 GB"); --json
# gives bytes (keys ending in _bytes).
GB = 1e9
OPTIMIZER_BYTES_MIXED = 12  # fp32 master weight + Adam m and v per parameter
OPTIMIZER_BYTES_FP32 = 8  # Adam m and v; the fp32 weight is the master
LOGIT_BYTES = 4  # the loss reads fp32 logits


def gradient_bytes(spec: Spec) -> int:
    """Bytes per gradient element of Megatron's gradient buffer (and its data-parallel reduction): fp32 when it
    accumulates and reduces in fp32 (--accumulate-allreduce-grads-in-fp32, which bf16 training forces; an fp32
    run), else the 16-bit training precision."""
    if spec.megatron_args.get("accumulate_allreduce_grads_in_fp32"):
        return 4
    return _gradient_bytes(spec.model)


def _gradient_bytes(shape: ModelShape) -> int:
    return 4 if shape.precision in ("bf16", "fp32") else gpt.bytes_per_element(shape)


def stored_activation_bytes(shape: ModelShape, layers: int) -> tuple[float, float]:
    """(bytes one microbatch leaves stored in `layers` decoder layers, bytes of the working set the backward
    rebuilds at once under full recomputation: one layer's activations, else 0)."""
    full = gpt.layer_activation_bytes(shape)
    if shape.recompute_granularity == "selective":
        scores = 0.0 if shape.attention_kernel == "flash" else (
            5.0 * shape.num_attention_heads * shape.seq_length ** 2 * shape.micro_batch_size / shape.tensor_parallel)
        return layers * (full - scores), 0.0
    recomputed = shape.recomputed_layers(layers)
    if not recomputed:
        return layers * full, 0.0
    return recomputed * gpt.boundary_activation_bytes(shape) + (layers - recomputed) * full, full


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one GPU of a pipeline stage, by what holds them, against the device's memory."""

    stage: int
    device: str
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    device_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.device_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "headroom_bytes": self.headroom_bytes,
                "fits": self.fits}


def _stage(shape: ModelShape, layers: int, rank: int, ranks: int, peak_stage_microbatches: float, *,
           gradient: int, shard: int, device: str = "", device_bytes: float = 0.0) -> StageMemory:
    element = gpt.bytes_per_element(shape)
    state = OPTIMIZER_BYTES_FP32 if shape.precision == "fp32" else OPTIMIZER_BYTES_MIXED
    parameters = gpt.stage_parameters(shape, layers, rank == 0, rank == ranks - 1, ranks)
    stored, working = stored_activation_bytes(shape, layers)
    activations = peak_stage_microbatches * stored + working
    if rank == ranks - 1:  # one microbatch's fp32 logits over the GPU's V/t vocabulary columns
        activations += LOGIT_BYTES * shape.seq_length * shape.micro_batch_size * gpt.vocab_per_gpu(shape)
    return StageMemory(stage=rank, device=device, weights_bytes=parameters * element,
                       gradients_bytes=parameters * gradient, optimizer_bytes=parameters * state / shard,
                       activations_bytes=activations, device_bytes=float(device_bytes))


def stage_memory(spec: Spec, device_bytes: Sequence[float], peak_stage_microbatches: Sequence[float]
                 ) -> tuple[StageMemory, ...]:
    """Peak memory of one GPU per stage: `device_bytes` its device's memory, `peak_stage_microbatches` the stage
    microbatches of stored activations the schedule holds on the rank at its peak (`SimResult.peak_stage_activations`)."""
    shard = spec.dp if spec.distributed_optimizer else 1
    return tuple(_stage(spec.model, spec.layers_per_stage[rank], rank, spec.pp, peak_stage_microbatches[rank],
                        gradient=gradient_bytes(spec), shard=shard, device=spec.devices[rank],
                        device_bytes=device_bytes[rank]) for rank in range(spec.pp))


def rank_memory_bytes(shape: ModelShape, layers: int, rank: int, ranks: int, peak_stage_microbatches: float) -> float:
    """Peak bytes on one GPU of pipeline rank `rank` of `ranks` holding `layers` decoder layers, with at most
    `peak_stage_microbatches` microbatches' activations of its whole stage in flight (no distributed optimizer)."""
    return _stage(shape, layers, rank, ranks, peak_stage_microbatches, gradient=_gradient_bytes(shape),
                  shard=1).total_bytes
