"""Model room: the kernels of one decoder layer, forward, backward and recomputed (norms, attention, its core and
its context-parallel exchange, the linear layers, activations, bias-dropout-add, RoPE, FP8 casts), each counted
from the megatron-core code `kernels` cites. Pure: shapes and settings in, kernels out. One concept over ~600
lines: a layer's kernel list follows Megatron's forward, backward and recompute code paths one kernel at a time,
and splitting it would part kernels that one code path launches together."""

from __future__ import annotations

from dataclasses import replace

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
    DGRAD,
    FLASH_BACKWARD_PRODUCTS,
    FLASH_BLOCK,
    FORWARD,
    FP8_BYTES,
    FP32,
    MASK_BYTES,
    RECOMPUTE,
    WGRAD,
    Kernel,
    KernelSettings,
    _Builder,
    _Dims,
    _dims,
    _fp8,
)
from hops_calib.model.moe_kernels import moe_backward, moe_forward
from hops_calib.spec import ModelShape


def _norm(b: _Builder, name: str, d: _Dims, backward: bool, te: bool, fp8_out: bool = False) -> None:
    """LayerNorm or RMSNorm over the local tokens: forward reads x and writes y and the fp32 statistics (mean and
    rstd; rstd only for RMSNorm); backward reads dy, x and the statistics and writes dx, then reduces the
    weight's (and bias's) per-block partial gradients. `fp8_out`: TE's norm writes y in FP8 (`_fp8_norm_fused`)."""
    shape = b.shape
    rms = shape.normalization == "RMSNorm"
    kind = "rmsnorm" if rms else "layernorm"
    stats = d.local * FP32 * (1 if rms else 2)
    source = (
        "extensions/transformer_engine.py TELayerNormColumnParallelLinear (TE's norm kernel)"
        if te
        else f"{_LAYER} (the spec's norm: FusedLayerNorm / WrappedTorchNorm)"
    )
    act = d.local * d.h * b.e
    if not backward:
        b.memory(f"{name}", kind, act + (d.local * d.h * FP8_BYTES if fp8_out else act) + stats, source=source)
        return
    b.memory(f"{name}.backward", kind, 3 * act + stats, source=source)
    blocks = d.local // FLASH_BLOCK + 1  # the partial weight gradients, one row per block of tokens, reduced
    b.memory(
        f"{name}.weight_grad_reduce", "sum", (1 if rms else 2) * (blocks + 1) * d.h * FP32, source=source, phase=WGRAD
    )


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
        ops = (
            (("mul_sin", 2), ("mul_cos", 2), ("neg", 1), ("cat", 2), ("add", 3))
            if backward
            else (("neg", 1), ("cat", 2), ("mul_cos", 2), ("mul_sin", 2), ("add", 3), ("cat_pass", 2))
        )
        for op, passes in ops:
            b.memory(
                f"attention.rope_{tensor}.{op}" + (".backward" if backward else ""), "rope", passes * one, source=_ROPE
            )


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
            b.kernels.append(
                Kernel(
                    "attention.core_flash",
                    ATTENTION,
                    b.phase,
                    dtype=b.dtype,
                    m=d.s,
                    n=d.s,
                    k=d.head,
                    batch=batch,
                    flops=executed,
                    model_flops=full * causal,
                    bytes=float(qkv_bytes + out_bytes + lse),
                    core_attention=True,
                    source=source,
                )
            )
            return
        b.memory("attention.core_flash.backward_preprocess", "sum", 2 * out_bytes + lse, source=source)
        b.kernels.append(
            Kernel(
                "attention.core_flash.backward",
                ATTENTION,
                b.phase,
                dtype=b.dtype,
                m=d.s,
                n=d.s,
                k=d.head,
                batch=batch,
                flops=executed * FLASH_BACKWARD_PRODUCTS,
                model_flops=2 * full * causal,
                bytes=float(2 * qkv_bytes + 2 * out_bytes + lse + d.tokens * d.q * 2 * FP32),
                source=source,
            )
        )
        return
    scores = batch * d.s * d.s * e
    mask = d.s * d.s * MASK_BYTES
    score_fp32 = batch * d.s * d.s * FP32
    repeat = d.heads // max(1, d.groups)
    if not backward:
        if repeat > 1:
            for tensor in ("k", "v"):
                b.memory(f"attention.repeat_{tensor}", "copy", d.tokens * (d.kv + d.q) * e, source=_CORE, core=True)
        b.gemm(
            "attention.scores",
            d.s,
            d.s,
            d.head,
            batch=batch,
            source=f"{_CORE} (baddbmm)",
            core=True,
            model_share=causal,
        )
        if s.softmax_fused:
            b.memory(
                "attention.softmax",
                "softmax",
                2 * scores,
                source=f"{_SOFTMAX} (ScaledUpperTriangMaskedSoftmax)",
                core=True,
            )
        else:
            if s.softmax_in_fp32:
                b.memory("attention.softmax_cast", "copy", scores + score_fp32, source=_SOFTMAX, core=True)
            width = score_fp32 if s.softmax_in_fp32 else scores
            b.memory(
                "attention.mask", "masked_fill", 2 * width + mask, source=f"{_SOFTMAX}.forward_torch_softmax", core=True
            )
            b.memory("attention.softmax", "softmax", 2 * width, source=f"{_SOFTMAX}.forward_torch_softmax", core=True)
            if s.softmax_in_fp32:
                b.memory("attention.softmax_cast_back", "copy", scores + score_fp32, source=_SOFTMAX, core=True)
        if s.dropout("attention"):
            b.memory(
                "attention.dropout", "dropout", 2 * scores + batch * d.s * d.s * MASK_BYTES, source=_CORE, core=True
            )
        b.gemm(
            "attention.context", d.s, d.head, d.s, batch=batch, source=f"{_CORE} (bmm)", core=True, model_share=causal
        )
        b.memory(
            "attention.context_layout",
            "copy",
            2 * d.tokens * d.q * e,
            source=f"{_CORE} (permute().contiguous())",
            core=True,
        )
        return
    # backward, in autograd's order: the context product's two gradients, dropout, softmax, the scores' two
    b.gemm(
        "attention.context.grad_probs",
        d.s,
        d.s,
        d.head,
        batch=batch,
        source=f"{_CORE} (bmm backward)",
        model_share=causal,
    )
    b.gemm(
        "attention.context.grad_value",
        d.s,
        d.head,
        d.s,
        batch=batch,
        source=f"{_CORE} (bmm backward)",
        model_share=causal,
    )
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
    b.gemm(
        "attention.scores.grad_query",
        d.s,
        d.head,
        d.s,
        batch=batch,
        source=f"{_CORE} (baddbmm backward)",
        model_share=causal,
    )
    b.gemm(
        "attention.scores.grad_key",
        d.s,
        d.head,
        d.s,
        batch=batch,
        source=f"{_CORE} (baddbmm backward)",
        model_share=causal,
    )
    for tensor, width in (("q", d.q), ("k", d.q)):  # alpha's gradient, on the repeated keys' gradient before the sum
        b.memory(f"attention.scale_grad_{tensor}", "scale", 2 * d.tokens * width * e, source=f"{_CORE} (baddbmm alpha)")
    if repeat > 1:
        for tensor in ("k", "v"):
            b.memory(f"attention.repeat_{tensor}.backward", "sum", d.tokens * (d.q + d.kv) * e, source=_CORE)


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


_MOE_SHARED = "transformer/moe/shared_experts.py SharedExpertMLP"
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
    functions = {
        "p2p": "AttnFuncWithCPAndKVP2P",
        "a2a": "AttnFuncWithCPAndQKVOA2A",
        "allgather": "AttnFuncWithCPAndKVAllGather",
    }
    source = f"{_TE_CP} ({functions.get(comm, comm)})"
    factor, model_factor = (FLASH_BACKWARD_PRODUCTS, 2.0) if backward else (1.0, 1.0)
    name = "attention.core_flash" + (".backward" if backward else "")
    if backward:
        b.memory("attention.core_flash.backward_preprocess", "sum", 2 * out_bytes + lse, source=source)
    if comm == "a2a":
        tag = "backward" if backward else "forward"
        b.collective(
            f"attention.cp_a2a_{'grad_output' if backward else 'qkv'}",
            "all_to_all",
            out_bytes if backward else q_bytes + kv_bytes,
            group="cp",
            source=source,
        )
        heads = batch // cp
        full = 4.0 * heads * d.head * d.s * d.s
        b.kernels.append(
            Kernel(
                name,
                ATTENTION,
                b.phase,
                dtype=b.dtype,
                m=d.s,
                n=d.s,
                k=d.head,
                batch=heads,
                flops=full * 0.5 * (1 + min(FLASH_BLOCK, d.s) / d.s) * factor,
                model_flops=full * 0.5 * model_factor,
                bytes=float(2 * (q_bytes + kv_bytes)),
                core_attention=not backward,
                source=source,
            )
        )
        b.collective(
            f"attention.cp_a2a_{'grad_qkv' if backward else 'output'}",
            "all_to_all",
            q_bytes + kv_bytes if backward else out_bytes,
            group="cp",
            source=f"{source} ({tag})",
        )
        return
    if comm == "allgather":
        if not backward:
            b.collective("attention.cp_kv_all_gather", "all_gather", kv_bytes * cp, group="cp", source=source)
        flops = (cp * step_model + diagonal) * factor
        b.kernels.append(
            Kernel(
                name,
                ATTENTION,
                b.phase,
                dtype=b.dtype,
                m=d.s // cp,
                n=d.s,
                k=d.head,
                batch=batch,
                flops=flops,
                model_flops=cp * step_model * model_factor,
                bytes=float(q_bytes + kv_bytes * cp + out_bytes + lse),
                core_attention=not backward,
                source=source,
            )
        )
        if backward:
            b.collective(
                "attention.cp_kv_grad_reduce_scatter", "reduce_scatter", kv_bytes * cp, group="cp", source=source
            )
        return
    for step in range(cp):
        if step < cp - 1:  # the next step's KV (with its gradient in the backward) travels under this step
            b.collective(
                f"attention.cp_kv_exchange.step{step}",
                "send_recv",
                kv_bytes * (2 if backward else 1),
                group="cp",
                overlapped=True,
                source=source,
            )
        b.kernels.append(
            Kernel(
                f"{name}.cp_step{step}",
                ATTENTION,
                b.phase,
                dtype=b.dtype,
                m=d.s // cp,
                n=d.s // cp,
                k=d.head,
                batch=batch,
                flops=(step_model + (diagonal if step == 0 else 0.0)) * factor,
                model_flops=step_model * model_factor,
                bytes=float(q_bytes + kv_bytes + out_bytes + lse),
                core_attention=not backward,
                source=source,
            )
        )
        if step and not backward:
            b.memory(
                f"attention.cp_out_correction.step{step}",
                "add",
                3 * d.tokens * d.q * FP32 + 2 * lse,
                source=f"{_TE_CP} (flash_attn_fwd_out_correction)",
                core=True,
            )


def _linear(
    b: _Builder,
    name: str,
    m_tokens: int,
    out: int,
    inp: int,
    s: KernelSettings,
    backward: bool,
    *,
    bias_fused_in: bool,
    source: str,
    norm_fused: bool = False,
) -> None:
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
    b.gemm(
        f"{name}.wgrad",
        out,
        inp,
        m_tokens,
        source=source,
        phase=WGRAD,
        accumulate_fp32=s.gradient_accumulation_fusion,
        fp8=fp8 and s.fp8_wgrad,
    )
    if not s.gradient_accumulation_fusion:
        b.memory(
            f"{name}.main_grad_add",
            "add",
            out * inp * (b.e + 2 * FP32),
            source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
            phase=WGRAD,
        )
    if s.bias and bias_fused_in and not s.transformer_engine:
        b.memory(
            f"{name}.bias_grad",
            "sum",
            m_tokens * out * b.e,
            source=f"{_LINEAR}.backward (grad_output.sum)",
            phase=WGRAD,
        )


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
        b.collective(
            "attention.qkv_all_gather",
            "all_gather",
            gathered,
            source=f"{linear} (sequence parallel input)",
            dtype="fp8" if fused else "",
        )
    _linear(
        b, "attention.linear_qkv", d.tokens, d.qkv, d.h, s, False, bias_fused_in=True, source=linear, norm_fused=True
    )
    _rope(b, d, s, False)
    _core_attention(b, d, s, False)
    _linear(b, "attention.linear_proj", d.tokens, d.h, d.q, s, False, bias_fused_in=False, source=linear)
    b.collective(
        "attention.proj_" + ("reduce_scatter" if sp else "all_reduce"),
        "reduce_scatter" if sp else "all_reduce",
        hidden,
        source=f"{_MAPPINGS} (RowParallelLinear output)",
    )
    _bias_dropout_add(b, "attention.bias_dropout_add", d, s, False)
    # MLP block
    if shape.moe:  # a mixture of experts in place of the dense MLP (`moe_kernels`), after its own norm
        _norm(b, "mlp.pre_norm", d, False, te)
        if shape.moe_shared_expert_ffn:
            _shared_expert(b, d, s, False)
        moe_forward(b, d, s)
        _bias_dropout_add(b, "mlp.bias_dropout_add", d, s, False)
        return tuple(b.kernels)
    _norm(b, "mlp.pre_norm", d, False, te, fp8_out=fused)
    if sp:
        b.collective(
            "mlp.fc1_all_gather",
            "all_gather",
            gathered,
            source=f"{linear} (sequence parallel input)",
            dtype="fp8" if fused else "",
        )
    fc1 = d.ffn * (2 if shape.swiglu else 1)
    _linear(b, "mlp.linear_fc1", d.tokens, fc1, d.h, s, False, bias_fused_in=False, source=linear, norm_fused=True)
    _activation(b, d, s, False)
    _linear(b, "mlp.linear_fc2", d.tokens, d.h, d.ffn, s, False, bias_fused_in=False, source=linear)
    b.collective(
        "mlp.fc2_" + ("reduce_scatter" if sp else "all_reduce"),
        "reduce_scatter" if sp else "all_reduce",
        hidden,
        source=f"{_MAPPINGS} (RowParallelLinear output)",
    )
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
    if shape.moe:
        moe_backward(b, d, s)
        if shape.moe_shared_expert_ffn:
            _shared_expert(b, d, s, True)
    else:
        _dense_mlp_backward(b, d, s, hidden, saved, fc1, linear)
    _norm(b, "mlp.pre_norm", d, True, te)
    _residual_grad(b, "mlp.residual_grad_add", d)
    # attention block
    _bias_dropout_add(b, "attention.bias_dropout_add", d, s, True)
    if sp:
        b.collective(
            "attention.proj_grad_all_gather", "all_gather", hidden, source=f"{_MAPPINGS} (reduce-scatter backward)"
        )
    _linear(b, "attention.linear_proj", d.tokens, d.h, d.q, s, True, bias_fused_in=False, source=linear)
    _core_attention(b, d, s, True)
    _rope(b, d, s, True)
    if not te:  # the q, k, v gradients concatenated into the fused QKV output's (torch.split's backward)
        b.memory(
            "attention.qkv_grad_cat",
            "cat",
            2 * d.tokens * d.qkv * b.e,
            source="transformer/attention.py SelfAttention.get_query_key_value_tensors (split backward)",
        )
    if sp:
        b.collective(
            "attention.qkv_input_all_gather",
            "all_gather",
            saved,
            overlapped=True,
            source=f"{_LINEAR}.backward",
            dtype="fp8" if _fp8(s) else "",
        )
    _linear(b, "attention.linear_qkv", d.tokens, d.qkv, d.h, s, True, bias_fused_in=True, source=linear)
    b.collective(
        "attention.qkv_dgrad_" + ("reduce_scatter" if sp else "all_reduce"),
        "reduce_scatter" if sp else "all_reduce",
        hidden,
        overlapped=True,
        source=f"{_LINEAR}.backward (async, under the weight gradient)",
    )
    _norm(b, "attention.input_norm", d, True, te)
    _residual_grad(b, "attention.residual_grad_add", d)
    return tuple(b.kernels)


def _dense_mlp_backward(
    b: _Builder, d: _Dims, s: KernelSettings, hidden: int, saved: int, fc1: int, linear: str
) -> None:
    """The dense MLP's backward (`layer_backward`): fc2's gradients, the activation's, fc1's, with their
    tensor-parallel collectives."""
    sp = b.shape.sequence_parallel
    if sp:  # the reduce-scatter's backward: gather the output gradient
        b.collective("mlp.fc2_grad_all_gather", "all_gather", hidden, source=f"{_MAPPINGS} (reduce-scatter backward)")
    _linear(b, "mlp.linear_fc2", d.tokens, d.h, d.ffn, s, True, bias_fused_in=False, source=linear)
    _activation(b, d, s, True)
    if sp:  # the input again, for the weight gradient (asynchronous, under the input-gradient GEMM)
        b.collective(
            "mlp.fc1_input_all_gather",
            "all_gather",
            saved,
            overlapped=True,
            source=f"{_LINEAR}.backward",
            dtype="fp8" if _fp8(s) else "",
        )
    _linear(b, "mlp.linear_fc1", d.tokens, fc1, d.h, s, True, bias_fused_in=False, source=linear)
    b.collective(
        "mlp.fc1_dgrad_" + ("reduce_scatter" if sp else "all_reduce"),
        "reduce_scatter" if sp else "all_reduce",
        hidden,
        overlapped=True,
        source=f"{_LINEAR}.backward (async, under the weight gradient)",
    )


def _shared_expert(b: _Builder, d: _Dims, s: KernelSettings, backward: bool) -> None:
    """The shared expert (`SharedExpertMLP`: a dense MLP of --moe-shared-expert-intermediate-size over the
    tensor-parallel group, its input all-gathered and its output reduce-scattered under sequence parallelism), as
    `layer_kernels` counts a dense MLP, under its own names."""
    shape = b.shape
    f = shape.moe_shared_expert_ffn // d.t
    fc1 = f * (2 if shape.swiglu else 1)
    hidden = d.tokens * d.h * b.e
    sp = shape.sequence_parallel
    linear = _TE_LINEAR if s.transformer_engine else _LINEAR
    kind = "swiglu" if shape.swiglu else "gelu"
    act = f"{_MOE_SHARED} (the activation)"
    dims = replace(d, ffn=f)
    if not backward:
        if sp:
            b.collective(
                "mlp.shared_expert.fc1_all_gather", "all_gather", hidden, source=f"{_MOE_SHARED}.pre_forward_comm"
            )
        _linear(b, "mlp.shared_expert.linear_fc1", dims.tokens, fc1, d.h, s, False, bias_fused_in=False, source=linear)
        b.memory(f"mlp.shared_expert.{kind}", kind, dims.tokens * (fc1 + f) * b.e, source=act)
        _linear(b, "mlp.shared_expert.linear_fc2", dims.tokens, d.h, f, s, False, bias_fused_in=False, source=linear)
        b.collective(
            "mlp.shared_expert.fc2_" + ("reduce_scatter" if sp else "all_reduce"),
            "reduce_scatter" if sp else "all_reduce",
            hidden,
            source=f"{_MOE_SHARED}.post_forward_comm",
        )
        return
    if sp:
        b.collective(
            "mlp.shared_expert.fc2_grad_all_gather",
            "all_gather",
            hidden,
            source=f"{_MAPPINGS} (reduce-scatter backward)",
        )
    _linear(b, "mlp.shared_expert.linear_fc2", dims.tokens, d.h, f, s, True, bias_fused_in=False, source=linear)
    b.memory(f"mlp.shared_expert.{kind}.backward", kind, dims.tokens * (f + 2 * fc1) * b.e, source=act)
    if sp:
        b.collective(
            "mlp.shared_expert.fc1_input_all_gather",
            "all_gather",
            hidden,
            overlapped=True,
            source=f"{_LINEAR}.backward",
        )
    _linear(b, "mlp.shared_expert.linear_fc1", dims.tokens, fc1, d.h, s, True, bias_fused_in=False, source=linear)
    b.collective(
        "mlp.shared_expert.fc1_dgrad_" + ("reduce_scatter" if sp else "all_reduce"),
        "reduce_scatter" if sp else "all_reduce",
        hidden,
        overlapped=True,
        source=f"{_LINEAR}.backward (async, under the weight gradient)",
    )


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
