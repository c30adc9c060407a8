"""Model room: the memory traffic of unfused attention scores in every decoder layer."""

from __future__ import annotations

from typing import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term


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
    """

    name = "attention_score_traffic"
    scope = "layers"
    params = (
        Param("passes_forward", 6.0, 0.0, 30.0, "passes", "16-bit passes over the score matrix in a layer's forward"),
        Param("passes_backward", 8.0, 0.0, 40.0, "passes", "16-bit passes over the score matrix in a layer's backward"),
        Param("memory_efficiency", 1.0, 0.05, 1.0, "fraction of peak",
              "achieved fraction of the device memory bandwidth in the score passes (streaming kernels reach 0.8-0.9)"),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        score_bytes = (shape.micro_batch_size * shape.num_attention_heads * shape.seq_length ** 2
                       * gpt.bytes_per_element(shape))
        forward, backward = [], []
        for k, layers in enumerate(context.layout.layers):
            bytes_per_ms = context.device_of(k).memory_bandwidth_bytes_per_s * params["memory_efficiency"] / 1e3
            pass_ms = score_bytes / bytes_per_ms
            forward.append(layers * params["passes_forward"] * pass_ms)
            backward.append(layers * params["passes_backward"] * pass_ms)
        # Every pass of the forward is the attention core's (selective recomputation redoes them all).
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward), attention_core_ms=tuple(forward))
