"""What-if: `predict --job DIR` and `plot timeline --job DIR` on configurations that have not run.

The repository's own CPU captures stand in for a configuration: copied without their event logs, they must
predict exactly what the ingested fixture predicts (the configuration is all a prediction sees), and an edited
copy must move the prediction the way the edit says.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.evaluate import open_store
from hops_calib.model_files import load_model
from hops_calib.plot.timeline import figure_size
from hops_calib.predict import predict

REPO = Path(__file__).resolve().parent.parent
RUN = "cpu_1f1b_l4_h512_s256_m4_run1"  # train split of the shipped CPU captures
INTERLEAVED = "cpu_interleaved_v2_l8_h512_s256_m4_run1"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def configuration_only(tmp_path: Path, run: str = RUN) -> Path:
    """A copy of a shipped capture's job directory without its event logs: a run that has not happened."""
    job = tmp_path / run
    shutil.copytree(REPO / "traces" / run, job, ignore=shutil.ignore_patterns("megatron_trace"))
    assert not (job / "megatron_trace").exists()
    return job


def predict_job(*args) -> dict:
    result = cli("predict", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_configuration_without_traces_predicts_what_its_fixture_predicts(tmp_path):
    out = predict_job("--job", configuration_only(tmp_path))
    fixture = open_store(REPO / "fixtures").load(RUN)
    expected = predict(fixture.spec, load_model(None))
    [got] = out["predictions"]
    assert got["asked"] == got["schedule"] == fixture.spec.schedule
    assert got["throughput_per_s"] == pytest.approx(expected.metrics.throughput_per_s, rel=1e-12)
    assert got["bubble_ratio"] == pytest.approx(expected.metrics.bubble_ratio, rel=1e-12)
    assert [s["forward_ms"] for s in got["stages"]] == pytest.approx(
        [row.forward_ms for row in expected.stage_phase_ms(fixture.spec)])
    assert out["configuration"]["devices"] == list(fixture.spec.devices)
    # the CPU captures meet no random stall: the range is the prediction itself
    assert got["stall_throughput_range"] == pytest.approx(
        {"low_per_s": expected.metrics.throughput_per_s, "high_per_s": expected.metrics.throughput_per_s, "share": 1.0})


def test_an_edited_configuration_moves_the_prediction_as_the_edit_says(tmp_path):
    job = configuration_only(tmp_path)
    before = predict_job("--job", job)["predictions"][0]
    args = job / "megatron_args.txt"
    text = args.read_text()
    assert "--global-batch-size 4" in text
    args.write_text(text.replace("--global-batch-size 4", "--global-batch-size 16"))
    after = predict_job("--job", job)
    assert after["configuration"]["microbatches"] == 16
    # Four times the microbatches between two flushes: the pipeline's fill and drain weigh less.
    assert after["predictions"][0]["bubble_ratio"] < before["bubble_ratio"]
    assert after["predictions"][0]["throughput_per_s"] > before["throughput_per_s"]


def test_schedules_side_by_side_and_what_they_hold_in_flight(tmp_path):
    job = configuration_only(tmp_path)
    out = predict_job("--job", job, "--schedule", "1f1b", "--schedule", "gpipe", "--schedule", "zb_h1",
                      "--schedule", "auto")
    by = {p["asked"]: p for p in out["predictions"]}
    assert list(by) == ["1f1b", "gpipe", "zb_h1", "auto"]
    microbatches, pp = out["configuration"]["microbatches"], out["configuration"]["pp"]
    assert max(by["gpipe"]["peak_activations"]) == microbatches  # all forwards before any backward
    assert max(by["1f1b"]["peak_activations"]) == min(pp, microbatches)
    assert by["auto"]["schedule"] in ("1f1b", "gpipe", "zb_h1")
    text = cli("predict", "--job", job, "--schedule", "1f1b", "--schedule", "auto").output
    assert f"auto: {by['auto']['schedule']}" in text and "random stalls" in text


@pytest.mark.parametrize("args,field", [
    (["--schedule", "pipedream"], "--schedule"),
    (["--schedule", "interleaved_1f1b"], "--schedule"),
])
def test_a_schedule_the_configuration_cannot_run_is_refused_by_name(tmp_path, args, field):
    result = cli("predict", "--job", configuration_only(tmp_path), *args)
    assert result.exit_code == 2 and field in result.output


def test_interleaved_configurations_predict_under_their_own_schedule(tmp_path):
    out = predict_job("--job", configuration_only(tmp_path, INTERLEAVED), "--schedule", "interleaved_1f1b")
    assert out["configuration"]["vp"] == 2 and out["predictions"][0]["schedule"] == "interleaved_1f1b"


def test_what_if_refuses_ambiguous_or_incomplete_requests(tmp_path):
    job = configuration_only(tmp_path)
    assert cli("predict", RUN, "--job", job, "--fixtures", REPO / "fixtures").exit_code == 2
    assert "--schedule applies to --job" in cli("predict", RUN, "--schedule", "gpipe", "--fixtures",
                                                REPO / "fixtures").output
    assert cli("predict", "--job", tmp_path / "nowhere").exit_code == 2
    shutil.rmtree(job / "calibration")
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and "configuration" in result.output and "link_bench" in result.output
    (job / "megatron_args.txt").unlink()
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and "megatron_args.txt" in result.output


def test_what_if_timeline_draws_one_predicted_panel_per_schedule(tmp_path):
    job = configuration_only(tmp_path)
    out = tmp_path / "whatif.png"
    result = cli("plot", "timeline", "--job", job, "--schedule", "1f1b", "--schedule", "gpipe", "--schedule", "zb_h1",
                 "--out", out, "--dpi", 50)
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width_in, height_in = figure_size(2, panels=3)
    assert struct.unpack(">II", data[16:24]) == (int(round(width_in * 50)), int(round(height_in * 50)))
    assert cli("plot", "timeline", "--out", out).exit_code == 2  # neither a fixture nor a job


def test_a_what_if_says_where_it_leaves_the_calibration_runs(tmp_path):
    store = open_store(REPO / "fixtures")
    train = [store.load(i).spec for i in store.ids("train")]
    job = configuration_only(tmp_path)
    inside = predict_job("--job", job, "--fixtures", REPO / "fixtures")
    assert inside["extrapolations"] == [] and f"{len(train)} runs" in inside["calibration"]
    assert "within the calibration runs' coverage" in cli("predict", "--job", job, "--fixtures",
                                                          REPO / "fixtures").stdout
    # More microbatches than any calibration run had: named, with the range the runs had.
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().replace("--global-batch-size 4", "--global-batch-size 64"))
    low, high = min(s.microbatches for s in train), max(s.microbatches for s in train)
    assert high < 64
    out = predict_job("--job", job, "--fixtures", REPO / "fixtures")
    flagged = {e["feature"]: e for e in out["extrapolations"]}
    assert flagged["microbatches"]["value"] == "64"
    assert flagged["microbatches"]["calibrated"] == (f"{low}" if low == high else f"{low}-{high}")
    text = cli("predict", "--job", job, "--fixtures", REPO / "fixtures").stdout
    assert "outside the calibration runs" in text and "microbatches 64" in text
    # No store to compare with: the prediction still comes, and says the coverage was not checked.
    unchecked = predict_job("--job", job, "--fixtures", tmp_path / "nowhere")
    assert unchecked["extrapolations"] is None and "no fixture store" in unchecked["calibration"]
