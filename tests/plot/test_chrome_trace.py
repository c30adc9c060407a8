"""Chrome trace export (hops_calib.plot.chrome) read back by a reader written here from the Trace Event Format's
rules (the JSON Object Format: a `traceEvents` list; complete events `ph: X` with `name`, `pid`, `tid`, `ts` and
`dur` in microseconds; metadata events `ph: M` naming processes and threads; the slices of one thread disjoint or
nested, else the viewers mis-draw them). No code of the writer is used to read."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.plot.chrome import write_chrome_trace
from hops_calib.plot.timeline import Panel
from hops_calib.model.predict import predict
from hops_calib.store import FixtureStore

REPO = Path(__file__).resolve().parents[2]
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def read_trace_event_format(path: Path) -> dict:
    """Parse a Chrome trace file and check the format's rules; return {process name: {thread name: [(name, ts_us,
    dur_us, args), ...]}}."""
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    assert data.get("displayTimeUnit", "ms") in ("ms", "ns")
    processes, threads = {}, {}
    slices = defaultdict(list)
    for event in data["traceEvents"]:
        assert isinstance(event, dict) and isinstance(event["ph"], str) and isinstance(event["name"], str)
        assert isinstance(event["pid"], int)
        if event["ph"] == "M":
            assert event["name"] in METADATA_NAMES and isinstance(event["args"], dict)
            if event["name"] == "process_name":
                processes[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                threads[event["pid"], event["tid"]] = event["args"]["name"]
            continue
        assert event["ph"] == "X", event  # the export writes complete events only
        assert isinstance(event["tid"], int)
        for key in ("ts", "dur"):
            assert isinstance(event[key], (int, float)) and not isinstance(event[key], bool) and event[key] >= 0
        slices[event["pid"], event["tid"]].append((event["name"], event["ts"], event["dur"], event.get("args", {})))
    out: dict = defaultdict(dict)
    for (pid, tid), items in slices.items():
        items.sort(key=lambda item: (item[1], -item[2]))
        open_ends: list[float] = []  # a stack of enclosing slices' ends
        for _, ts, dur, _ in items:
            while open_ends and open_ends[-1] <= ts:
                open_ends.pop()
            assert not open_ends or ts + dur <= open_ends[-1] + 1e-6, f"slices overlap without nesting on {tid}"
            open_ends.append(ts + dur)
        out[processes[pid]][threads[pid, tid]] = items
    return dict(out)


def _by_stage_phase(frame) -> dict:
    frame = frame.assign(ms=frame["end_ms"] - frame["start_ms"])
    groups = frame.groupby(["stage", "kind", "phase"])
    return {(int(s), k, p): (len(g), float(g["ms"].sum())) for (s, k, p), g in groups}


def _real_and_predicted_export(path: Path, iterations: int | None):
    """A shipped interleaved run and its prediction exported to `path`: (path, real timeline, predicted one)."""
    fixture = FixtureStore(REPO / "fixtures").load("cpu_interleaved_v2_l8_h512_s256_m4_run1")
    real = fixture.timeline()
    predicted = predict(fixture.spec, load_model()).result.timeline
    return write_chrome_trace(path, fixture.id, fixture.spec.devices,
                              [Panel("Real run (trace)", real), Panel("Predicted", predicted)], iterations), real, predicted


def test_real_and_predicted_lanes_read_back_with_every_interval(tmp_path):
    path, real, predicted = _real_and_predicted_export(tmp_path / "trace.json", None)
    read = read_trace_event_format(path)
    assert json.loads(path.read_text())["otherData"]["window"]["windowed"] is False  # whole runs, as asked
    assert list(read) == ["Real run (trace)", "Predicted"]
    for name, frame in (("Real run (trace)", real), ("Predicted", predicted)):
        got: dict = defaultdict(lambda: [0, 0.0])
        first = float(frame["start_ms"].min())
        for thread, items in read[name].items():
            stage = int(thread.split()[1])
            kind = "transfer" if "sends" in thread else "compute"
            for label, ts, dur, args in items:
                phase = label.removeprefix("send ").split()[0]
                got[stage, kind, phase][0] += 1
                got[stage, kind, phase][1] += dur / 1000.0
                assert ts / 1000.0 + first <= float(frame["end_ms"].max()) + 1e-6
        want = _by_stage_phase(frame)
        assert set(got) == set(want)
        for key, (count, ms) in want.items():
            # every ts and dur is written to the nanosecond (1e-6 ms each)
            assert got[key][0] == count and got[key][1] == pytest.approx(ms, rel=1e-9, abs=count * 1e-6), key


def test_overlapping_real_intervals_get_their_own_thread(tmp_path):
    fixture = FixtureStore(REPO / "fixtures").load("cpu_1f1b_l4_h512_s256_m4_run1")
    real = fixture.timeline()
    stage0 = real[(real["stage"] == 0) & (real["kind"] == "compute")].sort_values("start_ms")
    # shift one compute interval so that it starts inside the one before and ends after it (a real-trace overlap)
    before, victim = stage0.index[0], stage0.index[1]
    length = real.loc[before, "end_ms"] - real.loc[before, "start_ms"]
    real.loc[victim, "start_ms"] = real.loc[before, "start_ms"] + length / 2
    real.loc[victim, "end_ms"] = real.loc[before, "end_ms"] + length
    read = read_trace_event_format(write_chrome_trace(tmp_path / "t.json", fixture.id, fixture.spec.devices,
                                                      [Panel("real", real)]))
    assert any(thread.startswith("stage 0") and "+1" in thread for thread in read["real"])


def test_intervals_touching_up_to_float_noise_share_a_thread(tmp_path):
    """A predicted timeline's back-to-back tasks meet at sums of floats: one may start 1e-9 us before the previous
    ends. Touching is not overlapping: no extra thread."""
    fixture = FixtureStore(REPO / "fixtures").load("cpu_1f1b_l4_h512_s256_m4_run1")
    predicted = predict(fixture.spec, load_model()).result.timeline.copy()
    compute = predicted[(predicted["stage"] == 0) & (predicted["kind"] == "compute")].sort_values("start_ms")
    first, second = compute.index[0], compute.index[1]
    predicted.loc[second, "start_ms"] = predicted.loc[first, "end_ms"] - 1e-12  # 1e-9 us of noise
    read = read_trace_event_format(write_chrome_trace(tmp_path / "t.json", fixture.id, fixture.spec.devices,
                                                      [Panel("predicted", predicted)]))
    assert not any("+1" in thread for thread in read["predicted"])
    predicted.loc[second, "start_ms"] = predicted.loc[first, "end_ms"] - 1e-3  # a real microsecond's overlap
    read = read_trace_event_format(write_chrome_trace(tmp_path / "u.json", fixture.id, fixture.spec.devices,
                                                      [Panel("predicted", predicted)]))
    assert any(thread.startswith("stage 0") and "+1" in thread for thread in read["predicted"])


def test_the_default_export_holds_the_first_iterations_of_each_panel_and_says_so(tmp_path):
    path, real, predicted = _real_and_predicted_export(tmp_path / "trace.json", 2)
    read = read_trace_event_format(path)
    window = json.loads(path.read_text())["otherData"]["window"]
    assert window["windowed"] and window["iterations"] == 2
    for (name, frame), shown in zip((("Real run (trace)", real), ("Predicted", predicted)), window["panels"]):
        first_two = sorted(set(frame["iteration"]))[:2]
        kept = frame[frame["iteration"].isin(first_two)]
        assert shown["iterations_shown"] == 2 and shown["iterations"] == frame["iteration"].nunique() > 2
        assert shown["intervals_shown"] == len(kept) < len(frame) == shown["intervals"]
        items = [item for thread in read[name].values() for item in thread]
        assert len(items) == len(kept)
        assert _by_stage_phase(kept).keys() == {
            (int(t.split()[1]), "transfer" if "sends" in t else "compute", label.removeprefix("send ").split()[0])
            for t, thread in read[name].items() for label, *_ in thread}


def test_the_175b_jobs_chrome_export_is_bounded_and_says_it_is_windowed(tmp_path):
    """docs/whatif.md's 175B GPU job: 98 predicted iterations of 192 microbatches on 8 stages, 565,000 intervals and
    218 MB as a whole run. The default export holds 3 iterations: at most 3/98 of the intervals (as events, counted,
    plus the metadata: under 20,000 events), and the trace and the command's output say it is a window."""
    from job_copies import readme_gpu_job
    from typer.testing import CliRunner

    from hops_calib.cli import app

    job, _ = readme_gpu_job(tmp_path)
    trace_path = tmp_path / "175b.json"
    result = CliRunner().invoke(app, ["plot", "timeline", "--job", str(job), "--chrome", str(trace_path),
                                      "--out", str(tmp_path / "175b.png"), "--no-cluster"])
    assert result.exit_code == 0, result.output
    data = json.loads(trace_path.read_text())
    window = data["otherData"]["window"]
    assert window["windowed"] and window["iterations"] == 3
    (panel,) = window["panels"]
    assert panel["iterations_shown"] == 3 and panel["iterations"] > 50  # a long run, cut to its start
    assert panel["intervals_shown"] <= panel["intervals"] * 3 / panel["iterations"] * 1.05
    intervals = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(intervals) == panel["intervals_shown"]
    assert len(data["traceEvents"]) < 20_000
    labels = [e["args"]["labels"] for e in data["traceEvents"] if e["name"] == "process_labels"]
    assert labels == [f"first 3 of {panel['iterations']} iterations"]
    assert "exported: the first 3 iterations" in result.output and "--chrome-all" in result.output
    read_trace_event_format(trace_path)  # still a well-formed trace
