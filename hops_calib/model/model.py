"""Model room: a Model is device specs plus the active cost terms with their parameter values.

`Model.pipeline(spec)` turns what is known before a run into the simulator's
per-task costs; it reads nothing else. A model is parsed from and written to
TOML text here (the file I/O lives in `hops_calib.loop.model_files`), and is
identified by `sha256`, a hash of everything that changes its predictions.

Model file layout:

    [model]
    name = "baseline"
    description = "..."

    [devices.a10g]                # optional: override one catalog constant, with a source
    peak_bf16_flops_per_s = { value = 7.0e13, source = "..." }

    [terms.decoder_roofline]      # one table per active term; omitted parameters take defaults
    compute_efficiency = 0.5
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from hops_calib.errors import InputError, line_of, parse_toml
from hops_calib.model.devices import DeviceSpec, parse_catalog_tables, parse_devices
from hops_calib.model.terms import TERMS, Context, Contribution, Term, layout_of
from hops_calib.sim.pipeline import Pipeline, StageCosts
from hops_calib.spec import Spec

_MODEL_KEYS = {"model", "devices", "terms"}


@dataclass(frozen=True)
class ActiveTerm:
    """A term active in a model, with a value for each of its parameters."""

    term: Term
    values: tuple[tuple[str, float], ...]  # (parameter, value), in the term's declaration order

    @property
    def name(self) -> str:
        return self.term.name

    def params(self) -> dict[str, float]:
        return dict(self.values)

    def identity(self) -> dict[str, float]:
        """Its values as they make the model's identity: all of them, but an `inert` parameter at its default (which
        prices the term as it was before the parameter existed) left out, so adding one moves no model's sha256."""
        inert = {p.name: p.default for p in self.term.params if p.inert}
        return {name: value for name, value in self.values if not (name in inert and value == inert[name])}


def unknown_device_overrides(names: Iterable[str], device_types: Collection[str]) -> list[str]:
    """The per-device names (NAME@TYPE) among `names` whose TYPE is none of `device_types`: values for no device."""
    return [name for name in names if "@" in name and name.partition("@")[2] not in device_types]


def resolve_params(
    term_name: str,
    given: Mapping[str, Any],
    *,
    origin: str,
    text: str = "",
    table: str | None = None,
    base: Mapping[str, float] | None = None,
    device_types: Collection[str] | None = None,
) -> ActiveTerm:
    """Validate `given` parameter values for a term (unknown names, non-numbers, out of bounds; with
    `device_types`, a per-device value NAME@TYPE for a device type the model does not know).

    Parameters not given keep their value in `base`, else the term's default.
    """
    if term_name not in TERMS:
        raise InputError(
            origin,
            f"unknown term {term_name!r}",
            line=line_of(text, table),
            field=table or term_name,
            hint=f"terms implemented in hops_calib.model.terms: {', '.join(sorted(TERMS))}",
        )
    term = TERMS[term_name]
    values = dict(term.defaults())
    values.update(base or {})
    known = {p.name for p in term.params}
    for name, value in given.items():
        line = line_of(text, table, name)
        field = f"{table}.{name}" if table else f"{term_name}.{name}"
        try:
            param = term.param(name)
        except KeyError:
            per_device = [p.name for p in term.params if p.per_device]
            raise InputError(
                origin,
                f"term {term_name!r} has no parameter {name!r}",
                line=line,
                field=field,
                hint=f"its parameters are {sorted(known) or 'none'}"
                + (f"; per device type (NAME@TYPE): {', '.join(per_device)}" if per_device else ""),
            ) from None
        if device_types is not None and unknown_device_overrides([name], device_types):
            device = name.partition("@")[2]
            raise InputError(
                origin,
                f"{name!r} is a value for device type {device!r}, which the model does not know "
                f"(known: {', '.join(sorted(device_types))})",
                line=line,
                field=field,
                hint="a per-device value (NAME@TYPE) takes a device type of hops_calib/model/devices.toml "
                "or of the model file's [devices]; a value for no device would change nothing",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(origin, f"expected a finite number, got {value!r}", line=line, field=field)
        if not param.low <= value <= param.high:
            raise InputError(
                origin,
                f"{value} is outside the plausible range [{param.low}, {param.high}] ({param.unit}: {param.doc})",
                line=line,
                field=field,
            )
        if param.choices and float(value) not in param.choices:
            raise InputError(
                origin,
                f"{value} is not one of the values {name} takes",
                line=line,
                field=field,
                hint=f"use one of {', '.join(f'{c:g}' for c in param.choices)} ({param.doc})",
            )
        values[name] = float(value)
    overrides = sorted(name for name in values if "@" in name)
    return ActiveTerm(
        term, tuple((p.name, values[p.name]) for p in term.params) + tuple((name, values[name]) for name in overrides)
    )


@dataclass(frozen=True)
class Model:
    name: str
    description: str
    devices: tuple[DeviceSpec, ...]  # effective device specs (catalog plus this model's overrides)
    terms: tuple[ActiveTerm, ...]

    # --- identity -------------------------------------------------------------------------------

    def canonical(self) -> dict[str, Any]:
        """Everything that changes a prediction, in a canonical form (names, descriptions, citations excluded)."""
        return {
            "devices": {d.type: d.constants() for d in sorted(self.devices, key=lambda d: d.type)},
            "terms": {t.name: t.identity() for t in sorted(self.terms, key=lambda t: t.name)},
        }

    @cached_property  # a frozen model's identity never changes; every prediction stamps it
    def sha256(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # --- lookups --------------------------------------------------------------------------------

    def device(self, device_type: str) -> DeviceSpec:
        for device in self.devices:
            if device.type == device_type:
                return device
        raise KeyError(device_type)

    def active(self, term_name: str) -> ActiveTerm | None:
        for active in self.terms:
            if active.name == term_name:
                return active
        return None

    # --- one-term changes (each returns a new model) ---------------------------------------------

    def with_term(self, active: ActiveTerm) -> Model:
        """This model with `active` added, or replacing the same term's parameters."""
        if self.active(active.name) is None:
            return replace(self, terms=self.terms + (active,))
        return replace(self, terms=tuple(active if t.name == active.name else t for t in self.terms))

    def without_term(self, term_name: str) -> Model:
        return replace(self, terms=tuple(t for t in self.terms if t.name != term_name))

    def with_device_constant(self, device_type: str, constant: str, value: float, source: str) -> Model:
        updated = self.device(device_type).with_constant(constant, value, source)
        return replace(self, devices=tuple(updated if d.type == device_type else d for d in self.devices))

    # --- the one thing a model does ----------------------------------------------------------------

    def context(self, spec: Spec) -> Context:
        """What the terms see of `spec`: its layout and the device spec of every rank."""
        layout = layout_of(spec)
        devices = []
        for rank, device_type in enumerate(spec.devices):
            try:
                devices.append(self.device(device_type))
            except KeyError:
                # bad input (exit 2), not a bug: a run of a device type the catalog lacks
                raise InputError(
                    f"spec {spec.run_id}",
                    f"stage {rank} runs on device type {device_type!r}, which "
                    f"model {self.name!r} does not know (known: {sorted(d.type for d in self.devices)})",
                    field="gpu",
                    hint="add it to hops_calib/model/devices.toml or to the model file's [devices] with sources",
                ) from None
        # One TCP flow's ceiling is measured once, as the ends' all-reduce term's parameter (the link benchmark's
        # own 64 MiB medians, experiments/CAMPAIGN.md 045); over sockets every connection across nodes is one such
        # flow, so the hops and collectives priced from the NIC share are held under it too.
        from hops_calib.model.terms.embedding import EmbeddingGradAllReduce, socket_flow_bytes_per_ms

        ends = self.active(EmbeddingGradAllReduce.name)
        cap = socket_flow_bytes_per_ms(spec, ends.params()["flow_cap_gbit_s"]) if ends is not None else math.inf
        return Context(spec=spec, layout=layout, devices=tuple(devices), connection_cap_bytes_per_ms=cap)

    def term_params(self, active: ActiveTerm) -> dict[str, float]:
        """`active`'s values as its term reads them: a device type that is `calibrated_as` another takes that one's
        NAME@TYPE values where it has none of its own (the H200 the H100 DGX's: the same GH100 tensor cores)."""
        params = active.params()
        for device in self.devices:
            if device.calibrated_as:
                suffix = f"@{device.calibrated_as}"
                for name in [n for n in params if n.endswith(suffix)]:
                    params.setdefault(f"{name[: -len(suffix)]}@{device.type}", params[name])
        return params

    def contributions(self, context: Context) -> list[tuple[ActiveTerm, Contribution]]:
        """Every active term's contribution, in model order, with a superseded term's layer fields zeroed on the
        virtual stages whose device type an active superseding term covers (`Term.supersedes`, `Term.covers`)."""
        parts = [(active, active.term.contribute(context, self.term_params(active))) for active in self.terms]
        stages = context.layout.virtual_stages
        covered: dict[str, list[bool]] = {}
        for active in self.terms:
            params = self.term_params(active)
            for name in active.term.supersedes:
                mask = covered.setdefault(name, [False] * stages)
                for k in range(stages):
                    mask[k] = mask[k] or active.term.covers(params, context.device_of(k).type)
        out = []
        for active, part in parts:
            taken = covered.get(active.name)
            if taken is not None and any(taken):
                zeroed: dict[str, Any] = {
                    field: tuple(0.0 if taken[k] else v for k, v in enumerate(values))
                    for field in Contribution.LAYER_FIELDS
                    if (values := getattr(part, field))
                }
                part = replace(part, **zeroed)
            out.append((active, part))
        return out

    def pipeline(self, spec: Spec) -> Pipeline:
        """The simulator's input for `spec`: the sum of every active term's contribution."""
        context = self.context(spec)
        layout = context.layout
        totals: dict[str, list[float] | None] = dict.fromkeys(Contribution.LENGTHS)
        layer_work: dict[str, list[float]] = {
            name: [0.0] * layout.virtual_stages for name in ("forward_ms", "backward_ms", "attention_core_ms")
        }
        pre_optimizer_ms = post_optimizer_ms = 0.0
        stall: tuple[str, float, float] | None = None  # (term, ms, probability)
        switches: dict[str, dict[bool, str]] = {name: {} for name in Contribution.SWITCHES}
        for active, part in self.contributions(context):
            for field, length_name in Contribution.LENGTHS.items():
                values = getattr(part, field)
                if not values:
                    continue
                expected = getattr(layout, length_name)
                if len(values) != expected:
                    raise ValueError(
                        f"term {active.name} gave {len(values)} values of {field} for spec {spec.run_id}; "
                        f"expected {expected} (one per {length_name[:-1].replace('_', ' ')})"
                    )
                if active.term.scope == "layers" and field in layer_work:
                    layer_work[field] = [a + b for a, b in zip(layer_work[field], values)]
                    continue
                total = totals[field] or [0.0] * expected
                totals[field] = [a + b for a, b in zip(total, values)]
            pre_optimizer_ms += part.pre_optimizer_ms
            post_optimizer_ms += part.post_optimizer_ms
            if part.stall_probability > 0 and part.stall_ms > 0:
                if stall is not None:
                    raise ValueError(
                        f"terms {stall[0]} and {active.name} both price a pre-optimizer stall; the "
                        "simulator takes one (merge them into one term)"
                    )
                stall = (active.name, part.stall_ms, part.stall_probability)
            for switch, setters in switches.items():
                if getattr(part, switch) is not None:
                    setters.setdefault(getattr(part, switch), active.name)
        for switch, setters in switches.items():
            if len(setters) > 1:
                raise ValueError(
                    f"terms {setters[True]} and {setters[False]} disagree on the simulator switch {switch}"
                )

        def per(field: str) -> list[float]:
            return totals[field] or [0.0] * getattr(layout, Contribution.LENGTHS[field])

        recompute_work, recompute_floor = recomputation(
            spec, layout, layer_work["forward_ms"], layer_work["attention_core_ms"], per("forward_floor_ms")
        )
        layer_work["backward_ms"] = [b + r for b, r in zip(layer_work["backward_ms"], recompute_work)]
        floors = {
            "forward_floor_ms": per("forward_floor_ms"),
            "backward_floor_ms": [b + r for b, r in zip(per("backward_floor_ms"), recompute_floor)],
        }
        # The decoder layers take their GPU work or the host's launch floor under it, whichever is longer.
        for field, floor in (("forward_ms", "forward_floor_ms"), ("backward_ms", "backward_floor_ms")):
            totals[field] = [
                max(work, bound) + rest for work, bound, rest in zip(layer_work[field], floors[floor], per(field))
            ]

        stages = tuple(
            StageCosts(forward_ms=f, backward_ms=b, weight_grad_ms=w, host_ms=h)
            for f, b, w, h in zip(per("forward_ms"), per("backward_ms"), per("weight_grad_ms"), per("host_ms"))
        )
        return Pipeline(
            stages=stages,
            microbatches=spec.microbatches,
            chunks=spec.vp,
            iterations=spec.iterations,
            forward_transfer_ms=tuple(totals["forward_transfer_ms"] or ()),
            backward_transfer_ms=tuple(totals["backward_transfer_ms"] or ()),
            optimizer_ms=tuple(totals["optimizer_ms"] or ()),
            grad_reduce_ms=tuple(totals["grad_reduce_ms"] or ()),
            grad_reduce_tail_ms=tuple(totals["grad_reduce_tail_ms"] or ()),
            post_optimizer_rank_ms=tuple(totals["post_optimizer_rank_ms"] or ()),
            # Ranks that time-share a device (a CPU capture with more ranks than cores) are served by processor
            # sharing in the simulator: each computes at its core's share among the ranks computing there then.
            core_load=spec.core_load(),
            overlap_p2p=spec.overlap_p2p,
            pre_optimizer_ms=pre_optimizer_ms,
            post_optimizer_ms=post_optimizer_ms,
            stall_ms=stall[1] if stall else 0.0,
            stall_probability=stall[2] if stall else 0.0,
            # A switch no term sets keeps the simulator's own default.
            **{switch: next(iter(setters)) for switch, setters in switches.items() if setters},
        )

    def breakdown(self, spec: Spec) -> list[dict[str, float]]:
        """Per pipeline rank, the milliseconds of one iteration on one of its GPUs by what they are (each term's
        `category`: compute, tp_comm, cp_comm (context parallelism's exchanges), p2p, dp_reduce, ends_allreduce (the
        tied embedding's, before the optimizer), optimizer, host; and ep_comm, the expert groups' collectives of a
        term's `Contribution.expert_comm_ms`, taken out of its category), summed over its tasks: forward and backward
        per microbatch times the microbatches (recomputation counted as compute, and alone as `recompute`: the part
        of compute the recomputed forward adds), the hops it sends, its optimizer
        step, its gradient reduction (whole; `dp_reduce_exposed` is the part no backward hides, with the distributed
        optimizer's parameter all-gather after the step, which `dp_param_gather` gives alone: the simulator runs it
        in the rank's optimizer phase, `Pipeline.optimizer_ms` = `optimizer` + `dp_param_gather`; and with what
        Megatron-FSDP's gathers and reduce-scatters expose in the forwards and backwards,
        `DataParallelGradReduce._fsdp`) and the
        per-iteration work. The host's launch floors count only by how much they exceed the layers' GPU work (the
        simulator takes the longer of the two). A sum of work, not the critical path: waiting (the bubble) is not
        in it."""
        context = self.context(spec)
        layout, m = context.layout, spec.microbatches
        ranks, stages = layout.ranks, layout.virtual_stages
        out = [
            dict.fromkeys(
                (
                    "compute",
                    "recompute",
                    "tp_comm",
                    "ep_comm",
                    "cp_comm",
                    "p2p",
                    "dp_reduce",
                    "dp_reduce_exposed",
                    "dp_param_gather",
                    "ends_allreduce",
                    "optimizer",
                    "host",
                ),
                0.0,
            )
            for _ in range(ranks)
        ]
        layer = {"forward_ms": [0.0] * stages, "backward_ms": [0.0] * stages, "attention_core_ms": [0.0] * stages}
        floor = {"forward_floor_ms": [0.0] * stages, "backward_floor_ms": [0.0] * stages}
        reduce_whole, reduce_tail, last_backward = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
        after_step = [0.0] * ranks  # DP work after the optimizer step (the distributed optimizer's all-gather)
        in_stage = [0.0] * ranks  # DP work a stage's forward and backward expose (Megatron-FSDP's, `fsdp.exposed_ms`)

        def at(values: tuple[float, ...], k: int) -> float:
            return values[k] if values else 0.0

        for active, part in self.contributions(context):
            category = active.term.category
            for k in range(stages):
                rank = layout.rank_of(k)
                expert = at(part.expert_comm_ms, k)
                out[rank][category] += m * (at(part.forward_ms, k) + at(part.backward_ms, k) - expert)
                out[rank]["ep_comm"] += m * expert
                if category == "dp_reduce":
                    in_stage[rank] += m * (at(part.forward_ms, k) + at(part.backward_ms, k))
                out[rank]["host"] += m * at(part.host_ms, k)
                if k < ranks:  # chunk 0: the rank's last backward of an iteration
                    last_backward[rank] += at(part.backward_ms, k)
                if active.term.scope == "layers":
                    for field, values in layer.items():
                        values[k] += at(getattr(part, field), k)
                for field, values in floor.items():
                    values[k] += at(getattr(part, field), k)
            for k in range(layout.hops):
                out[layout.rank_of(k)][category] += m * at(part.forward_transfer_ms, k)
                out[layout.rank_of(k + 1)][category] += m * at(part.backward_transfer_ms, k)
            for rank in range(ranks):
                out[rank][category] += (
                    at(part.optimizer_ms, rank) + part.pre_optimizer_ms + part.stall_probability * part.stall_ms
                )
                if category == "dp_reduce":
                    after_step[rank] += at(part.optimizer_ms, rank)
                out[rank]["host"] += part.post_optimizer_ms + at(part.post_optimizer_rank_ms, rank)
                reduce_whole[rank] += at(part.grad_reduce_ms, rank)
                reduce_tail[rank] += at(part.grad_reduce_tail_ms, rank)
        redo_work, redo_floor = recomputation(
            spec, layout, layer["forward_ms"], layer["attention_core_ms"], floor["forward_floor_ms"]
        )
        for k in range(stages):
            rank = layout.rank_of(k)
            out[rank]["compute"] += m * redo_work[k]
            out[rank]["recompute"] += m * redo_work[k]
            excess = max(0.0, floor["forward_floor_ms"][k] - layer["forward_ms"][k]) + max(
                0.0, floor["backward_floor_ms"][k] + redo_floor[k] - layer["backward_ms"][k] - redo_work[k]
            )
            out[rank]["host"] += m * excess
        for rank in range(ranks):
            out[rank]["dp_reduce"] += reduce_whole[rank]
            out[rank]["dp_param_gather"] = after_step[rank]
            if reduce_whole[rank] or after_step[rank] or in_stage[rank]:
                # what no backward hides: the reduction beyond the last backward, all of what follows the step, and
                # what the forwards and backwards expose (priced as exposed: on their critical path)
                out[rank]["dp_reduce_exposed"] = (
                    max(reduce_tail[rank], reduce_whole[rank] - last_backward[rank]) + after_step[rank] + in_stage[rank]
                )
        return out

    # --- text -----------------------------------------------------------------------------------

    def to_toml(self, catalog: Mapping[str, DeviceSpec]) -> str:
        """The model file: device constants that differ from `catalog`, then each term with its parameters."""
        out = [
            "# hops-calib model file: device constants that differ from hops_calib/model/devices.toml, and the",
            "# active cost terms with their parameters. `hops-calib evaluate CANDIDATE --commit` rewrites it.",
            f"# model sha256 when written: {self.sha256}",
            "",
            "[model]",
            f"name = {_toml_string(self.name)}",
            f"description = {_toml_string(self.description)}",
        ]
        for device in sorted(self.devices, key=lambda d: d.type):
            known = catalog.get(device.type)
            changed = [
                c
                for c in device.constants()
                if known is None or getattr(known, c) != getattr(device, c) or known.source(c) != device.source(c)
            ]
            if not changed:
                continue
            out += ["", f"[devices.{device.type}]"]
            if known is None or known.name != device.name:
                out.append(f"name = {_toml_string(device.name)}")
            for constant in changed:
                out.append(
                    f"{constant} = {{ value = {_toml_float(getattr(device, constant))}, "
                    f"source = {_toml_string(device.source(constant))} }}"
                )
        for active in self.terms:
            term = active.term
            out += ["", f"# {term.summary()}", f"[terms.{active.name}]"]
            for name, value in active.values:
                param = term.param(name)
                key = _toml_string(name) if "@" in name else name
                out.append(
                    f"{key} = {_toml_float(value)}"
                    f"  # {param.unit}, plausible [{_toml_float(param.low)}, {_toml_float(param.high)}]"
                )
        return "\n".join(out) + "\n"


def recomputation(
    spec: Spec, layout, forward_ms: list[float], attention_core_ms: list[float], forward_floor_ms: list[float]
) -> tuple[list[float], list[float]]:
    """What activation recomputation adds to each virtual stage's backward: (GPU work, host launch floor).

    Mechanism, not a factor: a recomputed layer runs its forward again inside its backward, before the gradient
    kernels, to rebuild the activations its forward did not keep. Full recomputation redoes the whole forward of
    the layers it covers (`ModelShape.recomputed_layers`: every layer for the uniform method, the first N of each
    model chunk for block), so those layers' backward gains their forward's work, as every "layers" term priced
    it, and their forward's host launch floor (the host launches those kernels again). Selective recomputation
    redoes only the attention core (`attention_core_ms` of the terms), whose few kernels the floor does not see.
    The weight-gradient share is unchanged: the recomputed forward belongs to the input-gradient half.
    """
    shape = spec.model
    work, floor = [0.0] * layout.virtual_stages, [0.0] * layout.virtual_stages
    for k, layers in enumerate(layout.layers):
        if not layers:
            continue
        if shape.recompute_granularity == "selective":
            work[k] = attention_core_ms[k]
            continue
        share = shape.recomputed_layers(layers) / layers
        work[k], floor[k] = share * forward_ms[k], share * forward_floor_ms[k]
    return work, floor


def _toml_string(value: str) -> str:
    # A JSON string with ASCII escapes is a valid TOML basic string.
    return json.dumps(value)


def _toml_float(value: float) -> str:
    return repr(float(value))


def parse_model(text: str, *, origin: str, catalog: Mapping[str, DeviceSpec]) -> Model:
    """A Model from model-file TOML text; `origin` names the file in error messages."""
    data = parse_toml(text, origin, _MODEL_KEYS)
    header = data.get("model", {})
    name = header.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InputError(
            origin,
            "the model needs a name",
            line=line_of(text, "model"),
            field="model.name",
            hint='add [model] name = "..."',
        )
    devices = parse_devices(data.get("devices", {}), origin=origin, text=text, prefix="devices", base=catalog)
    terms = data.get("terms", {})
    if not isinstance(terms, dict) or not terms:
        raise InputError(
            origin,
            "no active terms",
            field="terms",
            hint=f"add at least one [terms.NAME] table; implemented terms: {', '.join(sorted(TERMS))}",
        )
    active = []
    for term_name, given in terms.items():
        table = f"terms.{term_name}"
        if not isinstance(given, dict):
            raise InputError(
                origin, "expected a table of parameter values", line=line_of(text, "terms", term_name), field=table
            )
        active.append(resolve_params(term_name, given, origin=origin, text=text, table=table, device_types=devices))
    return Model(
        name=name.strip(),
        description=str(header.get("description", "")).strip(),
        devices=tuple(devices[t] for t in sorted(devices)),
        terms=tuple(active),
    )


def parse_catalog(text: str, *, origin: str) -> dict[str, DeviceSpec]:
    """The device catalog (devices.toml text)."""
    data = parse_toml(text, origin)
    return parse_catalog_tables(data, origin=origin, text=text)
