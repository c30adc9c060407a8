"""Store room: what `ingest` and `fixtures list/show` report, as data: the rows and the JSON of the fixtures and
the notes of an ingest (`hops_calib.cli.render.fixtures` words them for people)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from hops_calib.metrics import samples_per_s
from hops_calib.store.digests import json_safe
from hops_calib.store.fixture import Fixture, MeasuredFixture, source_path
from hops_calib.store.writer import FixtureStore

if TYPE_CHECKING:  # the fixtures verbs show the store without loading the trace readers ingest needs
    from hops_calib.store.ingest import IngestReport

LIST_FIELDS = (
    "id",
    "kind",
    "split",
    "group",
    "schedule",
    "declared_schedule",
    "pp",
    "microbatches",
    "devices",
    "throughput_per_s",
    "steady_throughput_per_s",
    "bubble_ratio",
    "iteration_time_ms",
    "idle_ms",
    "dropped_lines",
    "content_hash",
)
# The configuration of a run, in `fixtures list --json` as `configuration` (both kinds).
CONFIG_FIELDS = (
    "tp",
    "pp",
    "dp",
    "vp",
    "gpus",
    "num_layers",
    "hidden_size",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
    "microbatches",
    "devices",
    "configured_schedule",
)
# What a run measured (as opposed to how it was configured). For a test fixture these are withheld: the held-out
# split is seen only in aggregate, through the audited `hops-calib report --split test`.
MEASURED_LIST_FIELDS = (
    "schedule",
    "throughput_per_s",
    "steady_throughput_per_s",
    "samples_per_s",
    "bubble_ratio",
    "iteration_time_ms",
    "idle_ms",
    "content_hash",
)
MEASURED_SHOW_FIELDS = (
    "content_hash",
    "schedule",
    "schedule_agreement",
    "throughput_per_s",
    "steady_throughput_per_s",
    "samples_per_s",
    "bubble_ratio",
    "utilization_per_stage",
    "iteration_time_ms",
    "iteration_periods_ms",
    "idle_ms",
    "idle_ms_per_iteration",
    "makespan_ms",
    "traced_iterations",
    "stages",
    "phase_stats",
    "kernels",
)
HELD_OUT = (
    "a test fixture: its measured results are seen only in aggregate, through the audited "
    "`hops-calib report --split test`"
)


def fixture_rows(store: FixtureStore, withheld: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One record per fixture; a test fixture's measured fields (and those of a run in `withheld`: id -> why it is
    held out, `hops_calib.loop.heldout.withheld`) are None, with `held_out` true."""
    withheld = withheld or {}
    records = []
    for record in store.rows():
        configuration = {name: json_safe(record.get(name)) for name in CONFIG_FIELDS}
        configuration["devices"] = list(configuration["devices"] if configuration["devices"] is not None else [])
        record = {name: json_safe(record.get(name)) for name in LIST_FIELDS}
        record["devices"] = list(record["devices"] if record["devices"] is not None else [])
        record["samples_per_s"] = json_safe(
            samples_per_s(record["throughput_per_s"], configuration["micro_batch_size"] or 1, configuration["dp"] or 1)
        )
        record["configuration"] = configuration
        if record["split"] == "test" or record["id"] in withheld:
            record.update(dict.fromkeys(MEASURED_LIST_FIELDS), held_out=True)
            if record["id"] in withheld:
                record["held_out_by"] = withheld[record["id"]]
        records.append(record)
    return records


def list_json(store: FixtureStore, withheld: dict[str, str] | None = None) -> str:
    return json.dumps(fixture_rows(store, withheld), indent=1)


def schedule_bubble(data: dict[str, Any]) -> float:
    """The schedule's bubble of a shown fixture's configuration on balanced stages, (p-1)/(v m+p-1)."""
    from hops_calib.metrics import schedule_bubble as bubble

    config = data["configuration"]
    return bubble(config["pp"], config["microbatches"], config.get("vp", 1))


MAX_NAMED = 12  # run ids named per split (and per reason a run is not priced) in the ingest summary


def _named(ids: list[str]) -> str:
    return ", ".join(ids[:MAX_NAMED]) + (f" and {len(ids) - MAX_NAMED} more" if len(ids) > MAX_NAMED else "")


def ingest_notes(report: IngestReport) -> list[str]:
    """What ingest says of the runs it wrote (text lines, and `notes` of --json): the split each went to, how to
    keep one's own runs in train, which trace source gave what for the runs of a profiled job directory, and which iteration-level runs the cost model does not price, and why."""
    written = [o for o in report.outcomes if o.status in ("new", "updated") and o.split]
    notes = []
    for split in ("train", "test"):
        ids = sorted(str(o.run_id) for o in written if o.split == split)
        if ids:
            reasons = sorted({o.split_from for o in written if o.split == split and o.split_from})
            notes.append(f"to {split}: {_named(ids)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    if any(o.split == "test" and o.status == "new" for o in written):
        notes.append(
            "(test runs are held out: only `report --split test` sees them, in aggregate. A run of your own "
            "that you want to look at, such as a what-if you launched, goes to train: `ingest` puts a source "
            "in train unless it states another split (a hops-calib-source.toml beside it) or --split asks, "
            "and --split train forces it for runs whose group the store has not seen; a stored split never "
            "moves)"
        )
    by_sources: dict[str, list[str]] = {}  # runs of a profiled job directory: which trace gave what
    for outcome in report.outcomes:
        if outcome.profiled and outcome.sources and outcome.status != "rejected":
            by_sources.setdefault(outcome.sources, []).append(str(outcome.run_id))
    for said, ids in sorted(by_sources.items()):
        notes.append(f"{said}: {_named(sorted(ids))}")
    measured = [o for o in written if o.priced is not None]
    if measured:
        priced = sum(bool(o.priced) for o in measured)
        notes.append(
            f"priced by the cost model: {priced} of the {len(measured)} iteration-level runs written"
            + ("" if priced < len(measured) else " (every one)")
        )
        by_reason: dict[str, list[str]] = {}
        for outcome in measured:
            if outcome.not_priced is not None:
                by_reason.setdefault(outcome.not_priced, []).append(str(outcome.run_id))
        for reason, ids in sorted(by_reason.items(), key=lambda item: -len(item[1])):
            notes.append(f"not priced ({len(ids)}): {reason} [{_named(sorted(ids))}]")
    return notes


def ingest_counts(report: IngestReport, store: FixtureStore) -> dict[str, Any]:
    """`ingest --json`'s `counts`: this ingest's runs by outcome (stored = new + updated + unchanged) and by the
    split they went to, and the store's fixtures by split after it."""
    stored = [o for o in report.outcomes if o.status != "rejected"]
    index = store.index() if store.exists() else None
    held = index["split"].value_counts().to_dict() if index is not None and len(index) else {}
    return {
        "runs": len(report.outcomes),
        "stored": len(stored),
        **{status: report.count(status) for status in ("new", "updated", "unchanged", "rejected")},
        "train": sum(o.split == "train" for o in stored),
        "test": sum(o.split == "test" for o in stored),
        "store_fixtures": int(sum(held.values())),
        "store_train": int(held.get("train", 0)),
        "store_test": int(held.get("test", 0)),
    }


def show_dict(fixture: Fixture | MeasuredFixture, held_out_by: str | None = None) -> dict[str, Any]:
    """What `fixtures show` prints; a test fixture's measured fields (and those of a train run held out:
    `held_out_by` says why) left out, `held_out` saying why."""
    data = _show_dict(fixture) if isinstance(fixture, Fixture) else _measured_show_dict(fixture)
    if fixture.split == "test" or held_out_by:
        for name in MEASURED_SHOW_FIELDS + MEASURED_ITERATION_FIELDS:
            data.pop(name, None)
        data["held_out"] = HELD_OUT if not held_out_by else f"held out {held_out_by}: its measured results are withheld"
    return data


# What an iteration-level fixture measured (withheld for a test fixture like MEASURED_SHOW_FIELDS).
MEASURED_ITERATION_FIELDS = (
    "iteration_periods_ms",
    "interval_iterations",
    "last_iterations",
    "timers_ms",
    "timing_log_option",
    "reported",
)


def _source(fixture: Fixture | MeasuredFixture) -> str | None:
    """Where the run was ingested from, as a path (`fixture.source_path`: the store records one beside it
    relative to the store's parent)."""
    recorded = fixture.meta.get("source")
    return str(source_path(recorded, fixture.path.parent)) if recorded else None


def _measured_show_dict(fixture: MeasuredFixture) -> dict[str, Any]:
    metrics, args = fixture.truth.metrics, fixture.launch
    return json_safe(
        {
            "id": fixture.id,
            "kind": fixture.kind,
            "split": fixture.split,
            "group": fixture.group,
            "content_hash": fixture.content_hash,
            "source": _source(fixture),
            "origin": fixture.meta.get("origin"),
            "mapping": fixture.meta.get("mapping"),
            "configuration": {
                "tp": args.get("tensor_model_parallel_size", 1),
                "pp": args.get("pipeline_model_parallel_size", 1),
                "dp": args.get("data_parallel_size", 1),
                "gpus": args.get("world_size"),
                "microbatches": metrics.microbatches_per_iteration,
                **{
                    name: args.get(name)
                    for name in (
                        "num_layers",
                        "hidden_size",
                        "ffn_hidden_size",
                        "num_attention_heads",
                        "seq_length",
                        "padded_vocab_size",
                        "micro_batch_size",
                        "global_batch_size",
                        "num_layers_per_virtual_pipeline_stage",
                        "recompute_granularity",
                        "recompute_method",
                        "recompute_num_layers",
                    )
                },
                "precision": "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32",
            },
            "hardware": fixture.hardware,
            "launch": args,
            "not_priced": fixture.not_priced,
            "throughput_per_s": metrics.throughput_per_s,
            "steady_throughput_per_s": metrics.steady_throughput_per_s,
            "samples_per_s": samples_per_s(
                metrics.throughput_per_s, args.get("micro_batch_size") or 1, args.get("data_parallel_size") or 1
            ),
            "iteration_time_ms": metrics.iteration_time_ms,
            "iteration_periods_ms": list(metrics.iteration_periods_ms),
            "interval_iterations": list(metrics.interval_iterations),
            "last_iterations": list(fixture.truth.last_iterations),
            "timers_ms": fixture.truth.timers_ms,
            "timing_log_option": fixture.truth.timing_log_option,
            "reported": fixture.truth.reported,
            "quality": fixture.quality,
        }
    )


def _show_dict(fixture: Fixture) -> dict[str, Any]:
    spec, truth, metrics = fixture.spec, fixture.truth, fixture.truth.metrics
    stages = []
    for stage in range(spec.pp):
        stages.append(
            {
                "stage": stage,
                "device": spec.devices[stage],
                "device_id": spec.device_ids[stage],
                "device_name": spec.device_names[stage] if spec.device_names else None,
                "layers": spec.layers_per_stage[stage],
                "forward_median_ms": truth.phase_median_ms(stage, "FORWARD"),
                "backward_median_ms": truth.phase_median_ms(stage, "BACKWARD"),
                "optimizer_median_ms": truth.optimizer_ms_per_stage[stage],
                "utilization": metrics.utilization_per_stage[stage],
            }
        )
    model = spec.model
    return json_safe(
        {
            "id": fixture.id,
            "split": fixture.split,
            "group": fixture.group,
            "content_hash": fixture.content_hash,
            "source": _source(fixture),
            "configuration": {
                "pp": spec.pp,
                "vp": spec.vp,
                "microbatches": spec.microbatches,
                "iterations": spec.iterations,
                "num_layers": model.num_layers,
                "hidden_size": model.hidden_size,
                "ffn_hidden_size": model.ffn_hidden_size,
                "num_attention_heads": model.num_attention_heads,
                "seq_length": model.seq_length,
                "vocab_size": model.vocab_size,
                "micro_batch_size": model.micro_batch_size,
                "global_batch_size": model.global_batch_size,
                "precision": model.precision,
                "untie_embeddings": model.untie_embeddings,
                "layers_per_stage": list(spec.layers_per_stage),
            },
            "devices": list(spec.devices),
            "links": [
                {
                    "src_stage": f.src_stage,
                    "dst_stage": f.dst_stage,
                    "latency_ms": f.latency_ms,
                    "bandwidth_gbit_s": f.bandwidth_gbit_s,
                }
                for f in spec.links
            ],
            "schedule": truth.observed_schedule,
            "configured_schedule": spec.schedule,
            "declared_schedule": spec.declared_schedule,
            "schedule_agreement": truth.schedule_agreement,
            "throughput_per_s": metrics.throughput_per_s,
            "steady_throughput_per_s": metrics.steady_throughput_per_s,
            "samples_per_s": samples_per_s(metrics.throughput_per_s, model.micro_batch_size, spec.dp),
            "bubble_ratio": metrics.bubble_ratio,
            "utilization_per_stage": list(metrics.utilization_per_stage),
            "iteration_time_ms": metrics.iteration_time_ms,
            "iteration_periods_ms": list(metrics.iteration_periods_ms),
            "idle_ms": truth.idle_ms,
            "idle_ms_per_iteration": list(truth.idle_ms_per_iteration),
            "makespan_ms": metrics.makespan_ms,
            "traced_iterations": list(truth.iterations),
            "stages": stages,
            "phase_stats": [vars(s) for s in truth.phase_stats],
            # per-kernel truth of a run ingested from a profiler trace (Kineto, Nsight Systems); absent otherwise
            **({"kernels": [vars(k) for k in truth.kernels]} if truth.kernels else {}),
            "quality": fixture.quality,
        }
    )
