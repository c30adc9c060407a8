"""Model room: a Megatron GPT training step as the kernels it launches, counted from megatron-core's own code.

Pure: shapes and settings in, kernels out (no device, no time: `hops_calib.model.kernel_pricing` prices them).
Every count is per microbatch and per GPU of a tensor-parallel group (t GPUs), for the megatron-core 0.16 code
installed as the optional extra (paths below are relative to `megatron/core/`):

- the layer: `transformer/transformer_layer.py` `TransformerLayer._forward_attention` / `_forward_mlp` (input
  norm, self-attention, bias-dropout-add, pre-MLP norm, MLP, bias-dropout-add) with the local spec
  (`models/gpt/gpt_layer_specs.py` `get_gpt_layer_local_spec`: separate norms, `ColumnParallelLinear`,
  `DotProductAttention`, `RowParallelLinear`) or the Transformer Engine spec
  (`get_gpt_layer_with_transformer_engine_spec`: the norms fused into `TELayerNormColumnParallelLinear`,
  `TEDotProductAttention`, `TERowParallelLinear`; `extensions/transformer_engine.py`);
- the linear layers: `tensor_parallel/layers.py` `LinearWithGradAccumulationAndAsyncCommunication` (forward
  `matmul` then a separate bias `add` in the local layer; backward the input gradient, its asynchronous
  all-reduce or reduce-scatter, under sequence parallelism a second all-gather of the input for the weight
  gradient, the weight gradient into the fp32 `main_grad` by `wgrad_gemm_accum_fp32` with
  gradient-accumulation fusion, else a bf16 gradient the DDP hook adds into `main_grad`:
  `distributed/distributed_data_parallel.py` `_make_backward_post_hook`), `ColumnParallelLinear` /
  `RowParallelLinear` (`skip_bias_add` hands the bias on to the fused bias-GeLU/SwiGLU and bias-dropout-add);
- core attention: `transformer/dot_product_attention.py` `DotProductAttention.forward` (GQA `repeat_interleave`,
  `baddbmm` scores with the softmax scale as alpha, `FusedScaleMaskSoftmax`, attention dropout, `bmm` context,
  `permute(...).contiguous()`), `fusions/fused_softmax.py` (`ScaledUpperTriangMaskedSoftmax` when
  `is_kernel_available`, else `forward_torch_softmax`: in-place `masked_fill_` then `torch.softmax`), or one fused
  (flash / cuDNN) kernel in TE's `DotProductAttention`;
- `fusions/fused_bias_dropout.py` `_bias_dropout_add_func`, `fusions/fused_bias_gelu.py`,
  `fusions/fused_bias_swiglu.py`, `models/common/embeddings/rope_utils.py` (`_apply_rotary_pos_emb_bshd`, or TE's
  fused RoPE), `models/common/embeddings/language_model_embedding.py` and `tensor_parallel/layers.py`
  `VocabParallelEmbedding.forward`, `tensor_parallel/cross_entropy.py` `_VocabParallelCrossEntropy` (fp32 cast,
  max, subtract, exp, sum, div; backward `mul_` and the cast back), the optimizer's multi-tensor passes
  (`optimizer/optimizer.py` `MixedPrecisionOptimizer`: gradient norm, Adam, copy of the fp32 main parameters to
  the 16-bit model; `distributed/param_and_grad_buffer.py` zeroes the gradient buffer each iteration).

GEMMs are written C[M, N] = A[M, K] B[K, N] (times `batch` for a batched GEMM): forward Y[T, out] = X[T, in] W^T;
input gradient dX[T, in] = dY[T, out] W; weight gradient dW[out, in] = dY^T X over the T tokens. Bytes are what a
kernel reads plus what it writes, once each (a kernel's own traffic, no cache reuse between kernels).
`flops` are the FLOPs a kernel executes; `model_flops` those Megatron's `num_floating_point_operations` counts
(`megatron_flops`): the same for every GEMM, half of the full score and context products for causal attention
("only half of the attention matrix is non-zero"), and the forward's count twice in a backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hops_calib.model import gpt
from hops_calib.spec import ModelShape

FORWARD, DGRAD, WGRAD, RECOMPUTE = "forward", "dgrad", "wgrad", "recompute"
PHASES = (FORWARD, DGRAD, WGRAD, RECOMPUTE)
GEMM, ATTENTION, MEMORY, COLLECTIVE = "gemm", "attention", "memory", "collective"
FP32 = 4
FP8_BYTES = 1  # an FP8 element (E4M3 or E5M2)
MASK_BYTES = 1  # a dropout or attention mask element (torch.bool / uint8)
INDEX_BYTES = 8  # token ids and positions (int64)
# Flash attention's rows per thread block: the causal kernel runs the diagonal blocks whole, so it executes
# (1 + FLASH_BLOCK / s) times the causal half of the score and context products (FlashAttention-2, Dao 2023,
# sec. 3.1: blocks of 128 queries on A100/H100).
FLASH_BLOCK = 128
# Flash attention's backward runs five products to the forward's two (it recomputes the scores; FlashAttention-2,
# Dao 2023, sec. 3.1.2, Algorithm 2): 2.5 x the forward's FLOPs, where Megatron counts 2 x.
FLASH_BACKWARD_PRODUCTS = 2.5


@dataclass(frozen=True)
class Kernel:
    """One kernel (or one collective) a training step launches: what it computes and moves."""

    name: str  # module and operation, e.g. "attention.linear_qkv" or "mlp.bias_gelu"
    op: str  # GEMM, ATTENTION (a fused flash kernel), MEMORY (a memory-bound kernel) or COLLECTIVE
    phase: str  # FORWARD, DGRAD (the input gradient), WGRAD (the weight gradient) or RECOMPUTE
    kind: str = ""  # MEMORY: the memory table's kernel (copy, add, layernorm, softmax, gelu...); COLLECTIVE: its op
    dtype: str = ""
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0  # read + written; a collective's: the whole buffer (an all-gather's output)
    group: str = ""  # COLLECTIVE: "tp"
    core_attention: bool = False  # part of the attention core (`--recompute-granularity selective` redoes it)
    overlapped: bool = False  # COLLECTIVE: asynchronous, under the weight-gradient GEMM launched after it
    source: str = ""  # the megatron-core file and function that launches it

    @property
    def shape(self) -> str:
        if self.op in (GEMM, ATTENTION):
            return (f"{self.batch} x " if self.batch > 1 else "") + f"{self.m} x {self.n} x {self.k}"
        return ""


@dataclass(frozen=True)
class KernelSettings:
    """The launch settings that decide which kernels a layer launches (Megatron-LM's argument defaults)."""

    transformer_engine: bool = True  # --transformer-impl transformer_engine (default) or local
    softmax_fused: bool = True  # the fused scale-mask-softmax kernel runs (asked for and the shape fits it)
    bias: bool = True  # --disable-bias-linear turns the linear layers' biases off
    bias_activation_fusion: bool = True  # --no-bias-gelu-fusion / --no-bias-swiglu-fusion
    bias_dropout_fusion: bool = True  # --no-bias-dropout-fusion
    rope_fusion: bool = True  # --no-rope-fusion
    gradient_accumulation_fusion: bool = True  # --no-gradient-accumulation-fusion
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    softmax_in_fp32: bool = False  # --attention-softmax-in-fp32
    # FP8 through Transformer Engine (`transformer/transformer_config.py` fp8, fp8_recipe, fp8_param, fp8_wgrad):
    # "" (16-bit GEMMs), "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3"; the recipe: "delayed" (Megatron's
    # default), "tensorwise" (current scaling) or "blockwise"
    fp8: str = ""
    fp8_recipe: str = "delayed"
    fp8_param_gather: bool = False  # --fp8-param-gather: the model's weights kept in FP8, all-gathered in FP8
    fp8_wgrad: bool = True  # --no-fp8-wgrad: the weight gradient in 16 bits
    cp_comm_type: str = "p2p"  # --cp-comm-type p2p|a2a|allgather (context parallelism's exchange)

    def dropout(self, which: str) -> bool:
        return (self.hidden_dropout if which == "hidden" else self.attention_dropout) > 0


def _flag(args: Mapping[str, Any], name: str, default: bool) -> bool:
    """A switch under its own name (a rank log's arguments block) or as --no-NAME (a command line)."""
    if name in args and args[name] is not None:
        return bool(args[name])
    if f"no_{name}" in args:
        return not bool(args[f"no_{name}"])
    return default


def _probability(args: Mapping[str, Any], name: str) -> float:
    value = args.get(name, 0.1)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.1


FP8_RECIPES = ("delayed", "tensorwise", "blockwise")  # the recipes priced (mxfp8 is Blackwell's; custom is code)


def fp8_format(args: Mapping[str, Any]) -> str:
    """The launch's FP8 format: `--fp8-format hybrid|e4m3` (`args.fp8`), Megatron-LM's older `--fp8-hybrid` /
    `--fp8-e4m3`, else "" (no FP8)."""
    for key in ("fp8", "fp8_format"):
        value = args.get(key)
        if isinstance(value, str) and value:
            return value
    if args.get("fp8_hybrid"):
        return "hybrid"
    if args.get("fp8_e4m3"):
        return "e4m3"
    return ""


def settings_from_args(args: Mapping[str, Any], *, softmax_fused: bool,
                       gradient_accumulation_fusion: bool) -> KernelSettings:
    """The kernel settings of a launch's arguments (Megatron's `args.` spelling), Megatron-LM's defaults where a
    setting is absent (`megatron/training/arguments.py`: --transformer-impl transformer_engine, the bias, bias-GeLU,
    bias-SwiGLU, bias-dropout and RoPE fusions on, dropouts 0.1). Whether the fused softmax runs and whether weight
    gradients accumulate in the GEMM are decided by the attention and elementwise terms' readers
    (`terms.attention.softmax_fused`, `terms.elementwise.gradient_accumulation_fused`), passed in."""
    return KernelSettings(
        transformer_engine=str(args.get("transformer_impl", "transformer_engine")) == "transformer_engine",
        softmax_fused=softmax_fused,
        bias=not bool(args.get("disable_bias_linear")) and _flag(args, "add_bias_linear", True),
        bias_activation_fusion=_flag(args, "bias_swiglu_fusion" if args.get("swiglu") else "bias_gelu_fusion", True),
        bias_dropout_fusion=_flag(args, "bias_dropout_fusion", True),
        rope_fusion=_flag(args, "apply_rope_fusion", True) and not bool(args.get("no_rope_fusion")),
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        hidden_dropout=_probability(args, "hidden_dropout"),
        attention_dropout=_probability(args, "attention_dropout"),
        softmax_in_fp32=bool(args.get("attention_softmax_in_fp32")),
        fp8=fp8_format(args),
        fp8_recipe=str(args.get("fp8_recipe") or "delayed"),
        fp8_param_gather=bool(args.get("fp8_param_gather")),
        fp8_wgrad=_flag(args, "fp8_wgrad", True),
        cp_comm_type=_cp_comm_type(args),
    )


def _cp_comm_type(args: Mapping[str, Any]) -> str:
    """--cp-comm-type (a list, one per layer, in Megatron-LM; one value for all layers is what is priced)."""
    value = args.get("cp_comm_type") or "p2p"
    return str(value[0] if isinstance(value, list) and value else value)


class _Builder:
    """Collects the kernels of one phase with the shape's element size and dtype."""

    def __init__(self, shape: ModelShape, phase: str) -> None:
        self.shape, self.phase = shape, phase
        self.e = gpt.bytes_per_element(shape)
        self.dtype = shape.precision
        self.kernels: list[Kernel] = []

    def gemm(self, name: str, m: int, n: int, k: int, *, batch: int = 1, source: str, accumulate_fp32: bool = False,
             core: bool = False, model_share: float = 1.0, phase: str | None = None, fp8: bool = False) -> None:
        """A GEMM of (m x k) by (k x n): 2mnk FLOPs (x batch); reads A and B, writes C (with `accumulate_fp32`,
        reads and writes the fp32 main gradient instead: `wgrad_gemm_accum_fp32`). `model_share`: the part of
        its FLOPs Megatron's count credits (1/2 for the causal score and context products). `fp8`: A and B in FP8
        (one byte each), C in the training precision (TE's FP8 GEMM, `te.cpp_extensions.general_gemm`)."""
        flops = 2.0 * batch * m * n * k
        out = 2 * FP32 if accumulate_fp32 else self.e
        operand = FP8_BYTES if fp8 else self.e
        self.kernels.append(Kernel(name, GEMM, phase or self.phase, dtype="fp8" if fp8 else self.dtype, m=m, n=n, k=k,
                                   batch=batch, flops=flops, model_flops=flops * model_share,
                                   bytes=float(batch * (m * k + k * n) * operand + batch * m * n * out),
                                   core_attention=core, source=source))

    def memory(self, name: str, kind: str, nbytes: float, *, source: str, core: bool = False,
               phase: str | None = None) -> None:
        self.kernels.append(Kernel(name, MEMORY, phase or self.phase, kind=kind, dtype=self.dtype,
                                   bytes=float(nbytes), core_attention=core, source=source))

    def collective(self, name: str, op: str, nbytes: float, *, source: str, overlapped: bool = False,
                   phase: str | None = None, group: str = "tp", dtype: str = "") -> None:
        if group != "tp" or max(1, self.shape.tensor_parallel) > 1:
            self.kernels.append(Kernel(name, COLLECTIVE, phase or self.phase, kind=op, dtype=dtype or self.dtype,
                                       bytes=float(nbytes), group=group, overlapped=overlapped, source=source))


@dataclass(frozen=True)
class _Dims:
    """A layer's sizes on one GPU of its tensor-parallel group."""

    t: int
    tokens: int  # s x b: the tokens a GEMM sees (whole sequences, gathered under sequence parallelism)
    local: int  # the tokens the norms, dropouts and residuals see (s x b / t under sequence parallelism)
    h: int
    head: int  # kv_channels: h / a
    heads: int  # a / t
    groups: int  # g / t
    ffn: int  # f / t
    s: int  # the whole sequence (the keys a query attends to)
    b: int
    cp: int = 1  # context-parallel GPUs: each holds s / cp of every sequence's tokens

    @property
    def q(self) -> int:
        return self.heads * self.head

    @property
    def kv(self) -> int:
        return self.groups * self.head

    @property
    def qkv(self) -> int:
        return self.q + 2 * self.kv


def _dims(shape: ModelShape) -> _Dims:
    t = max(1, int(shape.tensor_parallel))
    tokens = gpt.local_tokens(shape)  # s / cp x b under context parallelism
    return _Dims(t=t, tokens=tokens, local=tokens // t if shape.sequence_parallel else tokens,
                 h=shape.hidden_size, head=shape.hidden_size // shape.num_attention_heads,
                 heads=shape.num_attention_heads // t, groups=shape.kv_heads // t, ffn=shape.ffn_hidden_size // t,
                 s=shape.seq_length, b=shape.micro_batch_size, cp=max(1, int(shape.context_parallel)))


_LINEAR = "tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication"
_TE_LINEAR = "extensions/transformer_engine.py TELayerNormColumnParallelLinear / TERowParallelLinear (TE GEMM)"
_LAYER = "transformer/transformer_layer.py TransformerLayer"
_CORE = "transformer/dot_product_attention.py DotProductAttention.forward"
_SOFTMAX = "fusions/fused_softmax.py FusedScaleMaskSoftmax"
_BDA = "fusions/fused_bias_dropout.py _bias_dropout_add_func"
_ROPE = "models/common/embeddings/rope_utils.py apply_rotary_pos_emb"
_MAPPINGS = "tensor_parallel/mappings.py"
_LAYER_TRAFFIC = "experiments/scripts/layer_traffic.py (ATen ops of the local layer, counted)"


def _norm(b: _Builder, name: str, d: _Dims, backward: bool, te: bool, fp8_out: bool = False) -> None:
    """LayerNorm or RMSNorm over the local tokens: forward reads x and writes y and the fp32 statistics (mean and
    rstd; rstd only for RMSNorm); backward reads dy, x and the statistics and writes dx, then reduces the
    weight's (and bias's) per-block partial gradients. `fp8_out`: TE's norm writes y in FP8 (`_fp8_norm_fused`)."""
    shape = b.shape
    rms = shape.normalization == "RMSNorm"
    kind = "rmsnorm" if rms else "layernorm"
    stats = d.local * FP32 * (1 if rms else 2)
    source = ("extensions/transformer_engine.py TELayerNormColumnParallelLinear (TE's norm kernel)" if te
              else f"{_LAYER} (the spec's norm: FusedLayerNorm / WrappedTorchNorm)")
    act = d.local * d.h * b.e
    if not backward:
        b.memory(f"{name}", kind, act + (d.local * d.h * FP8_BYTES if fp8_out else act) + stats, source=source)
        return
    b.memory(f"{name}.backward", kind, 3 * act + stats, source=source)
    blocks = d.local // FLASH_BLOCK + 1  # the partial weight gradients, one row per block of tokens, reduced
    b.memory(f"{name}.weight_grad_reduce", "sum", (1 if rms else 2) * (blocks + 1) * d.h * FP32, source=source,
             phase=WGRAD)


def _bias_dropout_add(b: _Builder, name: str, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """Bias-dropout-add after a row-parallel layer (`_bias_dropout_add_func`): x + bias, dropout, + residual, on
    the local tokens. Fused (`bias_dropout_add_fused_train`, one jit kernel) or as separate ops; dropout at p = 0 is
    no kernel. Backward: the dropout mask's product (p > 0) and the bias gradient (a sum over tokens); the residual's
    gradient is the output's (no kernel)."""
    act = d.local * d.h * b.e
    drop = s.dropout("hidden")
    if not backward:
        if s.bias_dropout_fusion:
            b.memory(f"{name}", "bias_dropout_add", 3 * act + (d.local * d.h * MASK_BYTES if drop else 0), source=_BDA)
            return
        if s.bias:
            b.memory(f"{name}.bias_add", "add", 2 * act, source=_BDA)
        if drop:
            b.memory(f"{name}.dropout", "dropout", 2 * act + d.local * d.h * MASK_BYTES, source=_BDA)
        b.memory(f"{name}.residual_add", "add", 3 * act, source=_BDA)
        return
    if drop:
        b.memory(f"{name}.dropout_backward", "dropout", 2 * act + d.local * d.h * MASK_BYTES, source=_BDA)
    if s.bias:
        b.memory(f"{name}.bias_grad", "sum", act, source=_BDA, phase=WGRAD)


def _residual_grad(b: _Builder, name: str, d: _Dims) -> None:
    """Autograd adds the two gradients of a residual stream's input (through the residual and through the norm)."""
    b.memory(name, "add", 3 * d.local * d.h * b.e, source=f"{_LAYER} (autograd accumulates the residual's gradient)")


def _rope(b: _Builder, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """Rotary embeddings on q and k. Fused (TE's `fused_apply_rotary_pos_emb`, Transformer Engine layer): one kernel
    each that reads and writes the tensor. Unfused (`_apply_rotary_pos_emb_bshd`: t * cos + rotate_half(t) * sin,
    rotate_half = cat(-x2, x1), then cat with the unrotated part): neg, cat, two muls, add, cat forward, 12 passes;
    backward two muls, neg, cat, add, 10 passes."""
    if b.shape.position_embedding != "rope":
        return
    for tensor, width in (("q", d.q), ("k", d.kv)):
        one = d.tokens * width * b.e
        if s.rope_fusion and s.transformer_engine:
            b.memory(f"attention.rope_{tensor}" + (".backward" if backward else ""), "rope", 2 * one, source=_ROPE)
            continue
        ops = (("mul_sin", 2), ("mul_cos", 2), ("neg", 1), ("cat", 2), ("add", 3)) if backward else (
            ("neg", 1), ("cat", 2), ("mul_cos", 2), ("mul_sin", 2), ("add", 3), ("cat_pass", 2))
        for op, passes in ops:
            b.memory(f"attention.rope_{tensor}.{op}" + (".backward" if backward else ""), "rope", passes * one,
                     source=_ROPE)


def _core_attention(b: _Builder, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """The attention core: scores, softmax, dropout and context, for a / t heads of s x s.

    Flash (TE's fused attention, or the local layer's --use-flash-attn): one kernel forward (reads q, k, v, writes
    the output and the fp32 log-sum-exp), a preprocessing pass and one kernel backward. Unfused
    (`DotProductAttention`): GQA's `repeat_interleave` of k and v, the `baddbmm` scores (beta 0: C not read), the
    softmax (fused: one kernel reading the scores and writing the probabilities, backward reading both and writing
    the gradient; unfused: `masked_fill_` in place then `softmax`, and in the backward the softmax gradient plus
    the ops autograd's CopySlices runs for the in-place mask on a view of the score buffer: a zero fill, three
    copies, a clone and the out-of-place mask, as counted op by op), attention dropout (p > 0), the `bmm` context
    and its `permute().contiguous()`."""
    shape, e = b.shape, b.e
    causal = 0.5  # Megatron's count: only the lower triangle of the causal scores is multiplied
    batch = d.b * d.heads
    lse = batch * d.s * FP32
    if d.cp > 1:
        _context_parallel_attention(b, d, s, backward)
        return
    if shape.attention_kernel == "flash":
        full = 4.0 * batch * d.s * d.s * d.head
        executed = full * causal * (1 + min(FLASH_BLOCK, d.s) / d.s)
        qkv_bytes = d.tokens * d.qkv * e
        out_bytes = d.tokens * d.q * e
        source = "extensions/transformer_engine.py TEDotProductAttention (flash / cuDNN fused attention)"
        if not backward:
            b.kernels.append(Kernel("attention.core_flash", ATTENTION, b.phase, dtype=b.dtype, m=d.s, n=d.s,
                                    k=d.head, batch=batch, flops=executed, model_flops=full * causal,
                                    bytes=float(qkv_bytes + out_bytes + lse), core_attention=True, source=source))
            return
        b.memory("attention.core_flash.backward_preprocess", "sum", 2 * out_bytes + lse, source=source)
        b.kernels.append(Kernel("attention.core_flash.backward", ATTENTION, b.phase, dtype=b.dtype, m=d.s, n=d.s,
                                k=d.head, batch=batch, flops=executed * FLASH_BACKWARD_PRODUCTS,
                                model_flops=2 * full * causal,
                                bytes=float(2 * qkv_bytes + 2 * out_bytes + lse + d.tokens * d.q * 2 * FP32),
                                source=source))
        return
    scores = batch * d.s * d.s * e
    mask = d.s * d.s * MASK_BYTES
    score_fp32 = batch * d.s * d.s * FP32
    repeat = d.heads // max(1, d.groups)
    if not backward:
        if repeat > 1:
            for tensor in ("k", "v"):
                b.memory(f"attention.repeat_{tensor}", "copy", d.tokens * (d.kv + d.q) * e, source=_CORE, core=True)
        b.gemm("attention.scores", d.s, d.s, d.head, batch=batch, source=f"{_CORE} (baddbmm)", core=True,
               model_share=causal)
        if s.softmax_fused:
            b.memory("attention.softmax", "softmax", 2 * scores, source=f"{_SOFTMAX} (ScaledUpperTriangMaskedSoftmax)",
                     core=True)
        else:
            if s.softmax_in_fp32:
                b.memory("attention.softmax_cast", "copy", scores + score_fp32, source=_SOFTMAX, core=True)
            width = score_fp32 if s.softmax_in_fp32 else scores
            b.memory("attention.mask", "masked_fill", 2 * width + mask, source=f"{_SOFTMAX}.forward_torch_softmax",
                     core=True)
            b.memory("attention.softmax", "softmax", 2 * width, source=f"{_SOFTMAX}.forward_torch_softmax", core=True)
            if s.softmax_in_fp32:
                b.memory("attention.softmax_cast_back", "copy", scores + score_fp32, source=_SOFTMAX, core=True)
        if s.dropout("attention"):
            b.memory("attention.dropout", "dropout", 2 * scores + batch * d.s * d.s * MASK_BYTES, source=_CORE,
                     core=True)
        b.gemm("attention.context", d.s, d.head, d.s, batch=batch, source=f"{_CORE} (bmm)", core=True,
               model_share=causal)
        b.memory("attention.context_layout", "copy", 2 * d.tokens * d.q * e, source=f"{_CORE} (permute().contiguous())",
                 core=True)
        return
    # backward, in autograd's order: the context product's two gradients, dropout, softmax, the scores' two
    b.gemm("attention.context.grad_probs", d.s, d.s, d.head, batch=batch, source=f"{_CORE} (bmm backward)",
           model_share=causal)
    b.gemm("attention.context.grad_value", d.s, d.head, d.s, batch=batch, source=f"{_CORE} (bmm backward)",
           model_share=causal)
    if s.dropout("attention"):
        b.memory("attention.dropout_backward", "dropout", 2 * scores + batch * d.s * d.s * MASK_BYTES, source=_CORE)
    if s.softmax_fused:
        b.memory("attention.softmax_backward", "softmax", 3 * scores, source=f"{_SOFTMAX} (fused backward)")
    else:
        width = score_fp32 if s.softmax_in_fp32 else scores
        source = f"{_SOFTMAX}.forward_torch_softmax backward, {_LAYER_TRAFFIC}"
        b.memory("attention.softmax_backward", "softmax", 3 * width, source=source)
        b.memory("attention.mask_backward.zero_fill", "copy", width, source=source)
        for copy in range(3):
            b.memory(f"attention.mask_backward.copy_{copy + 1}", "copy", 2 * width, source=source)
        b.memory("attention.mask_backward.clone", "copy", 2 * width, source=source)
        b.memory("attention.mask_backward", "masked_fill", 2 * width + mask, source=source)
    b.gemm("attention.scores.grad_query", d.s, d.head, d.s, batch=batch, source=f"{_CORE} (baddbmm backward)",
           model_share=causal)
    b.gemm("attention.scores.grad_key", d.s, d.head, d.s, batch=batch, source=f"{_CORE} (baddbmm backward)",
           model_share=causal)
    for tensor, width in (("q", d.q), ("k", d.q)):  # alpha's gradient, on the repeated keys' gradient before the sum
        b.memory(f"attention.scale_grad_{tensor}", "scale", 2 * d.tokens * width * e, source=f"{_CORE} (baddbmm alpha)")
    if repeat > 1:
        for tensor in ("k", "v"):
            b.memory(f"attention.repeat_{tensor}.backward", "sum", d.tokens * (d.q + d.kv) * e, source=_CORE)


_TE_FP8 = "transformer_engine/pytorch/module (TE's quantizers under fp8_autocast; megatron-core fp8_utils.py get_fp8_context)"


def _fp8(s: KernelSettings) -> bool:
    """The linear layers' GEMMs run in FP8: --fp8-format with the Transformer Engine layer (`fp8_utils.py`
    `get_fp8_context` wraps the TE modules in `fp8_autocast`; the local layer has no FP8 path)."""
    return bool(s.fp8) and s.transformer_engine


def _fp8_norm_fused(s: KernelSettings) -> bool:
    """Under delayed scaling TE's `LayerNormLinear` has its norm kernel write the FP8 input directly (the scale is
    last step's); current (tensorwise) and blockwise scaling need the tensor's amax first, so the norm writes 16 bits
    and the input is quantized after it."""
    return _fp8(s) and s.fp8_recipe == "delayed"


def _fp8_quantize(b: _Builder, name: str, elements: int, s: KernelSettings, phase: str | None = None) -> None:
    """A 16-bit tensor quantized to FP8 for a GEMM, with its transpose (Hopper's FP8 GEMM takes only the TN layout,
    so the weight gradient needs X^T and dY^T in FP8: TE's `cast_transpose`, reads 2 B, writes 1 + 1 B per element).
    Tensorwise (current) scaling first reads the tensor for its amax (`Float8CurrentScalingQuantizer`); delayed
    scaling uses the amax history's scale; blockwise computes each block's scale inside the cast."""
    if s.fp8_recipe == "tensorwise":
        b.memory(f"{name}.amax", "amax", elements * b.e, source=_TE_FP8, phase=phase)
    b.memory(name, "cast_transpose", elements * (b.e + 2 * FP8_BYTES), source=_TE_FP8, phase=phase)


_TE_CP = "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py"
CP_COMM_TYPES = ("p2p", "a2a", "allgather")


def _context_parallel_attention(b: _Builder, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """The attention core under context parallelism (megatron-core hands TE's `DotProductAttention` its cp group and
    `cp_comm_type`: `extensions/transformer_engine.py` `TEDotProductAttention.__init__`; TE's
    `attn_forward_func_with_cp`). Each GPU holds s / cp tokens of every sequence as two chunks of c = s / 2cp
    (chunks i and 2cp - 1 - i: `megatron/core/utils.py` `get_batch_on_this_cp_rank`), so every GPU does 1/cp of the
    causal work: s^2 / 2cp score entries (Megatron's count), executed as flash blocks (the diagonal's whole blocks
    on its own chunks).

    p2p (`AttnFuncWithCPAndKVP2P`, the default): cp steps; step 0 its own KV (two causal blocks and one full one),
    each later step the KV chunk the ring brought (two full c x c blocks), 2c^2 entries a step. While a step runs,
    the next KV chunk (k and v of its s / cp tokens) is sent on around the ring (cp - 1 exchanges, overlapped with
    the step's attention), and each step's partial output is merged by its log-sum-exp (a correction kernel).
    Backward: the same cp steps, the KV and its gradient sent around together (cp - 1 exchanges of twice the bytes).
    a2a (`AttnFuncWithCPAndQKVOA2A`, DeepSpeed-Ulysses): q, k, v all-to-all'd from a sequence split to a head split,
    one flash kernel over the whole sequence on a / (t cp) heads, the output all-to-all'd back; backward the output
    gradient and the q, k, v gradients likewise; not overlapped. allgather (`AttnFuncWithCPAndKVAllGather`): the KV
    all-gathered over the group, the two query chunks against the keys before them, the KV gradient
    reduce-scattered back."""
    e, cp = b.e, d.cp
    batch = d.b * d.heads
    chunk = d.s // (2 * cp)
    per_entry = 4.0 * batch * d.head  # score and context products, 2 FLOPs a multiply-add each
    kv_bytes = 2 * d.tokens * d.kv * e  # k and v of the GPU's s / cp tokens
    q_bytes, out_bytes = d.tokens * d.q * e, d.tokens * d.q * e
    lse = batch * (d.s // cp) * FP32
    comm = s.cp_comm_type
    step_model = 2.0 * chunk * chunk * per_entry  # Megatron's count per step: 2c^2 entries
    diagonal = float(min(FLASH_BLOCK, chunk) * chunk) * per_entry  # step 0's causal blocks run their diagonal whole
    functions = {"p2p": "AttnFuncWithCPAndKVP2P", "a2a": "AttnFuncWithCPAndQKVOA2A",
                 "allgather": "AttnFuncWithCPAndKVAllGather"}
    source = f"{_TE_CP} ({functions.get(comm, comm)})"
    factor, model_factor = (FLASH_BACKWARD_PRODUCTS, 2.0) if backward else (1.0, 1.0)
    name = "attention.core_flash" + (".backward" if backward else "")
    if backward:
        b.memory("attention.core_flash.backward_preprocess", "sum", 2 * out_bytes + lse, source=source)
    if comm == "a2a":
        tag = "backward" if backward else "forward"
        b.collective(f"attention.cp_a2a_{'grad_output' if backward else 'qkv'}", "all_to_all",
                     out_bytes if backward else q_bytes + kv_bytes, group="cp", source=source)
        heads = batch // cp
        full = 4.0 * heads * d.head * d.s * d.s
        b.kernels.append(Kernel(name, ATTENTION, b.phase, dtype=b.dtype, m=d.s, n=d.s, k=d.head, batch=heads,
                                flops=full * 0.5 * (1 + min(FLASH_BLOCK, d.s) / d.s) * factor,
                                model_flops=full * 0.5 * model_factor, bytes=float(2 * (q_bytes + kv_bytes)),
                                core_attention=not backward, source=source))
        b.collective(f"attention.cp_a2a_{'grad_qkv' if backward else 'output'}", "all_to_all",
                     q_bytes + kv_bytes if backward else out_bytes, group="cp", source=f"{source} ({tag})")
        return
    if comm == "allgather":
        if not backward:
            b.collective("attention.cp_kv_all_gather", "all_gather", kv_bytes * cp, group="cp", source=source)
        flops = (cp * step_model + diagonal) * factor
        b.kernels.append(Kernel(name, ATTENTION, b.phase, dtype=b.dtype, m=d.s // cp, n=d.s, k=d.head, batch=batch,
                                flops=flops, model_flops=cp * step_model * model_factor,
                                bytes=float(q_bytes + kv_bytes * cp + out_bytes + lse), core_attention=not backward,
                                source=source))
        if backward:
            b.collective("attention.cp_kv_grad_reduce_scatter", "reduce_scatter", kv_bytes * cp, group="cp",
                         source=source)
        return
    for step in range(cp):
        if step < cp - 1:  # the next step's KV (with its gradient in the backward) travels under this step
            b.collective(f"attention.cp_kv_exchange.step{step}", "send_recv", kv_bytes * (2 if backward else 1),
                         group="cp", overlapped=True, source=source)
        b.kernels.append(Kernel(f"{name}.cp_step{step}", ATTENTION, b.phase, dtype=b.dtype, m=d.s // cp,
                                n=d.s // cp, k=d.head, batch=batch,
                                flops=(step_model + (diagonal if step == 0 else 0.0)) * factor,
                                model_flops=step_model * model_factor,
                                bytes=float(q_bytes + kv_bytes + out_bytes + lse), core_attention=not backward,
                                source=source))
        if step and not backward:
            b.memory(f"attention.cp_out_correction.step{step}", "add", 3 * d.tokens * d.q * FP32 + 2 * lse,
                     source=f"{_TE_CP} (flash_attn_fwd_out_correction)", core=True)


def _linear(b: _Builder, name: str, m_tokens: int, out: int, inp: int, s: KernelSettings, backward: bool, *,
            bias_fused_in: bool, source: str, norm_fused: bool = False) -> None:
    """A linear layer's GEMMs: forward (m_tokens x inp) by (inp x out); backward the input gradient and the weight
    gradient, the latter into the fp32 main gradient with gradient-accumulation fusion, else a 16-bit gradient
    that the DDP hook adds into main_grad (reads the gradient and main_grad, writes main_grad: 2 + 4 + 4 bytes per
    weight). `bias_fused_in`: the bias is this layer's own (not skipped on to a fusion): the local layer adds it in
    a separate kernel forward and sums its gradient backward; a TE GEMM adds it in the epilogue and reduces its
    gradient inside the weight-gradient GEMM.

    FP8 (`_fp8`): all three GEMMs in FP8 (the weight gradient in 16 bits under --no-fp8-wgrad), the input quantized
    with its transpose before the forward GEMM (`norm_fused` under delayed scaling: the norm wrote it in FP8, only
    the transpose is left: reads and writes 1 B per element), the output gradient quantized before the input
    gradient's; the weight's FP8 copy and transpose are made once per iteration (`fp8_weight_kernels`)."""
    fp8 = _fp8(s)
    if not backward:
        if fp8 and norm_fused and _fp8_norm_fused(s):
            b.memory(f"{name}.fp8_input_transpose", "transpose", 2 * m_tokens * inp * FP8_BYTES, source=_TE_FP8)
        elif fp8:
            _fp8_quantize(b, f"{name}.fp8_cast_input", m_tokens * inp, s)
        b.gemm(f"{name}", m_tokens, out, inp, source=source, fp8=fp8)
        if s.bias and bias_fused_in and not s.transformer_engine:
            b.memory(f"{name}.bias_add", "add", 2 * m_tokens * out * b.e, source=f"{_LINEAR}.forward (output + bias)")
        return
    if fp8:
        _fp8_quantize(b, f"{name}.fp8_cast_grad_output", m_tokens * out, s, phase=DGRAD)
    b.gemm(f"{name}.dgrad", m_tokens, inp, out, source=source, phase=DGRAD, fp8=fp8)
    b.gemm(f"{name}.wgrad", out, inp, m_tokens, source=source, phase=WGRAD,
           accumulate_fp32=s.gradient_accumulation_fusion, fp8=fp8 and s.fp8_wgrad)
    if not s.gradient_accumulation_fusion:
        b.memory(f"{name}.main_grad_add", "add", out * inp * (b.e + 2 * FP32),
                 source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
                 phase=WGRAD)
    if s.bias and bias_fused_in and not s.transformer_engine:
        b.memory(f"{name}.bias_grad", "sum", m_tokens * out * b.e, source=f"{_LINEAR}.backward (grad_output.sum)",
                 phase=WGRAD)


def _activation(b: _Builder, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """The MLP's activation on fc1's output: GeLU (f / t wide) or SwiGLU (2f / t in, f / t out), with fc1's bias
    (skipped on by `linear_fc1`). Fused (`bias_gelu_impl` / `bias_swiglu_impl`: one jit kernel each way, the bias
    gradient a sum over tokens) or unfused (bias add, then GeLU, or chunk, SiLU and product)."""
    e, f, tokens = b.e, d.ffn, d.tokens
    swiglu = b.shape.swiglu
    src = "fusions/fused_bias_swiglu.py bias_swiglu_impl" if swiglu else "fusions/fused_bias_gelu.py bias_gelu_impl"
    width = 2 * f if swiglu else f
    kind = "swiglu" if swiglu else "gelu"
    if not backward:
        if s.bias_activation_fusion:
            b.memory(f"mlp.bias_{kind}", kind, tokens * (width + f) * e, source=src)
            return
        src = "transformer/mlp.py MLP.forward (unfused activation)"
        if s.bias:
            b.memory("mlp.fc1.bias_add", "add", 2 * tokens * width * e, source=src)
        if swiglu:
            b.memory("mlp.silu", kind, 2 * tokens * f * e, source=src)
            b.memory("mlp.glu_product", "mul", 3 * tokens * f * e, source=src)
        else:
            b.memory("mlp.gelu", kind, 2 * tokens * f * e, source=src)
        return
    if s.bias_activation_fusion:
        b.memory(f"mlp.bias_{kind}.backward", kind, tokens * (f + 2 * width) * e, source=src)
    elif swiglu:
        src = "transformer/mlp.py MLP.forward (unfused activation), autograd"
        b.memory("mlp.glu_product.backward", "mul", 2 * 3 * tokens * f * e, source=src)
        b.memory("mlp.silu.backward", kind, 3 * tokens * f * e, source=src)
        b.memory("mlp.glu_cat", "cat", 2 * tokens * width * e, source=src)
    else:
        b.memory("mlp.gelu.backward", kind, 3 * tokens * f * e, source="transformer/mlp.py MLP.forward, autograd")
    if s.bias:
        b.memory("mlp.fc1.bias_grad", "sum", tokens * width * e, source=src, phase=WGRAD)


def layer_forward(shape: ModelShape, s: KernelSettings) -> tuple[Kernel, ...]:
    """The kernels of one decoder layer's forward, in launch order."""
    d, b = _dims(shape), _Builder(shape, FORWARD)
    te, e = s.transformer_engine, b.e
    sp = shape.sequence_parallel
    hidden = d.tokens * d.h * e  # one s x b x h buffer: what the layer's collectives move
    linear = _TE_LINEAR if te else _LINEAR
    fused = _fp8_norm_fused(s)  # the norms write FP8, and the sequence-parallel all-gathers move it
    gathered = hidden // b.e * FP8_BYTES if fused else hidden
    # attention block
    _norm(b, "attention.input_norm", d, False, te, fp8_out=fused)
    if sp:
        b.collective("attention.qkv_all_gather", "all_gather", gathered, source=f"{linear} (sequence parallel input)",
                     dtype="fp8" if fused else "")
    _linear(b, "attention.linear_qkv", d.tokens, d.qkv, d.h, s, False, bias_fused_in=True, source=linear,
            norm_fused=True)
    _rope(b, d, s, False)
    _core_attention(b, d, s, False)
    _linear(b, "attention.linear_proj", d.tokens, d.h, d.q, s, False, bias_fused_in=False, source=linear)
    b.collective("attention.proj_" + ("reduce_scatter" if sp else "all_reduce"), "reduce_scatter" if sp else
                 "all_reduce", hidden, source=f"{_MAPPINGS} (RowParallelLinear output)")
    _bias_dropout_add(b, "attention.bias_dropout_add", d, s, False)
    # MLP block
    _norm(b, "mlp.pre_norm", d, False, te, fp8_out=fused)
    if sp:
        b.collective("mlp.fc1_all_gather", "all_gather", gathered, source=f"{linear} (sequence parallel input)",
                     dtype="fp8" if fused else "")
    fc1 = d.ffn * (2 if shape.swiglu else 1)
    _linear(b, "mlp.linear_fc1", d.tokens, fc1, d.h, s, False, bias_fused_in=False, source=linear, norm_fused=True)
    _activation(b, d, s, False)
    _linear(b, "mlp.linear_fc2", d.tokens, d.h, d.ffn, s, False, bias_fused_in=False, source=linear)
    b.collective("mlp.fc2_" + ("reduce_scatter" if sp else "all_reduce"), "reduce_scatter" if sp else "all_reduce",
                 hidden, source=f"{_MAPPINGS} (RowParallelLinear output)")
    _bias_dropout_add(b, "mlp.bias_dropout_add", d, s, False)
    return tuple(b.kernels)


def layer_backward(shape: ModelShape, s: KernelSettings) -> tuple[Kernel, ...]:
    """The kernels of one decoder layer's backward, in autograd's order, each tagged DGRAD (the input gradient:
    what the previous layer waits for) or WGRAD (the weight gradient: what a zero-bubble schedule may defer)."""
    d, b = _dims(shape), _Builder(shape, DGRAD)
    te = s.transformer_engine
    sp = shape.sequence_parallel
    hidden = d.tokens * d.h * b.e
    linear = _TE_LINEAR if te else _LINEAR
    fc1 = d.ffn * (2 if shape.swiglu else 1)
    saved = hidden // b.e * FP8_BYTES if _fp8(s) else hidden  # the saved input, gathered again (FP8 under FP8)
    # MLP block
    _bias_dropout_add(b, "mlp.bias_dropout_add", d, s, True)
    if sp:  # the reduce-scatter's backward: gather the output gradient
        b.collective("mlp.fc2_grad_all_gather", "all_gather", hidden, source=f"{_MAPPINGS} (reduce-scatter backward)")
    _linear(b, "mlp.linear_fc2", d.tokens, d.h, d.ffn, s, True, bias_fused_in=False, source=linear)
    _activation(b, d, s, True)
    if sp:  # the input again, for the weight gradient (asynchronous, under the input-gradient GEMM)
        b.collective("mlp.fc1_input_all_gather", "all_gather", saved, overlapped=True, source=f"{_LINEAR}.backward",
                     dtype="fp8" if _fp8(s) else "")
    _linear(b, "mlp.linear_fc1", d.tokens, fc1, d.h, s, True, bias_fused_in=False, source=linear)
    b.collective("mlp.fc1_dgrad_" + ("reduce_scatter" if sp else "all_reduce"), "reduce_scatter" if sp else
                 "all_reduce", hidden, overlapped=True, source=f"{_LINEAR}.backward (async, under the weight gradient)")
    _norm(b, "mlp.pre_norm", d, True, te)
    _residual_grad(b, "mlp.residual_grad_add", d)
    # attention block
    _bias_dropout_add(b, "attention.bias_dropout_add", d, s, True)
    if sp:
        b.collective("attention.proj_grad_all_gather", "all_gather", hidden,
                     source=f"{_MAPPINGS} (reduce-scatter backward)")
    _linear(b, "attention.linear_proj", d.tokens, d.h, d.q, s, True, bias_fused_in=False, source=linear)
    _core_attention(b, d, s, True)
    _rope(b, d, s, True)
    if not te:  # the q, k, v gradients concatenated into the fused QKV output's (torch.split's backward)
        b.memory("attention.qkv_grad_cat", "cat", 2 * d.tokens * d.qkv * b.e, source="transformer/attention.py "
                 "SelfAttention.get_query_key_value_tensors (split backward)")
    if sp:
        b.collective("attention.qkv_input_all_gather", "all_gather", saved, overlapped=True,
                     source=f"{_LINEAR}.backward", dtype="fp8" if _fp8(s) else "")
    _linear(b, "attention.linear_qkv", d.tokens, d.qkv, d.h, s, True, bias_fused_in=True, source=linear)
    b.collective("attention.qkv_dgrad_" + ("reduce_scatter" if sp else "all_reduce"), "reduce_scatter" if sp else
                 "all_reduce", hidden, overlapped=True, source=f"{_LINEAR}.backward (async, under the weight gradient)")
    _norm(b, "attention.input_norm", d, True, te)
    _residual_grad(b, "attention.residual_grad_add", d)
    return tuple(b.kernels)


def recomputed(shape: ModelShape, s: KernelSettings, layers: int) -> tuple[tuple[Kernel, int], ...]:
    """What activation recomputation re-runs in the backward of a model chunk of `layers` layers, with counts.

    Full (`transformer/transformer_block.py` `TransformerBlock._checkpointed_forward`): the whole forward of the
    layers it covers (`ModelShape.recomputed_layers`: every layer for uniform, the first N for block), its
    collectives too. Selective (`transformer/attention.py` `Attention._checkpointed_attention_forward`, the
    default `recompute_modules = ["core_attn"]`): the attention core's forward (`core_attention` kernels), the
    fused flash kernel included."""
    if shape.recompute_granularity == "selective":
        chosen = [k for k in layer_forward(shape, s) if k.core_attention]
        count = layers
    else:
        count = shape.recomputed_layers(layers)
        chosen = list(layer_forward(shape, s)) if count else []
    return tuple((replace(k, phase=RECOMPUTE), count) for k in chosen)


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
        b.collective("embedding." + ("reduce_scatter" if shape.sequence_parallel else "all_reduce"),
                     "reduce_scatter" if shape.sequence_parallel else "all_reduce", rows,
                     source=f"{_MAPPINGS} (VocabParallelEmbedding output)")
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
        back.memory("embedding.dropout_backward", "dropout", 2 * local + d.local * d.h * MASK_BYTES, source=positions,
                    phase=DGRAD)
    if shape.sequence_parallel and d.t > 1:
        back.collective("embedding.grad_all_gather", "all_gather", rows, source=f"{_MAPPINGS} (reduce-scatter backward)",
                        phase=DGRAD)
    dense = "torch embedding_dense_backward (F.embedding's backward)"
    tables = [("word", vocab)] + ([("position", shape.seq_length)]
                                   if shape.position_embedding == "learned_absolute" else [])
    for table, size in tables:
        back.memory(f"embedding.{table}_grad_zero", "fill", size * d.h * e, source=dense)
        back.memory(f"embedding.{table}_grad_scatter", "embedding", 2 * rows + d.tokens * INDEX_BYTES, source=dense)
        back.memory(f"embedding.{table}_main_grad_add", "add", size * d.h * (e + 2 * FP32),
                    source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)")
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
    b.gemm("output.logits", d.tokens, vocab, d.h, source="tensor_parallel/layers.py ColumnParallelLinear (output_layer)")
    b.memory("loss.cast_fp32", "copy", logits * (e + FP32), source=f"{ce}.calculate_logits_max (.float())")
    b.memory("loss.max", "max", logits * FP32, source=f"{ce}.calculate_logits_max")
    b.collective("loss.max_all_reduce", "all_reduce", d.tokens * FP32, source=f"{ce}.forward")
    b.memory("loss.subtract_max", "add", 2 * logits * FP32, source=f"{ce}.calculate_predicted_logits")
    b.memory("loss.target_logits", "copy", d.tokens * (4 * INDEX_BYTES + 3 * FP32),
             source=f"{ce}.calculate_predicted_logits (target mask, gather)")
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
    back.gemm("output.logits.wgrad", vocab, d.h, d.tokens, source=_LINEAR, phase=WGRAD,
              accumulate_fp32=s.gradient_accumulation_fusion)
    if not s.gradient_accumulation_fusion:
        back.memory("output.logits.main_grad_add", "add", vocab * d.h * (e + 2 * FP32), phase=WGRAD,
                    source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)")
    back.collective("output.dgrad_" + ("reduce_scatter" if shape.sequence_parallel else "all_reduce"),
                    "reduce_scatter" if shape.sequence_parallel else "all_reduce", hidden, overlapped=True,
                    source=f"{_LINEAR}.backward")
    _norm(back, "output.final_norm", d, True, te)
    return tuple(b.kernels) + tuple(back.kernels)


def optimizer_kernels(shape: ModelShape, parameters: float, shard: int, *, distributed: bool
                      ) -> tuple[Kernel, ...]:
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
    return (("attention.linear_qkv", d.qkv, d.h), ("attention.linear_proj", d.h, d.q),
            ("mlp.linear_fc1", d.ffn * (2 if shape.swiglu else 1), d.h), ("mlp.linear_fc2", d.h, d.ffn))


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


def fp8_scaling_kernels(shape: ModelShape, s: KernelSettings, layers: int, history: int = 1
                        ) -> tuple[Kernel, ...]:
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
        b.collective(f"fp8.amax_all_reduce.{phase}", "all_reduce", gemms * tensors * AMAX_ENTRY_BYTES, phase=phase,
                     group="dp_cp", dtype="fp32", source="fp8_utils.py get_fp8_context (fp8_autocast's fp8_group)")
        b.memory(f"fp8.amax_and_scale_update.{phase}", "amax", 2 * entries * AMAX_ENTRY_BYTES, phase=phase,
                 source=_TE_FP8)
    return tuple(b.kernels)


@dataclass(frozen=True)
class StageKernels:
    """What one virtual stage launches per microbatch: (kernel, count) rows, the per-layer lists kept apart."""

    layers: int
    layer: tuple[Kernel, ...]  # one layer's forward and backward
    recompute: tuple[tuple[Kernel, int], ...]
    ends: tuple[Kernel, ...]  # the embedding (first stage) and the output layer and loss (last stage)

    def rows(self) -> tuple[tuple[Kernel, int], ...]:
        return (tuple((k, self.layers) for k in self.layer) + self.recompute + tuple((k, 1) for k in self.ends))


def stage_kernels(shape: ModelShape, s: KernelSettings, layers: int, *, first: bool, last: bool) -> StageKernels:
    """The kernels of a virtual stage with `layers` decoder layers, per microbatch (`first`: it holds the
    embedding; `last`: the output layer and loss)."""
    ends = ((embedding_kernels(shape, s) if first else ()) + (output_kernels(shape, s) if last else ())
            + fp8_scaling_kernels(shape, s, layers))
    return StageKernels(layers=layers, layer=(layer_forward(shape, s) + layer_backward(shape, s)) if layers else (),
                        recompute=recomputed(shape, s, layers) if layers else (), ends=ends)


def total_model_flops(rows: Iterable[tuple[Kernel, int]]) -> float:
    """Megatron-counted FLOPs of (kernel, count) rows, recomputation left out (as Megatron's count leaves it)."""
    return sum(k.model_flops * n for k, n in rows if k.phase != RECOMPUTE)


# --- Megatron's own count -----------------------------------------------------------------------------


def _padded_vocab(args: Mapping[str, Any]) -> int:
    """`args.padded_vocab_size` as Megatron-LM sets it (`megatron/training/tokenizer/tokenizer.py`
    `_vocab_size_with_padding`: the vocabulary rounded up to a multiple of --make-vocab-size-divisible-by (128) x
    t)."""
    if args.get("padded_vocab_size"):
        return int(args["padded_vocab_size"])
    multiple = int(args.get("make_vocab_size_divisible_by", 128)) * int(args.get("tensor_model_parallel_size", 1))
    return math.ceil(int(args["vocab_size"]) / multiple) * multiple


def megatron_flops(args: Mapping[str, Any], batch_size: int) -> float:
    """Megatron-LM's `num_floating_point_operations(args, batch_size)` (`megatron/training/training.py`, the
    `transformer_flops` branch, Megatron-LM core_r0.16.0), for a dense GPT without multi-latent attention,
    experts or multi-token prediction (a launch the cost model prices; anything else is refused):

        expansion = 3 x 2 x 2 (forward, weight and input gradient; two GEMMs of each size; 2 FLOPs a multiply-add)
        attention = expansion x L x h x h x ((1 + g/a + s/h/2) x (kv_channels x a / h))   # causal: half of s^2
        total = B x s x (expansion x L x h x f x (3/2 if SwiGLU) + attention + 3 x 2 x h x V_padded)

    The file is Megatron-LM's training loop, not part of the megatron-core package installed here, so this is
    that function re-written from its source; `tests/model/test_kernels.py` checks the kernels' FLOPs against it.
    """
    for unsupported in ("num_experts", "multi_latent_attention", "mtp_num_layers", "hybrid_override_pattern"):
        if args.get(unsupported):
            raise ValueError(f"megatron_flops: --{unsupported.replace('_', '-')} is not a dense GPT")
    layers, h, s = int(args["num_layers"]), int(args["hidden_size"]), int(args["seq_length"])
    heads = int(args["num_attention_heads"])
    kv_channels = int(args.get("kv_channels") or h // heads)
    groups = int(args["num_query_groups"]) if args.get("group_query_attention") else heads
    ffn = int(args.get("ffn_hidden_size") or 4 * h)
    gated = 3 / 2 if args.get("swiglu") else 1
    expansion = 3 * 2 * 2
    query_ratio = kv_channels * heads / h
    attention = expansion * layers * h * h * ((1 + groups / heads + s / h / 2) * query_ratio)
    return float(batch_size * s * (expansion * layers * h * ffn * gated + attention
                                   + 3 * 2 * h * _padded_vocab(args)))
