"""Model room: context parallelism's exchanges of the attention core, priced by `hops_calib.model.collectives` from
the collectives the kernel list (`layer_kernels._context_parallel_attention`) gives each decoder layer."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import kernels
from hops_calib.model.collectives import collective_ms
from hops_calib.model.devices import DeviceSpec
from hops_calib.model.kernel_pricing import peak_flops_per_s
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.model.terms.parallel import Rates, _collective_params, _rates
from hops_calib.spec import Spec

FORWARD, BACKWARD = "FORWARD", "BACKWARD"


def cp_layer_exchanges(spec: Spec) -> dict[str, tuple[kernels.Kernel, ...]]:
    """Per phase (FORWARD, BACKWARD), one decoder layer's context-parallel kernels in launch order: its collectives
    over the "cp" group and its attention-core kernels (under p2p the cp ring steps, `.cp_step` in their names),
    as `kernels.layer_forward` / `layer_backward` list them under the launch's kernel settings (`kernel_settings`,
    as the kernel table reads them); empty at cp = 1."""
    if spec.cp <= 1:
        return {}
    settings = kernel_settings(spec)
    return {
        phase: tuple(
            k
            for k in listed(spec.model, settings)
            if (k.op == kernels.COLLECTIVE and k.group == "cp") or k.op == kernels.ATTENTION
        )
        for phase, listed in ((FORWARD, kernels.layer_forward), (BACKWARD, kernels.layer_backward))
    }


def cp_exposed_ms(
    spec: Spec,
    device: DeviceSpec,
    rank: int,
    listed: tuple[kernels.Kernel, ...],
    rates: Rates,
    attention_efficiency: float,
) -> float:
    """What one layer's context-parallel collectives of one phase (`cp_layer_exchanges`) leave on the critical path.
    The p2p ring's exchange k (a send_recv, `overlapped`) runs under attention step k (`.cp_step{k}`, its FLOPs at
    the device's peak for its dtype times `attention_efficiency`): max(0, exchange - step) of it is exposed; every
    other collective (a2a's all-to-alls, allgather's all-gather and reduce-scatter) blocks, all of it exposed."""
    collectives = [k for k in listed if k.op == kernels.COLLECTIVE]
    steps = [k for k in listed if k.op == kernels.ATTENTION and ".cp_step" in k.name]
    exposed, ring = 0.0, 0
    for kernel in collectives:
        ms = collective_ms(spec, device, kernel.kind, kernel.bytes, "cp", stage=rank, **rates)
        if kernel.overlapped and ring < len(steps):
            step = steps[ring]
            step_ms = step.flops / (peak_flops_per_s(device, step.dtype) * attention_efficiency / 1e3)
            exposed += max(0.0, ms - step_ms)
            ring += 1
        else:
            exposed += ms
    return exposed


class ContextParallelComm(Term):
    """Each stage's context-parallel exchanges of the attention core, what of them its attention does not hide.

    Physics: under --context-parallel-size cp each GPU holds s / cp tokens of every sequence, as two chunks of
    c = s / 2cp (chunks i and 2cp - 1 - i, for a balanced causal load: `megatron/core/utils.py`
    `get_batch_on_this_cp_rank`); every kernel but the attention core sees only these, and the core needs the keys
    and values of the other chunks. Megatron-core hands TE's `DotProductAttention` the cp group, its global ranks
    and `cp_comm_type` (`extensions/transformer_engine.py` `TEDotProductAttention.__init__`), and TE runs the core
    through `attn_forward_func_with_cp` (`transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py`), whose exchanges this term prices per decoder layer and microbatch, from the kernels
    `layer_kernels._context_parallel_attention` lists (so the kernel table and this term price the same bytes):

    - p2p (`AttnFuncWithCPAndKVP2P`, Megatron's default `--cp-comm-type p2p`): cp attention steps of 2 c^2 score
      entries each (4 b (a / t) head FLOPs an entry); before step k computes, the KV chunk of step k + 1 (k and v of
      the GPU's s / cp tokens) is sent on around the ring (a send/recv: cp - 1 exchanges), so each exchange runs
      under its step's attention and only max(0, exchange - step) is exposed. Backward: the same cp steps (flash's
      backward FLOPs, `FLASH_BACKWARD_PRODUCTS` x the forward's), the KV and its gradient dKV sent around together
      (cp - 1 exchanges of twice the bytes), each under its step.
    - a2a (`AttnFuncWithCPAndQKVOA2A`, DeepSpeed-Ulysses): q, k, v all-to-all'd from the sequence split to a head
      split before the core, the output back after it; backward the output gradient and the q, k, v gradients.
    - allgather (`AttnFuncWithCPAndKVAllGather`): the KV all-gathered over the group, its gradient reduce-scattered.

    a2a's and allgather's collectives are taken as blocking (the core waits for them), all of their time exposed.
    A step's attention time is its executed FLOPs at the device's dense peak for the training precision
    (`peak_flops_per_s`) times `attention_efficiency`; at its default 1.0 the step is as short as it can be, so
    the exposure is an upper bound. Exchanges are priced by `hops_calib.model.collectives` over the cp group's
    placement on the nodes (`Spec.group_ranks`: megatron-core's tp-cp-dp-pp order puts its GPUs t ranks apart)
    with this term's collective rates. Full recomputation (`transformer/transformer_block.py`
    `TransformerBlock._checkpointed_forward`) runs the recomputed layers' forward again in the backward, its
    exchanges included (`ModelShape.recomputed_layers`). Nothing at cp = 1.
    """

    name = "context_parallel_comm"
    category = "cp_comm"
    params = _collective_params("for context parallelism's exchanges, beside the attention") + (
        Param(
            "attention_efficiency",
            1.0,
            0.1,
            1.0,
            "fraction of peak",
            "achieved fraction of the dense peak of the attention step a p2p exchange runs under (1: the step at "
            "peak, the exposure an upper bound)",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        listed = cp_layer_exchanges(spec)
        if not listed:
            return Contribution()
        layout = context.layout
        forward, backward = [], []
        for k, layers in enumerate(layout.layers):
            rank = layout.rank_of(k)
            device = context.devices[rank]
            rates = _rates(context, params, device.type)
            efficiency = Term.value(params, "attention_efficiency", device.type)
            per_layer = {
                phase: cp_exposed_ms(spec, device, rank, found, rates, efficiency) for phase, found in listed.items()
            }
            forward.append(layers * per_layer[FORWARD])
            backward.append(layers * per_layer[BACKWARD] + spec.model.recomputed_layers(layers) * per_layer[FORWARD])
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward))
