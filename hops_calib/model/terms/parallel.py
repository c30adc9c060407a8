"""Model room: the collectives of tensor and data parallelism, each priced by `hops_calib.model.collectives`."""

from __future__ import annotations

import math
from collections.abc import Mapping

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


def _rates(context: Context, params: Mapping[str, float], device_type: str) -> dict[str, float]:
    """The collective-pricing parameters both terms share (`_collective_params`) for one device type (its
    NAME@TYPE overrides, else the shared values), with one connection's ceiling across nodes (the context's: one TCP
    flow's over sockets), as collective_ms takes them."""
    return {**{name: Term.value(params, name, device_type) for name in ("efficiency", "step_latency_ms",
                                                                          "contention_step_ms")},
            "connection_cap_bytes_per_ms": context.connection_cap_bytes_per_ms}


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


def tp_async_backward(spec: Spec) -> tuple[tuple[str, float], ...]:
    """The backward collectives of one decoder layer that overlap a weight-gradient GEMM, as (kind, that GEMM's
    FLOPs per GPU): the column-parallel QKV's and fc1's input-gradient all-reduces (under sequence parallelism
    reduce-scatters), each launched asynchronously before its layer's weight gradient is computed
    (`TensorParallelComm`). The other backward collectives (under sequence parallelism the row-parallel layers'
    gradient all-gathers) block. None at t = 1."""
    if spec.tp <= 1:
        return ()
    shape = spec.model
    op = "reduce_scatter" if shape.sequence_parallel else "all_reduce"
    tokens = shape.seq_length * shape.micro_batch_size
    fc1_width = shape.ffn_hidden_size * (2 if shape.swiglu else 1)
    return ((op, 2.0 * tokens * shape.hidden_size * gpt.qkv_width(shape) / spec.tp),
            (op, 2.0 * tokens * shape.hidden_size * fc1_width / spec.tp))


def hidden_bytes(spec: Spec) -> float:
    """One s x b x h activation buffer in the training precision: what a layer's collectives move."""
    shape = spec.model
    return float(shape.seq_length * shape.micro_batch_size * shape.hidden_size * gpt.bytes_per_element(shape))


def tp_collectives(spec: Spec, virtual_stage: int, layers: int) -> dict[str, dict[tuple[str, float], int]]:
    """Per microbatch, the tensor-parallel collectives a virtual stage with `layers` decoder layers issues, by phase
    (FORWARD, BACKWARD) and (kind, bytes): its layers' (`tp_collectives_per_layer`), the vocabulary-parallel
    embedding's on the first (an all-reduce of its s x b x h output; under SP a reduce-scatter, gathered back in the
    backward), and on the last the output layer's (its input gradient's all-reduce in the backward; under SP an
    all-gather before it, reduce-scattered back) and the vocabulary-parallel cross entropy's three all-reduces of
    s x b fp32 values (the logits' maximum, the target logit, the sum of exponentials). Counted from Megatron-core's
    code and equal to what `hops-calib capture --tp 2` records. Empty at t = 1."""
    if spec.tp <= 1:
        return {}
    shape = spec.model
    tokens = shape.seq_length * shape.micro_batch_size
    hidden = hidden_bytes(spec)
    found: dict[str, dict[tuple[str, float], int]] = {"FORWARD": {}, "BACKWARD": {}}

    def add(phase: str, op: str, nbytes: float, count: int) -> None:
        if count:
            found[phase][(op, nbytes)] = found[phase].get((op, nbytes), 0) + count

    for op, count in tp_collectives_per_layer(spec).items():
        add("FORWARD", op, hidden, layers * count)
        add("BACKWARD", op, hidden, layers * count)
    sp = shape.sequence_parallel
    if virtual_stage == 0:
        add("FORWARD", "reduce_scatter" if sp else "all_reduce", hidden, 1)
        add("BACKWARD", "all_gather", hidden, 1 if sp else 0)
    if virtual_stage == spec.pp * spec.vp - 1:
        add("FORWARD", "all_gather", hidden, 1 if sp else 0)
        add("FORWARD", "all_reduce", float(tokens * 4), 3)
        add("BACKWARD", "reduce_scatter" if sp else "all_reduce", hidden, 1)
    return found


def dp_buckets(spec: Spec, parameters: float) -> int:
    """Buckets a rank's gradients are reduced in (`BUCKET_PARAMETERS`)."""
    if not spec.overlap_grad_reduce or parameters <= 0:
        return 1
    size = max(BUCKET_PARAMETERS, BUCKET_PARAMETERS_PER_REPLICA * spec.dp)
    return max(1, math.ceil(parameters / size))


def _collective_params(where: str) -> tuple[Param, ...]:
    """The parameters of a term made of collectives: the rate they reach, a ring step's latency and its contention;
    each a property of the machine (NCCL over NVLink, gloo between time-shared CPU cores), so per device type."""
    return (Param("efficiency", 1.0, 0.1, 1.0, "fraction of benchmark",
                  f"achieved fraction of the benchmarked (or ring-model) collective rate {where}", per_device=True),
            Param("step_latency_ms", 0.005, 0.0, 0.1, "ms", "latency of one ring step (NCCL over NVLink: ~5 us)",
                  per_device=True),
            Param("contention_step_ms", 0.0, 0.0, 1.0, "ms",
                  "latency each of a ring's 2(n-1) steps gains inside a training step over an isolated benchmark",
                  per_device=True))


class TensorParallelComm(Term):
    """Each stage's tensor-parallel collectives, on the critical path of its forward and backward.

    Physics: Megatron splits a layer's attention and MLP each into a column-parallel and a row-parallel GEMM over
    the t GPUs of a tensor-parallel group; the row-parallel output is a partial sum that an all-reduce completes
    before the next block (forward), and the column-parallel input gradient likewise (backward): two all-reduces of
    the s x b x h activations per layer and direction; with sequence parallelism each becomes a reduce-scatter plus
    an all-gather, the same bytes on the wire. The vocabulary-parallel embedding, output layer and cross entropy
    add their own (`tp_collectives`, which the CPU captures record one for one). The collectives are blocking:
    every rank of the group waits for the slowest to reach them and the next kernel needs their result, so they
    add to the stage's time, not under the host's launch floor (Transformer Engine's userbuffer overlap, which
    would hide them, is refused by the spec); full recomputation runs the recomputed layers' forward collectives
    again in the backward. Each is priced from the node's all-reduce benchmark at t GPUs where there is one, else
    by the ring model (`hops_calib.model.collectives`); `efficiency` is the fraction of that rate the collectives
    reach inside a training step, `step_latency_ms` a ring step's latency and `contention_step_ms` what each step
    gains over the isolated benchmark.

    The backward's column-parallel input-gradient collectives (the QKV's and fc1's: all-reduces, or under sequence
    parallelism reduce-scatters) are asynchronous: Megatron launches each and computes the layer's weight gradient
    before waiting on it (`LinearWithGradAccumulationAndAsyncCommunication`, default since Megatron-LM 2022; the
    `--no-async-tensor-model-parallel-allreduce` switch of older Megatron-LM / Megatron-DeepSpeed turns it off), so
    only what outlasts that weight-gradient GEMM is exposed (`tp_async_backward`; the GEMM at the device's
    peak, so the exposure is an upper bound). Small layers expose most of it, large ones almost none.
    """

    name = "tensor_parallel_comm"
    category = "tp_comm"
    params = _collective_params("inside a training step")

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        if spec.tp <= 1:
            return Contribution()
        layout = context.layout
        forward, backward = [], []
        hidden, overlapped = hidden_bytes(spec), tp_async_backward(spec)
        for k, layers in enumerate(layout.layers):
            rank = layout.rank_of(k)
            device = context.devices[rank]
            rates = _rates(context, params, device.type)

            def price(counts: dict[tuple[str, float], int]) -> float:
                # called only within this iteration, so the loop's current device, rank and rates are the ones meant
                return sum(count * collective_ms(spec, device, op, nbytes, "tp", stage=rank, **rates)  # noqa: B023
                           for (op, nbytes), count in counts.items())

            phases = tp_collectives(spec, k, layers)
            # one layer's forward collectives, which full recomputation runs again
            per_layer = price({(op, hidden): count for op, count in tp_collectives_per_layer(spec).items()})
            blocking = dict(phases["BACKWARD"])
            for op, _ in overlapped:
                blocking[(op, hidden)] -= layers
            flops_per_ms = device.peak_bf16_flops_per_s / 1e3
            exposed = sum(max(0.0, price({(op, hidden): 1}) - flops / flops_per_ms) for op, flops in overlapped)
            forward.append(price(phases["FORWARD"]))
            backward.append(price(blocking) + layers * exposed + spec.model.recomputed_layers(layers) * per_layer)
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward))


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
            rates = _rates(context, params, device.type)
            bucket_ms = collective_ms(spec, device, op, parameters / buckets * gradient_bytes(spec), "dp",
                                      stage=rank, **rates)
            whole.append(buckets * bucket_ms)
            tails.append(bucket_ms)
            gather = 0.0
            if spec.distributed_optimizer and not spec.overlap_param_gather:
                gather = collective_ms(spec, device, "all_gather", parameters * gpt.bytes_per_element(spec.model),
                                       "dp", stage=rank, **rates)
            gathers.append(gather)
        return Contribution(grad_reduce_ms=tuple(whole), grad_reduce_tail_ms=tuple(tails),
                            optimizer_ms=tuple(gathers) if any(gathers) else ())
