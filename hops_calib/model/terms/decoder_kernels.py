"""Model room: each decoder layer as the sum of the kernels Megatron launches for it, each priced on its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hops_calib.model.devices import DeviceSpec
from hops_calib.model.kernel_pricing import Pricer, Rates
from hops_calib.model.kernels import (
    COLLECTIVE,
    RECOMPUTE,
    WGRAD,
    KernelSettings,
    layer_backward,
    layer_forward,
    recomputed,
    settings_from_args,
)
from hops_calib.model.terms.attention import softmax_fused
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.model.terms.elementwise import gradient_accumulation_fused
from hops_calib.model.terms.roofline import EXPERT_LOAD_IMBALANCE
from hops_calib.spec import Spec


def kernel_settings(spec: Spec, params: Mapping[str, float] | None = None) -> KernelSettings:
    """The kernel settings of a spec's launch (`kernels.settings_from_args`, with the attention and elementwise
    terms' readings of the fused softmax and the gradient-accumulation fusion), and the expert load imbalance of
    the term's `params` where given."""
    settings = settings_from_args(
        spec.megatron_args,
        softmax_fused=softmax_fused(spec),
        gradient_accumulation_fusion=gradient_accumulation_fused(spec.megatron_args),
    )
    if params is not None and params.get("expert_load_imbalance", 1.0) != 1.0:
        settings = replace(settings, expert_load_imbalance=params["expert_load_imbalance"])
    return settings


def rates_of(params: Mapping[str, float], device_type: str) -> Rates:
    """The pricing rates of one device type from the term's parameters (NAME@TYPE overrides first)."""

    def value(name: str) -> float:
        return Term.value(params, name, device_type)

    return Rates(
        gemm_efficiency=value("gemm_efficiency"),
        fp8_gemm_efficiency=value("fp8_gemm_efficiency"),
        gemm_k_half=value("gemm_k_half"),
        memory_efficiency=value("memory_efficiency"),
        kernel_latency_us=value("kernel_latency_us"),
        flash_forward_efficiency=value("flash_forward_efficiency"),
        flash_backward_efficiency=value("flash_backward_efficiency"),
        use_tables=value("use_tables") == 1.0,
    )


def pricer_of(spec: Spec, device: DeviceSpec, params: Mapping[str, float]) -> Pricer:
    """The pricer of one device of a spec: the machine's component tables of that device type, else its datasheet."""
    return Pricer(device, spec.components(device.type), rates_of(params, device.type))


class DecoderKernels(Term):
    """Each decoder layer is the sum of its kernels, each a GEMM, fused attention or memory-bound kernel priced alone.

    Physics: a layer's forward and backward run their kernels one after another on one CUDA stream
    (CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron requires), so the layer's GPU time is the sum of its kernels'.
    The kernels are those megatron-core launches for the launch's layer (`hops_calib.model.kernels`: the local or
    the Transformer Engine layer, fusions on or off, sequence parallelism, GQA, SwiGLU, RoPE, flash or unfused
    attention), each priced by its own mechanism (`hops_calib.model.kernel_pricing`): a GEMM by its shape (tile and
    wave quantization over the SMs, the achieved fraction of peak from the machine's GEMM table, else the default
    curve from the datasheet), a memory-bound kernel by its bytes over the bandwidth the machine's memory table
    measured at that size (else the datasheet's at `memory_efficiency`, after a fixed `kernel_latency_us`), the fused
    attention kernel by its FLOPs at `flash_*_efficiency` of peak. The weight-gradient share is the WGRAD kernels'
    (what a zero-bubble schedule may defer), the attention core the `core_attention` kernels (what selective
    recomputation re-runs: `Model.pipeline` adds them, or the whole forward under full recomputation, to the
    backward). The tensor-parallel collectives are listed with the layer's kernels but priced by
    `tensor_parallel_comm`.

    The host launches every kernel (PyTorch's dispatcher, the CUDA launch): `launch_us` of host time per kernel, so
    a layer can go no faster than its kernel count times that, whatever its GPU work: the layer's floor (the
    simulator takes the longer of the two), the mechanism the fitted per-layer launch floor stands in for. With
    these the term replaces `decoder_roofline`, `attention_score_traffic`, `elementwise_traffic` and the per-layer
    floor (`layer_launch_floor`) on the device types it is `enabled` for (`Term.supersedes`: `Model` drops their
    layer work there), and prices nothing on the others, where those terms stand. It does not replace
    `layer_dispatch_floor`'s per-layer times: host time a layer spends on top of its GPU work, which no kernel's
    price holds (the vTrain layers, cut out of their iterations by `hops-calib decompose`, take their kernels'
    time plus 1.2-1.5 ms at every micro batch where the GPU bounds them; experiments/CAMPAIGN.md, session 19).
    Every parameter may take a value per device type; `use_tables` = 0 prices from the datasheet even where the
    machine has tables.
    """

    name = "decoder_kernels"
    scope = "layers"
    supersedes = (
        "decoder_roofline",
        "attention_score_traffic",
        "elementwise_traffic",
        "layer_launch_floor",
    )
    params = (
        Param(
            "enabled",
            1.0,
            0.0,
            1.0,
            "switch",
            "1: the layers of this device type are priced as their kernels, in place of the terms this one "
            "supersedes; 0: by those terms (this one prices nothing there)",
            choices=(0.0, 1.0),
            per_device=True,
        ),
        Param(
            "gemm_efficiency",
            0.8,
            0.1,
            1.0,
            "fraction of peak",
            "default curve: a full tile's achieved fraction of the dense peak at large K, where the device has no "
            "GEMM table (cuBLAS reaches 0.7-0.9 on large 16-bit GEMMs)",
            per_device=True,
        ),
        Param(
            "fp8_gemm_efficiency",
            0.8,
            0.1,
            1.0,
            "fraction of peak",
            "default curve: a full FP8 tile's achieved fraction of the dense FP8 peak (twice the 16-bit one) at large "
            "K, where the device has no FP8 GEMM table; Transformer Engine's FP8 GEMMs (cuBLASLt, "
            "te.pytorch.cpp_extensions.general_gemm) reach a lower fraction of their doubled peak than 16-bit ones",
            per_device=True,
        ),
        Param(
            "gemm_k_half",
            64.0,
            0.0,
            2048.0,
            "elements",
            "default curve: the K at which a tile's main loop equals its fixed prologue and epilogue (efficiency "
            "x K / (K + this))",
            per_device=True,
        ),
        Param(
            "memory_efficiency",
            0.8,
            0.05,
            1.0,
            "fraction of peak",
            "default curve: achieved fraction of the datasheet memory bandwidth by streaming kernels (STREAM-like "
            "kernels reach 0.8-0.9)",
            per_device=True,
        ),
        Param(
            "kernel_latency_us",
            3.0,
            0.0,
            100.0,
            "us",
            "default curve: a memory-bound kernel's fixed GPU time (fill and drain of the grid) before its bytes "
            "stream",
            per_device=True,
        ),
        Param(
            "flash_forward_efficiency",
            0.6,
            0.1,
            1.0,
            "fraction of peak",
            "achieved fraction of the dense peak of the fused attention forward (FlashAttention-2: 0.5-0.73 on A100)",
            per_device=True,
        ),
        Param(
            "flash_backward_efficiency",
            0.45,
            0.1,
            1.0,
            "fraction of peak",
            "achieved fraction of the dense peak of the fused attention backward (below the forward's)",
            per_device=True,
        ),
        Param(
            "launch_us",
            5.0,
            0.0,
            200.0,
            "us",
            "host time to launch one kernel (PyTorch dispatch and cudaLaunchKernel); kernels x this floors a layer",
            per_device=True,
        ),
        Param(
            "backward_launch_us",
            5.0,
            0.0,
            400.0,
            "us",
            "host time to launch one kernel of the backward (the autograd engine's per-node work on top of the "
            "dispatch and cudaLaunchKernel); the backward's kernels x this floor a layer's backward",
            per_device=True,
        ),
        Param(
            "use_tables",
            1.0,
            0.0,
            1.0,
            "switch",
            "1: price from the machine's GEMM and memory tables where it has them; 0: from the datasheet",
            choices=(0.0, 1.0),
            per_device=True,
        ),
        EXPERT_LOAD_IMBALANCE,
    )

    def covers(self, params: Mapping[str, float], device_type: str) -> bool:
        return self.value(params, "enabled", device_type) == 1.0

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        shape, settings = spec.model, kernel_settings(spec, params)
        forward_kernels = layer_forward(shape, settings)
        backward_kernels = layer_backward(shape, settings)
        priced: dict[str, tuple[float, float, float, float, float, float]] = {}
        forward: list[float] = []
        backward: list[float] = []
        weight_grad: list[float] = []
        core: list[float] = []
        forward_floor: list[float] = []
        backward_floor: list[float] = []
        for k, layers in enumerate(context.layout.layers):
            device = context.device_of(k)
            if not self.covers(params, device.type):
                for values in (forward, backward, weight_grad, core, forward_floor, backward_floor):
                    values.append(0.0)
                continue
            if device.type not in priced:
                pricer = pricer_of(spec, device, params)
                launch_ms = self.value(params, "launch_us", device.type) / 1e3
                backward_launch_ms = self.value(params, "backward_launch_us", device.type) / 1e3
                ms = {id(kernel): pricer.price(kernel).ms for kernel in forward_kernels + backward_kernels}
                compute = [kernel for kernel in forward_kernels if kernel.op != COLLECTIVE]
                priced[device.type] = (
                    sum(ms[id(kernel)] for kernel in compute),
                    sum(ms[id(kernel)] for kernel in backward_kernels),
                    sum(ms[id(kernel)] for kernel in backward_kernels if kernel.phase == WGRAD),
                    sum(ms[id(kernel)] for kernel in compute if kernel.core_attention),
                    launch_ms * len(forward_kernels),
                    backward_launch_ms * len(backward_kernels),
                )
            f, b, w, c, ff, bf = priced[device.type]
            launch_ms = self.value(params, "launch_us", device.type) / 1e3
            # selective recomputation's kernels are launched again in the backward (full recomputation's floor is
            # the forward's, which Model.pipeline adds)
            redo = (
                sum(n for kernel, n in recomputed(shape, settings, layers) if kernel.phase == RECOMPUTE)
                if shape.recompute_granularity == "selective"
                else 0
            )
            forward.append(layers * f)
            backward.append(layers * b)
            weight_grad.append(layers * w)
            core.append(layers * c)
            forward_floor.append(layers * ff)
            backward_floor.append(layers * bf + redo * launch_ms)
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            weight_grad_ms=tuple(weight_grad),
            attention_core_ms=tuple(core),
            forward_floor_ms=tuple(forward_floor),
            backward_floor_ms=tuple(backward_floor),
        )
