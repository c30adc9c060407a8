"""What `ingest` and `fixtures list/show` print for people, from the store room's rows (`hops_calib.store.views`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from hops_calib.cli.render.tables import text_table
from hops_calib.metrics import THROUGHPUT_UNIT
from hops_calib.store.fixture import Fixture, MeasuredFixture
from hops_calib.store.views import fixture_rows, ingest_notes, schedule_bubble, show_dict
from hops_calib.store.writer import FixtureStore

if TYPE_CHECKING:  # the fixtures verbs show the store without loading the trace readers ingest needs
    from hops_calib.store.ingest import IngestReport


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# The two bubbles, named apart: what a trace measures (HOPS's bubble ratio, JSON bubble_ratio) and the schedule's own.
MEASURED_BUBBLE = (
    "the measured bubble, HOPS's definition: 1 - mean stage utilization over the window, the silent "
    "stretch before the optimizer step included"
)


def list_text(store: FixtureStore, withheld: dict[str, str] | None = None) -> str:
    rows = fixture_rows(store, withheld)
    if not rows:
        return f"no fixtures in {store.root} (run: hops-calib ingest SRC --fixtures {store.root})"
    headers = [
        "id",
        "kind",
        "split",
        "observed",
        "declared",
        "pp",
        "m",
        "devices",
        "ubatch/s",
        "steady ubatch/s",
        "samples/s",
        "idle %",
        "iter ms",
        "idle ms",
    ]
    table = [
        [
            r["id"],
            r["kind"],
            r["split"],
            r["schedule"] or "-",
            r["declared_schedule"] or "-",
            str(r["pp"]),
            str(r["microbatches"]),
            "-".join(r["devices"]),
            _fmt(r["throughput_per_s"]),
            _fmt(r["steady_throughput_per_s"]),
            _fmt(r["samples_per_s"]),
            f"{r['bubble_ratio'] * 100:.1f}%" if r["bubble_ratio"] is not None else "-",
            _fmt(r["iteration_time_ms"], 1),
            "none" if r["idle_ms"] is not None and r["idle_ms"] < 0 else _fmt(r["idle_ms"], 1),
        ]
        for r in rows
    ]
    splits = {s: sum(r["split"] == s for r in rows) for s in ("train", "test")}
    groups = len({r["group"] for r in rows})
    footer = (
        f"{len(rows)} fixtures in {store.root}: train {splits['train']}, test {splits['test']} ({groups} groups); "
        f"idle %: {MEASURED_BUBBLE}"
    )
    if any(r["idle_ms"] is not None and r["idle_ms"] < 0 for r in rows):
        footer += (
            "; idle 'none': no collective before the optimizer holds the ranks together, so there is no idle "
            "stretch (its JSON idle_ms is negative: how far the first optimizer step starts before the last "
            "backward ends)"
        )
    if withheld:
        footer += (
            f"; the measured columns of {len(withheld)} train fixture(s) held out are withheld too (see "
            "`fixtures list --json`, held_out_by)"
        )
    if splits["test"]:
        footer += (
            "; the measured columns of test fixtures are withheld: the held-out split is seen only in "
            "aggregate, through the audited `hops-calib report --split test`"
        )
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("events", "iteration")}
    if kinds["iteration"]:
        footer += (
            f"; {kinds['iteration']} measured at iteration level (no events: no observed schedule, bubble "
            f"or idle), {kinds['events']} with events"
        )
    footer += (
        f"; m: microbatches per iteration; ubatch/s: throughput in {THROUGHPUT_UNIT} (kept iterations; "
        "steady: over the median iteration), samples/s = ubatch/s x micro batch size x data parallel size "
        "(hops_calib.metrics)"
    )
    return text_table(headers, table, right={5, 6, 8, 9, 10, 11, 12, 13}) + "\n" + footer


def ingest_summary(report: IngestReport, store: FixtureStore) -> str:
    counts = (
        f"{len(report.outcomes)} runs: {report.count('new')} new, {report.count('updated')} updated, "
        f"{report.count('unchanged')} unchanged, {report.count('rejected')} rejected; "
    )
    if not store.exists():
        return counts + f"no store made at {store.root} (no run to write)"
    index = store.index()
    splits = index["split"].value_counts().to_dict() if len(index) else {}
    return "\n".join(
        [
            counts
            + (
                f"store {store.root} holds {len(index)} fixtures (train {splits.get('train', 0)}, "
                f"test {splits.get('test', 0)})"
            )
        ]
        + ingest_notes(report)
    )


def _measured_show_text(data: dict[str, Any]) -> str:
    config, hardware = data["configuration"], data["hardware"]
    lines = [
        f"{data['id']}  (measured at iteration level; {data['split']} split, group {data['group']})",
        f"  source        {data['origin']}" + (f" via {data['mapping']}" if data.get("mapping") else ""),
        f"  model         {config['num_layers']} layers, hidden {config['hidden_size']}, heads "
        f"{config['num_attention_heads']}, seq {config['seq_length']}, vocab {config['padded_vocab_size']}, "
        f"{config['precision']}, recompute {config['recompute_granularity'] or 'none'}",
        f"  parallelism   t {config['tp']}, p {config['pp']}, d {config['dp']} on {config['gpus']} x "
        f"{hardware.get('gpu')} ({hardware.get('gpus_per_node')} per node); {config['microbatches']} microbatches "
        f"of {config['micro_batch_size']} per iteration",
        "  priced        " + ("yes" if data["not_priced"] is None else f"no: {data['not_priced']}"),
    ]
    if "held_out" in data:
        return "\n".join(lines + [f"  held out      {data['held_out']}"])
    lines += [
        f"  iteration     {_fmt(data['iteration_time_ms'], 1)} ms "
        + (
            f"median over {len(data['iteration_periods_ms'])} logged value(s) "
            f"({_count(sum(data['interval_iterations']), 'iteration')})"
            if data.get("last_iterations")
            else "(one measured value: a row of a table)"
        ),
        f"  throughput    {_fmt(data['throughput_per_s'], 3)} {THROUGHPUT_UNIT} (kept iterations), "
        f"{_fmt(data['steady_throughput_per_s'], 3)} steady; {_fmt(data['samples_per_s'], 2)} samples/s",
    ]
    for name, value in (data.get("reported") or {}).items():
        lines.append(f"  reported      {name} {_fmt(value, 2)} (as the run printed it)")
    for name, values in (data.get("timers_ms") or {}).items():
        lines.append(
            f"  timer         {name}: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in values.items()) + " ms/iteration"
        )
    for warning in data["quality"].get("warnings", []):
        lines.append(f"  warning       {warning}")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def show_text(fixture: Fixture | MeasuredFixture, held_out_by: str | None = None) -> str:
    data = show_dict(fixture, held_out_by)
    if fixture.kind != "events":
        return _measured_show_text(data)
    config = data["configuration"]
    header = [
        f"{data['id']}  ({data['split']} split, group {data['group']})",
        f"  source        {data['source']}",
        f"  model         {config['num_layers']} layers, hidden {config['hidden_size']}, ffn "
        f"{config['ffn_hidden_size']}, heads {config['num_attention_heads']}, seq {config['seq_length']}, "
        f"{config['precision']}",
        f"  pipeline      pp {config['pp']}, vp {config['vp']}, {config['microbatches']} microbatches x "
        f"{config['iterations']} iterations, layers per stage {config['layers_per_stage']}",
    ]
    if "held_out" in data:
        lines = header + [
            f"  schedule      configured {data['configured_schedule']}; declared {data['declared_schedule'] or '-'}",
            f"  devices       {', '.join(data['devices'])}",
            f"  held out      {data['held_out']}",
        ]
        return "\n".join(lines + _links_and_quality(data))
    lines = header + [
        f"  schedule      observed {data['schedule']}"
        + (
            f" (agrees on {data['schedule_agreement'] * 100:.0f}% of stage-iterations)"
            if data["schedule_agreement"] is not None
            else ""
        )
        + f"; configured {data['configured_schedule']}; declared {data['declared_schedule'] or '-'}",
        f"  throughput    {_fmt(data['throughput_per_s'], 3)} {THROUGHPUT_UNIT} (window), "
        f"{_fmt(data['steady_throughput_per_s'], 3)} steady; {_fmt(data['samples_per_s'], 2)} samples/s",
        f"  iteration     {_fmt(data['iteration_time_ms'], 1)} ms median period; " + _idle_text(data["idle_ms"]),
        f"  idle share    {data['bubble_ratio'] * 100:.1f}% ({MEASURED_BUBBLE}); schedule bubble "
        f"{100 * schedule_bubble(data):.1f}% ((p-1)/(v m+p-1), the schedule's own on balanced stages)",
        "",
    ]
    headers = ["stage", "device", "layers", "fwd ms", "bwd ms", "opt ms", "util"]
    rows = [
        [
            str(s["stage"]),
            s["device"] + (f" ({s['device_name']})" if s["device_name"] else ""),
            str(s["layers"]),
            _fmt(s["forward_median_ms"]),
            _fmt(s["backward_median_ms"]),
            _fmt(s["optimizer_median_ms"]),
            f"{s['utilization'] * 100:.1f}%",
        ]
        for s in data["stages"]
    ]
    lines.append(text_table(headers, rows, right={0, 2, 3, 4, 5, 6}))
    return "\n".join(lines + _links_and_quality(data))


def _links_and_quality(data: dict[str, Any]) -> list[str]:
    lines = []
    if data["links"]:
        lines.append("")
        lines.append(
            "  links (link benchmark, sender p50): "
            + ", ".join(
                f"{link['src_stage']}->{link['dst_stage']} {link['latency_ms']:.3f} ms + {link['bandwidth_gbit_s']:.1f} Gbit/s"
                for link in data["links"]
            )
        )
    quality = data["quality"]
    lines.append("")
    lines.append(
        f"  quality       {quality.get('events', '?')} events, {quality.get('dropped_lines', 0)} lines dropped"
        + (" (lenient)" if quality.get("lenient") else "")
    )
    for name, reasons in (quality.get("dropped") or {}).items():
        lines.append(f"                {name}: " + ", ".join(f"{n} {why}" for why, n in reasons.items()))
    for warning in quality.get("warnings", []):
        lines.append(f"  warning       {warning}")
    return lines


def _idle_text(idle_ms: float | None) -> str:
    """The idle stretch before the optimizer in words; negative where no barrier holds the ranks together."""
    if idle_ms is None:
        return "no idle stretch (the trace has no optimizer step)"
    if idle_ms < 0:
        return (
            f"no idle stretch: the first optimizer step starts {-idle_ms:.1f} ms (median) before the last "
            "backward of any rank ends (no collective before the optimizer holds the ranks together)"
        )
    return f"idle stretch {idle_ms:.1f} ms median (last backward of any rank -> first optimizer step)"
