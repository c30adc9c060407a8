"""Model room: device specs as data (peak FLOP/s, memory bandwidth), each constant with its source.

The catalog ships as `devices.toml` beside this module: GPU parts (`[gpus.NAME]`, what a GPU's datasheet states),
node types (`[nodes.NAME]`, GPUs per node, the intra-node fabric, the NICs) and device types, a GPU in a node (what
`Spec.devices` and a run's `gpu` name), whose constants not given come from the GPU or are derived from the node
(`compose_device`). A model file may override single constants of a device type. Parsing takes already-decoded
TOML tables, so this module does no I/O (rule 4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hops_calib.errors import InputError, line_of

# The numeric constants a device has; a candidate may correct exactly one of them.
CONSTANTS: dict[str, str] = {
    "peak_bf16_flops_per_s": "dense (no sparsity) bf16 tensor throughput, FLOP/s",
    "memory_bandwidth_bytes_per_s": "device memory bandwidth, bytes/s",
    "memory_bytes": "device memory capacity, bytes",
    "network_bandwidth_bytes_per_s": "nominal network bandwidth of the node the device sits in, bytes/s",
}
# Constants only some devices have (a device without a peer in its node has no intra-node link, an Ampere GPU no
# FP8); a device that has one gives it with a source like the others (or takes it from its GPU and node), and a
# candidate may correct it. Code reading one falls back where a device lacks it (`DeviceSpec.peak_flops_per_s`).
OPTIONAL_CONSTANTS: dict[str, str] = {
    "intra_node_bandwidth_bytes_per_s": "nominal GPU-to-GPU bandwidth within the node (NVLink), per direction, bytes/s",
    "peak_fp16_flops_per_s": "dense (no sparsity) fp16 tensor throughput, FLOP/s",
    "peak_fp8_flops_per_s": "dense (no sparsity) fp8 tensor throughput, FLOP/s",
    "peak_tf32_flops_per_s": "dense (no sparsity) tf32 tensor throughput, FLOP/s",
    "sm_count": "streaming multiprocessors of the GPU",
    "nvlink_bandwidth_bytes_per_s": "the GPU's own NVLink bandwidth, per direction, bytes/s",
    "gpus_per_node": "GPUs of the node the device sits in",
    "nics_per_node": "compute-fabric NICs of the node (storage NICs not counted)",
    "nic_bandwidth_bytes_per_s": "bandwidth of one of the node's compute NICs, bytes/s",
}
# What a GPU table (`[gpus.NAME]`) may give, and a node table (`[nodes.NAME]`).
GPU_CONSTANTS = (
    "peak_bf16_flops_per_s",
    "peak_fp16_flops_per_s",
    "peak_fp8_flops_per_s",
    "peak_tf32_flops_per_s",
    "memory_bandwidth_bytes_per_s",
    "memory_bytes",
    "sm_count",
    "nvlink_bandwidth_bytes_per_s",
)
GPU_REQUIRED = ("peak_bf16_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")
NODE_CONSTANTS = ("gpus_per_node", "intra_node_bandwidth_bytes_per_s", "nics_per_node", "nic_bandwidth_bytes_per_s")
NODE_REQUIRED = ("gpus_per_node", "nics_per_node", "nic_bandwidth_bytes_per_s")
# Whole-number constants (counts).
COUNTS = ("sm_count", "gpus_per_node", "nics_per_node")
# A device type's own keys besides its constants.
DEVICE_KEYS = ("name", "gpu", "node", "uncalibrated", "calibrated_as")
# The dtypes a peak is stated for, and the one each falls back to where a device states none.
PEAKS = {
    "bf16": "peak_bf16_flops_per_s",
    "fp16": "peak_fp16_flops_per_s",
    "fp8": "peak_fp8_flops_per_s",
    "tf32": "peak_tf32_flops_per_s",
}


@dataclass(frozen=True)
class Part:
    """A GPU part or a node type of the catalog: its name and constants, each with its source."""

    kind: str  # "gpus" or "nodes"
    key: str
    name: str
    values: tuple[tuple[str, float], ...]
    sources: tuple[tuple[str, str], ...]

    def get(self, constant: str) -> float | None:
        return dict(self.values).get(constant)

    def source(self, constant: str) -> str:
        return dict(self.sources)[constant]


@dataclass(frozen=True)
class DeviceSpec:
    """One device type: what a spec sheet says about it, with a citation per number."""

    type: str  # the key used in Spec.devices: "h100", "a10g", ...
    name: str
    peak_bf16_flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    network_bandwidth_bytes_per_s: float
    sources: tuple[tuple[str, str], ...]  # (constant, citation), one per constant
    # OPTIONAL_CONSTANTS: None where the device has none
    intra_node_bandwidth_bytes_per_s: float | None = None
    peak_fp16_flops_per_s: float | None = None
    peak_fp8_flops_per_s: float | None = None
    peak_tf32_flops_per_s: float | None = None
    sm_count: float | None = None
    nvlink_bandwidth_bytes_per_s: float | None = None
    gpus_per_node: float | None = None
    nics_per_node: float | None = None
    nic_bandwidth_bytes_per_s: float | None = None
    gpu: str | None = None  # the catalog's GPU part ([gpus.NAME]) and node type ([nodes.NAME]), where named
    node: str | None = None
    gpu_name: str = ""
    node_name: str = ""
    uncalibrated: str | None = None  # why no measured run backs this device yet (predict says so), else None
    # the device type whose fitted per-device values (NAME@TYPE) this one takes where it has none of its own (the
    # same chip in another node or memory: its GEMMs run alike), else None; the reason is in `uncalibrated`
    calibrated_as: str | None = None

    def source(self, constant: str) -> str:
        return dict(self.sources)[constant]

    def peak_flops_per_s(self, dtype: str = "bf16") -> float:
        """The dense tensor peak for `dtype` (bf16, fp16, fp8, tf32; fp32 reads tf32, Megatron's fp32 GEMMs run on
        TF32 tensor cores where PyTorch allows it). A device that states none for the dtype falls back to its bf16
        peak (fp8 on an Ampere GPU runs no faster than bf16; the CPU host states only one peak)."""
        name = PEAKS.get("tf32" if dtype == "fp32" else dtype)
        if name is None:
            raise ValueError(f"no tensor peak for dtype {dtype!r}; known: {', '.join(PEAKS)}, fp32")
        value = getattr(self, name)
        return float(value) if value is not None else self.peak_bf16_flops_per_s

    def node_words(self) -> str:
        """The node this device type stands for, in words (for predict's notes)."""
        if self.node is None:
            return f"{self.type}: {self.name}"
        parts = [
            f"{int(self.gpus_per_node)} x {self.gpu_name or self.gpu}"
            if self.gpus_per_node
            else (self.gpu_name or str(self.gpu))
        ]
        if self.intra_node_bandwidth_bytes_per_s:
            parts.append(f"{self.intra_node_bandwidth_bytes_per_s / 1e9:g} GB/s per direction between GPUs")
        else:
            parts.append("no GPU peer in the node")
        if self.nics_per_node and self.nic_bandwidth_bytes_per_s:
            parts.append(f"{int(self.nics_per_node)} x {self.nic_bandwidth_bytes_per_s * 8 / 1e9:g} Gb/s NICs")
        return f"{self.type}: node {self.node} ({self.node_name}; {', '.join(parts)})"

    def with_constant(self, constant: str, value: float, source: str) -> DeviceSpec:
        sources = dict(self.sources)
        sources[constant] = source
        changes: dict[str, Any] = {constant: float(value), "sources": tuple(sorted(sources.items()))}
        return replace(self, **changes)

    def constants(self) -> dict[str, float]:
        """Every constant the device has: the required ones, and the optional ones it gives."""
        found = {name: getattr(self, name) for name in CONSTANTS}
        found.update({name: getattr(self, name) for name in OPTIONAL_CONSTANTS if getattr(self, name) is not None})
        return found

    def to_table(self) -> dict[str, Any]:
        """The TOML table of this device with every constant it has (its GPU's and node's written out)."""
        table: dict[str, Any] = {"name": self.name}
        for constant, value in self.constants().items():
            table[constant] = {"value": value, "source": self.source(constant)}
        return table


# Physical bounds of each constant (SI units): a value outside is a typo or a unit slip, not a device. Wide on
# purpose: from a single CPU core (about 1e9 FLOP/s, 1e9 B/s of memory, 1e8 bytes) to a thousand times the largest
# accelerator of the catalog (B200's 4.5e15 dense FP8 FLOP/s, 8e12 B/s, 192e9 bytes; links of 9e11 B/s).
_FLOPS, _BYTES_PER_S = (1e8, 1e19), (1e5, 1e16)
BOUNDS: dict[str, tuple[float, float]] = {
    "peak_bf16_flops_per_s": _FLOPS,
    "peak_fp16_flops_per_s": _FLOPS,
    "peak_fp8_flops_per_s": _FLOPS,
    "peak_tf32_flops_per_s": _FLOPS,
    "memory_bandwidth_bytes_per_s": (1e8, 1e16),
    "memory_bytes": (1e6, 1e15),
    "network_bandwidth_bytes_per_s": _BYTES_PER_S,
    "intra_node_bandwidth_bytes_per_s": _BYTES_PER_S,
    "nvlink_bandwidth_bytes_per_s": _BYTES_PER_S,
    "nic_bandwidth_bytes_per_s": _BYTES_PER_S,
    "sm_count": (1, 1e5),
    "gpus_per_node": (1, 1e4),
    "nics_per_node": (1, 1e4),
}


def node_notes(devices: list[DeviceSpec], stated_per_node: int | None) -> tuple[list[str], int | None]:
    """What predict says of the nodes a launch runs on, and the GPUs per node to place its ranks by (None: keep
    the launch's). A launch that does not state its node (no torchrun --nnodes/--nproc-per-node) is taken to run
    on its device type's node, and said so; when every stage's device type has the same node of more than one
    GPU and the launch spans more GPUs than one such node holds, its ranks are placed on those nodes (Megatron's
    rank order: global rank r on node r // GPUs per node). A device no measured run backs says so too, and how
    to calibrate it."""
    notes: list[str] = []
    kinds: dict[str, DeviceSpec] = {}
    for device in devices:
        kinds.setdefault(device.type, device)
    for device in kinds.values():
        if device.node is not None and stated_per_node is None:
            notes.append(
                f"node not stated (no torchrun --nnodes/--nproc-per-node): {device.node_words()}; name "
                "another device type in hops.base.yaml (hardware.devices[].gpu) for another node"
            )
        elif device.gpus_per_node and stated_per_node is not None and stated_per_node != device.gpus_per_node:
            notes.append(
                f"the launch puts {stated_per_node} GPUs on a node, {device.type}'s node {device.node} "
                f"holds {int(device.gpus_per_node)}: its NVLink and per-GPU NIC share are that node's"
            )
        if device.uncalibrated:
            takes = (
                f"; it takes {device.calibrated_as}'s fitted values (NAME@{device.calibrated_as}) where it has none "
                "of its own"
                if device.calibrated_as
                else ""
            )
            notes.append(f"{device.type} is uncalibrated: {device.uncalibrated}{takes}")
            notes.append(
                f"to calibrate {device.type}: ingest measured runs of it (`hops-calib ingest SRC --fixtures DIR`), "
                "then pass `--fixtures DIR` (observe, tune and evaluate fit and judge on its runs there)"
            )
    nodes = {device.node for device in devices}
    per_node = next(iter(kinds.values())).gpus_per_node if len(nodes) == 1 and None not in nodes else None
    placed = int(per_node) if stated_per_node is None and per_node and per_node > 1 else None
    return notes, placed


def parse_constant(
    value: Any, *, origin: str, table: str, constant: str, line: int | None, allowed: tuple[str, ...] | None = None
) -> tuple[float, str]:
    """A `{ value = ..., source = "..." }` entry -> (value, source), refusing anything else (`allowed`: the
    constants the table may give, default every device constant)."""
    field_name = f"{table}.{constant}"
    known = allowed if allowed is not None else (*CONSTANTS, *OPTIONAL_CONSTANTS)
    if constant not in known:
        hint = (
            f"device constants are {', '.join(CONSTANTS)} (and, optionally, {', '.join(OPTIONAL_CONSTANTS)})"
            if allowed is None
            else f"this table takes {', '.join(allowed)}"
        )
        raise InputError(origin, f"unknown device constant {constant!r}", line=line, field=field_name, hint=hint)
    if not isinstance(value, dict) or set(value) != {"value", "source"}:
        raise InputError(
            origin,
            "a device constant must be an inline table with exactly 'value' and 'source'",
            line=line,
            field=field_name,
            hint=f'write {constant} = {{ value = 1.0e12, source = "vendor datasheet, ..." }}',
        )
    number, source = value["value"], value["source"]
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise InputError(origin, f"value must be a finite positive number, got {number!r}", line=line, field=field_name)
    if constant in COUNTS and float(number) != int(number):
        raise InputError(origin, f"value must be a whole number, got {number!r}", line=line, field=field_name)
    if not isinstance(source, str) or not source.strip():
        raise InputError(
            origin, "source must name where the number comes from (a vendor spec sheet)", line=line, field=field_name
        )
    low, high = BOUNDS[constant]
    if not low <= number <= high:
        raise InputError(
            origin,
            f"value {number:.3g} is outside the physical bounds of {constant} ({low:.0e} to "
            f"{high:.0e}, {CONSTANTS.get(constant) or OPTIONAL_CONSTANTS[constant]})",
            line=line,
            field=field_name,
            hint="check the number and its unit against the datasheet (SI units: FLOP/s, bytes/s, bytes)",
        )
    return float(number), source.strip()


def parse_parts(tables: Any, *, kind: str, origin: str, text: str = "") -> dict[str, Part]:
    """The GPU parts (`kind` "gpus") or node types ("nodes") of the catalog, from their decoded tables."""
    allowed, required = (GPU_CONSTANTS, GPU_REQUIRED) if kind == "gpus" else (NODE_CONSTANTS, NODE_REQUIRED)
    if not isinstance(tables, dict):
        raise InputError(origin, f"[{kind}] must hold one table per {kind[:-1]}", line=line_of(text, kind), field=kind)
    parts = {}
    for key, table in tables.items():
        header = f"{kind}.{key}"
        if not isinstance(table, dict):
            raise InputError(origin, "expected a table of constants", line=line_of(text, header), field=header)
        name = table.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InputError(
                origin, "needs a 'name' (the product name)", line=line_of(text, header), field=f"{header}.name"
            )
        values, sources = {}, {}
        for constant, raw in table.items():
            if constant != "name":
                values[constant], sources[constant] = parse_constant(
                    raw,
                    origin=origin,
                    table=header,
                    constant=constant,
                    line=line_of(text, header, constant),
                    allowed=allowed,
                )
        missing = [c for c in required if c not in values]
        if missing:
            raise InputError(
                origin,
                f"{header} is missing {missing}",
                line=line_of(text, header),
                field=header,
                hint='give each as { value = ..., source = "..." }',
            )
        parts[key] = Part(kind, key, name.strip(), tuple(sorted(values.items())), tuple(sorted(sources.items())))
    return parts


def composed(gpu: Part | None, node: Part | None) -> tuple[dict[str, float], dict[str, str]]:
    """The constants a device type takes from its GPU and node (values, sources): the GPU's own, the node's, its
    network share (NICs x NIC speed / GPUs per node: what one GPU of a busy node gets) and, in a node of more than
    one GPU, the node's GPU-to-GPU fabric as its intra-node bandwidth."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    if gpu is not None:
        values.update(gpu.values)
        sources.update((c, f"GPU {gpu.key}: {s}") for c, s in gpu.sources)
    if node is not None:
        required = {c: dict(node.values)[c] for c in NODE_REQUIRED}  # the parser refuses a node without them
        per_node, nics, speed = (required[c] for c in NODE_REQUIRED)
        for constant in NODE_REQUIRED:
            values[constant], sources[constant] = required[constant], f"node {node.key}: {node.source(constant)}"
        values["network_bandwidth_bytes_per_s"] = nics * speed / per_node
        sources["network_bandwidth_bytes_per_s"] = (
            f"node {node.key}: {nics:g} NIC(s) x {speed:g} B/s over {per_node:g} GPU(s) per node, the GPU's share; "
            f"{node.source('nic_bandwidth_bytes_per_s')}"
        )
        intra = node.get("intra_node_bandwidth_bytes_per_s")
        if intra is not None and per_node > 1:
            values["intra_node_bandwidth_bytes_per_s"] = intra
            sources["intra_node_bandwidth_bytes_per_s"] = (
                f"node {node.key}: {node.source('intra_node_bandwidth_bytes_per_s')}"
            )
    return values, sources


def parse_devices(
    tables: Mapping[str, Any],
    *,
    origin: str,
    text: str = "",
    prefix: str = "",
    base: Mapping[str, DeviceSpec] | None = None,
    gpus: Mapping[str, Part] | None = None,
    nodes: Mapping[str, Part] | None = None,
) -> dict[str, DeviceSpec]:
    """Device specs from decoded TOML tables `{type: {name, constant: {value, source}}}`.

    With `base`, a table may override single constants of a device already in
    `base`; a device type not in `base` must give every constant, or (in the
    catalog, with `gpus` and `nodes`) name its `gpu` and `node`, from which the
    constants it does not give are taken (`composed`). `text` (the TOML source)
    and `prefix` (the enclosing table, e.g. "devices") are only used to name
    lines in error messages.
    """
    devices = dict(base or {})
    composes = gpus is not None and nodes is not None
    for device_type, table in tables.items():
        header = f"{prefix}.{device_type}" if prefix else device_type
        if not isinstance(table, dict):
            raise InputError(
                origin, "expected a table of device constants", line=line_of(text, None, device_type), field=header
            )
        known = devices.get(device_type)
        sources = dict(known.sources) if known else {}
        values: dict[str, Any] = known.constants() if known else {}
        name = table.get("name", known.name if known else None)
        if not isinstance(name, str) or not name.strip():
            raise InputError(
                origin,
                "a new device type needs a 'name' (the product name)",
                line=line_of(text, header),
                field=f"{header}.name",
            )
        links: dict[str, Part | None] = {"gpu": None, "node": None}
        for key, parts in (("gpu", gpus), ("node", nodes)):
            if key not in table:
                continue
            given = table[key]
            if not composes or parts is None:
                raise InputError(
                    origin,
                    f"'{key}' names a part of the device catalog, which only the catalog does",
                    line=line_of(text, header, key),
                    field=f"{header}.{key}",
                    hint="a model file overrides single constants of a catalog device type",
                )
            if not isinstance(given, str) or given not in parts:
                raise InputError(
                    origin,
                    f"is {given!r}, not a {key} of the catalog (known: {', '.join(sorted(parts))})",
                    line=line_of(text, header, key),
                    field=f"{header}.{key}",
                    hint=f"name one of the [{key}s.NAME] tables",
                )
            links[key] = parts[given]
        # what only the catalog says of a device: why no measured run backs it, and whose fitted values it takes
        said: dict[str, str | None] = {}
        for key, what, hint in (
            (
                "uncalibrated",
                "'uncalibrated' says, in the catalog, why no measured run backs the device",
                'write uncalibrated = "datasheet values only: ..." in devices.toml',
            ),
            (
                "calibrated_as",
                "'calibrated_as' names, in the catalog, the device type whose fitted values an uncalibrated one takes",
                'with uncalibrated = "..." saying why, write calibrated_as = "TYPE" in devices.toml',
            ),
        ):
            said[key] = table.get(key, getattr(known, key) if known else None)
            given = said[key]
            if given is not None and (
                (key in table and not composes)
                or not isinstance(given, str)
                or not given
                or (key == "calibrated_as" and not said["uncalibrated"])
            ):
                raise InputError(origin, what, line=line_of(text, header, key), field=f"{header}.{key}", hint=hint)
        uncalibrated, calibrated_as = said["uncalibrated"], said["calibrated_as"]
        if links["gpu"] is not None or links["node"] is not None:
            derived, derived_sources = composed(links["gpu"], links["node"])
            for constant, value in derived.items():
                values.setdefault(constant, value)
                sources.setdefault(constant, derived_sources[constant])
        for constant, raw in table.items():
            if constant in DEVICE_KEYS:
                continue
            values[constant], sources[constant] = parse_constant(
                raw, origin=origin, table=header, constant=constant, line=line_of(text, header, constant)
            )
        missing = [c for c in CONSTANTS if c not in values]
        if missing:
            raise InputError(
                origin,
                f"device type {device_type!r} is missing {missing}",
                line=line_of(text, header),
                field=header,
                hint='give each as { value = ..., source = "..." }, or (in the catalog) name its gpu and node',
            )
        meta: dict[str, Any] = {}
        if known is not None:
            meta = {k: getattr(known, k) for k in ("gpu", "node", "gpu_name", "node_name")}
        if links["gpu"] is not None:
            meta.update(gpu=links["gpu"].key, gpu_name=links["gpu"].name)
        if links["node"] is not None:
            meta.update(node=links["node"].key, node_name=links["node"].name)
        numbers: dict[str, Any] = {c: float(values[c]) for c in (*CONSTANTS, *OPTIONAL_CONSTANTS) if c in values}
        devices[device_type] = DeviceSpec(
            type=device_type,
            name=name.strip(),
            sources=tuple(sorted(sources.items())),
            uncalibrated=uncalibrated,
            calibrated_as=calibrated_as,
            **meta,
            **numbers,
        )
    return devices


def parse_catalog_tables(data: Mapping[str, Any], *, origin: str, text: str = "") -> dict[str, DeviceSpec]:
    """The device types of the decoded catalog (devices.toml): its `[gpus.*]` and `[nodes.*]` tables, and one
    top-level table per device type."""
    gpus = parse_parts(data.get("gpus", {}), kind="gpus", origin=origin, text=text)
    nodes = parse_parts(data.get("nodes", {}), kind="nodes", origin=origin, text=text)
    types = {k: v for k, v in data.items() if k not in ("gpus", "nodes")}
    return parse_devices(types, origin=origin, text=text, gpus=gpus, nodes=nodes)
