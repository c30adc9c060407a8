"""Issue #22's iteration replayed through the CLI on the cluster runs, against a copy of the project's ledger (the
real one is never appended to): judgements on the wrong store, or of a change that moves no run, are refused
naming the store the model was calibrated on; an accepted candidate's JSON shows each run before and after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.ledger import read_entries
from hops_calib.loop.model_files import load_model

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "hops_calib" / "model" / "models" / "baseline.toml"
CLUSTER_SET = "34432cc1de87"  # the fixture set the ledger's cluster entries were judged on (ingested from ../shared)


from ledger_args import with_new_ledger

def cli(*args):
    return CliRunner().invoke(app, with_new_ledger(args))


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
        # the mechanism: the L4 stages' forward per microbatch is what moved (and what follows from it), never a
        # backward; a run that did not move shows no phases
        phases = row["phases_moved"]
        assert any(name.endswith("forward_ms") for name in phases), phases
        assert not any(name.endswith("backward_ms") for name in phases)
        assert all(p["delta"] == pytest.approx(p["after"] - p["before"]) and p["delta"] < 0 for name, p in
                   phases.items() if name.endswith("forward_ms"))
    assert not any("phases_moved" in row for row in data["per_run"] if not row["moved"])
    runs = {r["run_id"] for r in data["runs"]}
    assert set(data["runs_moved"]) < runs
    # observe on the cluster runs: terms per contributor, bias apart from noise
    observed = json.loads(cli("observe", "--fixtures", shared_fixtures, "--model", model, "--json").stdout)
    top = observed["contributors"][0]
    assert {"fixable_mape_pp", "noise_mape_pp", "bias_ms", "residual_spread_ms", "noise_ms", "terms"} <= set(top)
    assert any(c["noise_ms"] is not None and c["noise_mape_pp"] > 0 for c in observed["contributors"])
    assert all(t["term"] and t["param"] and isinstance(t["applies"], bool)
               for c in observed["contributors"] for t in c["terms"])
    # every parameter of a pricing term is found by nudging, none from a hand list: the random stalls' parameters
    # move the silent stretch of some iterations (not its median) on the runs they place stalls on
    [silent] = [c for c in observed["overall"] if c["quantity"] == "silent"]
    applies = {t["param"]: t["applies"] for t in silent["terms"] if t["term"] == "embedding_grad_allreduce"}
    assert applies["stall_probability"] and applies["rto_ms"]
    assert set(applies) == set(load_model(model).active("embedding_grad_allreduce").params())
    # the fields say what the signs mean
    assert "predicted minus real" in observed["fields"]["bias_ms"]
    assert "negative only where errors cancel" in observed["fields"]["fixable_mape_pp"]


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


def test_a_judged_change_is_judged_again_only_under_a_plan_naming_the_earlier_judgement(tmp_path):
    """#22's walkthrough: a rejected change copied under a new id and judged with looser tolerance flags was accepted
    and committed. The change (model before and after, fixture set) is what is judged, not the file; other rules come
    only from a plan stated before, which names the earlier judgement. On the shipped CPU store, a fresh ledger."""
    ledger, model, fixtures = tmp_path / "ledger" / "ledger.jsonl", tmp_path / "model.toml", REPO / "fixtures"
    shutil.copy(SHIPPED, model)
    change = 'action = "set"\nterm = "decoder_roofline"\nparams = { "compute_efficiency@cpu" = 0.27 }'
    first = candidate(tmp_path, "cpu-roofline-a", change)
    judge = ("--fixtures", fixtures, "--model", model, "--ledger", ledger, "--json")
    judged = cli("evaluate", first, *judge)
    assert judged.exit_code in (0, 1), judged.output
    data = json.loads(judged.stdout)
    # no plan: judged under the default rules, and the entry says so
    assert data["rules"]["from"] == "defaults" and data["rules"]["default_tolerances"]
    assert list(read_entries(ledger))[-1]["rules"]["from"] == "defaults"
    # tolerance options on a judgement are refused, pointing at `ledger plan`
    copy = candidate(tmp_path, "cpu-roofline-b", change)  # the same change under another id and file
    loose = cli("evaluate", copy, *judge, "--tolerance-mape-pp", "5", "--tolerance-rho", "0.5")
    assert loose.exit_code == 2 and "hops-calib ledger plan" in json.loads(loose.stdout)["error"]["message"]
    # the copy is the same change: refused, naming the earlier judgement; so is the model copied elsewhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(model, elsewhere / "model.toml")
    for where in (model, elsewhere / "model.toml"):
        again = cli("evaluate", copy, "--fixtures", fixtures, "--model", where, "--ledger", ledger, "--json")
        assert again.exit_code == 2, again.output
        error = json.loads(again.stdout)["error"]
        assert "ledger entry 1 already judged this change" in error["message"] and "--rejudge 1" in error["hint"]
    # a plan with looser rules that does not name the earlier judgement does not open it
    unnamed = json.loads(cli("ledger", "plan", "--note", "looser", "--candidate", copy, "--tolerance-mape-pp", "0.5",
                             "--ledger", ledger, "--json").stdout)
    refused = cli("evaluate", copy, *judge, "--plan", unnamed["seq"])
    assert refused.exit_code == 2 and "ledger entry 1 already judged" in refused.stdout
    # nor does a plan naming an entry that is not a judgement
    assert cli("ledger", "plan", "--note", "n", "--candidate", copy, "--rejudge", unnamed["seq"],
               "--ledger", ledger).exit_code == 2
    # the plan names it: judged again, and the entry links to the earlier judgement
    named = json.loads(cli("ledger", "plan", "--note", "looser: why the rules differ", "--candidate", copy,
                           "--rejudge", "1", "--tolerance-mape-pp", "0.5", "--tolerance-rho", "0.1", "--ledger", ledger,
                           "--json").stdout)
    assert named["rejudges"] == 1
    outside = elsewhere / "model.toml"
    rejudged = cli("evaluate", copy, "--fixtures", fixtures, "--model", outside, "--ledger", ledger, "--json",
                   "--plan", named["seq"], "--commit")
    assert rejudged.exit_code in (0, 1), rejudged.output
    data = json.loads(rejudged.stdout)
    assert data["rejudges"] == 1 and data["earlier_judgements"] == [1]
    assert data["rules"] == {**data["rules"], "from": f"plan {named['seq']}", "default_tolerances": False}
    entry = list(read_entries(ledger))[-1]
    assert entry["rejudges"] == 1 and entry["plan_seq"] == named["seq"]
    # ledger show says it all: the rules, the tolerances, the earlier judgement, the model file written
    shown = cli("ledger", "show", "--ledger", ledger).stdout.splitlines()
    assert "(default rules)" in shown[0]
    last = shown[-1]
    assert f"(under plan {named['seq']})" in last and "[tolerances: suite throughput MAPE may grow <= 0.5 pp" in last
    assert "judges again the change of entry 1" in last
    if data["committed"]:
        assert f"wrote {outside} (WARNING: not a checkout's model file)" in last
    notes = json.loads(cli("ledger", "show", "--ledger", ledger, "--json").stdout)["judgements"]
    assert notes["1"]["rules"] == "defaults" and notes[str(entry["seq"])]["earlier_judgements"] == [1]
    assert cli("ledger", "verify", "--ledger", ledger).exit_code == 0


def test_an_off_record_refusal_names_the_store_path_a_judgement_recorded(shared_fixtures, tmp_path):
    ledger, model = tmp_path / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(REPO / "ledger" / "ledger.jsonl", ledger)
    shutil.copy(SHIPPED, model)
    l4 = candidate(tmp_path, "l4-floor", 'action = "set"\nterm = "layer_launch_floor"\n'
                                         'params = { "forward_ms_per_layer@l4" = 1.52 }')
    judged = json.loads(cli("evaluate", l4, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger,
                            "--json").stdout)
    # the store path the project's ledger last recorded for the cluster fixture set (entries before #22 recorded
    # none: said, not null; judgements since, e.g. on several stores, list it in fixture_sets)
    recorded = [part["fixtures"] for e in read_entries(REPO / "ledger" / "ledger.jsonl")
                for part in (e.get("fixture_sets") or [e]) if isinstance(part.get("fixtures"), str)
                and part.get("fixture_set_sha256", "").startswith(CLUSTER_SET)]
    said = judged["calibration"]["calibrated_on"]["fixtures"]
    assert said == recorded[-1] if recorded else said.startswith("not recorded")
    assert list(read_entries(ledger))[-1]["fixtures"] == str(Path(shared_fixtures).resolve())
    # from now on the fixture set's store is known: a judgement on the wrong store names its path
    other = candidate(tmp_path, "l4-floor-2", 'action = "set"\nterm = "layer_launch_floor"\n'
                                              'params = { "forward_ms_per_layer@l4" = 1.5 }')
    refused = cli("evaluate", other, "--fixtures", REPO / "fixtures", "--model", model, "--ledger", ledger, "--json")
    assert refused.exit_code == 4, refused.output
    error = json.loads(refused.stdout)["error"]
    assert f"--fixtures {Path(shared_fixtures).resolve()}" in error["hint"]
    assert f"store {Path(shared_fixtures).resolve()}" in error["message"]
    # a change that moves no run there is refused naming where the shared values were calibrated
    inert = candidate(tmp_path, "roofline-memory", 'action = "set"\nterm = "decoder_roofline"\n'
                                                   'params = { memory_efficiency = 0.85 }')
    unmoved = cli("evaluate", inert, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger, "--json")
    assert unmoved.exit_code == 4, unmoved.output
    # refused naming where the shared values were calibrated: that it moves no run there, or (once the project's
    # ledger has calibrated them on more stores, as dgxc-01 did) that this store alone does not cover them
    message = json.loads(unmoved.stdout)["error"]["message"]
    assert "the shared values of term decoder_roofline" in message and "calibrated on" in message
    assert "moves none" in message or "omit" in message, message
    right = json.loads(cli("evaluate", other, "--fixtures", shared_fixtures, "--model", model, "--ledger", ledger,
                           "--json").stdout)
    assert right["calibration"]["calibrated_on"]["fixtures"] == str(Path(shared_fixtures).resolve())
    assert right["calibration"]["calibrated_on"]["fixtures_exists"] is True


def test_a_store_that_grew_holds_the_runs_it_was_calibrated_on():
    """Runs added to a store since its values were calibrated (new captures in train) leave it the store of that
    calibration, as more stores are fine: a judgement there covers every run the values were fitted to. A store
    missing one of them, or of other device types, does not hold it."""
    from hops_calib.loop import calibration
    from hops_calib.loop.calibration import FixtureSet, Scope, check_store, read_record
    from hops_calib.loop.suite import load_suites
    from hops_calib.store import FixtureStore

    suite = load_suites(REPO / "fixtures", "train")
    ids = sorted(suite.ids)
    recorded = sorted(FixtureStore(REPO / "fixtures").ids("train"))
    assert ids == recorded and len(ids) > 2
    for runs, holds in ((ids, "same runs re-ingested"), (ids[:-2], "same runs and 2 added since"),
                        ([*ids[:-1], "cpu_not_in_the_store_run1"], "")):
        fixture_set = FixtureSet(sha256="0" * 64, n_runs=len(runs), runs=tuple(runs), devices=("cpu",), path=None,
                                 entries=(1,))
        assert calibration._match(suite, fixture_set) == holds
    # an entry older than the run ids: the same device types and at least its count of runs
    for n_runs, holds in ((len(ids), "same device types and run count"),
                          (len(ids) - 5, "same device types and 5 runs more"), (len(ids) + 1, "")):
        legacy = FixtureSet(sha256="0" * 64, n_runs=n_runs, runs=None, devices=("cpu",), path=None, entries=(1,))
        assert calibration._match(suite, legacy) == holds
    assert calibration._match(suite, FixtureSet("0" * 64, 2, None, ("a100",), None, (1,))) == ""
    # the project's ledger: the CPU values were calibrated on 6 train runs, which this store holds with the others
    check = check_store(read_record(REPO / "ledger" / "ledger.jsonl"), Scope(devices=("cpu",)), suite, "evaluate")
    assert check.holds and check.calibrated.n_runs <= len(ids)
    assert all("judged on them and the runs added" in w for w in check.warnings if "runs more" in w)
