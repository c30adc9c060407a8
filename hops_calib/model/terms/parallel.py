"""Model room: the collectives of tensor and data parallelism, each priced by `hops_calib.model.collectives`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

from hops_calib.model import fsdp, gpt, kernels
from hops_calib.model.collectives import ALGORITHMS, collective_ms
from hops_calib.model.devices import DeviceSpec
from hops_calib.model.kernel_pricing import peak_flops_per_s
from hops_calib.model.memory import gradient_bytes, parameter_gather_bytes
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.model.terms.optimizer import rank_expert_parameters, rank_parameters
from hops_calib.spec import Spec

# Megatron-core's DistributedDataParallel buckets gradients only to overlap their reduction with the backward:
# buckets of max(40M, 1M x d) parameters under --overlap-grad-reduce, else one bucket of every gradient
# (megatron/core/distributed/distributed_data_parallel.py, bucket_size).
BUCKET_PARAMETERS = 40_000_000
BUCKET_PARAMETERS_PER_REPLICA = 1_000_000


class Rates(TypedDict):
    """What collective_ms takes of a term's parameters and the context."""

    efficiency: float
    step_latency_ms: float
    contention_step_ms: float
    connection_cap_bytes_per_ms: float


def _rates(context: Context, params: Mapping[str, float], device_type: str) -> Rates:
    """The collective-pricing parameters both terms share (`_collective_params`) for one device type (its
    NAME@TYPE overrides, else the shared values), with one connection's ceiling across nodes (the context's: one TCP
    flow's over sockets), as collective_ms takes them."""
    return Rates(
        efficiency=Term.value(params, "efficiency", device_type),
        step_latency_ms=Term.value(params, "step_latency_ms", device_type),
        contention_step_ms=Term.value(params, "contention_step_ms", device_type),
        connection_cap_bytes_per_ms=context.connection_cap_bytes_per_ms,
    )


def tp_collectives_per_layer(spec: Spec) -> dict[str, int]:
    """The tensor-parallel collectives one decoder layer issues in its forward (and, as many, in its backward), by
    kind, each of one s x b x h activation buffer (Megatron's column- then row-parallel attention and MLP,
    Shoeybi et al. 2019, fig. 3; Korthikanti et al. 2022, fig. 5): two all-reduces (the attention projection's and
    fc2's outputs; in the backward the QKV's and fc1's input gradients), or under sequence parallelism two
    all-gathers before the column-parallel layers and two reduce-scatters after the row-parallel ones (their
    backward: the reverse). None at t = 1."""
    if spec.tp <= 1:
        return {}
    # under experts (sequence parallelism required) the attention's pair, and the shared expert's where there is one
    # (`moe_kernels`: the routed experts' collectives run over the expert groups, `expert_collectives`)
    pairs = 1 + bool(spec.model.moe_shared_expert_ffn) if spec.model.moe else 2
    if spec.model.sequence_parallel:
        return {"all_gather": pairs, "reduce_scatter": pairs}
    return {"all_reduce": pairs}


def expert_collectives(spec: Spec) -> dict[str, tuple[tuple[str, str, float], ...]]:
    """Per phase (FORWARD, BACKWARD), one decoder layer's collectives over the expert groups, as (kind, group,
    bytes): the token dispatcher's all-to-alls over the expert-parallel group and all-gathers / reduce-scatters over
    the expert tensor-parallel one (alltoall), or its all-gathers and reduce-scatter over both (allgather), as
    `moe_kernels` lists them from megatron-core's `token_dispatcher.py`; empty without experts."""
    if not spec.model.moe:
        return {}
    from hops_calib.model.moe_kernels import EXPERT_GROUPS

    settings = kernels.settings_from_args(spec.megatron_args, softmax_fused=True, gradient_accumulation_fusion=True)
    return {
        phase: tuple(
            (k.kind, k.group, k.bytes)
            for k in listed(spec.model, settings)
            if k.op == kernels.COLLECTIVE and k.group in EXPERT_GROUPS
        )
        for phase, listed in (("FORWARD", kernels.layer_forward), ("BACKWARD", kernels.layer_backward))
    }


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
    tokens = gpt.local_tokens(shape)
    if shape.moe:  # the QKV's, and the shared expert's fc1 where there is one
        shared = shape.moe_shared_expert_ffn * (2 if shape.swiglu else 1)
        return ((op, 2.0 * tokens * shape.hidden_size * gpt.qkv_width(shape) / spec.tp),) + (
            ((op, 2.0 * tokens * shape.hidden_size * shared / spec.tp),) if shared else ()
        )
    fc1_width = shape.ffn_hidden_size * (2 if shape.swiglu else 1)
    return (
        (op, 2.0 * tokens * shape.hidden_size * gpt.qkv_width(shape) / spec.tp),
        (op, 2.0 * tokens * shape.hidden_size * fc1_width / spec.tp),
    )


# Transformer Engine's userbuffers overlap (--tp-comm-overlap; megatron-core hands TE `ub_overlap_ag`,
# `ub_overlap_rs`, `ub_bulk_dgrad`, `ub_bulk_wgrad`: `extensions/transformer_engine.py` TELinear /
# TELayerNormColumnParallelLinear, from `model_parallel_config.py` tp_comm_overlap_ag / _rs / tp_comm_bulk_dgrad /
# _wgrad, all on by default). TE's methods (`transformer_engine/pytorch/module/base.py` `initialize_ub`):
# ring_exchange for the all-gathers fused with a GEMM (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad: t chunks, the
# GEMM of one chunk while the next arrives), pipeline for the reduce-scatters after the row-parallel forward GEMMs
# (proj_fprop, fc2_fprop: `num_splits` 4 by default, each chunk reduce-scattered while the next is computed), bulk
# for the backward's all-gather of the input under the input-gradient GEMM and the reduce-scatter of the input
# gradient under the weight-gradient GEMM.
RING, PIPELINE, BULK = "ring_exchange", "pipeline", "bulk"
TP_OVERLAP_PIPELINE_SPLITS = 4


def tp_comm_overlap(spec: Spec) -> bool:
    """Whether the launch overlaps its layers' tensor-parallel collectives with their GEMMs (--tp-comm-overlap,
    which Megatron allows only with sequence parallelism and the TE layer)."""
    return bool(spec.megatron_args.get("tp_comm_overlap")) and spec.tp > 1 and spec.model.sequence_parallel


def tp_overlap_pairs(spec: Spec) -> dict[str, tuple[tuple[str, float, str], ...]]:
    """Per phase, one decoder layer's overlapped collectives as (kind, FLOPs per GPU of the GEMM it runs under,
    method): forward the QKV's and fc1's input all-gathers (ring exchange with their GEMMs) and the projection's and
    fc2's output reduce-scatters (pipelined with theirs); backward the row-parallel layers' output-gradient
    all-gathers (ring exchange with their input-gradient GEMMs) and the column-parallel layers' input-gradient
    reduce-scatters (bulk, under their weight-gradient GEMMs). A switch turned off (--disable-tp-comm-overlap-ag,
    -rs, --disable-tp-comm-bulk-wgrad) leaves its collectives out: they block."""
    args, shape, t = spec.megatron_args, spec.model, spec.tp
    tokens, h = gpt.local_tokens(shape), shape.hidden_size
    fc1 = shape.ffn_hidden_size * (2 if shape.swiglu else 1)
    q = shape.num_attention_heads * (h // shape.num_attention_heads)
    flops = {
        "qkv": 2.0 * tokens * h * gpt.qkv_width(shape) / t,
        "proj": 2.0 * tokens * h * q / t,
        "fc1": 2.0 * tokens * h * fc1 / t,
        "fc2": 2.0 * tokens * h * shape.ffn_hidden_size / t,
    }

    def on(name: str) -> bool:
        return args.get(name, True) is not False and not args.get(f"disable_{name}")

    ag, rs, bulk = on("tp_comm_overlap_ag"), on("tp_comm_overlap_rs"), on("tp_comm_bulk_wgrad")
    forward = ([("all_gather", flops["qkv"], RING), ("all_gather", flops["fc1"], RING)] if ag else []) + (
        [("reduce_scatter", flops["proj"], PIPELINE), ("reduce_scatter", flops["fc2"], PIPELINE)] if rs else []
    )
    backward = ([("all_gather", flops["fc2"], RING), ("all_gather", flops["proj"], RING)] if ag else []) + (
        [("reduce_scatter", flops["fc1"], BULK), ("reduce_scatter", flops["qkv"], BULK)] if bulk else []
    )
    return {"FORWARD": tuple(forward), "BACKWARD": tuple(backward)}


def overlap_exposed_ms(comm_ms: float, gemm_ms: float, method: str, t: int) -> float:
    """What of a collective overlapped with its GEMM stays on the critical path. Ring exchange (t chunks): the GEMM
    starts on the GPU's own chunk, each of the t - 1 others exposes what its transfer outlasts a chunk's GEMM.
    Pipeline (`TP_OVERLAP_PIPELINE_SPLITS` chunks): the same, plus the last chunk's reduce-scatter after the last
    GEMM. Bulk: what the collective outlasts the GEMM it runs under."""
    if method == BULK:
        return max(0.0, comm_ms - gemm_ms)
    n = t if method == RING else TP_OVERLAP_PIPELINE_SPLITS
    tail = comm_ms / n if method == PIPELINE else 0.0
    return tail + (n - 1) * max(0.0, (comm_ms - gemm_ms) / n)


def hidden_bytes(spec: Spec) -> float:
    """One s x b x h activation buffer in the training precision: what a layer's collectives move."""
    shape = spec.model
    return float(gpt.local_tokens(shape) * shape.hidden_size * gpt.bytes_per_element(shape))


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
    tokens = gpt.local_tokens(shape)
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


def _bucket_size(spec: Spec, given: object) -> float:
    """--ddp-bucket-size as a positive number of parameters, else an InputError naming the run and the field."""
    try:
        size = float(given)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        size = math.nan
    if not size > 0 or math.isinf(size):
        from hops_calib.errors import InputError

        raise InputError(
            f"run {spec.run_id}",
            f"--ddp-bucket-size {given!r} is not a positive number of parameters",
            field="ddp_bucket_size",
            hint="give the bucket size in parameters (Megatron's unit), or leave the flag out for Megatron's default",
        )
    return size


def dp_buckets(spec: Spec, parameters: float, rank: int = 0, first_rank_only: bool = False) -> int:
    """Buckets `rank`'s gradients are reduced in: without --overlap-grad-reduce one; with it buckets of
    --ddp-bucket-size parameters where the launch gives one, else of `BUCKET_PARAMETERS` (Megatron-core:
    DistributedDataParallel.__init__, ddp_config.bucket_size = max(40000000, 1000000 * dp_group.size())). With
    `first_rank_only`, as Megatron-core buckets: only on the first pipeline rank (the same __init__ sets
    bucket_size = None when pp_rank > 0, one bucket of every gradient), whose gradients are the last ready."""
    if not spec.overlap_grad_reduce or parameters <= 0 or (first_rank_only and rank > 0):
        return 1
    given = spec.megatron_args.get("ddp_bucket_size")
    size = (
        _bucket_size(spec, given)
        if given is not None
        else max(BUCKET_PARAMETERS, BUCKET_PARAMETERS_PER_REPLICA * spec.dp * spec.cp)
    )
    return max(1, math.ceil(parameters / size))


def _collective_params(where: str) -> tuple[Param, ...]:
    """The parameters of a term made of collectives: the rate they reach, a ring step's latency and its contention;
    each a property of the machine (NCCL over NVLink, gloo between time-shared CPU cores), so per device type."""
    return (
        Param(
            "efficiency",
            1.0,
            0.1,
            1.0,
            "fraction of benchmark",
            f"achieved fraction of the benchmarked (or ring-model) collective rate {where}",
            per_device=True,
        ),
        Param(
            "step_latency_ms",
            0.005,
            0.0,
            0.1,
            "ms",
            "latency of one ring step (NCCL over NVLink: ~5 us)",
            per_device=True,
        ),
        Param(
            "contention_step_ms",
            0.0,
            0.0,
            1.0,
            "ms",
            "latency each of a ring's 2(n-1) steps gains inside a training step over an isolated benchmark",
            per_device=True,
        ),
    )


class TensorParallelComm(Term):
    """Each stage's tensor-parallel collectives, on the critical path of its forward and backward.

    Physics: Megatron splits a layer's attention and MLP each into a column-parallel and a row-parallel GEMM over
    the t GPUs of a tensor-parallel group; the row-parallel output is a partial sum that an all-reduce completes
    before the next block (forward), and the column-parallel input gradient likewise (backward): two all-reduces of
    the s x b x h activations per layer and direction; with sequence parallelism each becomes a reduce-scatter plus
    an all-gather, the same bytes on the wire. The vocabulary-parallel embedding, output layer and cross entropy
    add their own (`tp_collectives`, which the CPU captures record one for one). The collectives are blocking:
    every rank of the group waits for the slowest to reach them and the next kernel needs their result, so they
    add to the stage's time, not under the host's launch floor (with Transformer Engine's userbuffers overlap,
    --tp-comm-overlap, the layers' collectives run under their GEMMs instead: `tp_overlap_pairs`,
    `overlap_exposed_ms`); full recomputation runs the recomputed layers' forward collectives
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

    A mixture of experts adds its token dispatcher's collectives over the expert groups (`expert_collectives`,
    megatron-core's `token_dispatcher.py`: the alltoall dispatcher's all-to-alls over the expert-parallel group, its
    all-gather and reduce-scatter over the expert tensor-parallel one; the allgather dispatcher's over both), each
    blocking (the experts wait for their tokens, the next block for theirs), priced by
    `hops_calib.model.collectives` over the group's placement on the nodes (`Spec.group_ranks`) with this term's
    rates, at any t (t = 1 included); the routed experts take no part in the layer's tensor-parallel pair (only the
    attention's and a shared expert's remain: `tp_collectives_per_layer`). The breakdown shows these apart
    (`Contribution.expert_comm_ms`, category `ep_comm`).
    """

    name = "tensor_parallel_comm"
    category = "tp_comm"
    params = _collective_params("inside a training step")

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        experts = expert_collectives(spec)
        if spec.tp <= 1 and not any(experts.values()):
            return Contribution()
        layout = context.layout
        forward, backward, expert_comm = [], [], []
        hidden, overlapped = hidden_bytes(spec), tp_async_backward(spec)
        for k, layers in enumerate(layout.layers):
            rank = layout.rank_of(k)
            device = context.devices[rank]
            rates = _rates(context, params, device.type)
            # the expert layers' collectives block (the dispatcher waits for the tokens it sends): every layer's,
            # and a recomputed layer's forward ones again
            expert = {
                phase: sum(
                    collective_ms(spec, device, op, nbytes, group, stage=rank, **rates) for op, group, nbytes in found
                )
                for phase, found in experts.items()
            }
            expert_forward = layers * expert.get("FORWARD", 0.0)
            expert_backward = layers * expert.get("BACKWARD", 0.0) + spec.model.recomputed_layers(layers) * expert.get(
                "FORWARD", 0.0
            )
            expert_comm.append(expert_forward + expert_backward)
            if spec.tp <= 1:
                forward.append(expert_forward)
                backward.append(expert_backward)
                continue

            def price(counts: dict[tuple[str, float], int]) -> float:
                # called only within this iteration, so the loop's current device, rank and rates are the ones meant
                return sum(
                    count * collective_ms(spec, device, op, nbytes, "tp", stage=rank, **rates)  # noqa: B023
                    for (op, nbytes), count in counts.items()
                )

            phases = tp_collectives(spec, k, layers)
            if tp_comm_overlap(spec):
                forward_ms, backward_ms = self._overlapped(spec, device, rank, rates, phases, layers, price)
                forward.append(forward_ms + expert_forward)
                backward.append(backward_ms + expert_backward)
                continue
            # one layer's forward collectives, which full recomputation runs again
            per_layer = price({(op, hidden): count for op, count in tp_collectives_per_layer(spec).items()})
            blocking = dict(phases["BACKWARD"])
            for op, _ in overlapped:
                if layers:  # a virtual stage without decoder layers has no layer collectives to overlap
                    blocking[(op, hidden)] -= layers
            flops_per_ms = device.peak_bf16_flops_per_s / 1e3
            exposed = sum(max(0.0, price({(op, hidden): 1}) - flops / flops_per_ms) for op, flops in overlapped)
            forward.append(price(phases["FORWARD"]) + expert_forward)
            backward.append(
                price(blocking) + layers * exposed + spec.model.recomputed_layers(layers) * per_layer + expert_backward
            )
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            expert_comm_ms=tuple(expert_comm) if any(expert_comm) else (),
        )

    @staticmethod
    def _overlapped(
        spec: Spec,
        device: DeviceSpec,
        rank: int,
        rates: Rates,
        phases: dict[str, dict[tuple[str, float], int]],
        layers: int,
        price: Any,
    ) -> tuple[float, float]:
        """(forward, backward) ms of a virtual stage under --tp-comm-overlap: each layer's overlapped collectives
        expose `overlap_exposed_ms` against their GEMMs (at the device's peak for the GEMMs' precision, so the
        exposure is an upper bound), the rest (the embedding's and output layer's, a switched-off method's) block;
        full recomputation runs the forward's again."""
        hidden = hidden_bytes(spec)
        fp8 = bool(kernels.fp8_format(spec.megatron_args))
        flops_per_ms = peak_flops_per_s(device, "fp8" if fp8 else "bf16") / 1e3
        pairs = tp_overlap_pairs(spec)
        exposed, blocking = {}, {}
        for phase in ("FORWARD", "BACKWARD"):
            exposed[phase] = sum(
                overlap_exposed_ms(
                    collective_ms(spec, device, op, hidden, "tp", stage=rank, **rates),
                    flops / flops_per_ms,
                    method,
                    spec.tp,
                )
                for op, flops, method in pairs[phase]
            )
            counts = dict(phases[phase])
            for op, _, _ in pairs[phase]:
                if layers:  # a virtual stage without decoder layers has no layer collectives to overlap
                    counts[(op, hidden)] -= layers
            blocking[phase] = price(counts)
        recomputed = spec.model.recomputed_layers(layers)
        return (
            blocking["FORWARD"] + layers * exposed["FORWARD"],
            blocking["BACKWARD"] + layers * exposed["BACKWARD"] + recomputed * exposed["FORWARD"],
        )


class DataParallelGradReduce(Term):
    """Each rank reduces its gradients over its data-parallel replicas after its backwards, or under them in buckets.

    Physics: the d replicas of a stage each hold the gradients of their own microbatches; before the optimizer
    step Megatron all-reduces them over the data-parallel group (with the distributed optimizer it
    reduce-scatters them instead, each replica then updates its 1/d of the parameters and all-gathers the updated
    16-bit weights, the linear ones in FP8 under --fp8-param-gather: `memory.parameter_gather_bytes`;
    megatron/core/distributed/param_and_grad_buffer.py, _ParamAndGradBucketGroup.start_grad_sync
    and start_param_sync). The bytes are the rank's parameters (on one GPU of its tensor-parallel group) times
    the gradient element (`gradient_bytes`: fp32 under bf16). Without --overlap-grad-reduce the reduction is one
    collective after the rank's last backward (DistributedDataParallel.finish_grad_sync, called by
    megatron/core/distributed/finalize_model_grads.py, finalize_model_grads); with it, Megatron reduces a bucket
    (`dp_buckets`) as soon as the last microbatch's backward has produced it (the backward post-hook's
    register_grad_ready; earlier microbatches run under no_sync), so all but the last bucket run under that
    backward (`Pipeline.grad_reduce_tail_ms`). Megatron-core buckets only on the first pipeline rank
    (DistributedDataParallel.__init__: bucket_size = None when pp_rank > 0; Megatron-LM's get_model also turns
    bucketing off for model chunks after the first): `first_rank_buckets` = 1 prices that, each later rank's
    whole reduction following its last backward (the other ranks' cool-down backwards hide it in the
    simulator); 0 buckets every rank. The parameter all-gather follows the optimizer step, unless
    --overlap-param-gather hides it under the next iteration's forwards (taken as fully hidden: the forward
    pre-hook waits on each bucket's all-gather, dispatched one bucket ahead). Collectives are priced by
    `hops_calib.model.collectives` (the node's benchmark, else a ring over NVLink and the node's shared NICs, or
    with `algorithm` = 1 two levels: a reduce-scatter inside the node on NVLink, an all-reduce across the nodes at
    each GPU's NIC share, an all-gather inside; 2 the faster of the two per bucket, as NCCL's tuner chooses);
    `net_step_latency_ms` is what each ring step across nodes adds over an NVLink step, and `efficiency` the
    fraction of the rate reached beside the backward's kernels. Under a mixture of experts the routed experts'
    gradients are their own buffers, reduced (and their parameters gathered) over the expert data-parallel group
    (world / (etp x ep x pp): `get_expert_data_parallel_group`), the rest over the data x context-parallel group.

    Megatron-FSDP (--use-megatron-fsdp, `hops_calib.model.fsdp`): no_shard and optim reduce as above (all-reduce,
    or reduce-scatter and gather); optim_grads and optim_grads_params reduce-scatter on every microbatch and the
    latter gathers every decoder layer before its forward and its backward, what their compute does not hide added
    to each virtual stage's forward and backward (`_fsdp`).
    """

    name = "data_parallel_grad_reduce"
    category = "dp_reduce"
    params = _collective_params("for gradient reduction, beside the backward's kernels") + (
        Param(
            "algorithm",
            0.0,
            0.0,
            2.0,
            "choice",
            "collective algorithm of a group across nodes: 0 flat ring, 1 two levels (NVLink inside the node, "
            "the NIC share across), 2 the faster of the two per message (NCCL's tuner)",
            choices=(0.0, 1.0, 2.0),
            inert=True,
        ),
        Param(
            "net_step_latency_ms",
            0.0,
            0.0,
            0.1,
            "ms",
            "latency each ring step across nodes adds over an NVLink step (InfiniBand and NCCL's proxy: ~5-10 us)",
            per_device=True,
            inert=True,
        ),
        Param(
            "first_rank_buckets",
            0.0,
            0.0,
            1.0,
            "switch",
            "1: under --overlap-grad-reduce only the first pipeline rank buckets (Megatron-core); 0: every rank",
            choices=(0.0, 1.0),
            inert=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        if spec.dp * spec.cp <= 1 and (not spec.model.moe or spec.edp <= 1):
            return Contribution()
        algorithm = ALGORITHMS[int(params["algorithm"])]
        first_rank_only = bool(params["first_rank_buckets"])
        # the gradients are reduced over the data x context-parallel group (`DistributedDataParallel` over
        # `get_data_parallel_group(with_context_parallel=True)`): every CP rank holds gradients of its own tokens;
        # the routed experts' in their own buffers over the expert data-parallel group (`expert_parallel_buffers`,
        # `get_expert_data_parallel_group`)
        group = "dp_cp" if spec.cp > 1 else "dp"
        if fsdp.shards_gradients(spec):
            return self._fsdp(context, params, group, algorithm)
        whole, tails, gathers = [], [], []
        for rank, device in enumerate(context.devices):
            parameters = rank_parameters(context, rank)
            experts = rank_expert_parameters(context, rank)
            op = "reduce_scatter" if spec.distributed_optimizer else "all_reduce"
            rates = _rates(context, params, device.type)
            net = Term.value(params, "net_step_latency_ms", device.type)
            reduce_ms, tail_ms, gather = 0.0, 0.0, 0.0
            for own, over in ((parameters - experts, group), (experts, "edp")):
                if own <= 0:
                    continue
                buckets = dp_buckets(spec, own, rank, first_rank_only)
                bucket_ms = collective_ms(
                    spec,
                    device,
                    op,
                    own / buckets * gradient_bytes(spec),
                    over,
                    stage=rank,
                    algorithm=algorithm,
                    net_step_latency_ms=net,
                    **rates,
                )
                reduce_ms += buckets * bucket_ms
                tail_ms += bucket_ms
                if spec.distributed_optimizer and not spec.overlap_param_gather:
                    gather += collective_ms(
                        spec,
                        device,
                        "all_gather",
                        parameter_gather_bytes(spec, own, spec.layers_per_stage[rank])
                        if over == group
                        else own * gpt.bytes_per_element(spec.model),
                        over,
                        stage=rank,
                        algorithm=algorithm,
                        net_step_latency_ms=net,
                        **rates,
                    )
            whole.append(reduce_ms)
            tails.append(tail_ms)
            gathers.append(gather)
        return Contribution(
            grad_reduce_ms=tuple(whole),
            grad_reduce_tail_ms=tuple(tails),
            optimizer_ms=tuple(gathers) if any(gathers) else (),
        )

    @staticmethod
    def _fsdp(context: Context, params: Mapping[str, float], group: str, algorithm: str) -> Contribution:
        """Megatron-FSDP sharding gradients (optim_grads) or gradients and weights (optim_grads_params): its
        collectives per microbatch, what of them each virtual stage's forward and backward expose (`fsdp.exposed_ms`,
        `fsdp.chunk_units`), and per rank the reduce-scatter left after its last backward (`grad_reduce_ms`, all of
        it exposed: finish_grad_sync waits for it before the optimizer step). optim_grads reduce-scatters a chunk's
        gradients after each backward (one bucket, or buckets of --ddp-bucket-size), under the next microbatch's
        work: each microbatch's backward exposes what that outlasts the chunk's forward and backward at peak; its
        unsharded weights are all-gathered from the updated shards after the step (MegatronFSDP.start_param_sync),
        in the optimizer phase unless --overlap-param-gather moves the gathers under the next forward."""
        spec, layout = context.spec, context.layout
        gradient = gradient_bytes(spec)
        forward, backward = [0.0] * layout.virtual_stages, [0.0] * layout.virtual_stages
        tails, gathers = [0.0] * layout.ranks, [0.0] * layout.ranks
        for k, layers in enumerate(layout.layers):
            rank = layout.rank_of(k)
            device = context.devices[rank]
            rates = _rates(context, params, device.type)
            net = Term.value(params, "net_step_latency_ms", device.type)
            flops_per_ms = peak_flops_per_s(device, "bf16") / 1e3

            def price(op: str, nbytes: float) -> float:
                # called only within this iteration: the loop's device, rank and rates are the ones meant
                return collective_ms(
                    spec,
                    device,  # noqa: B023
                    op,
                    nbytes,
                    group,
                    stage=rank,  # noqa: B023
                    algorithm=algorithm,
                    net_step_latency_ms=net,  # noqa: B023
                    **rates,  # noqa: B023
                )

            first, last = k == 0, k == layout.virtual_stages - 1
            units = fsdp.chunk_units(spec, rank, layers, first, last, price, flops_per_ms, gradient=gradient)
            if fsdp.shards_parameters(spec):
                forward[k], backward[k], tail = fsdp.exposed_ms(units)
            else:
                parameters = gpt.stage_parameters(spec.model, layers, first, last, spec.pp)
                buckets = dp_buckets(spec, parameters) if spec.megatron_args.get("ddp_bucket_size") else 1
                reduce = buckets * price("reduce_scatter", parameters / buckets * gradient)
                compute = sum(unit.forward_ms + unit.backward_ms for unit in units)
                backward[k] = max(0.0, reduce - compute)
                tail = reduce / buckets
                if not spec.overlap_param_gather:  # start_param_sync: the updated weights gathered after the step
                    gathers[rank] += price("all_gather", parameter_gather_bytes(spec, parameters, layers))
            if layout.chunk_of(k) == 0:  # a rank's first chunk runs its last backward
                tails[rank] += tail
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            grad_reduce_ms=tuple(tails),
            grad_reduce_tail_ms=tuple(tails),
            optimizer_ms=tuple(gathers) if any(gathers) else (),
        )
