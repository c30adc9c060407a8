"""Profiler traces in: PyTorch profiler (Kineto) traces recorded on this machine by `capture --profile` (shipped in
profiles/*_prof_run*), and GENERATED GPU traces (Kineto JSON and Nsight Systems SQLite, tests/profiler_synth.py)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiler_synth import job_dir, pipeline_run, write_kineto

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "profiles"  # profiled captures: apart from traces/, which calibrates the CPU model
PROFILED = sorted(path.name for path in PROFILES.glob("*_prof_run*"))
_PHASE = {"F": "FORWARD", "B": "BACKWARD", "OPT": "OPTIMIZER"}


def _ingest(sources: list[Path], store_path: Path):
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(store_path)
    return store, ingest(sources, store, split="train")


def _kineto_only(job: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "kineto" / job.name
    shutil.copytree(job, copy, ignore=shutil.ignore_patterns("megatron_trace"))
    return copy


def _compute(fixture) -> dict[tuple[int, int, int, int, str], tuple[int, int]]:
    events = fixture.events
    events = events[events["kind"] == "compute"]
    return {(int(s), int(c), int(i), int(m), str(p)): (int(a), int(b)) for s, c, i, m, p, a, b in zip(
        events["stage"], events["chunk"], events["iteration"], events["microbatch"], events["phase"],
        events["start_ns"], events["end_ns"])}


def test_profiled_captures_are_shipped():
    assert len(PROFILED) >= 2 and any("interleaved" in name for name in PROFILED)
    for name in PROFILED:
        files = sorted((PROFILES / name / "torch_profile").iterdir())
        assert [f.name for f in files] == ["rank-0.json.gz", "rank-1.json.gz"]


@pytest.mark.parametrize("name", PROFILED)
def test_the_kineto_trace_alone_gives_the_event_logs_truth(name, tmp_path):
    """The same run read from its profiler traces alone and from its event logs: the same events one for one, each
    profiler interval inside the event log's own (the log stamps around the call the profiler's range sits in) up to
    the two clocks' agreement, and every truth number within what those boundary gaps (the profiler's own
    overhead at each range, measured here) can move it."""
    job = PROFILES / name
    kineto_store, report = _ingest([_kineto_only(job, tmp_path)], tmp_path / "fk")
    assert report.ok, [o.error for o in report.rejected]
    log_store, report = _ingest([job], tmp_path / "fe")
    assert report.ok, [o.error for o in report.rejected]
    kin, log = kineto_store.load(name), log_store.load(name)
    assert kin.quality["trace_source"] == "kineto" and "trace_source" not in log.quality
    a, b = _compute(kin), _compute(log)
    assert a.keys() == b.keys() and len(a) == len(log.events[log.events["kind"] == "compute"])
    clocks_ns = 50_000  # the event log's clock (perf_counter anchored to time_ns) and the profiler's, one host
    gaps = []
    for key, (start, end) in a.items():
        log_start, log_end = b[key]
        assert start >= log_start - clocks_ns and end <= log_end + clocks_ns, key
        gaps += [abs(start - log_start), abs(end - log_end)]
    gap_ms = max(gaps) / 1e6
    assert gap_ms < 0.05 * min(e - s for s, e in b.values()) / 1e6  # the gaps are small against any interval
    tk, tl = kin.truth, log.truth
    assert tk.iterations == tl.iterations and tk.microbatches == tl.microbatches
    assert tk.observed_schedule == tl.observed_schedule == kin.spec.schedule
    assert tk.schedule_agreement == tl.schedule_agreement == 1.0
    for stats in tl.phase_stats:
        assert tk.phase_median_ms(stats.stage, stats.phase) == pytest.approx(stats.median_ms, abs=2 * gap_ms)
    assert np.allclose(tk.metrics.iteration_periods_ms, tl.metrics.iteration_periods_ms, atol=2 * gap_ms)
    assert tk.metrics.window_ms == pytest.approx(tl.metrics.window_ms, abs=2 * gap_ms)
    assert tk.metrics.completed_microbatches == tl.metrics.completed_microbatches
    busy_gap = 2 * gap_ms * len(a) / kin.spec.pp  # every interval of a stage may shrink by both its gaps
    for u, v in zip(tk.metrics.utilization_per_stage, tl.metrics.utilization_per_stage):
        assert u == pytest.approx(v, abs=busy_gap / tl.metrics.makespan_ms)


def test_kernel_truth_is_in_fixtures_show_and_agrees_with_the_launch(tmp_path):
    from typer.testing import CliRunner

    from hops_calib.cli import app

    name = next(n for n in PROFILED if "1f1b" in n)
    store, report = _ingest([_kineto_only(PROFILES / name, tmp_path)], tmp_path / "fk")
    assert report.ok
    result = CliRunner().invoke(app, ["fixtures", "show", name, "--fixtures", str(store.root), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    kernels = shown["kernels"]
    fixture = store.load(name)
    model = fixture.spec.model
    seq, hidden = model.seq_length, model.hidden_size
    assert {k["source"] for k in kernels} == {"cpu_op"}  # a CPU run: operators' self times
    gemm_shapes = {k["shape"] for k in kernels if k["kernel_class"] == "gemm" and k["phase"] == "FORWARD"}
    # the QKV projection and the FFN's first GEMM of Megatron's layer, from the launch's own sizes
    assert json.dumps([[seq, hidden], [hidden, 3 * hidden]], separators=(",", ":")) in gemm_shapes
    assert json.dumps([[seq, hidden], [hidden, model.ffn_hidden_size]], separators=(",", ":")) in gemm_shapes
    for stage in range(fixture.spec.pp):
        for phase in ("FORWARD", "BACKWARD"):
            inside = sum(k["per_iteration_ms"] for k in kernels if k["stage"] == stage and k["phase"] == phase)
            stats = next(s for s in fixture.truth.phase_stats if s.stage == stage and s.phase == phase)
            per_iteration = stats.mean_ms * stats.count / len(fixture.truth.iterations)
            assert 0.3 * per_iteration < inside <= per_iteration * 1.001, (stage, phase)  # self times sum inside
    assert {k["phase"] for k in kernels} >= {"FORWARD", "BACKWARD", "OPTIMIZER"}


@pytest.mark.parametrize("kind", ["kineto", "nsys"])
def test_generated_gpu_traces_give_the_device_intervals(kind, tmp_path):
    """GENERATED traces (tests/profiler_synth.py): each step's interval is the device time of the kernels its host
    span launched (first start to last end), as the event logs time compute with CUDA events."""
    runs = pipeline_run(pp=3, microbatches=4, iterations=2)
    job = job_dir(tmp_path / "jobs", f"gen_{kind}_run1", runs, kind=kind)
    store, report = _ingest([job], tmp_path / "fx")
    assert report.ok, [o.error for o in report.rejected]
    fixture = store.load(job.name)
    expected = {(run.rank, 0, s.iteration, -1 if s.kind == "OPT" else s.microbatch, _PHASE[s.kind]):
                (s.device_start, s.device_end)
                for run in runs for s in run.steps}
    assert _compute(fixture) == expected
    sends = fixture.events[fixture.events["kind"] == "transfer"]
    assert len(sends) == sum(s.send_to is not None for run in runs for s in run.steps)
    kernels = fixture.truth.kernels
    assert {k.source for k in kernels} == {"gpu_kernel"}
    classes = {k.kernel_class for k in kernels}
    assert {"gemm", "attention", "elementwise", "optimizer"} <= classes
    gemm = [k for k in kernels if k.kernel_class == "gemm" and k.phase == "FORWARD" and k.stage == 0]
    if kind == "kineto":  # the launching operator's Input Dims reach its kernels
        assert {k.shape for k in gemm} == {"[[2048,1024],[1024,3072]]", "[[2048,1024],[1024,4096]]"}
    else:
        assert {k.shape for k in gemm} == {None}
    assert fixture.truth.observed_schedule == "1f1b"


def test_one_damaged_trace_is_named_and_the_other_runs_ingest(tmp_path):
    good = job_dir(tmp_path / "jobs", "gen_good_run1", pipeline_run(pp=2), kind="kineto")
    cut = job_dir(tmp_path / "jobs", "gen_cut_run1", pipeline_run(pp=2), kind="kineto")
    trace = cut / "torch_profile" / "rank-1.json.gz"
    data = gzip.decompress(trace.read_bytes())
    trace.write_bytes(gzip.compress(data[: len(data) // 2]))
    store, report = _ingest([tmp_path / "jobs"], tmp_path / "fx")
    outcome = {o.run_id: o for o in report.outcomes}
    assert outcome["gen_good_run1"].status == "new"
    error = outcome["gen_cut_run1"].error
    assert outcome["gen_cut_run1"].status == "rejected" and re.search(r"rank-1\.json\.gz:\d+: ", error)
    assert "cut short" in error and store.ids() == ["gen_good_run1"]


def test_a_trace_without_profiler_steps_or_schedule_spans_says_what_to_record(tmp_path):
    from hops_calib.trace import TraceError
    from hops_calib.trace.kineto import read_kineto
    from hops_calib.trace.profile import assemble

    run = pipeline_run(pp=2)[0]
    path = tmp_path / "rank-0.json"
    no_steps = type(run)(rank=0, pp=2, steps=run.steps, windows=[])
    write_kineto(path, no_steps)
    with pytest.raises(TraceError, match="ProfilerStep") as raised:
        assemble(read_kineto(path), rank=0, stage=0, pp=2, vp=1, microbatches=4)
    assert "--profile-step-start" in str(raised.value) and str(path) in str(raised.value)
    path.write_text('{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", '
                    '"ts": 1e15, "dur": 10.0, "pid": 1, "tid": 1}]}')
    with pytest.raises(TraceError, match="callstack"):
        assemble(read_kineto(path), rank=0, stage=0, pp=2, vp=1, microbatches=4)
    path.write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 12.5, "dur": 1}]}')
    with pytest.raises(TraceError, match="baseTimeNanoseconds"):
        read_kineto(path)
    path.write_text("not json at all")
    with pytest.raises(TraceError, match="not valid JSON"):
        read_kineto(path)


def test_a_bad_nsys_export_is_named(tmp_path):
    import sqlite3

    from hops_calib.trace import TraceError
    from hops_calib.trace.nsys import read_nsys

    path = tmp_path / "rank0.sqlite"
    path.write_text("SQLite? no")
    with pytest.raises(TraceError, match="not an SQLite database"):
        read_nsys(path)
    path.unlink()
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT)")
    with pytest.raises(TraceError, match="TARGET_INFO_SESSION_START_TIME") as raised:
        read_nsys(path)
    assert "rank0.sqlite" in str(raised.value)


def test_two_traces_of_one_rank_are_refused(tmp_path):
    from hops_calib.trace import TraceError
    from hops_calib.trace.rank_traces import find_rank_traces

    job = job_dir(tmp_path / "jobs", "gen_twice_run1", pipeline_run(pp=2), kind="kineto")
    shutil.copy(job / "torch_profile" / "rank-0.json.gz", job / "torch_profile" / "host_1.123.pt.trace.json.gz")
    with pytest.raises(TraceError, match="two traces of rank 0"):
        find_rank_traces(job)


def test_the_chrome_export_nests_kernel_classes_under_the_real_phases(tmp_path):
    from hops_calib.plot.chrome import chrome_trace
    from hops_calib.plot.timeline import Panel

    name = next(n for n in PROFILED if "1f1b" in n)
    store, report = _ingest([_kineto_only(PROFILES / name, tmp_path)], tmp_path / "fk")
    fixture = store.load(name)
    trace = chrome_trace(name, fixture.spec.devices, [Panel("real", fixture.timeline(), kernels=fixture.truth.kernels)])
    bars = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "kernels"]
    assert slices and {s["args"]["kernel_class"] for s in slices} >= {"gemm", "elementwise"}
    steps = {}
    for bar in bars:
        inside = [s for s in slices if s["tid"] == bar["tid"] and bar["ts"] <= s["ts"] < bar["ts"] + bar["dur"]]
        assert inside and sum(s["dur"] for s in inside) <= bar["dur"] + 1e-3  # nested, never past the bar
        assert all(s["ts"] + s["dur"] <= bar["ts"] + bar["dur"] + 1e-3 for s in inside)
        steps[bar["tid"], bar["name"].split()[0]] = steps.get((bar["tid"], bar["name"].split()[0]), 0) + 1
    forward = [k for k in fixture.truth.kernels if k.stage == 0 and k.phase == "FORWARD" and k.kernel_class == "gemm"]
    per_step_ms = sum(k.per_iteration_ms for k in forward) / fixture.spec.microbatches
    shown = {round(s["args"]["mean_ms_per_step"], 9) for s in slices
             if s["args"]["kernel_class"] == "gemm" and s["tid"] < 50 and not s["args"]["scaled"]
             and any(b["tid"] == s["tid"] and b["name"].startswith("FORWARD") and b["ts"] <= s["ts"] < b["ts"] + b["dur"]
                     for b in bars)}
    assert shown == {round(per_step_ms, 9)}


def _log_lines(job: Path, edit) -> None:
    """Rewrite every rank's event log of `job` line by line: `edit(event)` returns the event to keep, or None."""
    for log in sorted((job / "megatron_trace").glob("rank*.jsonl")):
        kept = [edit(json.loads(line)) for line in log.read_text().splitlines() if line.strip()]
        log.write_text("".join(json.dumps(event) + "\n" for event in kept if event is not None))


@pytest.mark.parametrize("name", PROFILED)
def test_a_job_with_event_logs_and_kineto_keeps_the_logs_timing_and_gets_the_kernel_truth(name, tmp_path):
    """The shipped profiled captures hold both sources: ingest (--source auto) times the run from the event logs,
    exactly as --source events does, and attaches the Kineto traces' per-kernel truth, exactly as --source kineto
    gives it; the report says which source gave what."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    stores = {}
    for source in ("auto", "events", "kineto"):
        stores[source] = FixtureStore(tmp_path / source)
        report = ingest([PROFILES / name], stores[source], split="train", source=source)
        assert report.ok, [o.error for o in report.rejected]
        (outcome,) = report.outcomes
        assert outcome.profiled and outcome.sources
        stores[source] = (stores[source].load(name), outcome.sources)
    (merged, said), (logs, said_events), (kineto, said_kineto) = stores["auto"], stores["events"], stores["kineto"]
    assert said == "timing from event logs (megatron_trace/), per-kernel truth from Kineto (torch_profile/)"
    assert "no per-kernel truth" in said_events and "not read: Kineto (torch_profile/)" in said_events
    assert said_kineto.startswith("timing and per-kernel truth from Kineto") and "event logs" in said_kineto
    assert merged.events.equals(logs.events) and merged.truth.metrics == logs.truth.metrics
    assert merged.truth.phase_stats == logs.truth.phase_stats and not logs.truth.kernels
    assert merged.truth.kernels and merged.truth.kernels == kineto.truth.kernels
    assert merged.quality["kernel_source"] == "kineto" and "trace_source" not in merged.quality
    assert kineto.quality["trace_source"] == "kineto" and "kernel_source" not in kineto.quality


def test_the_kineto_kernel_truth_is_aligned_to_the_event_logs_iterations(tmp_path):
    """Kernel rows count on the iterations the event logs hold (both numbered by Megatron's iteration): an event log
    that kept one of the two profiled iterations gets that iteration's kernels, per iteration; one whose iterations
    the profiler never traced gets none, and a warning that says why."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest
    from hops_calib.trace.kineto import read_kineto
    from hops_calib.trace.profile import assemble

    name = next(n for n in PROFILED if "1f1b" in n)
    one = tmp_path / "one" / name
    shutil.copytree(PROFILES / name, one)
    _log_lines(one, lambda event: event if event["iteration"] == 3 else None)
    store = FixtureStore(tmp_path / "f1")
    report = ingest([one], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    fixture = store.load(name)
    assert fixture.truth.iterations == (3,)
    for rank in range(fixture.spec.pp):
        trace = one / "torch_profile" / f"rank-{rank}.json.gz"
        _c, _r, rows = assemble(read_kineto(trace), rank=rank, stage=rank, pp=fixture.spec.pp, vp=1,
                                microbatches=fixture.spec.microbatches)
        assert set(rows.iteration.tolist()) == {3, 4}
        expected_ms = rows.duration_ns[rows.iteration == 3].sum() / 1e6
        shown_ms = sum(k.per_iteration_ms for k in fixture.truth.kernels if k.stage == rank)
        assert shown_ms == pytest.approx(expected_ms, rel=1e-9)

    later = tmp_path / "later" / name
    shutil.copytree(PROFILES / name, later)
    _log_lines(later, lambda event: {**event, "iteration": event["iteration"] + 10})
    store = FixtureStore(tmp_path / "f2")
    report = ingest([later], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    assert not store.load(name).truth.kernels and "kernel_source" not in store.load(name).quality
    (warning,) = [w for w in report.outcomes[0].warnings if "per-kernel truth" in w]
    assert "share no iteration" in warning and "[13, 14]" in warning and "--profile-step-start" in warning


def test_ingest_of_the_profiled_captures_shows_kernels_and_evaluates(tmp_path):
    """The command line: `ingest profiles` says which source gave what, `fixtures show --json` has the kernels,
    `evaluate` scores the store; --source nsys on a job without nsys/ is refused, naming the field and the fix."""
    from typer.testing import CliRunner

    from hops_calib.cli import app

    runner, store = CliRunner(), str(tmp_path / "p")
    result = runner.invoke(app, ["ingest", str(PROFILES), "--fixtures", store])
    assert result.exit_code == 0, result.output
    assert ("timing from event logs (megatron_trace/), per-kernel truth from Kineto (torch_profile/): "
            + ", ".join(PROFILED)) in result.stdout
    for name in PROFILED:
        shown = json.loads(runner.invoke(app, ["fixtures", "show", name, "--fixtures", store, "--json"]).stdout)
        assert shown["kernels"] and {k["source"] for k in shown["kernels"]} == {"cpu_op"}
        assert shown["quality"]["kernel_source"] == "kineto"
    result = runner.invoke(app, ["evaluate", "--fixtures", store])
    assert result.exit_code == 0, result.output
    assert all(name in result.stdout for name in PROFILED)
    result = runner.invoke(app, ["ingest", str(PROFILES), "--fixtures", str(tmp_path / "n"), "--source", "nsys",
                                 "--json"])
    assert result.exit_code == 2
    errors = [run["error"] for run in json.loads(result.stdout)["runs"]]
    assert len(errors) == 2 and all("field '--source'" in e and "Nsight Systems (nsys/)" in e for e in errors)


def _strips(ax, top: float, bottom: float) -> list[tuple[int, float, float, str]]:
    """(stage, start, width, colour) of every rectangle of `ax` spanning y (stage + top, stage + bottom)."""
    from matplotlib.colors import to_hex

    found = []
    for collection in ax.collections:
        colours = [to_hex(c) for c in collection.get_facecolors()]
        for k, path in enumerate(collection.get_paths()):
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            stage = round(y0 - top)
            if abs(y0 - (stage + top)) < 1e-9 and abs(y1 - (stage + bottom)) < 1e-9:
                found.append((stage, float(x0), float(x1 - x0), colours[k % len(colours)]))
    return found


def test_the_png_timeline_draws_the_kernel_classes_under_the_real_phases(tmp_path):
    """Under each compute bar of the real panel a strip of kernel classes, end to end inside the bar, summing to the
    phase's kernel time per step (or the bar, where they would overrun it); the legend names the classes; the
    prediction, and a run without kernel truth, get no strip."""
    from hops_calib.plot import style
    from hops_calib.plot.timeline import (
        BAR_TOP,
        KERNEL_BOTTOM,
        KERNEL_TOP,
        Panel,
        kernel_classes_per_step,
        timeline_figure,
    )

    name = next(n for n in PROFILED if "1f1b" in n)
    store, report = _ingest([PROFILES / name], tmp_path / "f")
    assert report.ok, [o.error for o in report.rejected]
    fixture = store.load(name)
    real = fixture.timeline()
    figure = timeline_figure(name, fixture.spec.devices, [Panel("real", real, kernels=fixture.truth.kernels),
                                                          Panel("plain", real)], dpi=60)
    real_ax, plain_ax = figure.axes
    strips = _strips(real_ax, KERNEL_TOP, KERNEL_BOTTOM)
    assert strips and not _strips(plain_ax, KERNEL_TOP, KERNEL_BOTTOM)
    compute = real[real["kind"] == "compute"]
    per_step = kernel_classes_per_step(fixture.truth.kernels, compute["stage"].to_numpy(),
                                       compute["phase"].to_numpy(), compute["iteration"].to_numpy())
    origin = float(real["start_ms"].min())
    for stage, phase, start, end in zip(compute["stage"], compute["phase"], compute["start_ms"], compute["end_ms"]):
        start, end = start - origin, end - origin
        inside = [s for s in strips if s[0] == stage and start - 1e-9 <= s[1] < end]
        assert inside and all(s[1] + s[2] <= end + 1e-9 for s in inside)
        expected = min(end - start, sum(per_step[(stage, str(phase))].values()))
        assert sum(s[2] for s in inside) == pytest.approx(expected, rel=1e-9)
    assert {s[3] for s in strips} >= {style.kernel_colour(label).lower() for label in ("gemm", "elementwise")}
    bars = _strips(real_ax, BAR_TOP, 0.10)
    assert len(bars) == len(compute)  # the real run's bars make room for the strip; the plain panel's do not
    assert len(_strips(plain_ax, BAR_TOP, 0.26)) == len(compute)
    labels = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert "gemm kernels (strip under a step)" in labels and "elementwise kernels" in labels


def test_an_unusable_kineto_folder_beside_the_event_logs_leaves_the_logs_timing(tmp_path):
    """Two traces of one rank beside good event logs: the run is still timed by its logs, with no kernel truth, and
    ingest says why and what to do; --source kineto refuses it, naming the file."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    name = next(n for n in PROFILED if "1f1b" in n)
    job = tmp_path / "jobs" / name
    shutil.copytree(PROFILES / name, job)
    shutil.copy(job / "torch_profile" / "rank-0.json.gz", job / "torch_profile" / "rank-0.copy.json.gz")
    store = FixtureStore(tmp_path / "f")
    report = ingest([job], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    (outcome,) = report.outcomes
    assert outcome.sources == ("timing from event logs (megatron_trace/), no per-kernel truth (not read: Kineto "
                               "(torch_profile/), unusable: the run's warning says why)")
    assert any("two traces of rank 0" in w and "--source events" in w for w in outcome.warnings)
    assert not store.load(name).truth.kernels and store.load(name).truth.iterations
    refused = ingest([job], FixtureStore(tmp_path / "k"), split="train", source="kineto")
    assert "two traces of rank 0" in refused.outcomes[0].error
