"""Pictures on the real runs: timelines, parity plots, ledger history, the HTML report, and progress bars."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.ledger import read_entries
from hops_calib.plot import style
from hops_calib.plot.groups import MIN_DISCLOSED_RUNS, disclosable, group_rows, short_run_id
from hops_calib.plot.ledger import (FIGURE_SIZE_IN as LEDGER_SIZE_IN, LABEL_CHARS, ledger_figure, read_history,
                                   short_id, short_note)
from hops_calib.plot.parity import FIGURE_SIZE_IN as PARITY_SIZE_IN
from hops_calib.plot.timeline import figure_size, iteration_window

from conftest import PLAIN_MODEL_TOML

CHROMIUM = Path("/usr/bin/chromium")
DPI = 60  # small images: the pixel size still depends on it exactly, and they render fast

# Two one-term candidates: one lowers the roofline's efficiency (GPUs rarely reach peak on small GEMMs),
# one adds the untraced host work between iterations.
CANDIDATES = {
    "efficiency.toml": '''
id = "roofline-efficiency-0.3"
hypothesis = "small decoder GEMMs reach about a third of peak FLOP/s"
grounding = "hidden sizes of 1-2k leave tensor cores underfed"

[change]
action = "set"
term = "decoder_roofline"
params = { compute_efficiency = 0.3 }
''',
    "host.toml": '''
id = "iteration-host-overhead"
hypothesis = "untraced host work between iterations lowers real throughput"
grounding = "--log-interval 1 logs and fetches a batch on the host every iteration"

[change]
action = "add"
term = "iteration_host_overhead"
''',
}


from ledger_args import with_new_ledger

def cli(*args):
    return CliRunner().invoke(app, with_new_ledger(args))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def expected_px(size_in: tuple[float, float], dpi: float = DPI) -> tuple[int, int]:
    return int(round(size_in[0] * dpi)), int(round(size_in[1] * dpi))


@pytest.fixture(scope="module")
def train_run(shared_store):
    """A train run with the deepest pipeline the store has (the most lanes to draw)."""
    index = shared_store.index()
    train = index[index["split"] == "train"].sort_values(["pp", "id"], ascending=[False, True])
    return shared_store.load(train.iloc[0]["id"])


# --- timeline ------------------------------------------------------------------------------------

def test_timeline_png_has_the_figure_size_and_a_lane_per_stage(shared_fixtures, train_run, tmp_path):
    out = tmp_path / "timeline.png"
    result = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--out", out, "--dpi", DPI)
    assert result.exit_code == 0, result.output
    assert png_size(out) == expected_px(figure_size(train_run.spec.pp))
    assert f"wrote {out}" in result.stdout


def test_timeline_svg_is_well_formed_and_titled(shared_fixtures, train_run, tmp_path):
    out = tmp_path / "timeline.svg"
    result = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--out", out, "--iterations", 1)
    assert result.exit_code == 0, result.output
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    width_in, height_in = figure_size(train_run.spec.pp)
    assert float(root.get("width").removesuffix("pt")) == pytest.approx(width_in * 72)
    assert float(root.get("height").removesuffix("pt")) == pytest.approx(height_in * 72)
    text = out.read_text()
    # Text stays text (svg.fonttype none): the title, every stage label and the panels are searchable.
    assert train_run.id in text and "Real run (trace)" in text and "Predicted by model" in text
    for stage, device in enumerate(train_run.spec.devices):
        assert f"stage {stage} · {device.upper()}" in text


def test_timeline_with_chrome_writes_only_what_was_asked(shared_fixtures, train_run, tmp_path, monkeypatch):
    """--chrome alone writes the Chrome trace and no picture (none into the working directory); with --out, both."""
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "trace.json"
    result = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--chrome", trace)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    assert json.loads(trace.read_text())["traceEvents"] and ".png" not in result.stdout
    out = tmp_path / "pictures" / "t.png"
    out.parent.mkdir()
    result = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--chrome", trace, "--out", out,
                 "--dpi", DPI)
    assert result.exit_code == 0, result.output
    assert png_size(out) == expected_px(figure_size(train_run.spec.pp))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pictures", "trace.json"]
    assert f"wrote {out}" in result.stdout and f"wrote {trace}" in result.stdout


def test_the_window_holds_the_first_iterations_from_zero(train_run):
    real = train_run.timeline()
    for k in (1, 2, 3):
        window = iteration_window(real, k)
        assert window.iterations == tuple(sorted(real["iteration"].unique())[:k])
        assert set(window.rows["iteration"]) == set(window.iterations)
        assert window.rows["start_ms"].min() == 0.0
        assert window.iteration_starts_ms[0] == 0.0 and list(window.iteration_starts_ms) == sorted(
            window.iteration_starts_ms)
        of_window = real[real["iteration"].isin(window.iterations)]
        assert len(window.rows) == len(of_window)
        assert window.end_ms == pytest.approx(of_window["end_ms"].max() - of_window["start_ms"].min())
    more = iteration_window(real, 10_000)
    assert len(more.rows) == len(real)


def test_timeline_refuses_a_held_out_run_and_bad_options_without_writing(shared_fixtures, shared_store, train_run,
                                                                        tmp_path):
    out = tmp_path / "t.png"
    test_id = shared_store.ids("test")[0]
    refused = cli("plot", "timeline", test_id, "--fixtures", shared_fixtures, "--out", out)
    assert refused.exit_code == 2 and "test split" in refused.stderr
    wrong_suffix = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--out", tmp_path / "t.jpg")
    assert wrong_suffix.exit_code == 2 and "--out" in wrong_suffix.stderr and "*.png or *.svg" in wrong_suffix.stderr
    zero = cli("plot", "timeline", train_run.id, "--fixtures", shared_fixtures, "--out", out, "--iterations", 0)
    assert zero.exit_code == 2 and "--iterations" in zero.stderr
    unknown = cli("plot", "timeline", "no_such_run", "--fixtures", shared_fixtures, "--out", out)
    assert unknown.exit_code == 2 and "no_such_run" in unknown.stderr
    assert list(tmp_path.iterdir()) == []


# --- parity --------------------------------------------------------------------------------------

def test_parity_png_and_svg(shared_fixtures, shared_store, tmp_path):
    png, svg = tmp_path / "parity.png", tmp_path / "parity.svg"
    assert cli("plot", "parity", "--fixtures", shared_fixtures, "--out", png, "--dpi", DPI).exit_code == 0
    assert png_size(png) == expected_px(PARITY_SIZE_IN)
    result = cli("plot", "parity", "--fixtures", shared_fixtures, "--out", svg, "--label-worst", 2)
    assert result.exit_code == 0, result.output
    text = svg.read_text()
    ET.fromstring(text.encode())
    assert f"train split ({len(shared_store.ids('train'))} runs)" in text
    assert "±10%" in text or "±10 %" in text


def test_parity_labels_the_worst_runs_and_refuses_the_test_split(shared_fixtures, tmp_path):
    from hops_calib.plot.images import score_split

    scored = score_split(shared_fixtures, "train", None)
    out = tmp_path / "parity.svg"
    assert cli("plot", "parity", "--fixtures", shared_fixtures, "--out", out, "--label-worst", 2).exit_code == 0
    text = out.read_text()
    by_throughput = sorted(scored.points, key=lambda p: -abs(p.score.throughput_error_pct))
    by_bubble = sorted(scored.points, key=lambda p: -abs(p.score.bubble_error_pp))
    for point in by_throughput[:2] + by_bubble[:2]:
        assert short_run_id(point.run_id) in text
    labelled = {short_run_id(p.run_id) for p in by_throughput[:2] + by_bubble[:2]}
    best = short_run_id(by_throughput[-1].run_id)
    assert best in labelled or best not in text

    refused = cli("plot", "parity", "--split", "test", "--fixtures", shared_fixtures, "--out", tmp_path / "t.png")
    assert refused.exit_code == 2 and "refuses the test split" in refused.stderr
    assert not (tmp_path / "t.png").exists()


def test_parity_draws_each_runs_random_stall_spread(shared_fixtures):
    from matplotlib.container import ErrorbarContainer

    from hops_calib.plot.images import score_split
    from hops_calib.plot.parity import parity_figure

    scored = score_split(shared_fixtures, "train", None)
    exposed = [p for p in scored.points if p.score.stall_noise_ape_pct > 0]
    assert 0 < len(exposed) < len(scored.points)  # runs at the TCP ceiling, and NIC-paced ones
    throughput = parity_figure(scored.points, scored.suite, "t").axes[0]
    [bars] = [c for c in throughput.containers if isinstance(c, ErrorbarContainer)]
    segments = bars.lines[2][0].get_segments()
    assert len(segments) == len(exposed)
    for segment, point in zip(segments, exposed):
        (x0, y0), (x1, y1) = segment
        predicted = point.score.predicted_throughput_per_s
        assert x0 == x1 == pytest.approx(point.score.real_throughput_per_s)
        assert (y1 - y0) / 2 == pytest.approx(predicted * point.score.stall_noise_ape_pct / 100)
    assert "stall-noise floor" in throughput.get_title(loc="left")


def test_short_run_ids():
    assert short_run_id("exp2_9_g_only_pp4_run107") == "exp2_9 run107"
    assert short_run_id("cpu_pp2") == "cpu_pp2"
    # a log's or table's run named after its configuration: every part of it, both ends, less the source's name
    assert short_run_id("vtrain_t1p4d1_l12_h1024_s1024_mb1_gb2") == "p4 l12 h1024 s1024 mb1 gb2"
    assert short_run_id("sweep_t2p2d1_l24_h2048_s1024_mb1_gb16_run2") == "t2 p2 l24 h2048 s1024 mb1 gb16 run2"
    assert "…" in short_run_id("a" * 40) and len(short_run_id("a" * 40)) == 24
    # both ends kept: repeats of one configuration stay apart
    run1, run2 = (short_run_id(f"cpu_interleaved_v2_l8_h512_s256_m4_run{k}", limit=18) for k in (1, 2))
    assert run1 != run2 and run1.startswith("cpu_") and run1.endswith("run1") and len(run1) == 18


# --- ledger --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ledger_with_history(shared_fixtures, tmp_path_factory):
    """A ledger with two candidates evaluated (and committed when accepted) and one held-out report."""
    folder = tmp_path_factory.mktemp("ledger")
    model, ledger = folder / "model.toml", folder / "ledger.jsonl"
    model.write_text(PLAIN_MODEL_TOML)  # the shipped model already holds what these candidates add
    for name, text in CANDIDATES.items():
        (folder / name).write_text(text)
        result = cli("evaluate", folder / name, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger,
                     "--commit")
        assert result.exit_code in (0, 1), result.output
    assert cli("report", "--split", "test", "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger).exit_code == 0
    return {"model": model, "ledger": ledger}


def test_ledger_plot_draws_every_attempt(ledger_with_history, tmp_path):
    ledger = ledger_with_history["ledger"]
    entries = list(read_entries(ledger))
    attempts, audits = read_history(entries)
    assert [a.candidate_id for a in attempts] == [e["candidate"]["id"] for e in entries if e["kind"] == "evaluate"]
    assert [a.accepted for a in attempts] == [e["decision"] == "accepted" for e in entries if e["kind"] == "evaluate"]
    assert [a.seq for a in audits] == [e["seq"] for e in entries if e["kind"] == "report"]

    png, svg = tmp_path / "ledger.png", tmp_path / "ledger.svg"
    assert cli("plot", "ledger", "--ledger", ledger, "--out", png, "--dpi", DPI).exit_code == 0
    assert png_size(png) == expected_px(LEDGER_SIZE_IN)
    assert cli("plot", "ledger", "--ledger", ledger, "--out", svg).exit_code == 0
    text = svg.read_text()
    accepted = [a for a in attempts if a.accepted]
    assert accepted and len(accepted) < len(attempts)  # the history has both kinds
    for attempt in accepted:
        assert short_id(attempt.candidate_id) in text
    # Every attempt is drawn: the accepted on the step line and labelled, each rejected one as a cross.
    figure = ledger_figure(attempts, audits, "t")
    mape = figure.axes[0]
    assert [t.get_text() for t in mape.texts] == ["start"] + [short_id(a.candidate_id) for a in accepted]
    rejected_seqs = sorted(a.seq for a in attempts if not a.accepted)
    assert any(list(np.sort(c.get_offsets()[:, 0])) == rejected_seqs and c.get_paths()  # the crosses
               for c in mape.collections)
    assert mape.get_yscale() == "log" and figure.axes[2].get_yscale() == "linear"
    # One campaign only: the other candidates' labels are not drawn.
    first = accepted[0].candidate_id
    rest = {short_id(a.candidate_id) for a in accepted[1:]} - {short_id(first)}
    only = tmp_path / "only.svg"
    assert cli("plot", "ledger", "--ledger", ledger, "--out", only, "--candidates", f"^{first}$").exit_code == 0
    drawn = only.read_text()
    assert short_id(first) in drawn and not any(other in drawn for other in rest)
    # A filter that matches no candidate is a mistake to say, not an empty history to draw.
    none = cli("plot", "ledger", "--ledger", ledger, "--out", tmp_path / "none.png", "--candidates", "zzz")
    assert none.exit_code == 2 and "no candidate id matches --candidates 'zzz'" in none.stderr
    assert not (tmp_path / "none.png").exists()
    helped = " ".join(cli("plot", "ledger", "--help").stdout.replace("\u2502", " ").split())  # rich wraps in a box
    assert "(default: ledger-history.png in the current directory)" in helped


def _scores(mape: float) -> dict[str, float]:
    return {"throughput_mape_pct": mape, "bubble_mae_pp": 1.0, "util_spearman_mean": 0.9}


def _two_evaluations(second_mape: float, second_committed: bool) -> list[dict]:
    """001 accepted and committed (MAPE 5 -> 4), then 002 accepted (4 -> `second_mape`)."""
    return [
        {"seq": 1, "kind": "evaluate", "decision": "accepted", "candidate": {"id": "001-a"},
         "aggregates_before": _scores(5.0), "aggregates_after": _scores(4.0), "committed": True},
        {"seq": 2, "kind": "evaluate", "decision": "accepted", "candidate": {"id": "002-b"},
         "aggregates_before": _scores(4.0), "aggregates_after": _scores(second_mape), "committed": second_committed},
    ]


def test_a_committed_comparison_moves_the_ledger_line_and_an_undone_move_takes_it_back():
    scores = _scores
    entries = _two_evaluations(4.5, True) + [
        {"seq": 3, "kind": "compare", "decision": "rejected", "note": "move 002",
         "aggregates_before": scores(4.0), "aggregates_after": scores(4.5), "committed": True},
        {"seq": 4, "kind": "compare", "decision": "rejected", "note": "not committed",
         "aggregates_before": scores(4.0), "aggregates_after": scores(9.0)},
    ]
    attempts, _ = read_history(entries)
    assert [(a.seq, a.comparison, a.after["throughput_mape_pct"]) for a in attempts] == [
        (1, False, 4.0), (2, False, 4.5), (3, True, 4.0)]  # an uncommitted comparison changes no model
    mape = ledger_figure(attempts, [], "t").axes[0]
    assert [t.get_text() for t in mape.texts] == ["start", "001", "002", "move 002 undone"]
    line = mape.lines[0].get_ydata()
    assert list(line) == [5.0, 4.0, 4.5, 4.0, 4.0]  # back to the model before the move, and it stays there


def test_an_accepted_candidate_left_uncommitted_does_not_move_the_model_line():
    attempts, _ = read_history(_two_evaluations(3.0, False))
    mape = ledger_figure(attempts, [], "t").axes[0]
    assert list(mape.lines[0].get_ydata()) == [5.0, 4.0, 4.0]  # the model file stayed at 001's
    assert [t.get_text() for t in mape.texts] == ["start", "001"]
    hollow = [c for c in mape.collections if len(c.get_offsets()) and list(c.get_offsets()[:, 0]) == [2]]
    assert hollow and (hollow[0].get_facecolor()[0][:3] == 1.0).all()  # drawn, white inside


def test_a_comparison_is_labelled_by_the_head_of_its_note_and_the_panels_keep_their_size():
    scores = {"throughput_mape_pct": 2.0, "bubble_mae_pp": 1.0, "util_spearman_mean": 0.9}
    long_note = ("move 053-055 (hops as bursts, refit after 052); rules stated in CAMPAIGN.md session 5 before its "
                 "evaluations")
    entries = [
        {"seq": 1, "kind": "evaluate", "decision": "accepted", "candidate": {"id": "001-a"},
         "aggregates_before": scores, "aggregates_after": scores, "committed": True},
        {"seq": 2, "kind": "compare", "decision": "accepted", "note": long_note,
         "aggregates_before": scores, "aggregates_after": scores, "committed": True},
        {"seq": 3, "kind": "compare", "decision": "rejected", "note": "x" * 60,
         "aggregates_before": scores, "aggregates_after": scores, "committed": True},
    ]
    attempts, _ = read_history(entries)
    assert attempts[1].candidate_id == long_note  # the whole note stays with the attempt
    labels = [t.get_text() for t in ledger_figure(attempts, [], "t").axes[0].texts]
    assert labels == ["start", "001", "move 053-055", short_note("x" * 60) + " undone"]
    assert len(short_note("x" * 60)) == LABEL_CHARS and short_note("x" * 60).endswith("\u2026")
    assert short_note("(all in brackets)") == "(all in brackets)"  # nothing before the mark: the note itself


def test_ledger_plot_of_an_empty_or_missing_ledger_says_what_to_do(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "l.png"
    for ledger in (empty, tmp_path / "missing.jsonl"):
        result = cli("plot", "ledger", "--ledger", ledger, "--out", out)
        assert result.exit_code == 2
        assert str(ledger) in result.stderr and "hops-calib evaluate" in result.stderr
    assert not out.exists()


# --- groups and the HTML report ------------------------------------------------------------------

def test_held_out_groups_never_expose_a_small_group(shared_fixtures):
    from hops_calib.plot.images import score_split

    points = score_split(shared_fixtures, "train", None).points
    for key in (lambda p: p.device_mix, lambda p: p.pp, lambda p: p.microbatches):
        everything = group_rows(points, key)
        assert sum(r.suite.n_fixtures for r in everything) == len(points)
        shown = disclosable(points, key)
        if shown is None:
            small = sum(r.suite.n_fixtures for r in everything if r.suite.n_fixtures < MIN_DISCLOSED_RUNS)
            assert 0 < small < MIN_DISCLOSED_RUNS
            continue
        assert all(r.suite.n_fixtures >= MIN_DISCLOSED_RUNS for r in shown)
        assert sum(r.suite.n_fixtures for r in shown) == len(points)
    # One group per run is the extreme: nothing can be shown.
    assert disclosable(points, lambda p: p.run_id) is None or len(points) >= MIN_DISCLOSED_RUNS


def _render_in_chromium(page: Path, tmp_path: Path) -> str:
    """Load `page` in headless Chromium with a probe that reports, after load, whether every image decoded."""
    probe = page.with_name("probe-" + page.name)
    check = ("<script>window.addEventListener('load', () => { const images = [...document.images]; "
             "document.body.setAttribute('data-images', images.length); document.body.setAttribute('data-broken', "
             "images.filter(i => !(i.complete && i.naturalWidth > 0)).length); });</script>")
    probe.write_text(page.read_text().replace("</body>", check + "</body>"))
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000", "--dump-dom",
         probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_html_report_train_has_tables_images_and_every_run(shared_fixtures, shared_store, ledger_with_history,
                                                           tmp_path):
    page = tmp_path / "train.html"
    ledger = ledger_with_history["ledger"]
    before = len(list(read_entries(ledger)))
    result = cli("report", "--split", "train", "--fixtures", shared_fixtures, "--model", ledger_with_history["model"],
                 "--ledger", ledger, "--html", page)
    assert result.exit_code == 0, result.output
    assert f"wrote {page}" in result.stdout
    assert len(list(read_entries(ledger))) == before  # train is not held out: nothing to audit, nothing appended
    assert "nothing appended" in result.stdout and "not recorded: the train split is not held out" in page.read_text()
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "http://" not in html and "https://" not in html
    assert html.count('src="data:image/png;base64,') == 2  # parity plot and ledger history
    for fixture_id in shared_store.ids("train"):
        assert f"<td class=\"text\">{fixture_id}</td>" in html
    for fixture_id in shared_store.ids("test"):
        assert fixture_id not in html
    assert "By device mix" in html and "By pipeline depth" in html
    # Errors outside the ±10 % band are highlighted, as on the parity plot.
    from hops_calib.plot.images import score_split

    scores = [p.score for p in score_split(shared_fixtures, "train", ledger_with_history["model"]).points]
    outside = sum(abs(s.throughput_error_pct) > 10 for s in scores) + sum(
        abs(s.predicted_bubble_ratio - s.real_bubble_ratio) > 0.1 * s.real_bubble_ratio for s in scores)
    assert html.count('<td class="off">') == outside


def test_html_report_without_a_ledger_option_draws_the_projects_history_of_these_runs(shared_fixtures, shared_store,
                                                                                      tmp_path):
    from hops_calib.loop.ledger import resolve
    from hops_calib.plot.ledger import entries_on

    page = tmp_path / "train.html"
    result = cli("report", "--split", "train", "--fixtures", shared_fixtures, "--html", page)  # docs/results.md's line
    assert result.exit_code == 0, result.output
    assert page.read_text().count('src="data:image/png;base64,') == 2
    # the history keeps the entries that scored this store's splits; another store's (the CPU captures') go
    entries = list(read_entries(resolve(None)))
    sizes = {split: len(shared_store.ids(split)) for split in ("train", "test")}
    kept = entries_on(entries, sizes)
    assert kept and all(e["n_fixtures"] == sizes[e["split"]] for e in kept)
    assert any(e.get("n_fixtures") not in (None, *sizes.values()) for e in entries)  # the ledger has CPU entries


def test_html_report_test_split_shows_aggregates_only_and_is_audited(shared_fixtures, shared_store, tmp_path):
    page, ledger = tmp_path / "test.html", tmp_path / "ledger.jsonl"
    result = cli("report", "--split", "test", "--fixtures", shared_fixtures, "--ledger", ledger, "--html", page, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    entries = list(read_entries(ledger))
    assert [e["kind"] for e in entries] == ["report"] and entries[0]["split"] == "test"
    html = page.read_text()
    for fixture_id in shared_store.ids():
        assert fixture_id not in html  # no per-run row, no labelled point, of either split
    assert "<img" not in html  # no parity plot of held-out runs (and this ledger holds no candidate yet)
    assert f"{summary['throughput_mape_pct']:.2f}" in html and f"{summary['bubble_mae_pp']:.2f}" in html
    assert "Held-out report" in html
    assert f"test minus train {summary['gap_to_train_pp']:+.2f} pp" in html
    gap_low, gap_high = summary["intervals"]["gap_to_train_pp"]
    assert f"test minus train {gap_low:+.2f} to {gap_high:+.2f} pp" in html  # the spread over configurations
    outside = summary["outside_train"]
    assert f"{outside['runs']} of {outside['of']} configurations lie outside the train runs" in html

    bad = cli("report", "--split", "test", "--fixtures", shared_fixtures, "--ledger", ledger, "--html", tmp_path / "report.txt")
    assert bad.exit_code == 2 and "--html" in bad.stderr
    assert len(list(read_entries(ledger))) == 1  # a refused name costs no audit entry


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent: install Debian's chromium "
                                                  "(apt-get install chromium) to render the HTML report")
def test_html_report_loads_in_headless_chromium(shared_fixtures, ledger_with_history, tmp_path):
    page = tmp_path / "train.html"
    assert cli("report", "--split", "train", "--fixtures", shared_fixtures, "--model", ledger_with_history["model"],
               "--ledger", ledger_with_history["ledger"], "--html", page).exit_code == 0
    dom = _render_in_chromium(page, tmp_path)
    assert "hops-calib report: train split" in dom
    assert 'data-images="2"' in dom and 'data-broken="0"' in dom


# --- progress bars -------------------------------------------------------------------------------

def test_progress_bar_draws_on_a_terminal_and_is_silent_otherwise(shared_fixtures, shared_store, capsys):
    from rich.console import Console

    from hops_calib.loop.evaluate import evaluate
    from hops_calib.progress import QUIET, progress_bar

    with progress_bar("evaluate") as progress:  # pytest captures stdout: not a terminal
        assert progress is QUIET
    with progress_bar("evaluate", quiet=True, console=Console(file=io.StringIO(), force_terminal=True)) as progress:
        assert progress is QUIET  # --json wins even on a terminal
    assert capsys.readouterr() == ("", "")

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with progress_bar("evaluate", console=console) as progress:
        evaluate(shared_fixtures, progress=progress)
    drawn = screen.getvalue()
    n = len(shared_store.ids("train"))
    assert "evaluate" in drawn and f"{n}/{n}" in drawn


def test_evaluate_reports_one_unit_per_prediction(shared_fixtures, shared_store, tmp_path):
    from hops_calib.loop.evaluate import evaluate

    class Recorder:
        def __init__(self):
            self.total, self.done = None, []

        def start(self, total):
            self.total = total

        def advance(self, what=""):
            self.done.append(what)

    model = tmp_path / "model.toml"
    model.write_text(PLAIN_MODEL_TOML)
    candidate = tmp_path / "host.toml"
    candidate.write_text(CANDIDATES["host.toml"])
    recorder = Recorder()
    evaluate(shared_fixtures, model_path=model, candidate_path=candidate, ledger_path=tmp_path / "l.jsonl",
             progress=recorder)
    train = shared_store.ids("train")
    assert recorder.total == 2 * len(train) and recorder.done == train + train


def test_pixel_size_matches_what_is_written(train_run, tmp_path):
    from hops_calib.plot.timeline import Panel, timeline_figure

    for dpi in (40, 75):
        figure = timeline_figure("t", train_run.spec.devices, [Panel("real", train_run.timeline())], 1, dpi=dpi)
        expected = style.pixel_size(figure, dpi)
        out = style.save_figure(figure, tmp_path / f"one-panel-{dpi}.png", dpi)
        assert png_size(out) == expected == expected_px(figure_size(train_run.spec.pp, panels=1), dpi)


def test_written_files_are_as_readable_as_the_umask_allows(tmp_path):
    from hops_calib.files import atomic_write

    previous = os.umask(0o022)
    try:
        atomic_write(tmp_path / "image.png", b"x")
    finally:
        os.umask(previous)
    assert (tmp_path / "image.png").stat().st_mode & 0o777 == 0o644  # not mkstemp's private 0600


def test_a_polled_count_moves_the_same_bar(capsys):
    from rich.console import Console

    from hops_calib.progress import QUIET, progress_bar

    screen = io.StringIO()
    with progress_bar("tuning", console=Console(file=screen, force_terminal=True, width=100)) as progress:
        for completed in (0, 3, 7, 12):
            progress.update(completed, 12)
    assert "tuning" in screen.getvalue() and "12/12" in screen.getvalue()
    with progress_bar("tuning") as progress:  # not a terminal under pytest: QUIET, which counts silently too
        assert progress is QUIET
        progress.update(1, 2)
    assert capsys.readouterr() == ("", "")


def test_later_model_chunks_of_an_interleaved_schedule_are_hatched(train_run, tmp_path):
    import dataclasses

    from hops_calib.model.predict import predict
    from hops_calib.plot.timeline import Panel, timeline_figure

    from conftest import plain_model

    spec = train_run.spec
    # The same run with twice the layers, so every rank splits into two model chunks (Megatron's rule).
    interleaved = dataclasses.replace(spec, vp=2, schedule="interleaved_1f1b",
                                      layers_per_stage=tuple(2 * n for n in spec.layers_per_stage),
                                      model=dataclasses.replace(spec.model, num_layers=2 * spec.model.num_layers))
    model = plain_model()
    panels = {"1f1b": predict(spec, model).result.timeline, "interleaved": predict(interleaved, model).result.timeline}
    assert set(panels["interleaved"]["chunk"]) == {0, 1}
    for name, timeline in panels.items():
        figure = timeline_figure(name, spec.devices, [Panel(name, timeline)], 1)
        out = style.save_figure(figure, tmp_path / f"{name}.svg")
        assert ("later model chunk" in out.read_text()) == (name == "interleaved")


def test_a_program_reading_stderr_can_ask_for_progress_lines(monkeypatch, capsys):
    from hops_calib import progress as progress_module

    monkeypatch.setenv(progress_module.PROGRESS_ENV, "lines")
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    ticks = iter(range(100))
    monkeypatch.setattr(progress_module._Lines, "__init__", _lines_init_with(progress_module, ticks))
    with progress_module.progress_bar("evaluate", quiet=True) as progress:  # --json: the lines still come
        progress.start(3)
        for run in ("a", "b", "c"):
            progress.advance(run)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[:3] == ["evaluate: 1/3 (1 s) a", "evaluate: 2/3 (2 s) b", "evaluate: 3/3 (3 s) c"]
    assert lines[-1].startswith("evaluate: 3/3") and lines[-1].endswith(" done")  # the closing line says so


def _lines_init_with(progress_module, ticks):
    original = progress_module._Lines.__init__

    def init(self, label, stream=None, every_s=0.0):
        original(self, label, stream, every_s)
        self._clock = lambda: float(next(ticks))
        self._t0 = self._last = self._clock()

    return init



def test_the_default_timeline_of_a_job_of_many_microbatches_draws_a_readable_window(tmp_path):
    """docs/whatif.md's 175B GPU job (192 microbatches an iteration): two whole iterations give a forward ~1.5 px and the
    picture turns to moire. The default draws only the start of one iteration, each forward at least MIN_TASK_PX
    wide, says so in the title and a note; --iterations 2 still draws both whole iterations."""
    from job_copies import readme_gpu_job

    from hops_calib.plot.images import timeline_image
    from hops_calib.plot.timeline import MIN_TASK_PX, PLOT_WIDTH_SHARE
    from hops_calib.timeline import COMPUTE, FORWARD

    job, _ = readme_gpu_job(tmp_path)
    out = tmp_path / "t.png"

    def forward_px(image):
        ax = image.figure.axes[0]
        x_min, x_max = ax.get_xlim()
        return image.figure.get_figwidth() * PLOT_WIDTH_SHARE * DPI / (x_max - x_min), x_max

    default = timeline_image(None, tmp_path, None, None, out, DPI, job)
    whole = timeline_image(None, tmp_path, None, 2, out, DPI, job)
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job import what_if

    timeline = what_if(job, load_model(None), ()).predictions[0].result.timeline
    forwards = timeline[(timeline["kind"] == COMPUTE) & (timeline["phase"] == FORWARD)]
    forward_ms = float((forwards["end_ms"] - forwards["start_ms"]).median())
    px_default, span_default = forward_px(default)
    px_whole, span_whole = forward_px(whole)
    assert forward_ms * px_whole < MIN_TASK_PX  # two whole iterations: unreadable (the walkthrough's picture)
    assert forward_ms * px_default >= MIN_TASK_PX * 0.99
    assert span_default < span_whole
    title = default.figure._suptitle.get_text()
    assert "ms of 1 of" in title and "microbatches 0-" in title and "of 192" in title
    assert any(note.startswith("drawn: the first") and "--iterations K" in note for note in default.notes)
    assert "first 2 of" in whole.figure._suptitle.get_text()
    assert not any(note.startswith("drawn:") for note in whole.notes)
