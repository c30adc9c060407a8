"""Model room: the last stage's output layer (LM head) and cross-entropy loss."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term

LOGIT_BYTES = 4  # Megatron's vocab-parallel cross entropy computes the softmax in fp32


class OutputLayerLoss(Term):
    """The last stage projects to the vocabulary and computes the cross-entropy: a GEMM plus fp32 passes over the logits.

    Physics: Megatron's GPT puts the output layer (hidden -> padded vocabulary,
    tied to the word embedding by default) and the loss on the last pipeline
    stage. The projection costs 2·s·b·h·V FLOPs forward and twice that backward
    (input and weight gradient), at an achieved fraction of the device's bf16
    peak. The vocab-parallel cross entropy then casts the s·b·V logits to fp32 and
    makes several elementwise passes over them (max, subtract, exp, sum, log,
    gather; and their gradients backward): memory-bound traffic of
    passes × s·b·V × 4 bytes over the device's memory bandwidth. At V = 50k these
    logits are hundreds of MB, which is why the last stage is the slowest on the
    GDDR6 GPUs (A10G, L4) in the traces.

    The last stage also runs host work no FLOP count sees: Megatron's
    `get_batch` returns nothing on the middle stages, but the last one fetches
    the labels and loss mask of every microbatch (data iterator, host-to-device
    copies), and the loss function masks, sums and averages the loss across the
    data-parallel group. `host_ms` is that time per microbatch, in the forward; a
    property of the instance's CPU, so it may take a value per device type.
    """

    name = "output_layer_loss"
    params = (
        Param(
            "compute_efficiency",
            0.5,
            0.01,
            1.0,
            "fraction of peak",
            "achieved fraction of dense bf16 peak in the vocabulary projection GEMM",
            log=True,
            per_device=True,
        ),
        Param(
            "logit_passes_forward",
            8.0,
            0.0,
            40.0,
            "passes",
            "fp32 passes over the logits in the forward (cast, max, exp, sum, log, gather)",
        ),
        Param(
            "logit_passes_backward",
            4.0,
            0.0,
            40.0,
            "passes",
            "fp32 passes over the logits in the backward (softmax gradient, cast back)",
        ),
        Param(
            "host_ms",
            0.0,
            0.0,
            10.0,
            "ms",
            "host time per microbatch of the last stage's batch fetch (labels, loss mask) and loss function",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        layout, shape = context.layout, context.spec.model
        last = layout.virtual_stages - 1
        device = context.device_of(last)
        tokens = gpt.local_tokens(shape)  # s / cp x b under context parallelism
        vocab = gpt.vocab_per_gpu(shape)  # the output layer is vocabulary-parallel: V/t columns per GPU
        flops_per_ms = device.peak_bf16_flops_per_s * self.value(params, "compute_efficiency", device.type) / 1e3
        bytes_per_ms = device.memory_bandwidth_bytes_per_s / 1e3
        logit_ms = tokens * vocab * LOGIT_BYTES / bytes_per_ms
        gemm_ms = 2.0 * tokens * shape.hidden_size * vocab / flops_per_ms
        zeros = [0.0] * layout.virtual_stages
        forward, backward, weight_grad = list(zeros), list(zeros), list(zeros)
        forward[last] = gemm_ms + params["logit_passes_forward"] * logit_ms + self.value(params, "host_ms", device.type)
        backward[last] = 2.0 * gemm_ms + params["logit_passes_backward"] * logit_ms
        weight_grad[last] = gemm_ms  # the weight-gradient GEMM is half of the backward projection
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward), weight_grad_ms=tuple(weight_grad))
