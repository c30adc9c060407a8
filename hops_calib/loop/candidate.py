"""Candidates: a proposed one-term change to the model, read from TOML as data (never executed).

A candidate file (in `experiments/`) says what is expected and why, and makes
exactly one change:

    id = "embedding-grad-allreduce"
    hypothesis = "the first and last stage all-reduce ... so throughput MAPE drops"
    grounding = "Megatron ties input and output embeddings by default ..."

    [change]
    action = "add"                 # add | remove | set | set_device
    term = "embedding_grad_allreduce"
    params = { efficiency = 1.0 }  # add / set: parameter values (add: omitted ones take defaults)
    # unset = ["efficiency@l4"]    # set only: per-device values (NAME@TYPE) taken out, so that
    #                              # device falls back to the term's shared value

    # or, correcting one device constant:
    # [change]
    # action = "set_device"
    # device = "a10g"
    # constant = "peak_bf16_flops_per_s"
    # value = 7.0e13
    # source = "vendor datasheet, table ..., row ..."

A term named by a candidate must already be implemented in
`hops_calib.model.terms`; a candidate only activates, removes or sets it. One
touching more than one term (several `[[change]]` tables, a list of terms) is
refused with the terms it touched named (`TooManyChanges`, exit 2).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError, line_of, parse_toml
from hops_calib.model import CONSTANTS, OPTIONAL_CONSTANTS, TERMS, Model, resolve_params

ACTIONS = ("add", "remove", "set", "set_device")
_TOP_KEYS = {"id", "hypothesis", "grounding", "change", "expected", "author", "notes"}
_CHANGE_KEYS = {
    "add": ({"action", "term"}, {"params"}),
    "remove": ({"action", "term"}, set()),
    "set": ({"action", "term"}, {"params", "unset"}),
    "set_device": ({"action", "device", "constant", "value", "source"}, set()),
}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class TooManyChanges(InputError):
    """A candidate that touches more than one term or device constant."""

    def __init__(self, origin: str, touched: list[str], line: int | None) -> None:
        self.touched = touched
        super().__init__(
            origin,
            f"a candidate changes exactly one term or device constant; this one touches "
            f"{len(touched)}: {', '.join(touched)}",
            line=line,
            field="change",
            hint="split it into one candidate per term and evaluate them one at a time",
        )


@dataclass(frozen=True)
class Change:
    action: str  # one of ACTIONS
    term: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # set: per-device values (NAME@TYPE) taken out of the term
    device: str | None = None
    constant: str | None = None
    value: float | None = None
    source: str | None = None

    @property
    def term_name(self) -> str:
        """The term an add, remove or set change names (parse_candidate requires it of those actions)."""
        if self.term is None:
            raise ValueError(f"a {self.action!r} change that names no term")
        return self.term

    @property
    def device_constant(self) -> tuple[str, str, float, str]:
        """A set_device change's (device type, constant, value, source), which parse_candidate requires of it."""
        if self.device is None or self.constant is None or self.value is None or self.source is None:
            raise ValueError(f"a {self.action!r} change without its device, constant, value and source")
        return self.device, self.constant, self.value, self.source

    @property
    def target(self) -> str:
        """What the change touches: 'term NAME' or 'device TYPE.CONSTANT'."""
        if self.action == "set_device":
            return f"device {self.device}.{self.constant}"
        return f"term {self.term}"

    def describe(self) -> str:
        if self.action == "set_device":
            return f"set device {self.device}.{self.constant} = {self.value:g}"
        if self.action == "remove":
            return f"remove term {self.term}"
        values = ", ".join([f"{k}={v}" for k, v in self.params.items()] + [f"{k} unset" for k in self.unset])
        return f"{self.action} term {self.term}" + (f" ({values})" if values else "")


@dataclass(frozen=True)
class Candidate:
    id: str
    hypothesis: str
    grounding: str
    change: Change
    text: str  # the file as read, recorded whole in the ledger
    origin: str

    def apply(self, model: Model) -> Model:
        """The model with this candidate's change; InputError if it does not apply or changes nothing."""
        change, origin, text = self.change, self.origin, self.text
        active = model.active(change.term) if change.term else None
        known_devices = {d.type for d in model.devices}
        if change.action == "add":
            if active is not None:
                raise InputError(
                    origin,
                    f"term {change.term!r} is already active in model {model.name!r}",
                    line=line_of(text, "change", "term"),
                    field="change.term",
                    hint='use action = "set" to change its parameters',
                )
            changed = model.with_term(
                resolve_params(
                    change.term_name,
                    change.params,
                    origin=origin,
                    text=text,
                    table="change.params",
                    device_types=known_devices,
                )
            )
        elif change.action in ("remove", "set"):
            if active is None:
                raise InputError(
                    origin,
                    f"term {change.term!r} is not active in model {model.name!r} (active: "
                    f"{', '.join(t.name for t in model.terms)})",
                    line=line_of(text, "change", "term"),
                    field="change.term",
                    hint='use action = "add" to activate it',
                )
            if change.action == "remove":
                if len(model.terms) == 1:
                    raise InputError(
                        origin, f"removing {change.term!r} would leave the model with no terms", field="change.term"
                    )
                changed = model.without_term(change.term_name)
            else:
                base = active.params()
                for name in change.unset:
                    if name not in base:
                        present = sorted(k for k in base if "@" in k)
                        raise InputError(
                            origin,
                            f"term {change.term!r} has no per-device value {name!r} to unset",
                            line=line_of(text, "change", "unset"),
                            field="change.unset",
                            hint=f"its per-device values are {', '.join(present) or 'none'}",
                        )
                    del base[name]
                changed = model.with_term(
                    resolve_params(
                        change.term_name,
                        change.params,
                        origin=origin,
                        text=text,
                        table="change.params",
                        base=base,
                        device_types=known_devices,
                    )
                )
        else:
            device, constant, value, source = change.device_constant
            try:
                model.device(device)
            except KeyError:
                raise InputError(
                    origin,
                    f"unknown device type {device!r} (known: {', '.join(d.type for d in model.devices)})",
                    line=line_of(text, "change", "device"),
                    field="change.device",
                ) from None
            changed = model.with_device_constant(device, constant, value, source)
        if changed.sha256 == model.sha256:
            raise InputError(
                origin,
                f"the change ({change.describe()}) leaves the model's predictions unchanged",
                field="change",
                hint="a candidate must change something the model predicts with",
            )
        return changed


# A candidate goes whole into the append-only ledger: bounded before it is read. The longest text field of the
# campaign's candidates (experiments/) is 1,488 characters, their largest file under 8 KiB.
MAX_CANDIDATE_BYTES = 64 << 10
MAX_TEXT_CHARS = 16_000


def _text_field(data: dict[str, Any], key: str, origin: str, text: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InputError(
            origin,
            f"'{key}' is required and must be non-empty text",
            line=line_of(text, None, key),
            field=key,
            hint="a candidate states its falsifiable hypothesis and its physical grounding",
        )
    if len(value) > MAX_TEXT_CHARS:
        raise InputError(
            origin,
            f"'{key}' is {len(value):,} characters, more than the {MAX_TEXT_CHARS:,} a "
            "candidate's text may be (it goes whole into the append-only ledger)",
            line=line_of(text, None, key),
            field=key,
            hint="state the hypothesis in a paragraph; put long evidence in a file and cite it",
        )
    return value.strip()


def parse_candidate(text: str, *, origin: str) -> Candidate:
    """Parse candidate TOML text. Only data is read: term names are looked up in the registry, nothing is imported."""
    import tomllib

    try:  # a second change written as its own table ([change2], [change_b], ...): say it is a second change
        raw_tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raw_tables = {}  # parse_toml names the syntax error
    extra = sorted(
        k for k, v in raw_tables.items() if k not in _TOP_KEYS and k.startswith("change") and isinstance(v, dict)
    )
    if extra:
        named = [str(raw_tables[k].get("term") or raw_tables[k].get("device") or k) for k in extra]
        raise InputError(
            origin,
            f"[{extra[0]}] is a second change table (of {', '.join(named)}), besides [change]",
            line=line_of(text, extra[0]),
            field=extra[0],
            hint="a candidate changes exactly one term or device constant: put each change in its own "
            "candidate file, and evaluate them one at a time (or as a move: ledger plan + compare)",
        )
    data = parse_toml(text, origin, _TOP_KEYS)
    candidate_id = _text_field(data, "id", origin, text)
    if not _ID.match(candidate_id):
        raise InputError(
            origin,
            f"id {candidate_id!r} must be letters, digits, '_', '.', '-' (at most 100)",
            line=line_of(text, None, "id"),
            field="id",
        )
    hypothesis = _text_field(data, "hypothesis", origin, text)
    grounding = _text_field(data, "grounding", origin, text)

    raw_changes = data.get("change")
    if raw_changes is None:
        raise InputError(
            origin, "no [change] table", field="change", hint=f"add [change] with action = one of {', '.join(ACTIONS)}"
        )
    changes = raw_changes if isinstance(raw_changes, list) else [raw_changes]
    touched: list[str] = []
    for raw in changes:
        if not isinstance(raw, dict):
            raise InputError(origin, "[change] must be a table", field="change")
        for key in ("term", "device"):
            values = raw.get(key)
            names = values if isinstance(values, list) else [values] if values is not None else []
            for name in names:
                label = f"term {name}" if key == "term" else f"device {name}.{raw.get('constant')}"
                if label not in touched:
                    touched.append(label)
    header_line = line_of(text, "change")
    if len(touched) > 1:
        raise TooManyChanges(origin, touched, header_line)
    if len(changes) != 1:
        raise InputError(
            origin,
            f"{len(changes)} [[change]] tables; a candidate makes exactly one change",
            line=header_line,
            field="change",
            hint="merge them into one [change] table",
        )
    return Candidate(
        id=candidate_id,
        hypothesis=hypothesis,
        grounding=grounding,
        change=_parse_change(changes[0], origin, text),
        text=text,
        origin=origin,
    )


def _parse_change(raw: dict[str, Any], origin: str, text: str) -> Change:
    action = raw.get("action")
    if action not in ACTIONS:
        raise InputError(
            origin,
            f"action {action!r} is not one of {', '.join(ACTIONS)}",
            line=line_of(text, "change", "action"),
            field="change.action",
        )
    required, optional = _CHANGE_KEYS[action]
    missing = sorted(required - set(raw))
    extra = sorted(set(raw) - required - optional)
    if missing or extra:
        problem = "; ".join(
            p for p in (f"missing {missing}" if missing else "", f"not allowed {extra}" if extra else "") if p
        )
        raise InputError(
            origin,
            f"action {action!r}: {problem}",
            line=line_of(text, "change", extra[0] if extra else None),
            field="change",
            hint=f"action {action!r} takes {sorted(required | optional)}",
        )
    if action == "set_device":
        constant, value, source = raw["constant"], raw["value"], raw["source"]
        if constant not in CONSTANTS and constant not in OPTIONAL_CONSTANTS:
            raise InputError(
                origin,
                f"unknown device constant {constant!r}",
                line=line_of(text, "change", "constant"),
                field="change.constant",
                hint=f"device constants are {', '.join(CONSTANTS)} (and, where "
                f"a device has one, {', '.join(OPTIONAL_CONSTANTS)})",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise InputError(
                origin,
                f"value must be a finite positive number, got {value!r}",
                line=line_of(text, "change", "value"),
                field="change.value",
            )
        if not isinstance(source, str) or not source.strip():
            raise InputError(
                origin,
                "a device constant needs the source it was read from (a vendor spec sheet)",
                line=line_of(text, "change", "source"),
                field="change.source",
            )
        return Change(
            action=action, device=str(raw["device"]), constant=constant, value=float(value), source=source.strip()
        )
    term = raw["term"]
    if not isinstance(term, str) or term not in TERMS:
        raise InputError(
            origin,
            f"unknown term {term!r}",
            line=line_of(text, "change", "term"),
            field="change.term",
            hint="a candidate can only name terms implemented in hops_calib.model.terms ("
            f"{', '.join(sorted(TERMS))}); add a new term to the package first",
        )
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise InputError(
            origin,
            "params must be a table of parameter values",
            line=line_of(text, "change", "params"),
            field="change.params",
        )
    unset = raw.get("unset", [])
    if not isinstance(unset, list) or not all(isinstance(name, str) and "@" in name for name in unset):
        raise InputError(
            origin,
            "unset must be a list of per-device parameter names (NAME@TYPE)",
            line=line_of(text, "change", "unset"),
            field="change.unset",
            hint='for example unset = ["forward_ms_per_layer@l4"]',
        )
    overlap = sorted(set(unset) & set(params))
    if overlap:
        raise InputError(
            origin,
            f"{', '.join(overlap)} is both set and unset",
            line=line_of(text, "change", "unset"),
            field="change.unset",
            hint="give each per-device value either a number or unset",
        )
    if action == "set" and not params and not unset:
        raise InputError(
            origin,
            "action 'set' needs at least one parameter value or per-device value to unset",
            field="change.params",
        )
    return Change(action=action, term=term, params=dict(params), unset=tuple(unset))


def read_candidate(path: Path | str) -> Candidate:
    import os

    from hops_calib.loop.model_files import read_text

    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0  # (read_text says why it cannot be read)
    if size > MAX_CANDIDATE_BYTES:
        raise InputError(
            path,
            f"is {size / 2**20:.1f} MiB, more than the {MAX_CANDIDATE_BYTES >> 10} KiB a candidate "
            "file may be (it goes whole into the append-only ledger)",
            field="candidate",
            hint="a candidate holds its hypothesis, grounding and the values it changes: cut it down",
        )

    path = Path(path)
    return parse_candidate(read_text(path, "candidate file"), origin=str(path))


# --- a new candidate's scaffold (`hops-calib candidate new TERM`) ----------------------------------


def next_id(experiments: Path, term: str) -> str:
    """The next candidate id in `experiments/`: one more than the highest leading number there, then the term."""
    numbers = [int(m.group(1)) for p in experiments.glob("*.toml") if (m := re.match(r"^(\d+)-", p.stem))]
    return f"{max(numbers, default=0) + 1:03d}-{term.replace('_', '-')}"


def scaffold_text(term_name: str, model: Model, candidate_id: str, devices: Sequence[str] = ()) -> str:
    """A candidate file for one term, to be filled in: its parameters with the model's current values (or the
    defaults, for a term the model does not activate: action "add"), each with its default, bounds, unit and
    meaning, and the hypothesis and grounding marked FILL IN (evaluate refuses them until they are written).
    `devices`: device types to write a new per-device override (NAME@TYPE) for, for every parameter that takes one
    and has none for that type yet, at the value the type is priced with now (so that it changes nothing until
    edited)."""
    import inspect
    import json

    if term_name not in TERMS:
        raise InputError(
            "candidate new",
            f"unknown term {term_name!r}",
            field="TERM",
            hint=f"the terms implemented: {', '.join(sorted(TERMS))} (hops-calib terms lists them)",
        )
    if not _ID.match(candidate_id):
        raise InputError(
            "candidate new", f"id {candidate_id!r} must be letters, digits, '_', '.', '-' (at most 100)", field="--id"
        )
    term = TERMS[term_name]
    catalog = {device.type for device in model.devices}
    for device in devices:
        if device not in catalog:
            raise InputError(
                "candidate new",
                f"device type {device!r} is not in the model's catalog (known: {', '.join(sorted(catalog))})",
                field="--device",
                hint="name a device type of hops_calib/model/devices.toml (a100, h100, l4, ...)",
            )
    if devices and not any(param.per_device for param in term.params):
        raise InputError(
            "candidate new",
            f"term {term_name} has no parameter that takes a per-device value",
            field="--device",
            hint="its parameters are the same for every device; leave out --device",
        )
    active = model.active(term_name)
    values = active.params() if active else {}
    action = "set" if active else "add"
    physics = " ".join((inspect.getdoc(type(term)) or "").split())
    lines = [
        f"# A one-term candidate for {term_name} (written by `hops-calib candidate new`; the file's name is its id).",
        f"# One term: any of {term_name}'s parameters may change together here; another term's may not (its own",
        "# candidate, judged after this one). Edit the values below (a `set` that changes nothing is refused),",
        f'# replace both {PLACEHOLDER} texts, then: hops-calib ledger plan --note "..." --candidate THIS_FILE,',
        "# and hops-calib evaluate THIS_FILE --fixtures DIR --plan N [--commit] (see AGENTS.md).",
        f"# The term's physics: {physics}",
        f"id = {json.dumps(candidate_id)}",
        f"hypothesis = {json.dumps(PLACEHOLDER + ': what this change will do to which runs, and by how much (falsifiable)')}",
        f"grounding = {json.dumps(PLACEHOLDER + ': the mechanism (code, datasheet, trace) that makes the value physical')}",
        f"expected = {{ throughput_mape_pct = {0.0!r} }}  # what you expect the gate to see (recorded, not checked)",
        "",
        "[change]",
        f'action = "{action}"',
        f'term = "{term_name}"',
        "# Keep only the parameters you change (the others keep the model's values). A per-device value is",
        '# NAME@TYPE (e.g. "forward_ms_per_layer@l4"): a change of only such values is judged on that device\'s runs,',
        "# any other change on the runs the term's shared values were calibrated on (evaluate names them).",
        "[change.params]",
    ]
    for param in term.params:
        value = values.get(param.name, param.default)
        taken = (
            f"one of {', '.join(f'{c:g}' for c in param.choices)}"
            if param.choices
            else f"bounds [{param.low:g}, {param.high:g}]"
        )
        lines.append(
            f"{param.name} = {value!r}  # current {value:g}, default {param.default:g}, {taken} {param.unit}"
            f"{', per device' if param.per_device else ''}: {param.doc}"
        )
        for name, device_value in sorted(values.items()):
            if name.partition("@")[0] == param.name and "@" in name:
                lines.append(
                    f"{json.dumps(name)} = {device_value!r}  # current value for device type {name.partition('@')[2]}"
                )
        for device in devices if param.per_device else ():
            if f"{param.name}@{device}" not in values:
                lines.append(
                    f"{json.dumps(f'{param.name}@{device}')} = {value!r}  # new: {device}'s own value "
                    f"(now the shared {value:g}; edit it, or drop the line)"
                )
    return "\n".join(lines) + "\n"


def write_scaffold(
    term_name: str, model: Model, experiments: Path | str, candidate_id: str | None = None, devices: Sequence[str] = ()
) -> Path:
    """Write `scaffold_text` to experiments/ID.toml (never over an existing file); returns the path."""
    from hops_calib.files import atomic_write

    experiments = Path(experiments)
    if experiments.exists() and not experiments.is_dir():
        raise InputError(experiments, "is not a folder", field="--dir", hint="name the experiments folder")
    candidate_id = candidate_id or next_id(experiments, term_name)
    path = experiments / f"{candidate_id}.toml"
    text = scaffold_text(term_name, model, candidate_id, devices)
    if path.exists():
        raise InputError(
            path,
            "exists already; a candidate file is never overwritten (the ledger may cite it)",
            field="--id",
            hint="give another --id",
        )
    experiments.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
    return path


PLACEHOLDER = "FILL IN"  # what `candidate new` and `tune` write where only a person (or an agent) can give the reason


def refuse_placeholders(candidate: Candidate) -> None:
    """A candidate whose hypothesis or grounding still holds the placeholder is neither planned nor judged: the
    ledger keeps every entry for good, and one without its reason would say nothing about why it was tried."""
    from hops_calib.errors import line_of

    for key in ("hypothesis", "grounding"):
        if PLACEHOLDER in getattr(candidate, key):
            raise InputError(
                candidate.origin,
                f"its {key} still says {PLACEHOLDER!r}",
                field=key,
                line=line_of(candidate.text, None, key),
                hint=f"write the {key} (why this change, on what physical ground) in place of the "
                "placeholder `candidate new` or `tune` left, then plan or evaluate it",
            )
