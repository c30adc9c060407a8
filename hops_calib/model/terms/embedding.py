"""Model room: the tied word-embedding gradient all-reduce between the first and the last stage."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hops_calib.model import gpt
from hops_calib.model.memory import bf16_gradients
from hops_calib.model.terms.base import Context, Contribution, Param, Term
from hops_calib.spec import Spec
from hops_calib.trace.link_bench import LinkFit


def end_to_end_link(
    spec: Spec, nic_bytes_per_ms: tuple[float, float] = (0.0, 0.0), flow_cap_bytes_per_ms: float = math.inf
) -> tuple[LinkFit, bool]:
    """The link between the first and the last stage: benchmarked when pp = 2, otherwise estimated.

    A connection runs at the slower of its two ends. An end's network is at
    least as fast as the fastest link it was benchmarked on, and at least
    `nic_bytes_per_ms` (its NIC's nominal bandwidth at the achievable protocol
    efficiency; 0 = not known). A single TCP flow cannot exceed
    `flow_cap_bytes_per_ms`, benchmarked or not. Returns the link and whether that
    ceiling, rather than a NIC or a measured link, sets its bandwidth.
    """
    last = spec.pp - 1
    direct = spec.link(0, last)
    if direct is None:

        def capability(stage: int, nic: float) -> tuple[float, LinkFit | None]:
            touching = [f for f in spec.links if stage in (f.src_stage, f.dst_stage)]
            fastest = max(touching, key=lambda f: f.bytes_per_ms) if touching else None
            return max(nic, fastest.bytes_per_ms if fastest else 0.0), fastest

        ends = [capability(0, nic_bytes_per_ms[0]), capability(last, nic_bytes_per_ms[1])]
        slower, fit = min(ends, key=lambda end: end[0])
        fit = fit or min(spec.links, key=lambda f: f.bytes_per_ms)
        direct = LinkFit(
            0,
            last,
            latency_ms=fit.latency_ms,
            bytes_per_ms=slower or fit.bytes_per_ms,
            source=f"estimated from the ends' links and NICs ({fit.source})",
        )
    return flow_capped(direct, flow_cap_bytes_per_ms)


def flow_capped(link: LinkFit, flow_cap_bytes_per_ms: float) -> tuple[LinkFit, bool]:
    """`link` held under one TCP flow's ceiling, and whether the ceiling, not the link, sets its bandwidth."""
    if link.bytes_per_ms > flow_cap_bytes_per_ms:
        return LinkFit(
            link.src_stage,
            link.dst_stage,
            latency_ms=link.latency_ms,
            bytes_per_ms=flow_cap_bytes_per_ms,
            source=f"{link.source}, capped at one TCP flow's ceiling",
        ), True
    return link, False


def links_transport(spec: Spec) -> str:
    """The transport of `spec`'s traffic between nodes: the launch's (`Spec.transport`), else its links' between
    nodes (`LinkFit.transport`): "socket" when one runs over TCP sockets, "" when one says nothing (or there is
    none), else the one (or the "/"-joined several) they name."""
    if spec.transport:
        return spec.transport
    names = {fit.transport for fit in spec.links if not fit.intra_node}
    if "socket" in names:
        return "socket"
    return "" if "" in names else "/".join(sorted(names))


def over_sockets(spec: Spec) -> bool:
    """Whether `spec`'s traffic between nodes runs over NCCL's TCP socket transport, each connection one flow with
    its ceiling (and, for the ends' all-reduce, its retransmission stalls): when the launch or a link says
    sockets; when nothing says, where a link benchmark prices it (the cluster runs' own transport, kept as the
    default) but not where the NIC share prices it (the device's NIC, as NCCL runs it when nothing is said: over
    verbs on the InfiniBand NICs of the catalog's A100 nodes); never over verbs (InfiniBand, RoCE) or a network
    plugin, which have neither."""
    said = links_transport(spec)
    return said == "socket" or (said == "" and bool(spec.links))


def socket_flow_bytes_per_ms(spec: Spec, flow_cap_gbit_s: float) -> float:
    """The ceiling of one NCCL connection between nodes, bytes per ms: `flow_cap_gbit_s` over sockets
    (`over_sockets`), none (inf) otherwise."""
    return flow_cap_gbit_s * 1e9 / 8 / 1e3 if over_sockets(spec) else math.inf


def transport_note(spec: Spec) -> str | None:
    """What a what-if says when the launch's traffic between nodes does not say its transport: how it is then
    priced (None when it says, or nothing crosses nodes)."""
    if links_transport(spec):
        return None
    how = "no NCCL_NET or NCCL_IB_DISABLE=1 at the start of megatron_args.txt's command line"
    if any(not fit.intra_node for fit in spec.links):
        if spec.pp == 1 or spec.model.untie_embeddings:
            return None
        return (
            f"the links' transport is not said (no `transport` field or NCCL 'Using network' line in "
            f"calibration/link_bench, {how}): the ends' all-reduce is priced as NCCL's TCP socket transport, with "
            "one flow's ceiling and its retransmission stalls, as on the cluster runs; on InfiniBand or RoCE "
            "start it with NCCL_NET=IB and neither applies"
        )
    if not spec.links and spec.gpus_per_node and spec.gpus > spec.gpus_per_node:
        return (
            f"the transport between nodes is not said ({how}): collectives and hops across nodes are priced "
            "at the GPUs' share of their nodes' NICs, as NCCL runs verbs (InfiniBand, RoCE); over TCP sockets "
            "start the line with NCCL_NET=Socket (or NCCL_IB_DISABLE=1): each connection across nodes is then "
            "capped at one TCP flow's ceiling and the ends' all-reduce risks its retransmission stalls"
        )
    return None


def fp32_grad_buffers(spec: Spec) -> bool:
    """Whether Megatron keeps (and all-reduces) gradients in fp32: `--accumulate-allreduce-grads-in-fp32`, which
    Megatron-LM turns on under --bf16 and fp32 training has anyway; under --fp16 without it the grads are fp16, and
    under --bf16 --grad-reduce-in-bf16 bf16 (`memory.bf16_gradients`: the main_grad the embedding all-reduce reduces,
    finalize_model_grads.py _allreduce_word_embedding_grads, is the gradient buffer's)."""
    if bf16_gradients(spec):
        return False
    given = spec.megatron_args.get("accumulate_allreduce_grads_in_fp32")
    if given is not None:
        return bool(given)
    return spec.model.precision != "fp16"


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
    link each end was benchmarked on and, with `nic_efficiency` > 0, from each end
    node's nominal NIC bandwidth (device constant, AWS instance pages) at that
    protocol efficiency (TCP/IP and NCCL framing). NCCL's socket transport moves
    one connection's data through one TCP flow, whose throughput is bounded
    below the NIC by the host stack (`flow_cap_gbit_s`), benchmarked pair or not.
    Over verbs (InfiniBand, RoCE: `LinkFit.transport` "ib") or a network plugin the
    NIC moves the data without a TCP flow: no ceiling, no retransmission timeout
    (`over_sockets`); a link that does not say its transport is priced as sockets,
    as the cluster runs' were. Without a link benchmark the end GPU's NIC share
    prices it, held at the same ceiling over sockets; unsaid there, as verbs.

    A flow that runs at that ceiling, not paced by a slower NIC, overruns a
    queue now and then; a lost segment at the tail of the transfer is recovered
    only by TCP's retransmission timeout, whose floor on Linux is 200 ms
    (TCP_RTO_MIN = HZ/5, include/net/tcp.h). The expected stall per all-reduce
    is `stall_probability` x `rto_ms` on such flows and nothing on NIC-paced
    ones (an A10G end at 10 Gbit/s). With `realize_stalls` = 0 the expected
    value is added to every iteration: the window throughput averages the
    stalls, but then no predicted iteration is a stall-free one, as the median
    real iteration is. With 1 the stall goes to the simulator as an occasional
    delay (`Pipeline.stall_ms`), which places whole stalls in round(N p) of the
    N iterations, as a typical run has them.

    When both ends sit in one node and the machine's collective benchmark has a
    2-GPU all-reduce table (`Spec.collectives`: NVLink, no TCP, no stalls), the
    all-reduce costs that table's measured time at its size. Under --fp16
    Megatron keeps fp16 gradient buffers unless
    --accumulate-allreduce-grads-in-fp32 (on by default only with --bf16), so the
    elements are 2 bytes there; `bytes_per_element` prices fp32 buffers.

    The link benchmark times one-way sends; a two-rank all-reduce sends and
    receives at once over the same NICs and adds its reduction kernels, so it
    reaches `collective_efficiency` of the one-way bandwidth.

    A capped flow between two ends whose NICs can both burst far above the
    ceiling (two 100 Gbit/s H100 nodes, against 25 Gbit/s for an L4 end) sends
    line-rate bursts into a path shaped at the flow's rate; the shaper drops
    segments, and fast retransmission and window recovery (no timeout) cost
    throughput in proportion to the overrun. With `overrun = min(NIC_first,
    NIC_last) / ceiling` (nominal NIC rates, device constants), the flow's
    goodput is the ceiling / (1 + `overrun_loss` x (overrun - 1)) when the
    overrun exceeds 1. The same drops make a tail loss, and so a retransmission
    timeout, likelier: the stall probability is `stall_probability` x (1 +
    `stall_overrun_gain` x (overrun - 1)).
    """

    name = "embedding_grad_allreduce"
    category = "ends_allreduce"  # the breakdown shows it apart: it is what moves when the ends move
    params = (
        Param(
            "bytes_per_element",
            4.0,
            2.0,
            4.0,
            "bytes",
            "bytes per reduced gradient element: 4 for fp32 main grads (Megatron's default with --bf16), 2 for bf16",
        ),
        Param(
            "nic_efficiency",
            0.0,
            0.0,
            1.0,
            "fraction of NIC",
            "achieved fraction of an end node's nominal NIC bandwidth (0: use only the benchmarked links)",
        ),
        Param("flow_cap_gbit_s", 1000.0, 1.0, 1000.0, "Gbit/s", "throughput ceiling of one NCCL TCP flow", log=True),
        Param(
            "collective_efficiency",
            1.0,
            0.5,
            1.0,
            "fraction of p2p",
            "all-reduce bandwidth as a fraction of the one-way p2p bandwidth (both directions at once)",
        ),
        Param(
            "stall_probability",
            0.0,
            0.0,
            1.0,
            "per all-reduce",
            "chance that a flow at the TCP ceiling waits out one retransmission timeout",
        ),
        Param("rto_ms", 200.0, 50.0, 1000.0, "ms", "TCP retransmission timeout floor (Linux TCP_RTO_MIN: 200 ms)"),
        Param(
            "realize_stalls",
            0.0,
            0.0,
            1.0,
            "switch",
            "1: whole stalls in a typical run's iterations (the median iteration has none); 0: the expected stall on "
            "every iteration",
            choices=(0.0, 1.0),
        ),
        Param(
            "stall_overrun_gain",
            0.0,
            0.0,
            2.0,
            "per unit of overrun",
            "relative growth of the stall probability per unit of the slower end's NIC overrun of the ceiling",
        ),
        Param(
            "overrun_loss",
            0.0,
            0.0,
            1.0,
            "per unit of overrun",
            "goodput lost per unit by which the slower end's NIC rate exceeds the flow ceiling (shaper drops)",
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        price = end_collective(context.spec, params, context.devices)
        if price is None:
            return Contribution()
        if price.stall_ms:
            return Contribution(
                pre_optimizer_ms=price.transfer_ms, stall_ms=price.stall_ms, stall_probability=price.stall_probability
            )
        return Contribution(pre_optimizer_ms=price.transfer_ms + price.expected_stall_ms)


@dataclass(frozen=True)
class EndCollective:
    """The tied word-embedding gradient all-reduce between the first and the last stage, as priced: its bytes, the
    link it runs over (None: the node's 2-GPU all-reduce table), its time, and the retransmission stall it risks
    (`stall_ms` > 0: realized as whole stalls; else `expected_stall_ms` is added to every iteration)."""

    nbytes: float
    link: LinkFit | None
    transfer_ms: float
    capped: bool  # the one-TCP-flow ceiling, not a NIC or a measured link, sets its bandwidth
    stall_probability: float = 0.0
    stall_ms: float = 0.0
    expected_stall_ms: float = 0.0

    @property
    def ms(self) -> float:
        """Its time in an average iteration, the stall weighted by its probability."""
        return self.transfer_ms + self.expected_stall_ms + self.stall_probability * self.stall_ms

    def source(self) -> str:
        return "the node's 2-GPU all-reduce table (NVLink)" if self.link is None else self.link.source

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": "tied word-embedding gradient all-reduce between the first and the last stage, before the "
            "optimizer",
            "bytes": self.nbytes,
            "ms": self.ms,
            "transfer_ms": self.transfer_ms,
            "stall_probability": self.stall_probability,
            "stall_ms": self.stall_ms
            or (self.expected_stall_ms / self.stall_probability if self.stall_probability else 0.0),
            "bandwidth_gbit_s": self.link.bandwidth_gbit_s if self.link else None,
            "latency_ms": self.link.latency_ms if self.link else None,
            "capped_at_one_tcp_flow": self.capped,
            "source": self.source(),
        }


def end_collective(spec: Spec, params: Mapping[str, float], devices: Sequence[Any]) -> EndCollective | None:
    """How `EmbeddingGradAllReduce` prices `spec`'s end-to-end all-reduce (None: no tied embedding to reduce, or
    one stage). `devices`: the model's device specs per rank."""
    if spec.pp == 1 or spec.model.untie_embeddings:
        return None
    element = params["bytes_per_element"] if fp32_grad_buffers(spec) else gpt.bytes_per_element(spec.model)
    nbytes = gpt.vocab_per_gpu(spec.model) * spec.model.hidden_size * element
    table = spec.collective("all_reduce", 2)
    # one TCP flow's ceiling, and so its overrun and stalls, only where NCCL runs over sockets (`over_sockets`)
    cap = socket_flow_bytes_per_ms(spec, params["flow_cap_gbit_s"])
    nominal = tuple(devices[rank].network_bandwidth_bytes_per_s / 1e3 for rank in (0, spec.pp - 1))
    if not spec.links and spec.gpus_per_node and not (table is not None and spec.same_node(0, spec.pp - 1)):
        # GPUs placed on nodes, no link benchmark: a 2-GPU ring all-reduce (each end sends the buffer once) over
        # NVLink within a node, else over the end GPU's share of its node's NICs, as one TCP flow over sockets
        device = devices[0]
        inside = spec.same_node(0, spec.pp - 1) and device.intra_node_bandwidth_bytes_per_s
        rate = (
            device.intra_node_bandwidth_bytes_per_s
            if inside
            else (params["nic_efficiency"] * device.network_bandwidth_bytes_per_s)
        )
        link = LinkFit(
            0,
            spec.pp - 1,
            latency_ms=0.0,
            bytes_per_ms=rate / 1e3,
            source="NVLink within the node" if inside else "the end GPU's share of its node's NICs",
        )
        if inside or link.bytes_per_ms <= cap:
            return EndCollective(nbytes, link, nbytes / (rate / 1e3), False)
        link, capped = flow_capped(link, cap)  # the flow, measured by the link benchmark as the other path's
    else:
        if not spec.links:
            raise ValueError(
                f"spec {spec.run_id}: term {EmbeddingGradAllReduce.name} needs link fits "
                "(calibration/link_bench) and the spec has none; ingest the link benchmark or remove the "
                "term from the model"
            )
        if table is not None and spec.same_node(0, spec.pp - 1):
            # Both ends in one node: NCCL all-reduces over NVLink, as the node's benchmark measured it (no TCP).
            return EndCollective(nbytes, None, table.measured_ms(nbytes), False)
        nic = tuple(params["nic_efficiency"] * rate for rate in nominal)
        link, capped = end_to_end_link(spec, nic, cap)
    slowdown = 1.0
    overrun = max(0.0, min(nominal) / cap - 1.0) if capped else 0.0
    slowdown += params["overrun_loss"] * overrun
    link = LinkFit(
        link.src_stage,
        link.dst_stage,
        latency_ms=link.latency_ms,
        bytes_per_ms=link.bytes_per_ms * params["collective_efficiency"] / slowdown,
        source=link.source,
    )
    probability = (
        min(1.0, params["stall_probability"] * (1.0 + params["stall_overrun_gain"] * overrun)) if capped else 0.0
    )
    transfer = link.transfer_ms(nbytes)
    if params["realize_stalls"] == 1.0 and probability > 0:
        return EndCollective(nbytes, link, transfer, capped, probability, stall_ms=params["rto_ms"])
    return EndCollective(nbytes, link, transfer, capped, probability, expected_stall_ms=probability * params["rto_ms"])
