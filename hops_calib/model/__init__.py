"""The model room: device specs and named cost terms that turn a Spec into the simulator's Pipeline. Pure.

- `devices.toml` / `devices.py`: device specs as data, every constant with its source;
- `terms/`: the registry of named cost terms (`TERMS`), one small class each;
- `gpt.py`: FLOP, parameter and byte counts of a Megatron GPT layer;
- `model.py`: `Model` (devices + active terms), parsed from and written to TOML text;
- `models/*.toml`: the shipped model files (`baseline.toml`).

Reading and writing files is done by `hops_calib.loop.model_files`, not here (rule 4).
"""

from hops_calib.model.devices import CONSTANTS, OPTIONAL_CONSTANTS, DeviceSpec
from hops_calib.model.model import (
    ActiveTerm,
    Model,
    parse_catalog,
    parse_model,
    resolve_params,
    unknown_device_overrides,
)
from hops_calib.model.terms import TERMS, Context, Contribution, Layout, Param, Term, layout_of

__all__ = [
    "CONSTANTS",
    "OPTIONAL_CONSTANTS",
    "TERMS",
    "ActiveTerm",
    "Context",
    "Contribution",
    "DeviceSpec",
    "Layout",
    "Model",
    "Param",
    "Term",
    "layout_of",
    "parse_catalog",
    "parse_model",
    "resolve_params",
    "unknown_device_overrides",
]
