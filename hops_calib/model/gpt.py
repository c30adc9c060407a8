"""Model room: counts of a Megatron GPT model (FLOPs, parameters, bytes) that cost terms build on.

All counts are per microbatch (micro batch size b, sequence length s, hidden h,
FFN hidden f, a attention heads), for Megatron's `--transformer-impl local`
GPT layer: LayerNorm, QKV projection, core attention, output projection,
LayerNorm, two-matmul MLP. A matmul of (m x k) by (k x n) costs 2mkn FLOPs.
"""

from __future__ import annotations

import math

from hops_calib.spec import ModelShape

# Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128) times TP (1 here).
VOCAB_PADDING = 128

BYTES_PER_ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}


def bytes_per_element(shape: ModelShape) -> int:
    try:
        return BYTES_PER_ELEMENT[shape.precision]
    except KeyError:
        raise ValueError(f"unknown precision {shape.precision!r}; expected one of {sorted(BYTES_PER_ELEMENT)}"
                         ) from None


def layer_forward_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one decoder layer.

    QKV (6bsh^2) + output projection (2bsh^2) + MLP (4bsfh) + attention scores
    and context (4bs^2h). With f = 4h this is Megatron's 24bsh^2 + 4bs^2h
    (Narayanan et al., SC'21, eq. 2 without the LM head).
    """
    b, s, h, f = shape.micro_batch_size, shape.seq_length, shape.hidden_size, shape.ffn_hidden_size
    return 8.0 * b * s * h * h + 4.0 * b * s * h * f + 4.0 * b * s * s * h


def attention_core_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one decoder layer's attention core: the score and context products, 2bs^2h each (the part
    of `layer_forward_flops` that selective recomputation redoes)."""
    b, s, h = shape.micro_batch_size, shape.seq_length, shape.hidden_size
    return 4.0 * b * s * s * h


def layer_weight_grad_flops(shape: ModelShape) -> float:
    """Weight-gradient FLOPs of one decoder layer's backward: one matmul per weight matmul of the forward.

    The attention score/context products have no weights, so they appear only in
    the input-gradient half.
    """
    b, s, h, f = shape.micro_batch_size, shape.seq_length, shape.hidden_size, shape.ffn_hidden_size
    return 8.0 * b * s * h * h + 4.0 * b * s * h * f


def layer_parameters(shape: ModelShape) -> float:
    """Parameters of one decoder layer: QKV 3h^2+3h, projection h^2+h, MLP 2hf+f+h, two LayerNorms 4h."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return 4.0 * h * h + 2.0 * h * f + 9.0 * h + f


def layer_activation_bytes(shape: ModelShape) -> float:
    """Bytes of activations one decoder layer's forward writes and its backward reads (16-bit training).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.1): sbh(34 + 5as/h) with f = 4h, i.e. attention
    11sbh + 5as^2b, MLP 3sbh + 4sbf (19sbh at f = 4h), LayerNorms 4sbh.
    """
    b, s, h, f, a = (shape.micro_batch_size, shape.seq_length, shape.hidden_size, shape.ffn_hidden_size,
                     shape.num_attention_heads)
    return 18.0 * s * b * h + 4.0 * s * b * f + 5.0 * a * s * s * b


def boundary_activation_bytes(shape: ModelShape) -> float:
    """Bytes sent between pipeline stages per microbatch: the hidden states, s x b x h elements."""
    return float(shape.seq_length * shape.micro_batch_size * shape.hidden_size * bytes_per_element(shape))


def padded_vocab(shape: ModelShape) -> int:
    """The vocabulary size Megatron allocates: the next multiple of VOCAB_PADDING."""
    return math.ceil(shape.vocab_size / VOCAB_PADDING) * VOCAB_PADDING


def stage_parameters(shape: ModelShape, layers: int, first: bool, last: bool, ranks: int) -> float:
    """Parameters a pipeline rank holds: its decoder layers, plus the word and position embeddings on the first
    stage, the final LayerNorm and (tied or not) an output-layer copy of the word embedding on the last stage
    (one rank holding both keeps one copy)."""
    h = shape.hidden_size
    vocab = padded_vocab(shape)
    total = layers * layer_parameters(shape)
    if first:
        total += vocab * h + shape.seq_length * h
    if last:
        total += 2 * h + (vocab * h if ranks > 1 else 0)
    return float(total)
