"""Model room: the peak memory of one GPU of each pipeline stage, in bytes, from the launch alone.

What `predict --job` shows and a planner checks against each device's memory (`DeviceSpec.memory_bytes`). Counted
per GPU of a stage (its share of the tensor-parallel split), at the schedule's peak of stored activations:

- weights: the GPU's parameters (`gpt.stage_parameters`) in the training precision (2 bytes, fp32 4);
- gradients: Megatron's gradient buffer, one element per parameter (`gradient_bytes`: fp32 under bf16, which
  Megatron accumulates and reduces in fp32, or with --accumulate-allreduce-grads-in-fp32; 16-bit under
  --grad-reduce-in-bf16, `bf16_gradients`; else 16-bit);
- optimizer state: Adam's two fp32 moments, plus fp32 master weights under 16-bit training (12 bytes per
  parameter; 8 in fp32), split over the d data-parallel replicas under the distributed optimizer (ZeRO-1;
  Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12 = 16 B per parameter with 16-bit gradients, 18 with fp32 ones);
- a mixture of experts: the weights hold the GPU's local experts (num_experts / ep of them, each split etp ways:
  `gpt.expert_parameters`) and the router, their gradients likewise, their optimizer state sharded over the expert
  data-parallel group (world / (etp x ep x pp)) under the distributed optimizer; the stored activations add the
  routed rows (T x topk x etp of them: each expert's fc1 input, fc1 output and activation, the permutation's
  indices and probabilities) and the router's logits (`gpt.expert_activation_bytes`);
- activations: a layer's stored activations per microbatch (`gpt.layer_activation_bytes`: Korthikanti et al. 2022,
  with tensor and sequence parallelism, SwiGLU, GQA and flash attention) times the stage's layers times the stage
  microbatches the schedule holds at its peak (`SimResult.peak_stage_activations`); a dropout with p = 0 keeps no
  mask (`dropout_mask_saving`). Full recomputation keeps only
  each recomputed layer's input (`gpt.boundary_activation_bytes`: s x b x h, s/t under sequence parallelism) and
  rebuilds one layer's activations at a time in the backward (its working set is added once); selective
  recomputation drops the attention core's scores (5as^2b / t). The last stage holds one microbatch's fp32
  logits (s x b x V/t x 4).

FP8 through Transformer Engine (`kernels.fp8_format` with the TE layer): each linear weight also has its FP8 copy
and transpose, cached from the first microbatch (2 B per weight: `kernels.fp8_weight_kernels`); under
--fp8-param-gather the weight itself is FP8 (`fp8_utils.py` `quantize_param_shard`), 1 B plus its 1 B transpose
instead of 2 B. The linear layers save their inputs for the weight gradient in FP8 (TE's quantized input, kept
columnwise): the QKV and fc1 inputs (s b h each) and the projection and fc2 inputs (s b h, s b f) at 1 B an element
instead of 2 (`fp8_activation_saving`).

Megatron-FSDP (--use-megatron-fsdp): weights, gradients and optimizer state sharded over the data x context group
per --data-parallel-sharding-strategy, plus the gathered units and the gradients waiting for their reduce-scatter
(`fsdp.sharded_memory`).

Not counted: the CUDA context and NCCL buffers, allocator fragmentation, temporary GEMM workspaces (a few hundred
MB to a few GB on a real GPU): leave headroom (`StageMemory.headroom_bytes` says how much is left;
`DEFAULT_HEADROOM_BYTES` is what `plan --job` leaves by default, `StageMemory.fits_with_headroom` whether a stage
fits with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from hops_calib.model import fsdp, gpt, kernel_types, kernels
from hops_calib.spec import ModelShape, Spec

# The unit of every memory figure in text output: GB, 10^9 bytes, as GPU datasheets count ("A100 80 GB"); --json
# gives bytes (keys ending in _bytes). A device's capacity is also given in GiB (2^30 bytes), the unit HBM is built
# in (an H100 SXM's 80 GB are 80 GiB = 85.90 GB): `capacity_words`.
GB = 1e9
GIB = 2**30

# Memory a GPU holds besides what this module counts, left out of every pick of `plan --job` by default and what
# `predict --job` warns of when a stage leaves less:
# - the CUDA context: about 0.5 GB with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2
#   and in PyTorch 2.x wheels), up to about 1 GB with every kernel module loaded eagerly (NVIDIA, CUDA C++
#   Programming Guide, "Lazy Loading"); 1 GB is taken;
# - NCCL's buffers: NCCL_BUFFSIZE, 4 MiB by default (NCCL docs, Environment Variables: NCCL_BUFFSIZE "4194304"),
#   for each peer of each channel of each communicator; a rank of a Megatron launch keeps a tensor-, a data-, a
#   pipeline-parallel and an embedding communicator, each of up to 16 channels with 2 peers (a ring's previous and
#   next rank): 4 x 16 x 2 x 4 MiB = 0.54 GB;
# 1.5 GB in all (1.0 + 0.54, rounded down: the channels NCCL opens are fewer on small groups). A CPU device runs
# no CUDA context and gloo keeps no such buffers: nothing.
CUDA_CONTEXT_BYTES = 1.0e9
NCCL_BUFFER_BYTES = 4 * 16 * 2 * 4 * 2**20
DEFAULT_HEADROOM_BYTES = 1.5e9
OPTIMIZER_BYTES_MIXED = 12  # fp32 master weight + Adam m and v per parameter
OPTIMIZER_BYTES_FP32 = 8  # Adam m and v; the fp32 weight is the master
LOGIT_BYTES = 4  # the loss reads fp32 logits


def default_headroom_bytes(device_type: str) -> float:
    """The memory left out of a GPU of `device_type` for what the count leaves out (see DEFAULT_HEADROOM_BYTES)."""
    return 0.0 if device_type.startswith("cpu") else DEFAULT_HEADROOM_BYTES


def capacity_words(nbytes: float) -> str:
    """A device's capacity in words, in GB and GiB: "85.90 GB (80.00 GiB)"."""
    return f"{nbytes / GB:.2f} GB ({nbytes / GIB:.2f} GiB)"


def bf16_gradients(spec: Spec) -> bool:
    """Whether the launch keeps and reduces its gradients in the 16-bit training dtype under bf16: Megatron-LM's
    --grad-reduce-in-bf16 turns accumulate_allreduce_grads_in_fp32, which bf16 training otherwise forces, off, and
    megatron-core's DistributedDataParallel.__init__ (distributed_data_parallel.py) then allocates the gradient
    buffer in the parameter dtype (grad_dtype = torch.float if ddp_config.grad_reduce_in_fp32 else param.dtype;
    Megatron-FSDP's ParamAndGradBuffer alike). NeMo's performance recipes set grad_reduce_in_fp32 False."""
    return bool(spec.megatron_args.get("grad_reduce_in_bf16")) and spec.model.precision == "bf16"


def gradient_bytes(spec: Spec) -> int:
    """Bytes per gradient element of Megatron's gradient buffer (and its data-parallel reduction): fp32 when it
    accumulates and reduces in fp32 (--accumulate-allreduce-grads-in-fp32, which bf16 training forces; an fp32
    run), the 16-bit dtype under --grad-reduce-in-bf16 (`bf16_gradients`), else the 16-bit training precision."""
    if bf16_gradients(spec):
        return gpt.bytes_per_element(spec.model)
    if spec.megatron_args.get("accumulate_allreduce_grads_in_fp32"):
        return 4
    return _gradient_bytes(spec.model)


def _gradient_bytes(shape: ModelShape) -> int:
    return 4 if shape.precision in ("bf16", "fp32") else gpt.bytes_per_element(shape)


def fp8_activation_saving(shape: ModelShape) -> float:
    """Bytes one layer's stored activations shrink by when the linear layers save their inputs in FP8 (1 B an
    element instead of 2): the QKV and fc1 inputs, whole on every GPU of the group without sequence parallelism, and
    the projection's and fc2's, split t ways (`gpt.layer_activation_bytes`' split)."""
    s, b, h, f = gpt.local_seq(shape), shape.micro_batch_size, shape.hidden_size, shape.ffn_hidden_size
    t = max(1, shape.tensor_parallel)
    whole, split = 2.0 * s * b * h, float(s * b * h + s * b * f)
    return (whole + split) / t if shape.sequence_parallel else whole + split / t


def fp8_mode(spec: Spec) -> str:
    """ "" (no FP8), "cast" (FP8 GEMMs, 16-bit weights with cached FP8 copies) or "param" (--fp8-param-gather)."""
    args = spec.megatron_args
    if not kernels.fp8_format(args) or str(args.get("transformer_impl", "transformer_engine")) != "transformer_engine":
        return ""
    return "param" if args.get("fp8_param_gather") else "cast"


def parameter_gather_bytes(spec: Spec, parameters: float, layers: int) -> float:
    """Bytes the distributed optimizer all-gathers for a rank's `parameters` (`layers` decoder layers) after its
    step: the 16-bit weights, the linear ones in FP8 under --fp8-param-gather (`fp8_utils.py`
    `quantize_param_shard` quantizes each shard before the gather; biases and norms stay 16-bit)."""
    element = gpt.bytes_per_element(spec.model)
    if fp8_mode(spec) != "param":
        return parameters * element
    linear = layers * sum(out * inp for _, out, inp in kernels.linear_weights(spec.model))
    return parameters * element - linear * (element - kernels.FP8_BYTES)


def dropout_mask_saving(shape: ModelShape, hidden: bool, attention: bool) -> float:
    """Bytes one layer's stored activations shrink by when a dropout is off (`hidden`, `attention`: whether that
    dropout runs, p > 0). torch's dropout at p = 0 returns its input and keeps no mask (ATen's dropout returns the
    input for p == 0), which megatron-core's fused bias-dropout-add (fusions/fused_bias_dropout.py
    _bias_dropout_add_func: torch.nn.functional.dropout) and its attention dropout (transformer/dot_product_attention.py
    DotProductAttention: torch.nn.Dropout) both call. Hidden dropout off: the two 1-byte masks of the residual
    dropouts (2sbh of `gpt.layer_activation_bytes`' whole part, split t ways under sequence parallelism). Attention
    dropout off, unfused attention: the score matrix's mask (as^2b, 1 B) and the dropout's output (2as^2b; the
    context GEMM saves the softmax output, already stored), 3as^2b / t; a flash kernel stores no scores either way."""
    s, b, h = gpt.local_seq(shape), shape.micro_batch_size, shape.hidden_size
    t = max(1, shape.tensor_parallel)
    saving = 0.0
    if not hidden:
        saving += 2.0 * s * b * h / (t if shape.sequence_parallel else 1)
    if not attention and shape.attention_kernel != "flash" and shape.recompute_granularity != "selective":
        saving += 3.0 * shape.num_attention_heads * s * s * b / t
    return saving


def stored_activation_bytes(
    shape: ModelShape, layers: int, fp8: bool = False, dropout: tuple[bool, bool] = (True, True)
) -> tuple[float, float]:
    """(bytes one microbatch leaves stored in `layers` decoder layers, bytes of the working set the backward
    rebuilds at once under full recomputation: one layer's activations, else 0). `fp8`: the linear layers save
    their inputs in FP8; `dropout`: whether the (hidden, attention) dropouts run (`dropout_mask_saving`)."""
    full = (
        gpt.layer_activation_bytes(shape)
        - (fp8_activation_saving(shape) if fp8 else 0.0)
        - dropout_mask_saving(shape, *dropout)
    )
    if shape.recompute_granularity == "selective":
        scores = (
            0.0
            if shape.attention_kernel == "flash"
            else (
                5.0 * shape.num_attention_heads * shape.seq_length**2 * shape.micro_batch_size / shape.tensor_parallel
            )
        )
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

    @property
    def reserved_bytes(self) -> float:
        """What `plan --job` leaves out of this device's memory by default (`default_headroom_bytes`)."""
        return default_headroom_bytes(self.device)

    @property
    def fits_with_headroom(self) -> bool:
        """Whether the stage fits with `reserved_bytes` left: what `plan --job` checks a pick against."""
        return self.total_bytes <= self.device_bytes - self.reserved_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "fits_with_headroom": self.fits_with_headroom,
        }


def _stage(
    shape: ModelShape,
    layers: int,
    rank: int,
    ranks: int,
    peak_stage_microbatches: float,
    *,
    gradient: int,
    shard: int,
    device: str = "",
    device_bytes: float = 0.0,
    fp8: str = "",
    expert_shard: int | None = None,
    dropout: tuple[bool, bool] = (True, True),
) -> StageMemory:
    element = gpt.bytes_per_element(shape)
    state = OPTIMIZER_BYTES_FP32 if shape.precision == "fp32" else OPTIMIZER_BYTES_MIXED
    parameters = gpt.stage_parameters(shape, layers, rank == 0, rank == ranks - 1, ranks)
    weights = parameters * element
    if fp8:  # FP8 copies and transposes of the linear weights (under "param" the 16-bit weight is FP8 instead)
        linear = layers * sum(out * inp for _, out, inp in kernels.linear_weights(shape))
        weights += linear * 2 * kernels.FP8_BYTES - (linear * element if fp8 == "param" else 0)
    stored, working = stored_activation_bytes(shape, layers, fp8=bool(fp8), dropout=dropout)
    activations = peak_stage_microbatches * stored + working
    if rank == ranks - 1:  # one microbatch's fp32 logits over the GPU's V/t vocabulary columns
        activations += LOGIT_BYTES * gpt.local_tokens(shape) * gpt.vocab_per_gpu(shape)
    return StageMemory(
        stage=rank,
        device=device,
        weights_bytes=weights,
        gradients_bytes=parameters * gradient,
        optimizer_bytes=_optimizer_bytes(shape, layers, parameters, state, shard, expert_shard),
        activations_bytes=activations,
        device_bytes=float(device_bytes),
    )


def _optimizer_bytes(
    shape: ModelShape, layers: int, parameters: float, state: int, shard: int, expert_shard: int | None
) -> float:
    """The optimizer state of a GPU's `parameters`: over `shard` (the data x context-parallel replicas under the
    distributed optimizer), the routed experts' over `expert_shard` (the expert data-parallel group, megatron-core's
    expert optimizer: `optimizer/__init__.py` get_megatron_optimizer); without experts the whole over `shard`."""
    if not shape.moe:
        return parameters * state / shard
    experts = layers * gpt.expert_parameters(shape)
    return (parameters - experts) * state / shard + experts * state / (expert_shard or 1)


def stage_memory(
    spec: Spec, device_bytes: Sequence[float], peak_stage_microbatches: Sequence[float]
) -> tuple[StageMemory, ...]:
    """Peak memory of one GPU per stage: `device_bytes` its device's memory, `peak_stage_microbatches` the stage
    microbatches of stored activations the schedule holds on the rank at its peak (`SimResult.peak_stage_activations`)."""
    shard = spec.dp * spec.cp if spec.distributed_optimizer else 1  # sharded over the data x context group
    dropout = tuple(
        kernel_types.dropout_probability(spec.megatron_args, which) > 0 for which in ("hidden", "attention")
    )
    stages = tuple(
        _stage(
            spec.model,
            spec.layers_per_stage[rank],
            rank,
            spec.pp,
            peak_stage_microbatches[rank],
            gradient=gradient_bytes(spec),
            shard=shard,
            device=spec.devices[rank],
            device_bytes=device_bytes[rank],
            fp8=fp8_mode(spec),
            expert_shard=spec.edp if spec.distributed_optimizer else 1,
            dropout=(dropout[0], dropout[1]),
        )
        for rank in range(spec.pp)
    )
    if not fsdp.strategy(spec):
        return stages
    return tuple(_fsdp_stage(spec, stage) for stage in stages)


def launch_memory(
    spec: Spec, device_bytes_of: Callable[[str], Any], peak_stage_microbatches: Sequence[float]
) -> tuple[StageMemory, ...]:
    """Per stage, one GPU's peak memory (`stage_memory`), each stage's device memory `device_bytes_of(its device
    type)` (a model's catalog: `lambda t: model.device(t).memory_bytes`): what predict, plan and the gate's memory
    rule all read."""
    return stage_memory(spec, [device_bytes_of(device) for device in spec.devices], peak_stage_microbatches)


def launch_memory_fraction(
    spec: Spec, device_bytes_of: Callable[[str], Any], peak_stage_microbatches: Sequence[float]
) -> float | None:
    """The fullest GPU's peak over its memory (`launch_memory`; above 1 the launch does not fit); None where a
    device states no memory."""
    capacities = [device_bytes_of(device) for device in spec.devices]
    if not capacities or not all(c and c > 0 for c in capacities):
        return None
    stages = stage_memory(spec, capacities, peak_stage_microbatches)
    return max(stage.total_bytes / stage.device_bytes for stage in stages)


def chunk_layers(spec: Spec, rank: int) -> tuple[int, ...]:
    """Decoder layers of each model chunk of pipeline rank `rank` (its virtual stages)."""
    if spec.layers_per_virtual_stage:
        return tuple(spec.layers_per_virtual_stage[rank :: spec.pp])
    return (spec.layers_per_stage[rank] // spec.vp,) * spec.vp


def _fsdp_stage(spec: Spec, stage: StageMemory) -> StageMemory:
    """A stage's memory with its weights, gradients and optimizer state as Megatron-FSDP shards and gathers them
    (`fsdp.sharded_memory`); activations as without it."""
    rank, shape = stage.stage, spec.model
    parameters = gpt.stage_parameters(shape, spec.layers_per_stage[rank], rank == 0, rank == spec.pp - 1, spec.pp)
    sharded = fsdp.sharded_memory(
        spec,
        rank,
        parameters,
        chunk_layers(spec, rank),
        element=gpt.bytes_per_element(shape),
        gradient=gradient_bytes(spec),
        state=OPTIMIZER_BYTES_FP32 if shape.precision == "fp32" else OPTIMIZER_BYTES_MIXED,
    )
    return replace(
        stage,
        weights_bytes=sharded.weights_bytes,
        gradients_bytes=sharded.gradients_bytes,
        optimizer_bytes=sharded.optimizer_bytes,
    )


def rank_memory_bytes(shape: ModelShape, layers: int, rank: int, ranks: int, peak_stage_microbatches: float) -> float:
    """Peak bytes on one GPU of pipeline rank `rank` of `ranks` holding `layers` decoder layers, with at most
    `peak_stage_microbatches` microbatches' activations of its whole stage in flight (no distributed optimizer)."""
    return _stage(
        shape, layers, rank, ranks, peak_stage_microbatches, gradient=_gradient_bytes(shape), shard=1
    ).total_bytes
