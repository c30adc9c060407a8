"""Model room: counts of a Megatron GPT model (FLOPs, parameters, bytes) that cost terms build on.

All counts are per microbatch (micro batch size b, sequence length s, hidden h,
FFN hidden f, a attention heads, g key/value heads, t tensor-parallel GPUs) and per GPU, for Megatron's GPT
layer: a norm (LayerNorm or RMSNorm), QKV projection, core attention, output projection, a norm, an MLP of two
matmuls (three with SwiGLU). Tensor parallelism splits the matmuls and heads t ways (column- then row-parallel);
the norms stay whole unless sequence parallelism splits them. A matmul of (m x k) by (k x n) costs 2mkn FLOPs.
"""

from __future__ import annotations

import math

from hops_calib.spec import ModelShape

# Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128) times TP.
VOCAB_PADDING = 128

BYTES_PER_ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}


def bytes_per_element(shape: ModelShape) -> int:
    try:
        return BYTES_PER_ELEMENT[shape.precision]
    except KeyError:
        raise ValueError(
            f"unknown precision {shape.precision!r}; expected one of {sorted(BYTES_PER_ELEMENT)}"
        ) from None


def _t(shape: ModelShape) -> int:
    return max(1, int(shape.tensor_parallel))


def _cp(shape: ModelShape) -> int:
    return max(1, int(shape.context_parallel))


def local_seq(shape: ModelShape) -> int:
    """The tokens of a sequence one GPU holds: s / cp under context parallelism (its two load-balanced chunks)."""
    return shape.seq_length // _cp(shape)


def local_tokens(shape: ModelShape) -> int:
    """The tokens of a microbatch one GPU of a context-parallel group computes: s / cp x b."""
    return local_seq(shape) * shape.micro_batch_size


def qkv_width(shape: ModelShape) -> float:
    """Output width of the QKV projection: h for the queries plus 2 x (kv heads x head size) for keys and values
    (2h under multi-head attention; less under grouped-query attention)."""
    h = shape.hidden_size
    return h + 2.0 * h * shape.kv_heads / shape.num_attention_heads


def mlp_matmuls(shape: ModelShape) -> int:
    """h x f matmuls of the MLP: two (fc1, fc2), or three under SwiGLU (fc1 is 2f wide: gate and value)."""
    return 3 if shape.swiglu else 2


def moe_tokens(shape: ModelShape) -> int:
    """Tokens of a microbatch that enter one GPU's MoE layer: its s/cp x b tokens, split t ways by sequence
    parallelism (which megatron-core's MoELayer.forward requires under tensor parallelism)."""
    return local_tokens(shape) // _t(shape)


def expert_token_scale(shape: ModelShape, imbalance: float = 1.0) -> float:
    """The tokens the busiest local expert computes, against its balanced share (T x topk / E of the routed
    tokens): the load `imbalance` (1: balanced), held under the capacity factor where one is given (tokens past it
    are dropped: `moe_utils.py` topk_softmax_with_capacity), exactly the capacity under
    --moe-pad-expert-input-to-capacity."""
    if shape.moe_capacity_factor is None:
        return imbalance
    if shape.moe_pad_to_capacity:
        return shape.moe_capacity_factor
    return min(imbalance, shape.moe_capacity_factor)


def mlp_weight_flops(shape: ModelShape, expert_scale: float = 1.0) -> float:
    """Forward FLOPs of one layer's MLP weight GEMMs on one GPU: 2bsfh per h x f matmul over t; under experts the
    routed experts' 2bs x topk x h x f_moe (each token through topk experts; per GPU, after the dispatch, its local
    experts' T x topk x etp tokens of f_moe / etp each: the same over t) times `expert_scale` (`expert_token_scale`),
    plus the shared expert's 2bs h f_shared over t."""
    b, s, h = shape.micro_batch_size, local_seq(shape), shape.hidden_size
    if not shape.moe:
        return 2.0 * mlp_matmuls(shape) * b * s * h * shape.ffn_hidden_size / _t(shape)
    routed = shape.expert_ffn * shape.moe_router_topk * expert_scale
    return 2.0 * mlp_matmuls(shape) * b * s * h * (routed + shape.moe_shared_expert_ffn) / _t(shape)


def router_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one layer's router GEMM on one GPU (megatron-core `transformer/moe/router.py`
    TopKRouter.gating: logits[T, E] = x[T, h] W^T over the GPU's T tokens); 0 without experts. Megatron's
    `num_floating_point_operations` does not count it."""
    return 2.0 * moe_tokens(shape) * (shape.num_experts or 0) * shape.hidden_size if shape.moe else 0.0


def layer_weight_grad_flops(shape: ModelShape, expert_scale: float = 1.0) -> float:
    """FLOPs of one decoder layer's weight matmuls (per GPU: split t ways by tensor parallelism), which is also the
    weight-gradient FLOPs of its backward: one matmul per weight matmul of the forward.

    QKV 2bsh(h + 2hg/a) (6bsh^2 with as many key/value heads as heads), output projection 2bsh^2, MLP 2bshf per
    h x f matmul (two, three with SwiGLU). The attention score/context products have no weights, so they appear
    only in the input-gradient half.
    """
    b, s, h, f = shape.micro_batch_size, local_seq(shape), shape.hidden_size, shape.ffn_hidden_size
    if shape.moe:
        return 2.0 * b * s * h * (qkv_width(shape) + h) / _t(shape) + mlp_weight_flops(shape, expert_scale)
    return (2.0 * b * s * h * (qkv_width(shape) + h) + 2.0 * mlp_matmuls(shape) * b * s * h * f) / _t(shape)


def attention_core_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one decoder layer's attention core: the score and context products, 2bs^2h each (per GPU:
    a/t heads each; under context parallelism 1/cp of them, its s/cp queries against all s keys, the causal work
    balanced over the group), the part of `layer_forward_flops` that selective recomputation redoes."""
    b, s, h = shape.micro_batch_size, shape.seq_length, shape.hidden_size
    return 4.0 * b * s * s * h / _t(shape) / _cp(shape)


def layer_forward_flops(shape: ModelShape, expert_scale: float = 1.0) -> float:
    """Forward FLOPs of one decoder layer on one GPU of its tensor-parallel group.

    QKV (6bsh^2) + output projection (2bsh^2) + MLP (4bsfh) + attention scores
    and context (4bs^2h), all over t. With f = 4h and t = 1 this is Megatron's 24bsh^2 + 4bs^2h
    (Narayanan et al., SC'21, eq. 2 without the LM head); SwiGLU and grouped-query attention as
    `layer_weight_grad_flops` says.
    """
    return layer_weight_grad_flops(shape, expert_scale) + attention_core_flops(shape)


def model_flops_per_sample(shape: ModelShape) -> float:
    """Training FLOPs of one sample through the whole model, the forward and the backward's two matmuls per
    forward matmul (3x the forward), without recomputation: what model FLOPs utilization (MFU) counts (Narayanan et
    al., SC'21, eq. 3 / Chowdhery et al. 2022): every decoder layer whole (not split t ways) and the LM head's
    2shV."""
    layers = shape.num_layers * layer_forward_flops(shape) * _t(shape) * _cp(shape) / shape.micro_batch_size
    head = 2.0 * shape.seq_length * shape.hidden_size * padded_vocab(shape)
    return 3.0 * (layers + head)


def recomputed_flops_per_sample(shape: ModelShape, layers_per_chunk: list[int] | tuple[int, ...]) -> float:
    """FLOPs one sample's recomputation adds to `model_flops_per_sample` (what hardware FLOPs utilization, HFU,
    counts on top of MFU: Korthikanti et al. 2022, Sec. 6; Narayanan et al., SC'21, eq. 3 counts the full
    recomputed forward, 4x the forward instead of 3x): full recomputation redoes the whole forward of the layers it
    covers (`ModelShape.recomputed_layers` of each model chunk of `layers_per_chunk`), selective recomputation the
    attention core of every layer (`attention_core_flops`); nothing without recomputation. The LM head is never
    recomputed."""
    per_sample = _t(shape) / shape.micro_batch_size  # per-GPU, per-micro-batch FLOPs to the whole sample's
    if shape.recompute_granularity == "selective":
        return shape.num_layers * attention_core_flops(shape) * per_sample
    layers = sum(shape.recomputed_layers(n) for n in layers_per_chunk if n)
    return layers * layer_forward_flops(shape) * per_sample


def norm_parameters(shape: ModelShape) -> float:
    """Parameters of one layer's two norms, replicated on every GPU of the tensor-parallel group: a weight and a
    bias of h each for LayerNorm, a weight only for RMSNorm."""
    return (4.0 if shape.normalization == "LayerNorm" else 2.0) * shape.hidden_size


def layer_parameters(shape: ModelShape) -> float:
    """Parameters of one decoder layer on one GPU: QKV h(h + 2hg/a) + its bias, projection h^2 + h, MLP h x f per
    matmul with biases (f per fc1 column, h for fc2), split t ways; the two norms replicated. With t = 1, multi-head
    attention, GeLU and LayerNorm: 4h^2 + 2hf + 9h + f."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if shape.moe:  # the router's E x h weight (replicated), the shared expert and the local experts
        attention = (h * qkv_width(shape) + qkv_width(shape) + h * h) / _t(shape) + h
        return (
            attention
            + mlp_parameters(shape, 0)
            + norm_parameters(shape)
            + expert_parameters(shape)
            + (shape.num_experts or 0) * h
        )
    fc1 = (mlp_matmuls(shape) - 1) * f  # fc1's output width
    split = (h * qkv_width(shape) + qkv_width(shape) + h * h + h * fc1 + fc1 + f * h) / _t(shape)
    # Row-parallel layers (projection, fc2) keep their bias whole on every GPU.
    return split + 2.0 * h + norm_parameters(shape)


def mlp_parameters(shape: ModelShape, f: int) -> float:
    """A tensor-parallel MLP of hidden f on one GPU: h x f per matmul with fc1's bias split t ways, fc2's bias
    whole (a row-parallel layer keeps its bias on every GPU); under experts the dense MLP is the shared expert
    (`SharedExpertMLP`, f = --moe-shared-expert-intermediate-size, none at 0)."""
    if shape.moe:
        f = shape.moe_shared_expert_ffn
        if not f:
            return 0.0
    h = shape.hidden_size
    fc1 = (mlp_matmuls(shape) - 1) * f  # fc1's output width
    return (h * fc1 + fc1 + f * h) / _t(shape) + h


def expert_parameters(shape: ModelShape) -> float:
    """The routed experts' parameters on one GPU (its num_experts / ep local experts, each split etp ways:
    `transformer/moe/experts.py` GroupedMLP / TEGroupedMLP / SequentialMLP), which the distributed optimizer shards
    over the expert data-parallel group; 0 without experts. A bias per expert (fc1's split, fc2's whole; megatron
    allows one only at etp 1)."""
    if not shape.moe:
        return 0.0
    h, f, etp = shape.hidden_size, shape.expert_ffn, max(1, shape.expert_tensor_parallel)
    fc1 = (mlp_matmuls(shape) - 1) * f
    return shape.local_experts * ((h * fc1 + fc1 + f * h) / etp + h)


def layer_activation_bytes(shape: ModelShape) -> float:
    """Bytes of activations one decoder layer's forward writes and its backward reads on one GPU (16-bit training).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.1-4.2): sbh(34 + 5as/h) with f = 4h at t = 1, i.e. attention
    11sbh + 5as^2b, MLP 3sbh + 4sbf (19sbh at f = 4h), LayerNorms 4sbh. Under tensor
    parallelism the norms' inputs, the attention and MLP inputs and the two dropout masks (10sbh) stay
    whole on every GPU and the rest splits t ways, sbh(10 + 24/t + 5as/(ht)); with sequence
    parallelism everything splits. Grouped-query attention keeps g/a of the key and value
    tensors (4sbh at a = g), SwiGLU keeps fc1's 2f-wide output and its f-wide product (6sbf
    instead of 4sbf); a flash kernel stores no score matrix (the 5as^2b).
    """
    b, s, h, f, a = (
        shape.micro_batch_size,
        local_seq(shape),
        shape.hidden_size,
        shape.ffn_hidden_size,
        shape.num_attention_heads,
    )
    t = _t(shape)
    whole = 10.0 * s * b * h
    kv = 4.0 * s * b * h * shape.kv_heads / a
    mlp = (6.0 if shape.swiglu else 4.0) * s * b * (shape.moe_shared_expert_ffn if shape.moe else f)
    scores = 0.0 if shape.attention_kernel == "flash" else 5.0 * a * s * s * b
    split = 4.0 * s * b * h + kv + mlp + scores  # Q 2sbh + projection input 2sbh, K and V, MLP, scores
    dense = (whole + split) / t if shape.sequence_parallel else whole + split / t
    return dense + expert_activation_bytes(shape) if shape.moe else dense


def expert_activation_bytes(shape: ModelShape, imbalance: float = 1.0) -> float:
    """Bytes one GPU's MoE layer stores for its backward (0 without experts), of its T tokens (`moe_tokens`) and
    the R = T x topk x etp routed rows its local experts compute (times `expert_token_scale`): the router's logits
    and fp32 probabilities (T x E, `router.py` TopKRouter), the permutation's indices and probabilities (R, int64
    and fp32: `moe_utils.py` permute), each expert's fc1 input, fc1 output (2 f_moe / etp wide under SwiGLU) and
    activation output (the fc2 input), in the training precision (`experts.py`)."""
    if not shape.moe:
        return 0.0
    e = bytes_per_element(shape)
    tokens, experts = moe_tokens(shape), shape.num_experts or 0
    etp = max(1, shape.expert_tensor_parallel)
    rows = tokens * shape.moe_router_topk * etp * expert_token_scale(shape, imbalance)
    f = shape.expert_ffn / etp
    fc1 = (mlp_matmuls(shape) - 1) * f
    router = tokens * experts * ((4 if shape.moe_router_fp32 else e) + 4)
    return router + rows * (12 + (shape.hidden_size + fc1 + f) * e)


def boundary_activation_bytes(shape: ModelShape) -> float:
    """Bytes sent between pipeline stages per microbatch by one GPU: the hidden states, s x b x h elements (s/t x b
    x h under sequence parallelism, each GPU of the group sending its slice)."""
    tokens = local_seq(shape) // _t(shape) if shape.sequence_parallel else local_seq(shape)
    return float(tokens * shape.micro_batch_size * shape.hidden_size * bytes_per_element(shape))


def padded_vocab(shape: ModelShape) -> int:
    """The vocabulary size Megatron allocates: the next multiple of VOCAB_PADDING x t."""
    multiple = VOCAB_PADDING * _t(shape)
    return math.ceil(shape.vocab_size / multiple) * multiple


def vocab_per_gpu(shape: ModelShape) -> int:
    """Rows of the word embedding (and columns of the output layer) one GPU holds: the vocabulary splits t ways."""
    return padded_vocab(shape) // _t(shape)


def stage_parameters(shape: ModelShape, layers: int, first: bool, last: bool, ranks: int) -> float:
    """Parameters one GPU of a pipeline rank holds (its share of the tensor-parallel split): its decoder layers,
    plus the word embedding (V/t rows) and learned position embeddings on the first stage, the final norm and (tied
    or not) an output-layer copy of the word embedding on the last stage (one rank holding both keeps one copy)."""
    h = shape.hidden_size
    vocab = vocab_per_gpu(shape)
    total = layers * layer_parameters(shape)
    if first:
        total += vocab * h + (shape.seq_length * h if shape.position_embedding == "learned_absolute" else 0)
    if last:
        total += norm_parameters(shape) / 2 + (vocab * h if ranks > 1 else 0)
    return float(total)
