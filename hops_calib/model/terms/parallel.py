"""Model room: the collectives of tensor and data parallelism, each priced by `hops_calib.model.collectives`."""

from __future__ import annotations

import math
from typing import Mapping

from hops_calib.model import gpt
from hops_calib.model.collectives import collective_ms
from hops_calib.model.memory import gradient_bytes
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.model.terms.optimizer import rank_parameters
from hops_calib.spec import Spec

# Megatron-core's DistributedDataParallel buckets gradients only to overlap their reduction with the backward:
# buckets of max(40M, 1M x d) parameters under --overlap-grad-reduce, else one bucket of every gradient
# (megatron/core/distributed/distributed_data_parallel.py, bucket_size).
BUCKET_PARAMETERS = 40_000_000
BUCKET_PARAMETERS_PER_REPLICA = 1_000_000


def tp_collectives_per_layer(spec: Spec) -> dict[str, int]:
    """The tensor-parallel collectives one decoder layer issues in its forward (and, as many, in its backward), by
    kind, each of one s x b x h activation buffer (Megatron's column- then row-parallel attention and MLP,
    Shoeybi et al. 2019, fig. 3; Korthikanti et al. 2022, fig. 5): two all-reduces (the attention projection's and
    fc2's outputs; in the backward the QKV's and fc1's input gradients), or under sequence parallelism two
    all-gathers before the column-parallel layers and two reduce-scatters after the row-parallel ones (their
    backward: the reverse). None at t = 1."""
    if spec.tp <= 1:
        return {}
    if spec.model.sequence_parallel:
        return {"all_gather": 2, "reduce_scatter": 2}
    return {"all_reduce": 2}


def dp_buckets(spec: Spec, parameters: float) -> int:
    """Buckets a rank's gradients are reduced in (`BUCKET_PARAMETERS`)."""
    if not spec.overlap_grad_reduce or parameters <= 0:
        return 1
    size = max(BUCKET_PARAMETERS, BUCKET_PARAMETERS_PER_REPLICA * spec.dp)
    return max(1, math.ceil(parameters / size))


def _collective_params(where: str) -> tuple[Param, ...]:
    """The two parameters of a term made of collectives: the rate they reach and a ring step's latency."""
    return (Param("efficiency", 1.0, 0.1, 1.0, "fraction of benchmark",
                  f"achieved fraction of the benchmarked (or ring-model) collective rate {where}"),
            Param("step_latency_ms", 0.005, 0.0, 0.1, "ms", "latency of one ring step (NCCL over NVLink: ~5 us)"),
            Param("contention_step_ms", 0.0, 0.0, 1.0, "ms",
                  "latency each of a ring's 2(n-1) steps gains inside a training step over an isolated benchmark"))


class TensorParallelComm(Term):
    """Each decoder layer's tensor-parallel collectives over NVLink, on the critical path of its forward and backward.

    Physics: Megatron splits a layer's attention and MLP each into a column-parallel and a row-parallel GEMM over
    the t GPUs of a tensor-parallel group; the row-parallel output is a partial sum that an all-reduce completes
    before the next block (forward), and the column-parallel input gradient likewise (backward): two all-reduces of
    the s x b x h activations per layer and direction (`tp_collectives_per_layer`); with sequence parallelism each
    becomes a reduce-scatter plus an all-gather, the same bytes on the wire. The collectives are blocking: the next
    kernel needs their result, so they add to the layer's time (Transformer Engine's userbuffer overlap, which
    would hide them, is refused by the spec). Each is priced from the node's all-reduce benchmark at t GPUs where
    there is one, else by the ring model over NVLink (`hops_calib.model.collectives`); `efficiency` is the
    fraction of that rate the collectives reach inside a training step (streams and SMs shared with compute), and
    `step_latency_ms` a ring step's latency. Full recomputation redoes the forward's collectives with the
    forward (a "layers" term). Left out: the vocabulary-parallel embedding's and loss's small all-reduces.
    """

    name = "tensor_parallel_comm"
    scope = "layers"
    category = "tp_comm"
    params = _collective_params("inside a training step")

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        kinds = tp_collectives_per_layer(spec)
        if not kinds:
            return Contribution()
        nbytes = spec.model.seq_length * spec.model.micro_batch_size * spec.model.hidden_size \
            * gpt.bytes_per_element(spec.model)
        per_stage = []
        for k, layers in enumerate(context.layout.layers):
            rank = context.layout.rank_of(k)
            layer_ms = sum(count * collective_ms(spec, context.devices[rank], op, nbytes, "tp", stage=rank,
                                                 efficiency=params["efficiency"],
                                                 step_latency_ms=params["step_latency_ms"],
                                                 contention_step_ms=params["contention_step_ms"])
                           for op, count in kinds.items())
            per_stage.append(layers * layer_ms)
        return Contribution(forward_ms=tuple(per_stage), backward_ms=tuple(per_stage))


class DataParallelGradReduce(Term):
    """Each rank reduces its gradients over its data-parallel replicas after its backwards, or under them in buckets.

    Physics: the d replicas of a stage each hold the gradients of their own microbatches; before the optimizer
    step Megatron all-reduces them over the data-parallel group (with the distributed optimizer it
    reduce-scatters them instead, each replica then updates its 1/d of the parameters and all-gathers the updated
    16-bit weights). The bytes are the rank's parameters (on one GPU of its tensor-parallel group) times the
    gradient element (`gradient_bytes`: fp32 under bf16). Without --overlap-grad-reduce the reduction is one
    collective after the rank's last backward; with it, Megatron reduces a bucket (`dp_buckets`) as soon as the
    last microbatch's backward has produced it, so all but the last bucket run under that backward
    (`Pipeline.grad_reduce_tail_ms`). The parameter all-gather follows the optimizer step, unless
    --overlap-param-gather hides it under the next iteration's forwards (taken as fully hidden). Collectives are
    priced by `hops_calib.model.collectives` (the node's benchmark, else a ring over NVLink and the node's shared
    NICs); `efficiency` is the fraction of that rate reached beside the backward's kernels.
    """

    name = "data_parallel_grad_reduce"
    category = "dp_reduce"
    params = _collective_params("for gradient reduction, beside the backward's kernels")

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        if spec.dp <= 1:
            return Contribution()
        whole, tails, gathers = [], [], []
        for rank, device in enumerate(context.devices):
            parameters = rank_parameters(context, rank)
            buckets = dp_buckets(spec, parameters)
            op = "reduce_scatter" if spec.distributed_optimizer else "all_reduce"
            bucket_ms = collective_ms(spec, device, op, parameters / buckets * gradient_bytes(spec), "dp",
                                      stage=rank, efficiency=params["efficiency"],
                                      step_latency_ms=params["step_latency_ms"],
                                      contention_step_ms=params["contention_step_ms"])
            whole.append(buckets * bucket_ms)
            tails.append(bucket_ms)
            gather = 0.0
            if spec.distributed_optimizer and not spec.overlap_param_gather:
                gather = collective_ms(spec, device, "all_gather", parameters * gpt.bytes_per_element(spec.model),
                                       "dp", stage=rank, efficiency=params["efficiency"],
                                       step_latency_ms=params["step_latency_ms"],
                                      contention_step_ms=params["contention_step_ms"])
            gathers.append(gather)
        return Contribution(grad_reduce_ms=tuple(whole), grad_reduce_tail_ms=tuple(tails),
                            optimizer_ms=tuple(gathers) if any(gathers) else ())
