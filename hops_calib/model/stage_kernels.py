"""Model room: the kernels a pipeline stage launches beyond its decoder layers (the first stage's embedding, the
last stage's output layer and loss, the optimizer's passes, FP8 weights and their scaling), and a stage's whole
list (`stage_kernels`). Pure: shapes and settings in, kernels out."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hops_calib.model import gpt
from hops_calib.model.kernel_types import (
    _LINEAR,
    _MAPPINGS,
    _TE_FP8,
    DGRAD,
    FORWARD,
    FP8_BYTES,
    FP32,
    INDEX_BYTES,
    MASK_BYTES,
    RECOMPUTE,
    WGRAD,
    Kernel,
    KernelSettings,
    _Builder,
    _dims,
    _fp8,
)
from hops_calib.model.layer_kernels import _norm, layer_backward, layer_forward, recomputed
from hops_calib.spec import ModelShape


def embedding_kernels(shape: ModelShape, s: KernelSettings) -> tuple[Kernel, ...]:
    """The first stage's input embedding, forward and backward (`VocabParallelEmbedding.forward`,
    `LanguageModelEmbedding.forward`): at t > 1 the out-of-range token mask and its masked input, the lookup of
    s x b rows of the V/t x h table, zeroing the rows another GPU holds, the all-reduce (a reduce-scatter under
    sequence parallelism); learned positions' lookup and add; the [b, s] -> [s, b] copy; embedding dropout. Backward:
    the dense V/t x h gradient (`embedding_dense_backward`: a zero fill and a scatter-add of the token gradients),
    which the DDP hook adds into the fp32 main gradient (the embedding is no linear layer: no fused
    accumulation)."""
    d, b = _dims(shape), _Builder(shape, FORWARD)
    e = b.e
    vocab = gpt.vocab_per_gpu(shape)
    rows = d.tokens * d.h * e
    source = "tensor_parallel/layers.py VocabParallelEmbedding.forward"
    if d.t > 1:
        b.memory("embedding.input_mask", "copy", d.tokens * (2 * INDEX_BYTES + MASK_BYTES), source=source)
        b.memory("embedding.masked_input", "copy", d.tokens * 3 * INDEX_BYTES, source=source)
    b.memory("embedding.lookup", "embedding", 2 * rows + d.tokens * INDEX_BYTES, source=source)
    if d.t > 1:
        b.memory("embedding.mask_rows", "copy", rows, source=source)
        b.collective(
            "embedding." + ("reduce_scatter" if shape.sequence_parallel else "all_reduce"),
            "reduce_scatter" if shape.sequence_parallel else "all_reduce",
            rows,
            source=f"{_MAPPINGS} (VocabParallelEmbedding output)",
        )
    positions = "models/common/embeddings/language_model_embedding.py LanguageModelEmbedding.forward"
    if shape.position_embedding == "learned_absolute":
        b.memory("embedding.position_lookup", "embedding", 2 * rows + d.tokens * INDEX_BYTES, source=positions)
        b.memory("embedding.position_add", "add", 3 * rows, source=positions)
    b.memory("embedding.transpose", "copy", 2 * rows, source=f"{positions} (transpose(0, 1).contiguous())")
    local = d.local * d.h * e
    if s.dropout("hidden"):
        b.memory("embedding.dropout", "dropout", 2 * local + d.local * d.h * MASK_BYTES, source=positions)
    back = _Builder(shape, WGRAD)
    if s.dropout("hidden"):
        back.memory(
            "embedding.dropout_backward",
            "dropout",
            2 * local + d.local * d.h * MASK_BYTES,
            source=positions,
            phase=DGRAD,
        )
    if shape.sequence_parallel and d.t > 1:
        back.collective(
            "embedding.grad_all_gather",
            "all_gather",
            rows,
            source=f"{_MAPPINGS} (reduce-scatter backward)",
            phase=DGRAD,
        )
    dense = "torch embedding_dense_backward (F.embedding's backward)"
    tables = [("word", vocab)] + (
        [("position", shape.seq_length)] if shape.position_embedding == "learned_absolute" else []
    )
    for table, size in tables:
        back.memory(f"embedding.{table}_grad_zero", "fill", size * d.h * e, source=dense)
        back.memory(f"embedding.{table}_grad_scatter", "embedding", 2 * rows + d.tokens * INDEX_BYTES, source=dense)
        back.memory(
            f"embedding.{table}_main_grad_add",
            "add",
            size * d.h * (e + 2 * FP32),
            source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
        )
    return tuple(b.kernels) + tuple(back.kernels)


def output_kernels(shape: ModelShape, s: KernelSettings) -> tuple[Kernel, ...]:
    """The last stage's final norm, output layer and vocabulary-parallel cross entropy, forward and backward.

    `models/gpt/gpt_model.py` `GPTModel._postprocess`: the decoder's final norm, under sequence parallelism the
    all-gather before the column-parallel output layer, the logits GEMM (T x V/t x h, the tied word embedding),
    `tensor_parallel/cross_entropy.py` `_VocabParallelCrossEntropy`: over the T x V/t logits L, the fp32 cast
    (reads 2L bytes, writes 4L), max (reads 4L), three all-reduces of T fp32 values (max, target logit, sum of
    exponentials), subtract, exp and div in place (8L each), sum (4L): 9.5 fp32 passes; backward the `mul_` by the
    loss gradient (8L) and autograd's cast back to 16 bits (6L). The logits' input gradient is all-reduced (a
    reduce-scatter under sequence parallelism); the tied weight's gradient accumulates in the fp32 main gradient."""
    d, b = _dims(shape), _Builder(shape, FORWARD)
    e = b.e
    vocab = gpt.vocab_per_gpu(shape)
    logits = d.tokens * vocab
    hidden = d.tokens * d.h * e
    ce = "tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy"
    te = s.transformer_engine
    _norm(b, "output.final_norm", d, False, te)
    if shape.sequence_parallel:
        b.collective("output.all_gather", "all_gather", hidden, source="tensor_parallel/layers.py ColumnParallelLinear")
    b.gemm(
        "output.logits", d.tokens, vocab, d.h, source="tensor_parallel/layers.py ColumnParallelLinear (output_layer)"
    )
    b.memory("loss.cast_fp32", "copy", logits * (e + FP32), source=f"{ce}.calculate_logits_max (.float())")
    b.memory("loss.max", "max", logits * FP32, source=f"{ce}.calculate_logits_max")
    b.collective("loss.max_all_reduce", "all_reduce", d.tokens * FP32, source=f"{ce}.forward")
    b.memory("loss.subtract_max", "add", 2 * logits * FP32, source=f"{ce}.calculate_predicted_logits")
    b.memory(
        "loss.target_logits",
        "copy",
        d.tokens * (4 * INDEX_BYTES + 3 * FP32),
        source=f"{ce}.calculate_predicted_logits (target mask, gather)",
    )
    b.memory("loss.exp", "exp", 2 * logits * FP32, source=f"{ce}.calculate_predicted_logits")
    b.memory("loss.sum_exp", "sum", logits * FP32, source=f"{ce}.calculate_predicted_logits")
    b.collective("loss.target_all_reduce", "all_reduce", d.tokens * FP32, source=f"{ce}.forward")
    b.collective("loss.sum_all_reduce", "all_reduce", d.tokens * FP32, source=f"{ce}.forward")
    b.memory("loss.log", "copy", 3 * d.tokens * FP32, source=f"{ce}.calculate_cross_entropy_loss")
    b.memory("loss.softmax_div", "div", 2 * logits * FP32, source=f"{ce}.calculate_cross_entropy_loss")
    b.memory("loss.mask_sum", "sum", 3 * d.tokens * FP32, source="pretrain_gpt.py loss_func (masked sum)")
    back = _Builder(shape, DGRAD)
    back.memory("loss.grad_target", "copy", d.tokens * (INDEX_BYTES + 2 * FP32), source=f"{ce}.calculate_gradients")
    back.memory("loss.grad_scale", "mul", 2 * logits * FP32, source=f"{ce}.calculate_gradients (mul_)")
    back.memory("loss.grad_cast", "copy", logits * (FP32 + e), source=f"{ce} (autograd of .float())")
    back.gemm("output.logits.dgrad", d.tokens, d.h, vocab, source=_LINEAR)
    back.gemm(
        "output.logits.wgrad",
        vocab,
        d.h,
        d.tokens,
        source=_LINEAR,
        phase=WGRAD,
        accumulate_fp32=s.gradient_accumulation_fusion,
    )
    if not s.gradient_accumulation_fusion:
        back.memory(
            "output.logits.main_grad_add",
            "add",
            vocab * d.h * (e + 2 * FP32),
            phase=WGRAD,
            source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
        )
    back.collective(
        "output.dgrad_" + ("reduce_scatter" if shape.sequence_parallel else "all_reduce"),
        "reduce_scatter" if shape.sequence_parallel else "all_reduce",
        hidden,
        overlapped=True,
        source=f"{_LINEAR}.backward",
    )
    _norm(back, "output.final_norm", d, True, te)
    return tuple(b.kernels) + tuple(back.kernels)


def optimizer_kernels(shape: ModelShape, parameters: float, shard: int, *, distributed: bool) -> tuple[Kernel, ...]:
    """One optimizer step on a GPU holding `parameters` (its share of the tensor-parallel split), its state split
    `shard` ways (the distributed optimizer's data-parallel replicas). `distributed/param_and_grad_buffer.py`
    zeroes the whole fp32 gradient buffer (4 B per parameter); `optimizer/clip_grads.py`
    `get_grad_norm_fp32` reads the shard's fp32 gradients (4 B); apex/TE `FusedAdam` (`multi_tensor_adam`) reads
    gradient, fp32 parameter, m and v and writes the last three (28 B); `MixedPrecisionOptimizer` copies the fp32
    parameters to the 16-bit model (reads 4, writes 2 B); under fp16 the loss scale's unscale-and-check reads and
    writes the gradients (8 B). The distributed optimizer then all-gathers the 16-bit parameters (the
    data-parallel term's collective, not listed)."""
    b = _Builder(shape, WGRAD)
    own = parameters / max(1, shard)
    source = "optimizer/optimizer.py MixedPrecisionOptimizer.step"
    b.memory("optimizer.zero_grad_buffer", "fill", parameters * FP32, source="distributed/param_and_grad_buffer.py")
    if shape.precision == "fp16":
        b.memory("optimizer.unscale_check_inf", "scale", own * 2 * FP32, source=source)
    b.memory("optimizer.grad_norm", "l2norm", own * FP32, source="optimizer/clip_grads.py get_grad_norm_fp32")
    b.memory("optimizer.adam", "adam", own * 7 * FP32, source=f"{source} (multi_tensor_adam)")
    b.memory("optimizer.copy_to_model", "copy", own * (FP32 + gpt.bytes_per_element(shape)), source=source)
    del distributed  # the step's kernels are the same; the all-gather after it is the data-parallel term's
    return tuple(b.kernels)


def linear_weights(shape: ModelShape) -> tuple[tuple[str, int, int], ...]:
    """(name, out, in) of a decoder layer's four linear weights on one GPU of its tensor-parallel group."""
    d = _dims(shape)
    return (
        ("attention.linear_qkv", d.qkv, d.h),
        ("attention.linear_proj", d.h, d.q),
        ("mlp.linear_fc1", d.ffn * (2 if shape.swiglu else 1), d.h),
        ("mlp.linear_fc2", d.h, d.ffn),
    )


def fp8_weight_kernels(shape: ModelShape, s: KernelSettings) -> tuple[Kernel, ...]:
    """One decoder layer's FP8 weight casts, once per iteration: TE caches a weight's FP8 copy and its transpose
    from the first microbatch on (`extensions/transformer_engine.py` `TELinear.forward` passes `is_first_microbatch`;
    megatron-core sets it True after each optimizer step). A 16-bit weight is cast with its transpose (reads 2 B,
    writes 1 + 1 B); under --fp8-param-gather the weight already is FP8 (the optimizer writes it: `fp8_utils.py`
    `quantize_param_shard`), and only its transpose is made (1 + 1 B). Empty without FP8."""
    if not _fp8(s):
        return ()
    b = _Builder(shape, FORWARD)
    for name, out, inp in linear_weights(shape):
        if s.fp8_param_gather:
            b.memory(f"{name}.fp8_weight_transpose", "transpose", 2 * out * inp * FP8_BYTES, source=_TE_FP8)
        else:
            b.memory(f"{name}.fp8_weight_cast", "cast_transpose", out * inp * (b.e + 2 * FP8_BYTES), source=_TE_FP8)
    return tuple(b.kernels)


AMAX_ENTRY_BYTES = FP32  # one fp32 amax (and scale) per quantized tensor and history slot


def fp8_scaling_kernels(shape: ModelShape, s: KernelSettings, layers: int, history: int = 1) -> tuple[Kernel, ...]:
    """Delayed scaling's bookkeeping for a model chunk of `layers` layers, per microbatch: under delayed scaling
    megatron-core wraps the whole block in one `fp8_autocast` (`transformer/transformer_block.py`
    `TransformerBlock.forward`: `use_outer_quantization_context`), whose exit all-reduces the amaxes over the amax
    reduction group (`fp8_utils.py` `get_fp8_context`: `get_amax_reduction_group(with_context_parallel=True)`,
    data x tensor x context parallel) and updates every scale in one fused kernel (TE's
    `amax_and_scale_update`); the same after the backward. Forward: three quantized tensors per GEMM (input,
    weight, output), backward two (output gradient, input gradient), `history` slots each (--fp8-amax-history-len).
    Empty without FP8 or for another recipe."""
    if not _fp8(s) or s.fp8_recipe != "delayed" or not layers:
        return ()
    b = _Builder(shape, FORWARD)
    gemms = len(linear_weights(shape)) * layers
    for phase, tensors in ((FORWARD, 3), (DGRAD, 2)):
        entries = gemms * tensors * (history + 2)  # the amax history, the scale and its inverse
        b.collective(
            f"fp8.amax_all_reduce.{phase}",
            "all_reduce",
            gemms * tensors * AMAX_ENTRY_BYTES,
            phase=phase,
            group="dp_cp",
            dtype="fp32",
            source="fp8_utils.py get_fp8_context (fp8_autocast's fp8_group)",
        )
        b.memory(
            f"fp8.amax_and_scale_update.{phase}", "amax", 2 * entries * AMAX_ENTRY_BYTES, phase=phase, source=_TE_FP8
        )
    return tuple(b.kernels)


@dataclass(frozen=True)
class StageKernels:
    """What one virtual stage launches per microbatch: (kernel, count) rows, the per-layer lists kept apart."""

    layers: int
    layer: tuple[Kernel, ...]  # one layer's forward and backward
    recompute: tuple[tuple[Kernel, int], ...]
    ends: tuple[Kernel, ...]  # the embedding (first stage) and the output layer and loss (last stage)

    def rows(self) -> tuple[tuple[Kernel, int], ...]:
        return tuple((k, self.layers) for k in self.layer) + self.recompute + tuple((k, 1) for k in self.ends)


def stage_kernels(shape: ModelShape, s: KernelSettings, layers: int, *, first: bool, last: bool) -> StageKernels:
    """The kernels of a virtual stage with `layers` decoder layers, per microbatch (`first`: it holds the
    embedding; `last`: the output layer and loss)."""
    ends = (
        (embedding_kernels(shape, s) if first else ())
        + (output_kernels(shape, s) if last else ())
        + fp8_scaling_kernels(shape, s, layers)
    )
    return StageKernels(
        layers=layers,
        layer=(layer_forward(shape, s) + layer_backward(shape, s)) if layers else (),
        recompute=recomputed(shape, s, layers) if layers else (),
        ends=ends,
    )


def total_model_flops(rows: Iterable[tuple[Kernel, int]]) -> float:
    """Megatron-counted FLOPs of (kernel, count) rows, recomputation left out (as Megatron's count leaves it)."""
    return sum(k.model_flops * n for k, n in rows if k.phase != RECOMPUTE)
