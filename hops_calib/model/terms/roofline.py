"""Model room: the roofline cost of each decoder layer's forward and backward."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term


class DecoderRoofline(Term):
    """Each decoder layer takes the longer of its FLOPs over achieved peak and its bytes over achieved bandwidth.

    Physics: a layer is bound either by its tensor-core work or by the memory
    traffic of reading its weights and writing its activations (Williams et al.,
    "Roofline", CACM 2009). Forward FLOPs are Megatron's 24bsh^2 + 4bs^2h (f = 4h,
    general f in `gpt.layer_forward_flops`); bytes are the bf16 weights plus the
    activations the layer stores for backward (Korthikanti et al. 2022). Backward
    computes both the input and the weight gradient, each a matmul the size of the
    forward's, so it costs `backward_factor` times the forward in FLOPs and bytes;
    its weight-gradient share is the weight matmuls' share of backward FLOPs, and
    its attention core (what selective recomputation redoes) the score and context
    products' share of forward FLOPs.
    Peak FLOP/s and bandwidth come from the device specs; the efficiencies are the
    achievable fractions of those peaks. The datasheet peak is at boost clock; a
    power-limited part (the L4 at 72 W) runs sustained GEMMs well below it, so
    the compute efficiency may take a value per device type
    ("compute_efficiency@l4"); so may the backward factor, since a backward,
    longer and heavier than the forward, pushes a power-capped part further
    below its boost clock.
    """

    name = "decoder_roofline"
    scope = "layers"
    params = (
        Param(
            "compute_efficiency",
            0.5,
            0.01,
            1.0,
            "fraction of peak",
            "achieved fraction of dense bf16 peak in the layer's GEMMs (large GEMMs reach 0.5-0.8)",
            log=True,
            per_device=True,
        ),
        Param(
            "memory_efficiency",
            0.8,
            0.05,
            1.0,
            "fraction of peak",
            "achieved fraction of the device memory bandwidth (STREAM-like kernels reach 0.8-0.9)",
            log=True,
        ),
        Param(
            "backward_factor",
            2.0,
            1.0,
            4.0,
            "x forward",
            "backward work relative to forward: input gradient + weight gradient = 2",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        forward_flops = gpt.layer_forward_flops(shape)
        forward_bytes = gpt.layer_parameters(shape) * gpt.bytes_per_element(shape) + gpt.layer_activation_bytes(shape)
        weight_grad_flops = gpt.layer_weight_grad_flops(shape)
        core_share = gpt.attention_core_flops(shape) / forward_flops
        forward, backward, weight_grad, core = [], [], [], []
        for k, layers in enumerate(context.layout.layers):
            device = context.device_of(k)
            flops_per_ms = device.peak_bf16_flops_per_s * self.value(params, "compute_efficiency", device.type) / 1e3
            bytes_per_ms = device.memory_bandwidth_bytes_per_s * params["memory_efficiency"] / 1e3
            layer_forward_ms = max(forward_flops / flops_per_ms, forward_bytes / bytes_per_ms)
            backward_factor = self.value(params, "backward_factor", device.type)
            layer_backward_ms = backward_factor * layer_forward_ms
            forward.append(layers * layer_forward_ms)
            backward.append(layers * layer_backward_ms)
            weight_grad.append(layers * layer_backward_ms * weight_grad_flops / (backward_factor * forward_flops))
            core.append(layers * layer_forward_ms * core_share)
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            weight_grad_ms=tuple(weight_grad),
            attention_core_ms=tuple(core),
        )
