"""Issue #22's iteration replayed through the CLI on the cluster runs, against a copy of the project's ledger (the
real one is never appended to): judgements on the wrong store, or of a change that moves no run, are refused
naming the store the model was calibrated on; an accepted candidate's JSON shows each run before and after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.ledger import read_entries

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "hops_calib" / "model" / "models" / "baseline.toml"
CLUSTER_SET = "34432cc1de87"  # the fixture set the ledger's cluster entries were judged on (ingested from ../shared)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def candidate(folder: Path, name: str, change: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f'id = "{name}"\nhypothesis = "h"\ngrounding = "g"\n\n[change]\n{change}\n')
    return path


def test_the_wrong_store_and_a_change_that_moves_nothing_are_refused_naming_the_calibrated_store(
        shared_fixtures, tmp_path):
    ledger, model = tmp_path / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(REPO / "ledger" / "ledger.jsonl", ledger)
    shutil.copy(SHIPPED, model)
    entries = len(list(read_entries(ledger)))
    l4 = candidate(tmp_path, "l4-floor", 'action = "set"\nterm = "layer_launch_floor"\n'
                                         'params = { "forward_ms_per_layer@l4" = 1.6 }')
    # No --fixtures: the shipped CPU store, where no run has an L4: refused, naming the cluster fixture set.
    for args in ((), ("--fixtures", REPO / "fixtures")):
        refused = cli("evaluate", l4, *args, "--model", model, "--ledger", ledger, "--json")
        assert refused.exit_code == 4, refused.output
        error = json.loads(refused.stdout)
        assert error["status"] == "off_record" and CLUSTER_SET in error["error"]["message"]
        assert "--off-record" in error["error"]["hint"]
    # The CPU device's values on the cluster store: also the wrong runs (calibrated on the CPU captures).
    cpu = candidate(tmp_path, "cpu-roofline", 'action = "set"\nterm = "decoder_roofline"\n'
                                              'params = { "compute_efficiency@cpu" = 0.31 }')
    refused = cli("evaluate", cpu, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger, "--json")
    assert refused.exit_code == 4 and "on cpu" in json.loads(refused.stdout)["error"]["message"]
    # Judged anyway with --off-record: it moves no cluster run, so it is marked, and never committed.
    never = cli("evaluate", cpu, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger, "--off-record",
                "--commit")
    assert never.exit_code == 4 and "moves none of the 36 runs" in never.stderr
    marked = cli("evaluate", cpu, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger,
                 "--off-record", "--json")
    assert marked.exit_code == 0, marked.output
    data = json.loads(marked.stdout)
    assert data["off_record"] and data["runs_moved"] == [] and not data["committed"]
    assert list(read_entries(ledger))[-1]["off_record"] is True
    assert len(list(read_entries(ledger))) == entries + 1  # the refusals wrote nothing
    assert model.read_bytes() == SHIPPED.read_bytes()


def test_an_accepted_candidate_shows_every_run_before_and_after_and_observe_names_terms(shared_fixtures, tmp_path):
    ledger, model = tmp_path / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(REPO / "ledger" / "ledger.jsonl", ledger)
    shutil.copy(SHIPPED, model)
    # The suite as shipped: the numbers of the last accepted change, on the runs it was judged on.
    plain = json.loads(cli("evaluate", "--fixtures", shared_fixtures, "--model", model, "--json").stdout)
    assert plain["status"] == "ok" and plain["fixture_set_sha256"].startswith(CLUSTER_SET)
    assert round(plain["throughput_mape_pct"], 4) == round(list(read_entries(ledger))[118]["aggregates_after"]
                                                           ["throughput_mape_pct"], 4)
    # A one-term change of the L4's launch floor, judged under relaxed rules stated in a plan first.
    l4 = candidate(tmp_path, "l4-floor", 'action = "set"\nterm = "layer_launch_floor"\n'
                                         'params = { "forward_ms_per_layer@l4" = 1.52 }')
    plan = json.loads(cli("ledger", "plan", "--note", "l4 floor", "--candidate", l4, "--ledger", ledger,
                          "--tolerance-mape-pp", "0.5", "--tolerance-rho", "0.05", "--json").stdout)
    judged = cli("evaluate", l4, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger, "--plan",
                 plan["seq"], "--json")
    assert judged.exit_code == 0, judged.output
    data = json.loads(judged.stdout)
    assert data["status"] == "accepted" and data["calibration"]["match"] == "same fixture set"
    assert data["model"] == str(model) and data["ledger"]["path"] == str(ledger)
    moved = {row["run_id"]: row for row in data["per_run"] if row["moved"]}
    assert set(moved) == set(data["runs_moved"]) and moved
    for row in moved.values():  # only L4 runs move, and each shows its before, after and delta
        assert row["before"]["throughput_error_pct"] != row["after"]["throughput_error_pct"]
    runs = {r["run_id"] for r in data["runs"]}
    assert set(data["runs_moved"]) < runs
    # observe on the cluster runs: terms per contributor, bias apart from noise
    observed = json.loads(cli("observe", "--fixtures", shared_fixtures, "--model", model, "--json").stdout)
    top = observed["contributors"][0]
    assert {"fixable_mape_pp", "noise_mape_pp", "bias_ms", "residual_spread_ms", "noise_ms", "terms"} <= set(top)
    assert any(c["noise_ms"] is not None and c["noise_mape_pp"] > 0 for c in observed["contributors"])
    assert all(t["term"] and t["param"] and isinstance(t["applies"], bool)
               for c in observed["contributors"] for t in c["terms"])


def test_a_model_and_a_ledger_of_two_checkouts_draw_a_warning_and_the_output_names_both(tmp_path):
    homes = []
    for name in ("a", "b"):
        home = tmp_path / name
        (home / "hops_calib").mkdir(parents=True)
        shutil.copy(REPO / "pyproject.toml", home / "pyproject.toml")
        homes.append(home)
    model, ledger = homes[0] / "model.toml", homes[1] / "ledger" / "ledger.jsonl"
    shutil.copy(SHIPPED, model)
    cpu = candidate(tmp_path, "cpu-roofline", 'action = "set"\nterm = "decoder_roofline"\n'
                                              'params = { "compute_efficiency@cpu" = 0.31 }')
    judged = cli("evaluate", cpu, "--fixtures", REPO / "fixtures", "--model", model, "--ledger", ledger, "--json")
    assert judged.exit_code in (0, 1), judged.output
    data = json.loads(judged.stdout)
    assert data["model"] == str(model) and data["ledger"]["path"] == str(ledger)
    assert any(f"the model {model} is in the checkout {homes[0]}" in w for w in data["warnings"])
    # a new ledger has no record: nothing is calibrated yet, any store may start it
    assert data["calibration"]["calibrated_on"] is None and data["calibration"]["match"] == "no record"
