"""Model room: the roofline cost of each decoder layer's forward and backward."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.kernel_pricing import peak_flops_per_s
from hops_calib.model.kernel_types import settings_from_args
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.spec import Spec


def fp8_linear_gemms(spec: Spec) -> tuple[bool, bool]:
    """(the linear layers' forward and input-gradient GEMMs run in FP8, their weight-gradient GEMMs do): FP8
    through Transformer Engine (`--fp8-format` with `--transformer-impl transformer_engine`; megatron-core
    `fp8_utils.py` `get_fp8_context` wraps the block's TE modules in `fp8_autocast`, under which TE's `Linear` /
    `LayerNormLinear` run fprop, dgrad and wgrad as FP8 GEMMs, wgrad in 16 bits under `--no-fp8-wgrad`). The
    attention core (TE's fused attention: its score and context products and softmax) stays 16-bit without
    `--fp8-dot-product-attention`, which the spec refuses."""
    settings = settings_from_args(spec.megatron_args, softmax_fused=True, gradient_accumulation_fusion=True)
    on = bool(settings.fp8) and settings.transformer_engine
    return on, on and settings.fp8_wgrad


def linear_gemm_precision(spec: Spec) -> str:
    """The precision of the launch's linear GEMMs, in `plan --precision`'s words: fp8 where they run in FP8
    (`fp8_linear_gemms`: Transformer Engine's fprop and dgrad under `fp8_autocast`), else the launch's own training
    dtype (bf16, fp16, fp32: megatron-core `model_parallel_config.py` ModelParallelConfig.params_dtype)."""
    return "fp8" if fp8_linear_gemms(spec)[0] else spec.model.precision


# The tokens the busiest GPU's local experts compute against their balanced share (`gpt.expert_token_scale`): a
# parameter of the layer terms (`decoder_roofline`, `decoder_kernels`), which move nothing without experts.
EXPERT_LOAD_IMBALANCE = Param(
    "expert_load_imbalance",
    1.0,
    1.0,
    8.0,
    "x balanced",
    "tokens the busiest GPU's local experts compute against their balanced share T x topk / E (1: balanced "
    "routing); a mixture of experts' layer waits for it. Per device type where its runs start from another "
    "router (the CPU captures' untrained one: @cpu)",
    inert=True,
    per_device=True,
)


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

    FP8 (`fp8_linear_gemms` = 1): under Transformer Engine's FP8 the four linear layers' GEMMs (QKV, projection,
    fc1, fc2: `gpt.layer_weight_grad_flops` of the forward, as many in the input and the weight gradient) run on
    the FP8 tensor cores, at the device's dense FP8 peak (H100 SXM 1,979 TFLOP/s against 989.5 bf16, datasheet;
    `kernel_pricing.peak_flops_per_s`), at the same achieved fraction of it; the attention core stays at the bf16
    peak. So an FP8 layer's forward takes (W x P16 / P8 + C) / (P16 x efficiency) for its W linear and C core
    FLOPs, the backward `backward_factor` times it, its weight-gradient share the linear part's; under
    `--no-fp8-wgrad` the weight gradient runs at the bf16 peak. At 0 every GEMM is priced at the bf16 peak.

    A mixture of experts (`gpt.mlp_weight_flops`, `hops_calib.model.moe_kernels`): the MLP's FLOPs are the routed
    experts' (each token through topk of them, 2 T topk h f_moe per matmul over t on a GPU) and the shared
    expert's, plus the router's GEMM (`gpt.router_flops`); the bytes the GPU's local experts' weights and their
    stored activations. The busiest GPU's experts compute `expert_load_imbalance` times their balanced share of the
    routed tokens (a property of the router's balancing, not of one run: 1 = balanced, as Megatron's aux-loss
    balancing aims at; a device type's own value where its runs start from another router, as the CPU captures
    start from megatron-core's untrained `TopKRouter` with no auxiliary loss), held under a capacity factor where the launch gives one (`gpt.expert_token_scale`); the
    layer waits for it. The all-to-alls are `tensor_parallel_comm`'s.
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
        Param(
            "fp8_linear_gemms",
            0.0,
            0.0,
            1.0,
            "switch",
            "1: an FP8 launch's linear-layer GEMMs (Transformer Engine) at the device's FP8 peak; 0: every GEMM at "
            "the bf16 peak",
            choices=(0.0, 1.0),
            inert=True,
        ),
        EXPERT_LOAD_IMBALANCE,
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        forward_bytes = gpt.layer_parameters(shape) * gpt.bytes_per_element(shape) + gpt.layer_activation_bytes(shape)
        core_flops = gpt.attention_core_flops(shape)
        fp8, fp8_wgrad = (
            fp8_linear_gemms(context.spec) if params.get("fp8_linear_gemms", 0.0) == 1.0 else (False, False)
        )
        forward, backward, weight_grad, core = [], [], [], []
        for k, layers in enumerate(context.layout.layers):
            device = context.device_of(k)
            # the busiest GPU's experts: the imbalance of the router the device type's runs start from
            imbalance = params.get(f"expert_load_imbalance@{device.type}", params.get("expert_load_imbalance", 1.0))
            scale = gpt.expert_token_scale(shape, imbalance) if shape.moe else 1.0
            weight_grad_flops = gpt.layer_weight_grad_flops(shape, scale) + gpt.router_flops(shape)
            forward_flops = weight_grad_flops + core_flops if shape.moe else gpt.layer_forward_flops(shape)
            core_share = core_flops / forward_flops
            flops_per_ms = device.peak_bf16_flops_per_s * self.value(params, "compute_efficiency", device.type) / 1e3
            bytes_per_ms = device.memory_bandwidth_bytes_per_s * params["memory_efficiency"] / 1e3
            backward_factor = self.value(params, "backward_factor", device.type)
            if not fp8:
                layer_forward_ms = max(forward_flops / flops_per_ms, forward_bytes / bytes_per_ms)
                layer_backward_ms = backward_factor * layer_forward_ms
                forward.append(layers * layer_forward_ms)
                backward.append(layers * layer_backward_ms)
                weight_grad.append(layers * layer_backward_ms * weight_grad_flops / (backward_factor * forward_flops))
                core.append(layers * layer_forward_ms * core_share)
                continue
            # the linear GEMMs' FLOPs in bf16-peak equivalents: forward and input gradient; weight gradient
            ratio = device.peak_bf16_flops_per_s / peak_flops_per_s(device, "fp8")
            linear = weight_grad_flops * ratio
            linear_wgrad = linear if fp8_wgrad else weight_grad_flops
            equivalent = linear + core_flops
            layer_forward_ms = max(equivalent / flops_per_ms, forward_bytes / bytes_per_ms)
            # the weight gradient takes as long as the forward's linear part, at its own precision's peak
            layer_weight_grad_ms = layer_forward_ms * linear_wgrad / equivalent
            layer_backward_ms = (
                backward_factor * layer_forward_ms + layer_forward_ms * (linear_wgrad - linear) / equivalent
            )
            forward.append(layers * layer_forward_ms)
            backward.append(layers * layer_backward_ms)
            weight_grad.append(layers * layer_weight_grad_ms)
            core.append(layers * layer_forward_ms * core_flops / equivalent)
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            weight_grad_ms=tuple(weight_grad),
            attention_core_ms=tuple(core),
        )
