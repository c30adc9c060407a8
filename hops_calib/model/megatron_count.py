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
    return float(batch_size * s * (expansion * layers * h * ffn * gated + attention + 3 * 2 * h * _padded_vocab(args)))
