"""Model room: a Megatron GPT training step as the kernels it launches, counted from megatron-core's own code.

Pure: shapes and settings in, kernels out (no device, no time: `hops_calib.model.kernel_pricing` prices them).
The names live by concept: `kernel_types` (the kernel, the launch settings, the builder), `layer_kernels` (a
decoder layer's kernels), `stage_kernels` (a stage's others: embedding, output, optimizer, FP8 weights) and
`megatron_count` (Megatron's own FLOPs count); this module gathers them under one name.
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

from hops_calib.model.kernel_types import (
    _BDA,
    _CORE,
    _LAYER,
    _LAYER_TRAFFIC,
    _LINEAR,
    _MAPPINGS,
    _ROPE,
    _SOFTMAX,
    _TE_FP8,
    _TE_LINEAR,
    ATTENTION,
    COLLECTIVE,
    DGRAD,
    FLASH_BACKWARD_PRODUCTS,
    FLASH_BLOCK,
    FORWARD,
    FP8_BYTES,
    FP8_RECIPES,
    FP32,
    GEMM,
    INDEX_BYTES,
    MASK_BYTES,
    MEMORY,
    PHASES,
    RECOMPUTE,
    WGRAD,
    Kernel,
    KernelSettings,
    _Builder,
    _cp_comm_type,
    _Dims,
    _dims,
    _flag,
    _fp8,
    _probability,
    fp8_format,
    settings_from_args,
)
from hops_calib.model.layer_kernels import (
    _TE_CP,
    CP_COMM_TYPES,
    _activation,
    _bias_dropout_add,
    _context_parallel_attention,
    _core_attention,
    _fp8_norm_fused,
    _fp8_quantize,
    _linear,
    _norm,
    _residual_grad,
    _rope,
    layer_backward,
    layer_forward,
    recomputed,
)
from hops_calib.model.megatron_count import (
    _padded_vocab,
    megatron_flops,
)
from hops_calib.model.stage_kernels import (
    AMAX_ENTRY_BYTES,
    StageKernels,
    embedding_kernels,
    fp8_scaling_kernels,
    fp8_weight_kernels,
    linear_weights,
    optimizer_kernels,
    output_kernels,
    stage_kernels,
    total_model_flops,
)

__all__ = [
    "AMAX_ENTRY_BYTES",
    "ATTENTION",
    "COLLECTIVE",
    "CP_COMM_TYPES",
    "DGRAD",
    "FLASH_BACKWARD_PRODUCTS",
    "FLASH_BLOCK",
    "FORWARD",
    "FP8_BYTES",
    "FP8_RECIPES",
    "FP32",
    "GEMM",
    "INDEX_BYTES",
    "MASK_BYTES",
    "MEMORY",
    "PHASES",
    "RECOMPUTE",
    "WGRAD",
    "_BDA",
    "_CORE",
    "_LAYER",
    "_LAYER_TRAFFIC",
    "_LINEAR",
    "_MAPPINGS",
    "_ROPE",
    "_SOFTMAX",
    "_TE_CP",
    "_TE_FP8",
    "_TE_LINEAR",
    "Kernel",
    "KernelSettings",
    "StageKernels",
    "_Builder",
    "_Dims",
    "_activation",
    "_bias_dropout_add",
    "_context_parallel_attention",
    "_core_attention",
    "_cp_comm_type",
    "_dims",
    "_flag",
    "_fp8",
    "_fp8_norm_fused",
    "_fp8_quantize",
    "_linear",
    "_norm",
    "_padded_vocab",
    "_probability",
    "_residual_grad",
    "_rope",
    "embedding_kernels",
    "fp8_format",
    "fp8_scaling_kernels",
    "fp8_weight_kernels",
    "layer_backward",
    "layer_forward",
    "linear_weights",
    "megatron_flops",
    "optimizer_kernels",
    "output_kernels",
    "recomputed",
    "settings_from_args",
    "stage_kernels",
    "total_model_flops",
]
