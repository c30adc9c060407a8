"""Model room: device specs as data (peak FLOP/s, memory bandwidth), each constant with its source.

The catalog ships as `devices.toml` beside this module; a model file may
override single constants. Parsing takes already-decoded TOML tables, so this
module does no I/O (rule 4).
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
# Constants only some devices have (a device without a peer in its node has no intra-node link); a device that
# has one gives it with a source like the others, and a candidate may correct it.
OPTIONAL_CONSTANTS: dict[str, str] = {
    "intra_node_bandwidth_bytes_per_s": "nominal GPU-to-GPU bandwidth within the node (NVLink), per direction, bytes/s",
}


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
    intra_node_bandwidth_bytes_per_s: float | None = None  # OPTIONAL_CONSTANTS: None where the device has none

    def source(self, constant: str) -> str:
        return dict(self.sources)[constant]

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
        """The TOML table of this device (as in devices.toml)."""
        table: dict[str, Any] = {"name": self.name}
        for constant, value in self.constants().items():
            table[constant] = {"value": value, "source": self.source(constant)}
        return table


def parse_constant(value: Any, *, origin: str, table: str, constant: str, line: int | None) -> tuple[float, str]:
    """A `{ value = ..., source = "..." }` entry -> (value, source), refusing anything else."""
    field = f"{table}.{constant}"
    if constant not in CONSTANTS and constant not in OPTIONAL_CONSTANTS:
        raise InputError(origin, f"unknown device constant {constant!r}", line=line, field=field,
                         hint=f"device constants are {', '.join(CONSTANTS)} (and, optionally, "
                              f"{', '.join(OPTIONAL_CONSTANTS)})")
    if not isinstance(value, dict) or set(value) != {"value", "source"}:
        raise InputError(origin, "a device constant must be an inline table with exactly 'value' and 'source'",
                         line=line, field=field,
                         hint=f'write {constant} = {{ value = 1.0e12, source = "vendor datasheet, ..." }}')
    number, source = value["value"], value["source"]
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise InputError(origin, f"value must be a finite positive number, got {number!r}", line=line, field=field)
    if not isinstance(source, str) or not source.strip():
        raise InputError(origin, "source must name where the number comes from (a vendor spec sheet)", line=line,
                         field=field)
    return float(number), source.strip()


def parse_devices(tables: Mapping[str, Any], *, origin: str, text: str = "", prefix: str = "",
                  base: Mapping[str, DeviceSpec] | None = None) -> dict[str, DeviceSpec]:
    """Device specs from decoded TOML tables `{type: {name, constant: {value, source}}}`.

    With `base`, a table may override single constants of a device already in
    `base`; a device type not in `base` must give every constant. `text` (the
    TOML source) and `prefix` (the enclosing table, e.g. "devices") are only
    used to name lines in error messages.
    """
    devices = dict(base or {})
    for device_type, table in tables.items():
        header = f"{prefix}.{device_type}" if prefix else device_type
        if not isinstance(table, dict):
            raise InputError(origin, "expected a table of device constants", line=line_of(text, None, device_type),
                             field=header)
        known = devices.get(device_type)
        sources = dict(known.sources) if known else {}
        values: dict[str, Any] = known.constants() if known else {}
        name = table.get("name", known.name if known else None)
        if not isinstance(name, str) or not name.strip():
            raise InputError(origin, "a new device type needs a 'name' (the product name)",
                             line=line_of(text, header), field=f"{header}.name")
        for constant, raw in table.items():
            if constant == "name":
                continue
            values[constant], sources[constant] = parse_constant(
                raw, origin=origin, table=header, constant=constant, line=line_of(text, header, constant))
        missing = [c for c in CONSTANTS if c not in values]
        if missing:
            raise InputError(origin, f"device type {device_type!r} is missing {missing}", line=line_of(text, header),
                             field=header, hint="give each as { value = ..., source = \"...\" }")
        devices[device_type] = DeviceSpec(type=device_type, name=name.strip(), sources=tuple(sorted(sources.items())),
                                          **{c: float(values[c]) for c in CONSTANTS},
                                          **{c: float(values[c]) for c in OPTIONAL_CONSTANTS if c in values})
    return devices
