"""Model room: Megatron-FSDP (--use-megatron-fsdp), what it shards, what it gathers and when, from its code.

Megatron-core 0.16.1 ships it in megatron/core/distributed/fsdp/: `mcore_fsdp_adapter.py` FullyShardedDataParallel
wraps each model chunk in `src/megatron_fsdp/megatron_fsdp.py` MegatronFSDP over the data x context-parallel group
(`_init_dist_index`: get_data_parallel_group(with_context_parallel=True)), d GPUs. --data-parallel-sharding-strategy
(`spec.fsdp_strategy`) says what is sharded d ways:

- no_shard (ZeRO-0) and optim (ZeRO-1: the optimizer state and fp32 main weights): gradients reduced once per
  iteration, on the last microbatch (MegatronFSDP.__init__ `is_delay_grad_reduce`; `_process_post_backward_gradients`
  reduces when `is_last_microbatch`), as Megatron's DDP and distributed optimizer do: priced as they are;
- optim_grads (ZeRO-2): the gradients too. They are reduce-scattered after every microbatch's backward
  (`_process_post_backward_gradients`: `grad_reduce_every_bprop`), each bucket into the GPU's 1/d shard once its
  gradients are ready (`param_and_grad_buffer.py` GradReducePipeline.reduce_gradients), on a side stream;
- optim_grads_params (ZeRO-3): the 16-bit weights too. Each FSDP unit (every TransformerLayer: the adapter's
  `fsdp_unit_modules`) is all-gathered before its forward (`_pre_forward_param_unshard`) and again before its
  backward (`_pre_backward_param_unshard`), released after each (`release_module_parameters`), and its gradients
  reduce-scattered after its backward. The gathers run on their own stream ahead of the compute:
  `AllGatherPipeline.all_gather_params` prefetches the next units in forward order (in backward order in the
  backward) until the prefetched elements reach `suggested_AG_prefetch_size`, half the communication unit
  (`MegatronFSDP._init_fsdp_param_and_grad_buffer`: suggested_communication_unit_size, by default twice a unit's
  elements, at least 1e9). Modules outside the units (the embedding, the final norm and output layer) are
  gathered and reduced as buckets of their own in the same order.

What that costs (`exposed_ms`): a stream of collectives against the compute they overlap. In the forward the first
unit's gather waits (nothing earlier to hide it), each later one shows what it outlasts the previous unit's compute.
In the backward each unit's compute hides the next unit's gather together with the previous unit's reduce-scatter
(the two share the GPU's links: their times add); the last reduce-scatter runs after the chunk's backward, under the
next microbatch's work, or at the end of the iteration before the optimizer step (`finish_grad_sync`). Compute is
taken at the device's peak (as the tensor-parallel overlap does, `terms/parallel.py`), so the exposure is an upper
bound. The collectives are priced by `hops_calib.model.collectives` over the data x context-parallel group.

Memory per GPU (`sharded_memory`): the sharded buffers (weights, gradients, optimizer state 1/d each, per strategy)
plus the temporary unsharded buckets: the gathered units (the current one and the prefetched ones, in the 16-bit
parameter dtype, of the one model chunk computing) and the gradients waiting to be reduce-scattered
(GradReducePipeline.wait_for_previous_grad_reduce frees a queued bucket only once the queue holds more than
suggested_RS_queue_capacity = the communication unit of them, so each chunk keeps up to that, plus the bucket just
launched and the one being accumulated, until the iteration's finish_grad_sync). The modules outside the units are counted gathered whole (an upper bound: their own
buckets are gathered for their own forward and backward only).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hops_calib.model import gpt
from hops_calib.spec import Spec, fsdp_strategy

# MegatronFSDP._init_fsdp_param_and_grad_buffer: suggested_communication_unit_size = max(1e9, 2 x a unit's elements)
# when not given; the gather prefetch limit is half of it, the reduce-scatter queue capacity all of it
COMMUNICATION_UNIT_FLOOR = 1_000_000_000


def strategy(spec: Spec) -> str:
    """The launch's Megatron-FSDP sharding strategy, "" without Megatron-FSDP."""
    return fsdp_strategy(spec.megatron_args)


def shards_gradients(spec: Spec) -> bool:
    return strategy(spec) in ("optim_grads", "optim_grads_params")


def shards_parameters(spec: Spec) -> bool:
    return strategy(spec) == "optim_grads_params"


def shard_ways(spec: Spec) -> int:
    """d: the GPUs of the data x context-parallel group a Megatron-FSDP buffer is sharded over."""
    return spec.dp * spec.cp


def unit_parameters(spec: Spec) -> float:
    """Parameters of one FSDP unit on one GPU: one decoder layer's share of the tensor-parallel split."""
    return gpt.layer_parameters(spec.model)


def outside_parameters(spec: Spec, rank: int) -> tuple[float, float]:
    """(parameters before the decoder layers, after them) on one GPU of pipeline rank `rank`, the modules outside
    the FSDP units: the embedding on the first rank, the final norm and the output layer on the last."""
    shape = spec.model
    before = gpt.stage_parameters(shape, 0, True, False, spec.pp) if rank == 0 else 0.0
    after = gpt.stage_parameters(shape, 0, False, True, spec.pp) if rank == spec.pp - 1 else 0.0
    return before, after


def communication_unit(spec: Spec) -> float:
    """Elements of Megatron-FSDP's communication unit (MegatronFSDP._init_fsdp_param_and_grad_buffer): the launch's
    --suggested-communication-unit-size, else twice a unit's elements under optim_grads_params, else the
    --ddp-bucket-size, else 1e9; at least 1e9 (its max(1_000_000_000, ...))."""
    given = spec.megatron_args.get("suggested_communication_unit_size")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return float(given)
    if shards_parameters(spec):
        suggested = 2.0 * unit_parameters(spec)
    else:
        bucket = spec.megatron_args.get("ddp_bucket_size")
        suggested = float(bucket) if isinstance(bucket, (int, float)) and bucket else COMMUNICATION_UNIT_FLOOR
    return max(float(COMMUNICATION_UNIT_FLOOR), suggested)


def gathered_units(spec: Spec, layers: int) -> int:
    """Units of a model chunk of `layers` decoder layers gathered at once: the one computing and the prefetched
    ones (AllGatherPipeline.all_gather_params adds units while the prefetched elements are under half the
    communication unit), at most the chunk's."""
    if layers <= 0:
        return 0
    unit = unit_parameters(spec)
    prefetched = math.ceil(communication_unit(spec) / 2 / unit) if unit > 0 else 0
    return min(layers, 1 + prefetched)


def reducing_units(spec: Spec, layers: int) -> int:
    """Units of a chunk whose unsharded gradients are held at once under optim_grads_params: up to the
    reduce-scatter queue's capacity (GradReducePipeline.wait_for_previous_grad_reduce waits only while the queue
    holds more elements than the communication unit), the one just launched and the one being accumulated."""
    if layers <= 0:
        return 0
    unit = unit_parameters(spec)
    queued = math.floor(communication_unit(spec) / unit) if unit > 0 else 0
    return min(layers, queued + 2)


@dataclass(frozen=True)
class ShardedMemory:
    """One GPU's bytes under Megatron-FSDP, by what holds them (`memory.StageMemory`'s fields)."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float


def sharded_memory(
    spec: Spec,
    rank: int,
    parameters: float,
    chunk_layers: Sequence[int],
    *,
    element: int,
    gradient: int,
    state: int,
) -> ShardedMemory:
    """Weights, gradients and optimizer state of one GPU of pipeline rank `rank` holding `parameters` (its model
    chunks of `chunk_layers` decoder layers), with `element` bytes per weight, `gradient` per gradient and `state`
    of optimizer state per parameter, under the launch's Megatron-FSDP strategy (see the module's docstring)."""
    how = strategy(spec)
    d = shard_ways(spec)
    if how in ("", "no_shard"):
        return ShardedMemory(parameters * element, parameters * gradient, parameters * state)
    optimizer = parameters * state / d
    if how == "optim":
        return ShardedMemory(parameters * element, parameters * gradient, optimizer)
    outside = sum(outside_parameters(spec, rank))
    if how == "optim_grads":
        # no units: the gradients are bucketed by --ddp-bucket-size (BucketingPolicy; none given: one bucket of the
        # chunk's), each held unsharded until its reduce-scatter is done
        bucket = spec.megatron_args.get("ddp_bucket_size")
        size = float(bucket) if isinstance(bucket, (int, float)) and bucket else parameters
        queued = math.floor(communication_unit(spec) / size) if size > 0 else 0
        unsharded = min(parameters, (queued + 2) * size)
        return ShardedMemory(parameters * element, parameters * gradient / d + unsharded * gradient, optimizer)
    # one chunk computes at a time, its gathered units released after their forward and backward; but each chunk's
    # reduce-scatter queue keeps its buckets until it overflows or the iteration's finish_grad_sync
    unit = unit_parameters(spec)
    gathered = gathered_units(spec, max(chunk_layers, default=0)) * unit + outside
    reducing = sum(reducing_units(spec, layers) for layers in chunk_layers) * unit + outside
    return ShardedMemory(
        parameters * element / d + gathered * element,
        parameters * gradient / d + reducing * gradient,
        optimizer,
    )


@dataclass(frozen=True)
class Unit:
    """One piece of a model chunk Megatron-FSDP gathers and reduces as a whole: its all-gather and reduce-scatter
    times and the forward and backward compute it runs (ms)."""

    gather_ms: float
    reduce_ms: float
    forward_ms: float
    backward_ms: float


def exposed_ms(units: Sequence[Unit]) -> tuple[float, float, float]:
    """(forward, backward, tail) ms of a chunk's collectives that its compute does not hide, `units` in forward
    order (see the module's docstring): the forward's first gather and what each later gather outlasts the previous
    unit's forward; the backward's first gather and what each later gather with the previous unit's reduce-scatter
    outlasts that unit's backward; the tail is the last unit's reduce-scatter, after the chunk's backward."""
    if not units:
        return 0.0, 0.0, 0.0
    forward = units[0].gather_ms + sum(
        max(0.0, unit.gather_ms - previous.forward_ms) for previous, unit in itertools.pairwise(units)
    )
    backwards = list(reversed(units))
    backward = backwards[0].gather_ms + sum(
        max(0.0, unit.gather_ms + previous.reduce_ms - previous.backward_ms)
        for previous, unit in itertools.pairwise(backwards)
    )
    return forward, backward, backwards[-1].reduce_ms


def chunk_units(
    spec: Spec,
    rank: int,
    layers: int,
    first_chunk: bool,
    last_chunk: bool,
    price: Callable[[str, float], float],
    flops_per_ms: float,
    *,
    gradient: int,
) -> list[Unit]:
    """The units of one model chunk of `layers` decoder layers on pipeline rank `rank` under optim_grads_params,
    in forward order: the embedding (on the first virtual stage), the decoder layers, the final norm and output
    layer (on the last), each priced by `price(op, bytes)` (an all-gather of its 16-bit weights, a reduce-scatter
    of its gradients) and its compute at `flops_per_ms`. A decoder layer's backward is twice its forward, plus
    the forward again where full recomputation redoes it (MegatronFSDP gathers once for both)."""
    shape = spec.model
    element = gpt.bytes_per_element(shape)
    before, after = outside_parameters(spec, rank)
    unit = unit_parameters(spec)
    forward = gpt.layer_forward_flops(shape) / flops_per_ms
    recomputed = 1.0 if shape.recompute_granularity == "full" else 0.0
    backward = (2.0 + recomputed) * forward

    def piece(parameters: float, forward_ms: float, backward_ms: float) -> Unit:
        return Unit(
            price("all_gather", parameters * element),
            price("reduce_scatter", parameters * gradient),
            forward_ms,
            backward_ms,
        )

    units = []
    if first_chunk and before:
        units.append(piece(before, 0.0, 0.0))  # a lookup: no GEMM to hide a gather
    layer = piece(unit, forward, backward)
    units.extend([layer] * layers)
    if last_chunk and after:
        head = 2.0 * gpt.local_tokens(shape) * shape.hidden_size * gpt.vocab_per_gpu(shape) / flops_per_ms
        units.append(piece(after, head, 2.0 * head))
    return units
