"""What-if room: a cluster, its hosts, the devices on each, and the links between hosts (benchmarked, or declared
by hand).

A prediction prices a pipeline hop by the hosts at its two ends, never by the hop's position in the pipeline: a
link benchmark measured whatever hosts sat at its stage positions when it ran, and a what-if that reorders the
stages puts other hosts there. The cluster says which host each device id lives on and what each host pair's link
costs. It is written by hand (YAML) or built by `hops-calib cluster` from job directories: every pair file of
every run names the hosts of its two ranks (`hostname`), and the stage map names the device at each rank.

```yaml
nodes:
  - host: g-hetero-st-g6a-1
    devices: [{id: l4_node0_gpu0, gpu: l4}]          # one entry per GPU of the host
links:
  - hosts: [g-hetero-st-g6a-1, g-hetero-st-g6b-1]    # sender, receiver
    latency_ms: 0.0
    bandwidth_gbit_s: 20.9
    benchmark: [[1048576, 0.23], [2097152, 0.59]]  # optional: medians (bytes, ms) by size; without it, declared
    source: "pooled p50 of 39 pair files"
```

A host pair with a benchmark is priced by its medians (as a run's own link benchmark is); one without by the
declared latency + size / bandwidth. A link measured in one direction prices the other when that one has none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.trace.link_bench import LinkFit

BITS_PER_GBIT = 1e9


@dataclass(frozen=True)
class Device:
    id: str
    gpu: str  # device type, as the model's catalog names it ("h100", "l4", "cpu")
    name: str = ""


@dataclass(frozen=True)
class Node:
    host: str
    devices: tuple[Device, ...]

    @property
    def gpus(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Link:
    """The link from `src_host` to `dst_host`: its fit (latency + size / bandwidth) and, when benchmarked, the
    benchmark's medians (bytes, ms) by size."""

    src_host: str
    dst_host: str
    latency_ms: float
    bandwidth_gbit_s: float
    points: tuple[tuple[float, float], ...] = ()
    source: str = ""

    @property
    def benchmarked(self) -> bool:
        return bool(self.points)

    def fit(self, src_stage: int, dst_stage: int, reverse: bool = False) -> LinkFit:
        """This link as the LinkFit of a hop between two stages (the unit a cost model prices)."""
        kind = "benchmark" if self.benchmarked else "declared"
        direction = (
            f"{self.dst_host} -> {self.src_host}, measured the other way"
            if reverse
            else f"{self.src_host} -> {self.dst_host}"
        )
        return LinkFit(
            src_stage=src_stage,
            dst_stage=dst_stage,
            latency_ms=self.latency_ms,
            bytes_per_ms=self.bandwidth_gbit_s * BITS_PER_GBIT / 8 / 1e3,
            source=f"cluster {kind} {direction}" + (f" ({self.source})" if self.source else ""),
            points=self.points,
        )


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    links: tuple[Link, ...] = ()
    origin: str = ""  # the file it was read from, or what it was built from
    notes: tuple[str, ...] = field(default=(), compare=False)
    # where a default cluster was set (HOPS_CALIB_CLUSTER, a hops-calib.toml); "" when asked for by --cluster
    default_from: str = field(default="", compare=False)

    def named(self) -> str:
        """The cluster in words: its file, and where it was set when it was not asked for."""
        return self.origin + (f" (the default, set by {self.default_from})" if self.default_from else "")

    def for_job(self, device_ids: Sequence[str], notes: list[str]) -> Cluster | None:
        """This cluster for a job of `device_ids`; None (said in `notes`) when it is a default that lists none of
        them: a default cluster is not applied to a job on other machines."""
        if not self.default_from or any(self.host_of(d) is not None for d in device_ids):
            return self
        notes.append(
            f"the default cluster {self.origin} (set by {self.default_from}) lists none of the job's devices "
            f"({', '.join(device_ids)}): not applied; give --cluster FILE to use a cluster anyway, or "
            "--no-cluster to silence this"
        )
        return None

    def host_of(self, device_id: str) -> str | None:
        for node in self.nodes:
            if any(device.id == device_id for device in node.devices):
                return node.host
        return None

    def device(self, device_id: str) -> Device | None:
        return next((d for node in self.nodes for d in node.devices if d.id == device_id), None)

    def link(self, src_host: str, dst_host: str) -> tuple[Link, bool] | None:
        """The link src -> dst, else the one measured dst -> src (then True: priced by the other direction)."""
        for reverse, (a, b) in ((False, (src_host, dst_host)), (True, (dst_host, src_host))):
            for link in self.links:
                if (link.src_host, link.dst_host) == (a, b):
                    return link, reverse
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "host": node.host,
                    "devices": [
                        {"id": d.id, "gpu": d.gpu, **({"name": d.name} if d.name else {})} for d in node.devices
                    ],
                }
                for node in self.nodes
            ],
            "links": [
                {
                    "hosts": [link.src_host, link.dst_host],
                    "latency_ms": link.latency_ms,
                    "bandwidth_gbit_s": link.bandwidth_gbit_s,
                    **({"benchmark": [list(p) for p in link.points]} if link.points else {}),
                    **({"source": link.source} if link.source else {}),
                }
                for link in self.links
            ],
        }


def cluster_yaml(cluster: Cluster) -> str:
    import yaml

    header = "# hops-calib cluster: hosts, their devices, and the links between hosts (see hops_calib/cluster.py)\n" + (
        f"# built from {cluster.origin}\n" if cluster.origin else ""
    )
    return header + yaml.safe_dump(cluster.to_dict(), sort_keys=False, default_flow_style=None, width=118)


# --- reading a cluster file ---------------------------------------------------------------------------------------

_LINK_KEYS = ("hosts", "bandwidth_gbit_s", "latency_ms", "benchmark", "source")


class _Marks:
    """The line (1-based) of every node of a YAML document, by its path (("links", 21, "bandwidth_gbit_s")), read
    from yaml's composed node tree: an error names the line of the entry or key it is about."""

    def __init__(self, root: Any):
        self.lines: dict[tuple, int] = {}
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: Any, path: tuple) -> None:
        import yaml

        self.lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                self.lines[(*path, name, "key")] = key.start_mark.line + 1
                self._walk(value, (*path, name))
        elif isinstance(node, yaml.SequenceNode):
            for k, item in enumerate(node.value):
                self._walk(item, (*path, k))

    def line(self, *path: Any) -> int | None:
        """The line of `path`; the line of its key when given (`key=True` paths end with "key"); else of its nearest
        ancestor that exists."""
        while path:
            if path in self.lines:
                return self.lines[path]
            if (*path, "key") in self.lines:
                return self.lines[(*path, "key")]
            path = path[:-1]
        return self.lines.get(())


def read_cluster(path: Path | str) -> Cluster:
    """A cluster file (YAML, or JSON, which YAML reads too). Errors name the file, the line of the offending entry
    or key, and the field."""
    import yaml

    path = Path(path)
    if str(path) in ("", "."):
        raise InputError(
            str(path), "is no file name", field="--cluster", hint="give a cluster file, or --no-cluster for none"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InputError(
            str(path),
            f"cannot be read ({error.strerror or error})",
            field="--cluster",
            hint="give a cluster file, as `hops-calib cluster JOB_DIRS --out FILE` writes",
        ) from None
    if len(text) > 64 << 20:
        raise InputError(str(path), "is larger than 64 MiB; not a cluster description", field="--cluster")
    try:
        marks = _Marks(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise InputError(
            str(path),
            f"is not valid YAML ({getattr(error, 'problem', error)})",
            line=mark.line + 1 if mark else None,
            hint="fix the syntax",
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise InputError(
            str(path),
            "needs a non-empty list 'nodes'",
            field="nodes",
            line=marks.line("nodes") if isinstance(data, dict) else marks.line(),
            hint="nodes: [{host: NAME, devices: [{id: DEVICE_ID, gpu: TYPE}]}]",
        )

    def fail(problem: str, where: str, at: tuple, hint: str = "") -> InputError:
        return InputError(str(path), problem, field=where, line=marks.line(*at), hint=hint)

    nodes, seen_devices, seen_hosts = [], set(), set()
    for k, entry in enumerate(data["nodes"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("host"), str) or not entry["host"]:
            raise fail(
                f"entry {k} is {entry!r}", f"nodes[{k}].host", ("nodes", k, "host"), hint="each node needs a host name"
            )
        host = entry["host"]
        if host in seen_hosts:
            raise fail(
                f"host {host!r} is listed twice", f"nodes[{k}].host", ("nodes", k, "host"), "list each host once"
            )
        seen_hosts.add(host)
        devices = entry.get("devices")
        if not isinstance(devices, list) or not devices:
            raise fail(
                f"host {host!r} has no devices",
                f"nodes[{k}].devices",
                ("nodes", k, "devices"),
                "devices: [{id: DEVICE_ID, gpu: TYPE}] (one per GPU)",
            )
        parsed = []
        for d, device in enumerate(devices):
            where = f"nodes[{k}].devices[{d}]"
            if not isinstance(device, dict) or not device.get("id") or not device.get("gpu"):
                raise fail(
                    f"is {device!r}", where, ("nodes", k, "devices", d), "each device needs an id and a gpu type"
                )
            if str(device["id"]) in seen_devices:
                raise fail(
                    f"device {device['id']!r} is listed twice",
                    where,
                    ("nodes", k, "devices", d, "id"),
                    "a device id lives on one host",
                )
            seen_devices.add(str(device["id"]))
            parsed.append(Device(str(device["id"]), str(device["gpu"]).lower(), str(device.get("name") or "")))
        nodes.append(Node(host, tuple(parsed)))
    links = []
    for k, entry in enumerate(data.get("links") or []):
        where = f"links[{k}]"
        hosts = entry.get("hosts") if isinstance(entry, dict) else None
        if not isinstance(entry, dict):
            raise fail(f"is {entry!r}", where, ("links", k), "{hosts: [SENDER, RECEIVER], bandwidth_gbit_s: G}")
        if not (isinstance(hosts, list) and len(hosts) == 2 and all(isinstance(h, str) for h in hosts)):
            raise fail(f"is {entry!r}", f"{where}.hosts", ("links", k, "hosts"), "hosts: [SENDER_HOST, RECEIVER_HOST]")
        unknown = [h for h in hosts if h not in seen_hosts]
        if unknown:
            raise fail(
                f"names host {unknown[0]!r}, which no node lists",
                f"{where}.hosts",
                ("links", k, "hosts", hosts.index(unknown[0])),
                "add the node, or fix the host name",
            )
        unknown_keys = [key for key in entry if key not in _LINK_KEYS]
        if unknown_keys:
            raise fail(
                f"unknown key {unknown_keys[0]!r}",
                f"{where}.{unknown_keys[0]}",
                ("links", k, unknown_keys[0], "key"),
                f"a link takes {', '.join(_LINK_KEYS)}",
            )
        if "bandwidth_gbit_s" not in entry:
            raise fail(
                "needs bandwidth_gbit_s",
                f"{where}.bandwidth_gbit_s",
                ("links", k),
                "bandwidth_gbit_s: G (a number > 0), latency_ms: L (default 0)",
            )
        values = {}
        for key, low in (("latency_ms", 0.0), ("bandwidth_gbit_s", None)):
            raw = entry.get(key, 0.0)
            number = raw if isinstance(raw, (int, float)) and not isinstance(raw, bool) else math.nan
            if not (math.isfinite(number) and (number > 0 if low is None else number >= low)):
                raise fail(
                    f"is {raw!r}; must be a finite number " + ("> 0" if low is None else ">= 0"),
                    f"{where}.{key}",
                    ("links", k, key),
                    f"{key}: a number in " + ("Gbit/s" if low is None else "ms"),
                )
            values[key] = float(number)
        latency, bandwidth = values["latency_ms"], values["bandwidth_gbit_s"]
        points = []
        for n, point in enumerate(entry.get("benchmark") or ()):
            ok = (
                isinstance(point, list)
                and len(point) == 2
                and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                    for x in point
                )
            )
            if not ok:
                raise fail(
                    f"is {point!r}; must be a positive [bytes, ms] pair",
                    f"{where}.benchmark[{n}]",
                    ("links", k, "benchmark", n),
                    "benchmark: [[bytes, ms], ...]",
                )
            points.append((float(point[0]), float(point[1])))
        links.append(
            Link(hosts[0], hosts[1], latency, bandwidth, tuple(sorted(points)), str(entry.get("source") or ""))
        )
    pairs = [(link.src_host, link.dst_host) for link in links]
    if len(set(pairs)) != len(pairs):
        twice = max(k for k, p in enumerate(pairs) if pairs.count(p) > 1)
        raise fail(
            f"the link {pairs[twice][0]} -> {pairs[twice][1]} is listed twice",
            f"links[{twice}]",
            ("links", twice),
            "keep one",
        )
    return Cluster(tuple(nodes), tuple(links), origin=str(path))


# --- building a cluster from job directories ----------------------------------------------------------------------


def cluster_from_jobs(sources: Iterable[Path | str]) -> Cluster:
    """Every device and benchmarked host pair of every job directory under `sources`: a device's host is the
    `hostname` its rank wrote in the run's pair files; a host pair's link pools every pair file that measured it
    (per message size, the median of the runs' sender medians) and is fitted as a run's own benchmark is.

    A device seen on two hosts, or a job whose files cannot be read, is left out with a note (the rest stands).
    """
    from hops_calib.trace import TraceError, read_device_types, read_stage_map
    from hops_calib.trace.job import LINK_BENCH_DIR, find_job_dirs
    from hops_calib.trace.link_bench import fit_points, pair_files, read_pair_hosts, read_sender_p50

    notes: list[str] = []
    device_hosts: dict[str, set[str]] = defaultdict(set)
    device_info: dict[str, Device] = {}
    measured: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    files: dict[tuple[str, str], list[str]] = defaultdict(list)
    jobs = [job for source in sources for job in find_job_dirs(Path(source))]
    if not jobs:
        raise InputError(
            ", ".join(str(s) for s in sources),
            "holds no job directory",
            field="SRC",
            hint="give job directories (megatron_args.txt, hops_trace_map.json, hops.base.yaml, "
            "calibration/link_bench/) or folders holding them",
        )
    for job in jobs:
        try:
            stage_devices = read_stage_map(job)
            types = read_device_types(job)
            for i, j, path in pair_files(job / LINK_BENCH_DIR):
                if max(i, j) >= len(stage_devices):
                    notes.append(f"{path}: names stage {max(i, j)} of a {len(stage_devices)}-stage map; left out")
                    continue
                hosts = read_pair_hosts(path)
                # a side with no hostname (an older benchmark) is its device: the link is between those devices
                src, dst = (host or stage_devices[stage] for host, stage in zip(hosts, (i, j)))
                for stage, host in ((i, src), (j, dst)):
                    device_id = stage_devices[stage]
                    device_hosts[device_id].add(host)
                    info = types.get(device_id)
                    device_info.setdefault(
                        device_id, Device(device_id, info.type if info else "?", info.name if info else "")
                    )
                for size, ms in _medians(read_sender_p50(path)):
                    measured[src, dst][size].append(ms)
                files[src, dst].append(str(path))
        except (TraceError, OSError, ValueError) as error:
            notes.append(f"{job}: left out ({error})")
    by_host: dict[str, list[Device]] = defaultdict(list)
    for device_id, seen_on in sorted(device_hosts.items()):
        if len(seen_on) > 1:
            notes.append(
                f"device {device_id} appears on hosts {sorted(seen_on)} in different runs; left out (give "
                "each device id one host)"
            )
            continue
        by_host[next(iter(seen_on))].append(device_info[device_id])
    links = []
    for (src, dst), sizes in sorted(measured.items()):
        if src not in by_host or dst not in by_host:
            continue
        points = [(size, float(np.median(times))) for size, times in sorted(sizes.items())]
        label = (
            f"pooled sender p50 of {len(files[src, dst])} pair file(s)"
            if len(files[src, dst]) > 1
            else files[src, dst][0]
        )
        try:
            fit = fit_points(points, 0, 1, label, files[src, dst][0])
        except (TraceError, ValueError) as error:
            notes.append(f"link {src} -> {dst}: no fit ({error}); left out")
            continue
        links.append(Link(src, dst, fit.latency_ms, fit.bandwidth_gbit_s, fit.points, label))
    nodes = tuple(Node(host, tuple(devices)) for host, devices in sorted(by_host.items()))
    return Cluster(nodes, tuple(links), origin=f"{len(jobs)} job directories", notes=tuple(notes))


def _medians(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    by_size: dict[float, list[float]] = defaultdict(list)
    for size, ms in points:
        by_size[size].append(ms)
    return [(size, float(np.median(times))) for size, times in sorted(by_size.items())]
