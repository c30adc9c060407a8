"""Model room: the memory traffic of unfused attention scores in every decoder layer."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.spec import Spec


def softmax_batch_per_block(key_length: int) -> int:
    """Rows (attention batches) one CUDA block of Megatron's fused causal softmax takes: 4 warps of 32 threads,
    two rows per warp up to 128 keys, one beyond (csrc/megatron/scaled_masked_softmax.h, get_batch_per_block)."""
    return 8 if key_length <= 128 else 4


def softmax_fusion_asked(spec: Spec) -> bool:
    """Whether the launch asks for Megatron's fused scale-mask-softmax: masked-softmax fusion on (its default;
    `--no-masked-softmax-fusion` turns it off)."""
    on = spec.megatron_args.get("masked_softmax_fusion")
    if on is None:
        on = not spec.megatron_args.get("no_masked_softmax_fusion", False)
    return bool(on)


def softmax_fused(spec: Spec) -> bool:
    """Whether Megatron runs the attention softmax in its fused scale-mask-softmax kernel: masked-softmax fusion on
    (its default; `--no-masked-softmax-fusion` turns it off), 16-bit inputs and shapes the kernel takes
    (megatron/core/fusions/fused_softmax.py, `is_kernel_available`: 16 < s <= 4096, s a multiple of 4, and the
    attention batches b x np, np the heads PER TENSOR-PARALLEL PARTITION, a multiple of 4 and of the kernel's
    batches per block for the causal mask). Otherwise Megatron falls back to separate scale, mask and softmax
    kernels (`forward_torch_softmax`): at t = 8 with 16 heads and micro batch 1, b x np = 2."""
    shape = spec.model
    s = shape.seq_length
    attention_batches = shape.micro_batch_size * (shape.num_attention_heads // max(1, shape.tensor_parallel))
    return (
        softmax_fusion_asked(spec)
        and shape.precision in ("fp16", "bf16")
        and 16 < s <= 4096
        and s % 4 == 0
        and attention_batches % 4 == 0
        and attention_batches % softmax_batch_per_block(s) == 0
    )


def softmax_fallback(spec: Spec) -> bool:
    """Whether a 16-bit launch asked for the fused softmax (masked-softmax fusion on, Megatron's default) but its
    shape does not fit the kernel (`softmax_fused`), so Megatron runs separate scale, mask and softmax kernels with
    their fp32 casts instead (FusedScaleMaskSoftmax.forward_torch_softmax)."""
    return softmax_fusion_asked(spec) and spec.model.precision in ("fp16", "bf16") and not softmax_fused(spec)


def attention_dropout(spec: Spec) -> float:
    """The launch's attention dropout probability (Megatron's default 0.1 when not given)."""
    value = spec.megatron_args.get("attention_dropout", 0.1)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.1


class AttentionScoreTraffic(Term):
    """Unfused attention writes and re-reads the a x s x s score matrix several times per layer: bytes over bandwidth.

    Physics: `--transformer-impl local` without flash attention materialises the
    attention scores (b·a·s² elements, 16-bit) and, with
    --no-masked-softmax-fusion, scales, masks, softmaxes and drops them out in
    separate kernels, each a full pass over the matrix; backward repeats the
    softmax and dropout gradients. That traffic grows with s², not with the
    GEMMs' FLOPs, and it is what makes long sequences slow on the GDDR6 GPUs
    (A10G, L4): passes × b·a·s²·2 bytes over the device's achieved memory
    bandwidth. The passes can be counted from the code rather than fitted:
    `experiments/scripts/layer_traffic.py` runs a megatron-core layer with the
    cluster runs' flags and adds up every ATen op's reads and writes of the score
    matrix (forward ~6: the GEMM's write, the in-place mask, softmax, the context
    GEMM's read; backward ~18, three times as many: besides the softmax backward
    and the two GEMMs, autograd's handling of the in-place mask on a view of the
    score buffer clones and copies the gradient). Streaming kernels reach a
    fraction of the datasheet bandwidth (`memory_efficiency`).

    With masked-softmax fusion (Megatron's default; the cluster runs turn it
    off) a 16-bit run whose shapes fit the kernel (Megatron's
    FusedScaleMaskSoftmax: 16 < s <= 4096, s and heads x micro batch multiples
    of 4) scales, masks and
    softmaxes in one kernel that reads the scores once and writes the
    probabilities once: forward 4 passes (the score GEMM's write, the kernel's
    read and write, the context GEMM's read), backward 7 (the context GEMM's
    gradient writes the probabilities' gradient and its weight half reads the
    probabilities; the fused softmax backward reads both and writes the score
    gradient; the score GEMM's two gradient products read it), counted from the
    kernels rather than fitted. Attention dropout (--attention-dropout, Megatron's
    default 0.1; every cluster run sets 0) adds a kernel that reads the
    probabilities and writes them and a one-byte mask (2.5 passes of 16-bit
    elements), and its backward reads the gradient and the mask and writes
    (2.5). Hidden dropout acts on s x b x h elements, a·s/h times fewer than the
    scores, and is left to the elementwise term.

    A 16-bit launch that asks for the fused kernel but whose shape does not fit it
    (`softmax_fallback`: b x heads per tensor-parallel GPU not a multiple of 4,
    e.g. t = 8 with 16 heads at micro batch 1) runs Megatron's unfused path
    instead: the unfused passes, and separate cast, scale, mask, softmax and cast
    kernels whose host launches (`fallback_host_ms` per layer and direction) raise
    the layer's launch floor. Launches that turn the fusion off were calibrated
    with those ops in their floors and take nothing extra.
    """

    name = "attention_score_traffic"
    scope = "layers"
    params = (
        Param("passes_forward", 6.0, 0.0, 30.0, "passes", "16-bit passes over the score matrix in a layer's forward"),
        Param("passes_backward", 8.0, 0.0, 40.0, "passes", "16-bit passes over the score matrix in a layer's backward"),
        Param(
            "memory_efficiency",
            1.0,
            0.05,
            1.0,
            "fraction of peak",
            "achieved fraction of the device memory bandwidth in the score passes (streaming kernels reach 0.8-0.9)",
        ),
        Param(
            "fused_passes_forward",
            4.0,
            0.0,
            30.0,
            "passes",
            "16-bit passes over the score matrix in a layer's forward with the fused scale-mask-softmax kernel",
        ),
        Param(
            "fused_passes_backward",
            7.0,
            0.0,
            40.0,
            "passes",
            "16-bit passes over the score matrix in a layer's backward with the fused scale-mask-softmax kernel",
        ),
        Param(
            "dropout_passes_forward",
            2.5,
            0.0,
            10.0,
            "passes",
            "16-bit passes over the score matrix of attention dropout's forward (read, write, one-byte mask)",
        ),
        Param(
            "dropout_passes_backward",
            2.5,
            0.0,
            10.0,
            "passes",
            "16-bit passes over the score matrix of attention dropout's backward (gradient and mask read, write)",
        ),
        Param(
            "fallback_host_ms",
            0.0,
            0.0,
            5.0,
            "ms",
            "host time per layer and direction the unfused softmax's separate ops add when a 16-bit launch's shape "
            "does not fit the fused kernel it asked for (on the launch floor)",
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        if shape.attention_kernel == "flash":  # a fused kernel keeps the scores on chip: no traffic of its own
            return Contribution()
        # a / t heads per GPU of a tensor-parallel group
        score_bytes = (
            shape.micro_batch_size * shape.num_attention_heads * shape.seq_length**2 * gpt.bytes_per_element(shape)
        ) / shape.tensor_parallel
        kind = "fused_passes" if softmax_fused(context.spec) else "passes"
        passes_forward, passes_backward = params[f"{kind}_forward"], params[f"{kind}_backward"]
        if attention_dropout(context.spec) > 0:
            passes_forward += params["dropout_passes_forward"]
            passes_backward += params["dropout_passes_backward"]
        forward, backward = [], []
        for k, layers in enumerate(context.layout.layers):
            bytes_per_ms = context.device_of(k).memory_bandwidth_bytes_per_s * params["memory_efficiency"] / 1e3
            pass_ms = score_bytes / bytes_per_ms
            forward.append(layers * passes_forward * pass_ms)
            backward.append(layers * passes_backward * pass_ms)
        # The fallback's extra ops are host launches: they raise the layers' launch floor (each direction, and the
        # recomputed forward's with it), which binds where the GPU work is short.
        floor = (
            tuple(layers * params["fallback_host_ms"] for layers in context.layout.layers)
            if params["fallback_host_ms"] and softmax_fallback(context.spec)
            else ()
        )
        # Every pass of the forward is the attention core's (selective recomputation redoes them all).
        return Contribution(
            forward_ms=tuple(forward),
            backward_ms=tuple(backward),
            attention_core_ms=tuple(forward),
            forward_floor_ms=floor,
            backward_floor_ms=floor,
        )
