"""Model room: the optimizer step of each rank, memory-bound over the parameters the rank holds."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.spec import Spec


def stage_parameters(spec: Spec, layers: int, rank: int) -> float:
    """Parameters one GPU of pipeline rank `rank` holds with `layers` decoder layers (`gpt.stage_parameters`)."""
    return gpt.stage_parameters(spec.model, layers, rank == 0, rank == spec.pp - 1, spec.pp)


def rank_parameters(context: Context, rank: int) -> float:
    """Parameters one GPU of pipeline rank `rank` holds (`stage_parameters`)."""
    return stage_parameters(context.spec, context.layout.layers_on_rank(rank), rank)


def rank_expert_parameters(context: Context, rank: int) -> float:
    """The routed experts' parameters one GPU of pipeline rank `rank` holds (`gpt.expert_parameters` per layer);
    0 without experts."""
    return context.layout.layers_on_rank(rank) * gpt.expert_parameters(context.spec.model)


def optimizer_parameters(context: Context, rank: int) -> float:
    """The parameters whose optimizer step one GPU of pipeline rank `rank` runs: its dense ones over
    `optimizer_shard`, its routed experts' over the expert data-parallel group under the distributed optimizer
    (megatron-core's `DistributedOptimizer` shards each buffer over its own data-parallel group:
    `optimizer/__init__.py` get_megatron_optimizer builds the expert optimizer over
    `get_expert_data_parallel_group`)."""
    spec = context.spec
    parameters = rank_parameters(context, rank)
    if not spec.model.moe:
        return parameters / optimizer_shard(spec)
    experts = rank_expert_parameters(context, rank)
    expert_shard = spec.edp if spec.distributed_optimizer else 1
    return (parameters - experts) / optimizer_shard(spec) + experts / expert_shard


def optimizer_shard(spec: Spec) -> int:
    """How many ways a GPU's optimizer state and step are split: over the data-parallel replicas under the
    distributed optimizer (each updates its 1/d of the parameters, then all-gathers them), else 1."""
    return spec.dp * spec.cp if spec.distributed_optimizer else 1  # the data x context-parallel group


class OptimizerStep(Term):
    """Each rank's Adam step streams its parameters' fp32 state through memory: bytes per parameter over bandwidth.

    Physics: Megatron's mixed-precision optimizer keeps fp32 master weights,
    gradients and the two Adam moments per parameter. One step reads the fp32
    gradients for the global norm (4 B), reads and writes master weight, m and v
    and reads the gradient in the Adam update (28 B), copies the master weights
    back to the bf16 model (6 B) and zeroes the gradient buffer (4 B): about 42
    bytes per parameter, with a handful of FLOPs each, so the step is
    memory-bound. Parameters per rank are its decoder layers plus the embeddings
    on the first stage and the final LayerNorm and output-layer weights on the
    last. The step runs on every rank as an OPTIMIZER task after the iteration's
    barrier; the next iteration starts when it is done. Besides the traffic, a
    step has a fixed cost: the multi-tensor kernels, the gradient-norm and
    found-inf reductions and the bf16 copy-back are launched per parameter group
    whatever the rank's size (`fixed_ms`), and per decoder layer the rank
    holds (`per_layer_ms`): each layer's dozen weight and bias tensors add
    kernel launches and per-tensor work to the norm, update and copy-back, which
    the host issues one by one on a fast GPU.
    """

    name = "optimizer_step"
    category = "optimizer"
    params = (
        Param(
            "bytes_per_parameter",
            42.0,
            16.0,
            64.0,
            "bytes",
            "memory traffic per parameter of one mixed-precision Adam step (norm, update, copy back, zero grads)",
            per_device=True,
        ),
        Param(
            "memory_efficiency",
            0.8,
            0.005,
            1.0,
            "fraction of peak",
            "achieved fraction of the device memory bandwidth by the optimizer's elementwise kernels",
            log=True,
            per_device=True,
        ),
        Param(
            "fixed_ms",
            0.0,
            0.0,
            500.0,
            "ms",
            "launch and reduction overhead of one optimizer step, whatever its size",
            per_device=True,
        ),
        Param(
            "per_layer_ms",
            0.0,
            0.0,
            10.0,
            "ms",
            "launch and per-tensor overhead per decoder layer on the rank",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        times = []
        for rank, device in enumerate(context.devices):
            bytes_per_ms = (
                device.memory_bandwidth_bytes_per_s * self.value(params, "memory_efficiency", device.type) / 1e3
            )
            times.append(
                self.value(params, "fixed_ms", device.type)
                + self.value(params, "per_layer_ms", device.type) * context.layout.layers_on_rank(rank)
                + optimizer_parameters(context, rank)
                * self.value(params, "bytes_per_parameter", device.type)
                / bytes_per_ms
            )
        return Contribution(optimizer_ms=tuple(times))


class GradientSync(Term):
    """The optimizer step waits for every rank only when a collective precedes it: tied embeddings or gradient clipping.

    Physics: Megatron reaches the optimizer step through collectives that span
    the pipeline: the tied word-embedding gradient all-reduce between the first
    and last stage (unless --untie-embeddings-and-output-weights) and, with
    --clip-grad > 0 (the default 1.0), the all-reduce of the global gradient
    norm over the model-parallel group. Either makes every rank wait for the
    slowest one's last backward before stepping. Without both (the CPU
    captures: untied embeddings, torch's AdamW without clipping), each rank
    steps as soon as its own backwards are done. No parameters: the spec says
    which case a run is.
    """

    name = "gradient_sync"

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        synced = (context.spec.pp > 1 and not shape.untie_embeddings) or shape.clip_grad > 0
        return Contribution(optimizer_barrier=synced)
