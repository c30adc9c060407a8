"""What-if room: pricing a job's pipeline hops by the hosts at their ends (`Hop`, `LinkBook`, `price_hops`): each
hop's link from the job's own benchmark of that host pair, else the cluster's (`cluster.Cluster`), and what to say
where neither prices it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hops_calib.spec import Spec
from hops_calib.trace.link_bench import LinkFit
from hops_calib.whatif.cluster import Cluster


@dataclass(frozen=True)
class Hop:
    """One pipeline hop of a what-if, as priced: its stages, devices, hosts and the link that prices it (None: no
    benchmark or declared link for that host pair)."""

    src_stage: int
    dst_stage: int
    src_device: str
    dst_device: str
    src_host: str
    dst_host: str
    link: LinkFit | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "src_stage": self.src_stage,
            "dst_stage": self.dst_stage,
            "devices": [self.src_device, self.dst_device],
            "hosts": [self.src_host, self.dst_host],
            "bandwidth_gbit_s": self.link.bandwidth_gbit_s if self.link else None,
            "latency_ms": self.link.latency_ms if self.link else None,
            "source": self.link.source if self.link else None,
        }


class LinkBook:
    """Every link a job's hops can be priced by, read once: the job's own pair files with the hosts they name, and
    the cluster. `hops(device_ids)` prices the hops of any order of the job's devices (a what-if, a planner's
    candidate) by the hosts at their ends.

    A device's host is the cluster's; else the one the job's own benchmark names at the device's stage position
    in the job's stage map (the benchmark ran with that map: true of every recorded run, not of a what-if that moved
    stages without a cluster saying where the devices live); "" when neither knows.
    """

    def __init__(
        self,
        job_dir: Path | str,
        device_ids: Sequence[str],
        own_links: Sequence[LinkFit],
        cluster: Cluster | None,
        notes: list[str] | None = None,
    ):
        from hops_calib.trace.job import LINK_BENCH_DIR
        from hops_calib.trace.link_bench import pair_files, read_pair_hosts

        self.cluster = cluster
        files = {(i, j): path for i, j, path in pair_files(Path(job_dir) / LINK_BENCH_DIR)}
        named = {pair: read_pair_hosts(path) for pair, path in files.items()}
        by_position: dict[int, str] = {}
        for (i, j), hosts in sorted(named.items()):
            for stage, host in zip((i, j), hosts):
                if host and stage < len(device_ids):
                    by_position.setdefault(stage, host)
        self.device_hosts: dict[str, str] = {}
        positional: list[str] = []
        for stage, device_id in enumerate(device_ids):
            listed = cluster.host_of(device_id) if cluster is not None else None
            if listed is None and by_position.get(stage):
                listed = by_position[stage]
                positional.append(device_id)
            self.device_hosts[device_id] = listed or ""
        if notes is not None and cluster is not None and positional:
            notes.append(
                f"cluster {cluster.origin} does not list device(s) {', '.join(positional)}: their host is "
                "the one the job's link benchmark names at their stage position (add them to the cluster "
                "if the stages moved)"
            )
        self.own = [
            (named[fit.src_stage, fit.dst_stage], fit) for fit in own_links if (fit.src_stage, fit.dst_stage) in named
        ]
        self.wrap_around = any(
            len(device_ids) > 2 and {f.src_stage, f.dst_stage} == {len(device_ids) - 1, 0} for f in own_links
        )

    def link(self, a: int, b: int, hosts: tuple[str, str]) -> LinkFit | None:
        """The link of the hop from stage a to stage b between `hosts` (see `price_hops`)."""
        if not all(hosts):
            return None
        same_place = [fit for got, fit in self.own if got == hosts and (fit.src_stage, fit.dst_stage) == (a, b)]
        if same_place:
            return same_place[0]
        elsewhere = [fit for got, fit in self.own if got == hosts]
        if elsewhere:
            fit = elsewhere[0]
            return replace(
                fit,
                src_stage=a,
                dst_stage=b,
                source=f"{fit.source} (the job's benchmark of {hosts[0]} "
                f"-> {hosts[1]} at stages {fit.src_stage}-{fit.dst_stage})",
            )
        found = self.cluster.link(*hosts) if self.cluster is not None else None
        if found is not None:
            return found[0].fit(a, b, reverse=found[1])
        reverse = [fit for got, fit in self.own if got == hosts[::-1]]
        if reverse:
            fit = reverse[0]
            return replace(
                fit, src_stage=a, dst_stage=b, source=f"{fit.source} ({hosts[0]} -> {hosts[1]}, measured the other way)"
            )
        return None

    def hops(self, device_ids: Sequence[str]) -> tuple[Hop, ...]:
        pp = len(device_ids)
        pairs = [(k, k + 1) for k in range(pp - 1)] + ([(pp - 1, 0)] if self.wrap_around else [])
        hops = []
        for a, b in pairs:
            hosts = (self.device_hosts.get(device_ids[a], ""), self.device_hosts.get(device_ids[b], ""))
            hops.append(Hop(a, b, device_ids[a], device_ids[b], *hosts, self.link(a, b, hosts)))
        return tuple(hops)


def price_hops(
    job_dir: Path,
    device_ids: Sequence[str],
    own_links: Sequence[LinkFit],
    cluster: Cluster | None,
    notes: list[str] | None = None,
) -> tuple[Hop, ...]:
    """Every hop of the pipeline priced by the hosts at its ends: the job's own benchmark of that host pair (the
    pair file at the hop's position first, as a run is priced by its own benchmark), else the cluster's link of the
    pair (benchmarked or declared; the other direction's when only that one exists), else the job's own benchmark
    of the pair the other way round; no link when nothing prices it."""
    return LinkBook(job_dir, device_ids, own_links, cluster, notes).hops(device_ids)


def unpriced_hint(hops: Sequence[Hop], cluster: Cluster | None) -> str:
    """What to add so that every hop has a link."""
    missing = [h for h in hops if h.link is None]
    pairs = "; ".join(
        f"stages {h.src_stage}-{h.dst_stage} ({h.src_device} on {h.src_host or 'an unknown host'} -> "
        f"{h.dst_device} on {h.dst_host or 'an unknown host'})"
        for h in missing
    )
    where = f"to {cluster.origin}" if cluster is not None and cluster.origin else "to a cluster file (--cluster)"
    return (
        f"no benchmark or declared link prices {pairs}: add the link ({{hosts: [SENDER, RECEIVER], "
        f"bandwidth_gbit_s: G, latency_ms: L}}) {where}, or run the link benchmark between those hosts "
        "(calibration/link_bench/pair_<i>_<j>.jsonl)"
        + (
            ""
            if all(h.src_host and h.dst_host for h in missing)
            else "; list the devices' hosts in the cluster's nodes"
        )
    )


def relinked(
    spec: Spec, job_dir: Path, cluster: Cluster | None, notes: list[str] | None = None
) -> tuple[Spec, tuple[Hop, ...]]:
    """`spec` (built from `job_dir`) with every hop priced by the hosts at its ends (`price_hops`), and the hops.
    Hops nothing prices are left without a link (the caller refuses them: `unpriced_hint`)."""
    hops = price_hops(job_dir, spec.device_ids, spec.links, cluster, notes)
    # a hop within one node that the spec prices from the node's collective benchmark keeps that price
    hops = tuple(
        replace(hop, link=spec.link(hop.src_stage, hop.dst_stage))
        if hop.link is None and getattr(spec.link(hop.src_stage, hop.dst_stage), "intra_node", False)
        else hop
        for hop in hops
    )
    if spec.nodes:  # a host nothing named is the node the job's hardware.devices name
        hops = tuple(
            replace(
                hop,
                src_host=hop.src_host or spec.nodes[hop.src_stage],
                dst_host=hop.dst_host or spec.nodes[hop.dst_stage],
            )
            for hop in hops
        )
    links = tuple(hop.link for hop in hops if hop.link is not None)
    return replace(spec, links=links), hops
