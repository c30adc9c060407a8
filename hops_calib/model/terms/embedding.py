"""Model room: the tied word-embedding gradient all-reduce between the first and the last stage."""

from __future__ import annotations

from typing import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.spec import LinkFit, Spec


def end_to_end_link(spec: Spec) -> LinkFit:
    """The link between the first and the last stage: benchmarked when pp = 2, otherwise estimated.

    A node's network is at least as fast as the fastest link it was benchmarked on,
    and a connection runs at the slower of its two ends; so an unbenchmarked pair
    (first, last) takes, of the fastest fitted links touching each end, the slower.
    """
    last = spec.pp - 1
    direct = spec.link(0, last)
    if direct is not None:
        return direct

    def fastest_touching(stage: int) -> LinkFit | None:
        touching = [f for f in spec.links if stage in (f.src_stage, f.dst_stage)]
        return max(touching, key=lambda f: f.bytes_per_ms) if touching else None

    ends = [f for f in (fastest_touching(0), fastest_touching(last)) if f is not None]
    if not ends:
        return min(spec.links, key=lambda f: f.bytes_per_ms)
    return min(ends, key=lambda f: f.bytes_per_ms)


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
    unless pp = 2; otherwise `end_to_end_link` estimates the pair from the fastest
    link each end was benchmarked on.
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
        nbytes = gpt.padded_vocab(spec.model) * spec.model.hidden_size * params["bytes_per_element"]
        return Contribution(pre_optimizer_ms=end_to_end_link(spec).transfer_ms(nbytes))
