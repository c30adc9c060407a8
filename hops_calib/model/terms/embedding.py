"""Model room: the tied word-embedding gradient all-reduce between the first and the last stage."""

from __future__ import annotations

import math
from typing import Mapping

from hops_calib.model.terms.base import Context, Contribution, Param, Term

# Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128) times TP (1 here).
VOCAB_PADDING = 128


class EmbeddingGradAllReduce(Term):
    """Before the optimizer, the first and last stage all-reduce the tied word-embedding gradient over their link.

    Physics: Megatron ties the input and output word embeddings unless
    --untie-embeddings-and-output-weights is given. With pp > 1 the first stage
    holds the input embedding and the last stage a copy for the output layer, and
    every iteration, after the last backward and before the optimizer step,
    Megatron all-reduces their gradients (padded vocabulary x hidden elements)
    between those two ranks (`_allreduce_word_embedding_grads`). Under --bf16 it
    accumulates and reduces gradients in fp32 (`accumulate_allreduce_grads_in_fp32`
    defaults on), so 4 bytes per element. A two-rank ring all-reduce sends each
    rank's whole buffer once (2(n-1)/n = 1), so it costs the link's latency plus
    bytes over bandwidth. The other ranks wait for it: the optimizer's
    gradient-norm all-reduce spans every pipeline rank, so this is barrier work
    (pre_optimizer_ms). The first and last stage were not benchmarked as a pair
    unless pp = 2; otherwise the slowest fitted link of the run prices it, as every
    hop here crosses nodes over the same kind of network.
    """

    name = "embedding_grad_allreduce"
    params = (
        Param("bytes_per_element", 4.0, 2.0, 4.0, "bytes",
              "bytes per reduced gradient element: 4 for fp32 main grads (Megatron's default with --bf16), 2 for bf16"),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec = context.spec
        if spec.pp == 1 or spec.model.untie_embeddings:
            return Contribution()
        if not spec.links:
            raise ValueError(f"spec {spec.run_id}: term {self.name} needs link fits (calibration/link_bench) and the "
                             "spec has none; ingest the link benchmark or remove the term from the model")
        vocab = math.ceil(spec.model.vocab_size / VOCAB_PADDING) * VOCAB_PADDING
        nbytes = vocab * spec.model.hidden_size * params["bytes_per_element"]
        fit = spec.link(0, spec.pp - 1)
        cost = fit.transfer_ms(nbytes) if fit is not None else max(f.transfer_ms(nbytes) for f in spec.links)
        return Contribution(pre_optimizer_ms=cost)
