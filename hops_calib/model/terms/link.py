"""Model room: the wire time of activations and gradients between adjacent pipeline stages."""

from __future__ import annotations

from typing import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Term


class LinkTransfer(Term):
    """Each hop carries s x b x h bf16 elements, costing the link's latency plus bytes over its bandwidth.

    Physics: between stages Megatron sends the hidden states forward and their
    gradient (same shape) backward, once per microbatch. The link benchmark (a
    separate job on the same nodes) measured NCCL send times for 1-64 MB messages;
    its latency + size / bandwidth fit (`Spec.links`) prices a message of any
    size. A hop whose stage pair was not benchmarked (the wrap-around hop of an
    interleaved schedule) takes the slowest fitted link of the run: every hop
    here crosses nodes over the same kind of network. No parameters: the fit is
    a measurement of the link, not of the run being predicted.
    """

    name = "link_transfer"

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec, layout = context.spec, context.layout
        if layout.hops == 0:
            return Contribution()
        if not spec.links:
            raise ValueError(f"spec {spec.run_id}: term {self.name} needs link fits (calibration/link_bench) and the "
                             "spec has none; ingest the link benchmark or remove the term from the model")
        nbytes = gpt.boundary_activation_bytes(spec.model)
        slowest_ms = max(fit.transfer_ms(nbytes) for fit in spec.links)
        times = []
        for k in range(layout.hops):
            fit = spec.link(layout.rank_of(k), layout.rank_of(k + 1))
            times.append(fit.transfer_ms(nbytes) if fit is not None else slowest_ms)
        return Contribution(forward_transfer_ms=tuple(times), backward_transfer_ms=tuple(times))
