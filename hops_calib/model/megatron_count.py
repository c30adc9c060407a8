"""Model room: Megatron-LM's own count of a step's FLOPs (`num_floating_point_operations`), which the kernel lists'
`model_flops` are checked against."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _padded_vocab(args: Mapping[str, Any]) -> int:
    """`args.padded_vocab_size` as Megatron-LM sets it (`megatron/training/tokenizer/tokenizer.py`
    `_vocab_size_with_padding`: the vocabulary rounded up to a multiple of --make-vocab-size-divisible-by (128) x
    t)."""
    if args.get("padded_vocab_size"):
        return int(args["padded_vocab_size"])
    multiple = int(args.get("make_vocab_size_divisible_by", 128)) * int(args.get("tensor_model_parallel_size", 1))
    return math.ceil(int(args["vocab_size"]) / multiple) * multiple


def moe_layer_pattern(args: Mapping[str, Any]) -> list[int]:
    """Which decoder layers are MoE (1) or dense (0), as Megatron-LM's `num_floating_point_operations` reads
    --moe-layer-freq: an integer N makes layer i MoE when i % N == 0, a list is the pattern itself; every layer dense
    without --num-experts."""
    layers = int(args["num_layers"])
    if not args.get("num_experts"):
        return [0] * layers
    from hops_calib.spec.assumptions import layer_pattern

    freq = layer_pattern(args.get("moe_layer_freq") or 1)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    pattern = [int(v) for v in freq]
    if len(pattern) != layers:
        raise ValueError(f"megatron_flops: --moe-layer-freq has {len(pattern)} entries for {layers} layers")
    return pattern


def megatron_flops(args: Mapping[str, Any], batch_size: int) -> float:
    """Megatron-LM's `num_floating_point_operations(args, batch_size)` (`megatron/training/training.py`, the
    `transformer_flops` branch, Megatron-LM core_r0.16.0), for a GPT without multi-latent attention or multi-token
    prediction (a launch the cost model prices; anything else is refused), dense or a mixture of experts:

        expansion = 3 x 2 x 2 (forward, weight and input gradient; two GEMMs of each size; 2 FLOPs a multiply-add)
        attention = expansion x L x h x h x ((1 + g/a + s/h/2) x (kv_channels x a / h))   # causal: half of s^2
        mlp = expansion x L x h x (f x gated x dense/L + (f_moe x topk + f_shared) x gated x moe/L)
        total = B x s x (mlp + attention + 3 x 2 x h x V_padded)

    with dense and moe the layers --moe-layer-freq makes dense and MoE (`moe_layer_pattern`; all dense without
    --num-experts), f_moe --moe-ffn-hidden-size (default --ffn-hidden-size), topk --moe-router-topk (the experts each
    token is routed to; the router's own GEMM is not counted), f_shared --moe-shared-expert-intermediate-size (0
    without), gated 3/2 under SwiGLU.

    The file is Megatron-LM's training loop, not part of the megatron-core package installed here, so this is
    that function re-written from its source; `tests/model/test_kernels.py` checks the kernels' FLOPs against it.
    """
    for unsupported in ("multi_latent_attention", "mtp_num_layers", "hybrid_override_pattern"):
        if args.get(unsupported):
            raise ValueError(f"megatron_flops: --{unsupported.replace('_', '-')} is not a GPT the count covers")
    layers, h, s = int(args["num_layers"]), int(args["hidden_size"]), int(args["seq_length"])
    heads = int(args["num_attention_heads"])
    kv_channels = int(args.get("kv_channels") or h // heads)
    groups = int(args["num_query_groups"]) if args.get("group_query_attention") else heads
    ffn = int(args.get("ffn_hidden_size") or 4 * h)
    gated = 3 / 2 if args.get("swiglu") else 1
    expansion = 3 * 2 * 2
    query_ratio = kv_channels * heads / h
    attention = expansion * layers * h * h * ((1 + groups / heads + s / h / 2) * query_ratio)
    if not args.get("num_experts"):
        mlp = expansion * layers * h * ffn * gated
    else:
        moe_layers = sum(moe_layer_pattern(args))
        dense_layers = layers - moe_layers
        expert_ffn = int(args.get("moe_ffn_hidden_size") or ffn)
        topk = int(args.get("moe_router_topk") or 2)
        shared = int(args.get("moe_shared_expert_intermediate_size") or 0)
        mlp = (
            expansion
            * layers
            * h
            * (
                ffn * gated * (dense_layers / layers)
                + expert_ffn * topk * gated * (moe_layers / layers)
                + shared * gated * (moe_layers / layers)
            )
        )
    return float(batch_size * s * (mlp + attention + 3 * 2 * h * _padded_vocab(args)))
