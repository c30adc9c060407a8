"""Model room: the time of one collective (all-reduce, reduce-scatter, all-gather) over a tensor- or data-parallel
group of a launch, from the machine's collective benchmark where it has one, else from a ring over its links.

Pure: reads the spec (which holds the benchmark tables and the placement of ranks on nodes) and device constants.

- Measured: a group inside one node whose size has an all-reduce table (`Spec.collective`) takes the table's time
  at the message size. A ring reduce-scatter or all-gather of a buffer moves (n - 1)/n of it per GPU, half of the
  all-reduce's 2(n - 1)/n (NCCL runs the all-reduce as exactly those two), so it takes half the table's time.
- Ring model otherwise: an all-reduce of S bytes over n GPUs sends 2(n - 1)/n x S over each GPU's slowest hop of
  the ring, in 2(n - 1) steps of a latency each; reduce-scatter and all-gather half of both. A ring inside one
  node runs at the device's NVLink bandwidth (`intra_node_bandwidth_bytes_per_s`; a device without one, as a CPU
  host whose ranks talk gloo over loopback, at the slowest hop the spec's link benchmark measured, else at the
  network's). A ring across nodes crosses each node boundary once per ring; every GPU of a node runs a group of
  the same kind at the same time (all tp x dp replicas reduce together), so the node's NICs (the device's network
  bandwidth is its GPU's share of them) are shared: each group crossing the node gets the NIC share of the GPUs it
  has there (NCCL spreads a ring's channels over the NICs of its GPUs), however many other groups also cross.
  Over NCCL's TCP socket transport a ring's crossing is one connection, held under one TCP flow's ceiling
  (`Context.connection_cap_bytes_per_ms`, the ceiling the ends' all-reduce measured), whatever the NICs could do.
  Every step of a ring that crosses nodes waits for its slowest hop, a network one: each of its 2(n - 1) steps
  takes the network's latency (`net_step_latency_ms`, added to the NVLink step's).
- Two levels (`algorithm="two_level"`, a group of N nodes with g > 1 GPUs in each): the reduction as NCCL's
  tree and hierarchical algorithms run it, a level per fabric: a reduce-scatter inside each node over NVLink
  ((g - 1)/g x S per GPU, g - 1 NVLink steps; the node's g-GPU table where the spec has one), an all-reduce of
  each GPU's S/g across the N nodes over its own share of the node's NICs (2(N - 1)/N x S/g, 2(N - 1) network
  steps), and an all-gather inside the node like the reduce-scatter. A reduce-scatter is the first two levels'
  reduce-scatter halves, an all-gather the mirror. Against the flat ring it sends 1/g of the buffer over the
  network per GPU at its own NIC share (the ring: all of it, over the g GPUs' shares together: the same network
  time) and takes 2(g - 1) + 2(N - 1) steps instead of 2(gN - 1), at the price of the NVLink passes, which the
  ring pipelines under its network hops. `algorithm="fastest"` takes the faster of the two per message, as
  NCCL's tuner picks among its algorithms by their modelled time (NCCL src/graph/tuning.cc, ncclTopoTuneModel).
"""

from __future__ import annotations

import math

from hops_calib.model.devices import DeviceSpec
from hops_calib.spec import Spec

OPS = ("all_reduce", "reduce_scatter", "all_gather")
ALGORITHMS = ("ring", "two_level", "fastest")
POINT_OPS = ("send_recv", "all_to_all")  # context parallelism's exchanges, priced by the ring's hop bandwidth


def group_size(spec: Spec, group: str) -> int:
    """GPUs of a group: "tp", "cp", "dp", or "dp_cp" (data x context parallel); the expert layers' "ep", "etp",
    "tp_ep" (etp x ep), "edp" and "tp_cp" (`Spec.group_ranks`)."""
    return {
        "tp": spec.tp,
        "cp": spec.cp,
        "dp_cp": spec.dp * spec.cp,
        "ep": spec.ep,
        "etp": spec.etp,
        "tp_ep": spec.etp * spec.ep,
        "edp": spec.edp,
        "tp_cp": spec.tp * spec.cp,
    }.get(group, spec.dp)


def ring_bandwidth_bytes_per_ms(
    spec: Spec, device: DeviceSpec, group: str, stage: int = 0, connection_cap_bytes_per_ms: float = math.inf
) -> float:
    """Bytes per ms over the slowest hop of a `group` ring ("tp" or "dp") of `stage`, with its node's NICs shared,
    and a hop across nodes held under one connection's ceiling (`Context.connection_cap_bytes_per_ms`)."""
    placed = spec.group_nodes(group, stage)
    if device.intra_node_bandwidth_bytes_per_s is None and spec.links and (placed is None or placed[0] == 1):
        # no NVLink (a CPU host: gloo over loopback): the hop the link benchmark measured between the host's ranks
        return min(fit.bytes_per_ms for fit in spec.links)
    intra = device.intra_node_bandwidth_bytes_per_s or device.network_bandwidth_bytes_per_s
    if placed is None or placed[0] == 1:  # one node (or no nodes given: a job directory's single-node group)
        return intra / 1e3
    _nodes, per_node = placed
    return min(intra / 1e3, device.network_bandwidth_bytes_per_s * per_node / 1e3, connection_cap_bytes_per_ms)


def collective_ms(
    spec: Spec,
    device: DeviceSpec,
    op: str,
    nbytes: float,
    group: str,
    *,
    stage: int = 0,
    efficiency: float = 1.0,
    step_latency_ms: float = 0.0,
    contention_step_ms: float = 0.0,
    connection_cap_bytes_per_ms: float = math.inf,
    algorithm: str = "ring",
    net_step_latency_ms: float = 0.0,
) -> float:
    """Time of one `op` of an `nbytes` buffer (the whole buffer: an all-gather's output, a reduce-scatter's input)
    over a `group` of `stage`; 0 for a group of one GPU. `efficiency` scales the bandwidth the ring model uses
    (and the table's rate), `step_latency_ms` is the ring model's latency per step, and `contention_step_ms` what
    each of the ring's steps adds inside a training step over an isolated benchmark (both paths);
    `connection_cap_bytes_per_ms` holds a ring's hop across nodes under one connection's ceiling. `algorithm`
    ("ring", "two_level", "fastest": `ALGORITHMS`) prices a group spanning nodes, whose steps across nodes each
    add `net_step_latency_ms`; a group inside one node is a ring whatever it says."""
    if op not in OPS + POINT_OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS + POINT_OPS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    n = group_size(spec, group)
    if n <= 1 or nbytes <= 0:
        return 0.0
    if op in POINT_OPS:
        # send_recv: one hop of the group's ring moves nbytes (context parallelism's KV exchange, every GPU sending
        # and receiving at once); all_to_all: each GPU keeps 1/n of its nbytes and exchanges the rest, n - 1 steps
        placed = spec.group_nodes(group, stage)
        if op == "all_to_all" and placed is not None and placed[0] > 1:
            return _all_to_all_across_nodes_ms(
                device,
                nbytes,
                n,
                placed,
                efficiency,
                step_latency_ms + net_step_latency_ms,
                contention_step_ms,
                connection_cap_bytes_per_ms,
            )
        bandwidth = ring_bandwidth_bytes_per_ms(spec, device, group, stage, connection_cap_bytes_per_ms) * efficiency
        steps, moved = (1, nbytes) if op == "send_recv" else (n - 1, nbytes * (n - 1) / n)
        return steps * step_latency_ms + moved / bandwidth + steps * contention_step_ms
    share = 1.0 if op == "all_reduce" else 0.5
    placed = spec.group_nodes(group, stage)
    table = spec.collective("all_reduce", n)
    steps = 2 * (n - 1)
    contention = share * steps * contention_step_ms
    if table is not None and (placed is None or placed[0] == 1):
        return share * table.measured_ms(nbytes) / efficiency + contention
    latency = step_latency_ms + (net_step_latency_ms if placed is not None and placed[0] > 1 else 0.0)
    bandwidth = ring_bandwidth_bytes_per_ms(spec, device, group, stage, connection_cap_bytes_per_ms) * efficiency
    ring = share * (steps * latency + steps / n * nbytes / bandwidth) + contention
    if algorithm == "ring" or placed is None or placed[0] == 1 or placed[1] == 1:
        return ring
    two = two_level_ms(
        spec,
        device,
        op,
        nbytes,
        placed,
        efficiency=efficiency,
        step_latency_ms=step_latency_ms,
        contention_step_ms=contention_step_ms,
        connection_cap_bytes_per_ms=connection_cap_bytes_per_ms,
        net_step_latency_ms=net_step_latency_ms,
    )
    return two if algorithm == "two_level" else min(ring, two)


def _all_to_all_across_nodes_ms(
    device: DeviceSpec,
    nbytes: float,
    n: int,
    placed: tuple[int, int],
    efficiency: float,
    step_latency_ms: float,
    contention_step_ms: float,
    connection_cap_bytes_per_ms: float,
) -> float:
    """An all-to-all of `nbytes` per GPU over a group of n GPUs placed as (N nodes, g GPUs in each, n = N g): each
    GPU sends 1/n of its buffer to every other; the (g - 1)/n of it for its node mates over NVLink, the (n - g)/n for
    the other nodes over its own share of the node's NICs (every GPU of the node sends at once: NCCL's all-to-all is
    grouped send/recv, `ncclGroupStart` around n point-to-point calls, as megatron-core's `tensor_parallel/
    mappings.py` `all_to_all` issues it through torch.distributed.all_to_all_single), the two fabrics at the same
    time: the longer of them, after n - 1 steps of a latency each."""
    _nodes, per_node = placed
    intra = (device.intra_node_bandwidth_bytes_per_s or device.network_bandwidth_bytes_per_s) / 1e3 * efficiency
    nic = min(device.network_bandwidth_bytes_per_s / 1e3, connection_cap_bytes_per_ms) * efficiency
    inside = nbytes * (per_node - 1) / n / intra
    across = nbytes * (n - per_node) / n / nic
    return (n - 1) * (step_latency_ms + contention_step_ms) + max(inside, across)


def two_level_ms(
    spec: Spec,
    device: DeviceSpec,
    op: str,
    nbytes: float,
    placed: tuple[int, int],
    *,
    efficiency: float = 1.0,
    step_latency_ms: float = 0.0,
    contention_step_ms: float = 0.0,
    connection_cap_bytes_per_ms: float = math.inf,
    net_step_latency_ms: float = 0.0,
) -> float:
    """`op` of `nbytes` over a group placed as `placed` = (N nodes, g GPUs in each), a level per fabric: inside
    the node over NVLink (the node's g-GPU all-reduce table where the spec has one, halved for each of the
    reduce-scatter and the all-gather), across the nodes a ring over N of each GPU's S/g at its share of the
    node's NICs (under one connection's ceiling over sockets). An all-reduce is reduce-scatter inside, all-reduce
    across, all-gather inside; a reduce-scatter (all-gather) the halves of the first two (last two)."""
    nodes, per_node = placed
    intra = device.intra_node_bandwidth_bytes_per_s or device.network_bandwidth_bytes_per_s
    table = spec.collective("all_reduce", per_node)
    if table is not None:
        inside_half = 0.5 * table.measured_ms(nbytes) / efficiency
    else:
        inside_half = (per_node - 1) * step_latency_ms + (per_node - 1) / per_node * nbytes / (intra / 1e3 * efficiency)
    inside_half += (per_node - 1) * contention_step_ms
    nic = min(device.network_bandwidth_bytes_per_s / 1e3, connection_cap_bytes_per_ms) * efficiency
    across_steps = 2 * (nodes - 1)
    across = (
        across_steps * (step_latency_ms + net_step_latency_ms + contention_step_ms)
        + across_steps / nodes * (nbytes / per_node) / nic
    )
    if op == "all_reduce":
        return 2 * inside_half + across
    return inside_half + 0.5 * across
