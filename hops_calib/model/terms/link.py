"""Model room: the wire time of activations and gradients between adjacent pipeline stages."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term


class LinkTransfer(Term):
    """Each hop carries s x b x h bf16 elements, priced from the link benchmark: its fit, or its median at that size.

    Physics: between stages Megatron sends the hidden states forward and their
    gradient (same shape) backward, once per microbatch. The link benchmark (a
    separate job on the same nodes) measured NCCL send times for 1-64 MB messages;
    its latency + size / bandwidth fit (`Spec.links`) prices a message of any
    size. A hop whose stage pair was not benchmarked (the wrap-around hop of an
    interleaved schedule) takes the slowest fitted link of the run: every hop
    here crosses nodes over the same kind of network.

    The benchmark's time is not affine in size: 1-2 MB messages ride socket
    buffers and cost less per byte than 64 MB ones, so the least-squares line
    has a negative intercept on almost every pair, and held at zero latency it
    over-prices the 0.5-6 MB messages of these runs. `measured_weight` reads
    instead the benchmark's own median at the message size, interpolated
    between the measured sizes: 0 is the fit, 1 the measurement. Both readings
    are of the link benchmark, never of the run being predicted.

    The benchmark sends its messages back to back; a pipeline sends one every
    few milliseconds. On a shaped network (an instance's bandwidth allowance,
    such as the A10G nodes' "up to 10 Gbps") that is not the same link: a
    burst passes faster than a stream. The A10G pairs' median at 2 MiB (1.6
    ms) is the shaped 10 Gbit/s, their fastest repetition 0.5 ms; in the train
    runs a 2 MiB hop between A10G nodes reaches an idle consumer 0.8-1.0 ms
    after its producer ends, net of the host time after a receive. With
    `burst_mib` > 0 a hop is priced instead by `LinkFit.burst_ms`: its first
    `burst_mib` MiB at the rate of the benchmark's smallest message (1 MiB,
    sent within the allowance) and the rest at the rate of its largest
    messages (the shaped stream). On unshaped links the two rates agree. A hop
    within one node (`LinkFit.intra_node`, priced from the node's all-reduce
    benchmark by the ring formula) crosses NVLink, which no allowance shapes,
    and is priced by the weighted reading.
    """

    name = "link_transfer"
    category = "p2p"
    params = (
        Param(
            "measured_weight",
            0.0,
            0.0,
            1.0,
            "weight",
            "0: latency + bandwidth fit; 1: the benchmark's median at the message size (interpolated)",
        ),
        Param(
            "burst_mib",
            0.0,
            0.0,
            64.0,
            "MiB",
            "0: price hops by the weighted reading above; > 0: a hop's first burst_mib MiB at the benchmark's "
            "smallest-message rate, the rest at its largest-message rate (LinkFit.burst_ms)",
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        spec, layout = context.spec, context.layout
        if layout.hops == 0:
            return Contribution()
        if not spec.links and not spec.gpus_per_node:
            from hops_calib.errors import InputError

            raise InputError(
                f"run {spec.run_id}",
                f"has no link benchmark, and term {self.name} prices its hops from one",
                field="links",
                hint="add the job's calibration/link_bench/pair_<i>_<i+1>.jsonl and ingest it again; "
                "or take the fixture out of the store to score the others",
            )
        nbytes = gpt.boundary_activation_bytes(spec.model)
        weight, burst_bytes = params["measured_weight"], params["burst_mib"] * 2**20

        def cost(fit) -> float:
            if burst_bytes > 0 and not fit.intra_node:  # an NVLink hop is not shaped: no burst allowance
                return fit.burst_ms(nbytes, burst_bytes)
            return (1.0 - weight) * fit.transfer_ms(nbytes) + weight * fit.measured_ms(nbytes)

        def unmeasured(a: int, b: int) -> float:
            """A hop no benchmark measured, between GPUs placed on nodes: over NVLink within a node, else over
            the sending GPU's share of its node's NICs (every GPU of a stage sends its own hop at once), held
            under one connection's ceiling (one TCP flow's over sockets: `Context.connection_cap_bytes_per_ms`)."""
            device = context.devices[a]
            inside = device.intra_node_bandwidth_bytes_per_s if spec.same_node(a, b) else None
            if inside:
                return nbytes / (inside / 1e3)
            return nbytes / min(device.network_bandwidth_bytes_per_s / 1e3, context.connection_cap_bytes_per_ms)

        slowest_ms = max((cost(fit) for fit in spec.links), default=0.0)
        times = []
        for k in range(layout.hops):
            a, b = layout.rank_of(k), layout.rank_of(k + 1)
            fit = spec.link(a, b)
            times.append(cost(fit) if fit is not None else unmeasured(a, b) if spec.gpus_per_node else slowest_ms)
        return Contribution(forward_transfer_ms=tuple(times), backward_transfer_ms=tuple(times))
