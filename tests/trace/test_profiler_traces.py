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

from profiler_synth import job_dir, pipeline_run, write_kineto  # noqa: E402

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
