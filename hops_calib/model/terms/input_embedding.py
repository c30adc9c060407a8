"""Model room: the first stage's input embedding (batch fetch, lookup, and its dense gradient)."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term

GRAD_BYTES = 4  # fp32 main gradients (Megatron's default under --bf16)


class InputEmbedding(Term):
    """The first stage fetches the batch and looks up word and position embeddings; backward accumulates a dense V x h gradient.

    Physics: only the first pipeline stage runs `get_batch` (the mock dataset's
    tokens, labels, masks and position ids, built and copied to the device) and
    the embedding lookups; both are a fixed host cost per microbatch, not FLOPs.
    Backward scatters the token gradients into the word-embedding gradient, and
    Megatron accumulates that V x h buffer in fp32 main-grad storage: passes over
    V·h·4 bytes at the device's memory bandwidth.
    """

    name = "input_embedding"
    params = (
        Param(
            "forward_ms",
            1.0,
            0.0,
            20.0,
            "ms",
            "host time of get_batch and the embedding lookups per microbatch",
            per_device=True,
        ),
        Param(
            "backward_ms",
            0.0,
            0.0,
            20.0,
            "ms",
            "fixed host time of the embedding backward per microbatch",
            per_device=True,
        ),
        Param("grad_passes", 2.0, 0.0, 20.0, "passes", "passes over the fp32 V x h word-embedding gradient"),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        layout, shape = context.layout, context.spec.model
        device = context.device_of(0)
        grad_ms = (
            gpt.vocab_per_gpu(shape) * shape.hidden_size * GRAD_BYTES / (device.memory_bandwidth_bytes_per_s / 1e3)
        )
        forward, backward = [0.0] * layout.virtual_stages, [0.0] * layout.virtual_stages
        forward[0] = self.value(params, "forward_ms", device.type)
        backward[0] = self.value(params, "backward_ms", device.type) + params["grad_passes"] * grad_ms
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward), weight_grad_ms=tuple(backward))
