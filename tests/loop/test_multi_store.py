"""A judgement covers every store the model is calibrated on (issue #19's protocol gap): `evaluate`, `compare` and
`tune` take --fixtures more than once and judge the union of the stores' train runs; the gate's rules hold on each
store; the ledger entry lists each store's fixture set and path; a later judgement of that part of the model that
omits one of the stores is refused (exit 4) naming it and its path.

On two stores made of the shipped CPU captures (the 1F1B runs and the interleaved runs), with a fresh ledger."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hops_calib.loop.ledger import read_entries
from hops_calib.store.fixture_store import INDEX
from tests.loop.test_agent_iteration import REPO, SHIPPED, candidate, cli


def store_of(tmp_path: Path, name: str, keep) -> Path:
    """A copy of the shipped CPU store holding only the runs `keep` accepts (its index rebuilt from the folders)."""
    store = tmp_path / name
    shutil.copytree(REPO / "fixtures", store)
    (store / INDEX).unlink()
    for run in store.iterdir():
        if run.is_dir() and not keep(run.name):
            shutil.rmtree(run)
    return store


def wide_plan(tmp_path: Path, ledger: Path, note: str) -> tuple[Path, dict]:
    """The first change of a fresh record (the host overhead at 2.5 ms) and a plan with wide tolerances, so that it
    is committed whatever the CPU numbers are."""
    first = candidate(tmp_path, "host-a", 'action = "set"\nterm = "iteration_host_overhead"\nparams = { host_ms = 2.5 }')
    plan = json.loads(cli("ledger", "plan", "--note", note, "--candidate", first,
                          "--tolerance-mape-pp", "0.5", "--tolerance-bubble-mae-pp", "0.5", "--tolerance-rho", "0.1",
                          "--tolerance-run-throughput-pp", "4", "--tolerance-run-bubble-pp", "4", "--ledger", ledger,
                          "--json").stdout)
    return first, plan


def test_a_change_committed_on_two_stores_is_judged_on_both_and_refused_on_one(tmp_path):
    one_f_one_b = store_of(tmp_path, "one_f_one_b", lambda name: "interleaved" not in name)
    interleaved = store_of(tmp_path, "interleaved", lambda name: "interleaved" in name)
    ledger, model = tmp_path / "ledger" / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(SHIPPED, model)
    both = ("--fixtures", one_f_one_b, "--fixtures", interleaved)
    common = ("--model", model, "--ledger", ledger, "--json")
    first, plan = wide_plan(tmp_path, ledger, "start the record on both stores")
    judged = cli("evaluate", first, *both, *common, "--plan", plan["seq"], "--commit")
    assert judged.exit_code == 0, judged.output
    data = json.loads(judged.stdout)
    paths = [str(one_f_one_b.resolve()), str(interleaved.resolve())]
    assert data["committed"] and data["fixtures"] == paths
    # each store's own verdict, on its own runs
    assert [s["fixtures"] for s in data["stores"]] == paths
    runs = {s["fixtures"]: s["runs_moved"] for s in data["stores"]}
    assert runs[paths[0]] and all("interleaved" not in r for r in runs[paths[0]])
    assert runs[paths[1]] and all("interleaved" in r for r in runs[paths[1]])
    assert sorted(data["runs_moved"]) == sorted(runs[paths[0]] + runs[paths[1]])
    entry = list(read_entries(ledger))[-1]
    assert [s["fixtures"] for s in entry["fixture_sets"]] == paths
    assert [s["fixture_set_sha256"] for s in entry["fixture_sets"]] == [s["fixture_set_sha256"]
                                                                         for s in data["fixture_sets"]]
    assert entry["fixture_set_sha256"] not in {s["fixture_set_sha256"] for s in entry["fixture_sets"]}

    # The same term on one of the two stores: refused, naming the other store and its path.
    second = candidate(tmp_path, "host-b", 'action = "set"\nterm = "iteration_host_overhead"\nparams = { host_ms = 2.9 }')
    for given, omitted in ((one_f_one_b, interleaved), (interleaved, one_f_one_b)):
        refused = cli("evaluate", second, "--fixtures", given, *common)
        assert refused.exit_code == 4, refused.output
        error = json.loads(refused.stdout)["error"]
        assert error["field"] == "fixtures" and str(omitted.resolve()) in error["message"]
        assert f"--fixtures {one_f_one_b.resolve()} --fixtures {interleaved.resolve()}" in error["hint"]
    assert len(list(read_entries(ledger))) == 2  # the refusals wrote nothing
    # Judged off the record on one store, then planned for both: a judgement on more runs is a new one (a plan
    # without --fixtures refuses the text judged before); its evaluation must be on the stores the plan names.
    assert cli("evaluate", second, "--fixtures", one_f_one_b, *common, "--off-record").exit_code in (0, 1)
    assert cli("ledger", "plan", "--note", "n", "--candidate", second, "--ledger", ledger).exit_code == 2
    plan = json.loads(cli("ledger", "plan", "--note", "host-b on both stores", "--candidate", second, *both,
                          "--ledger", ledger, "--json").stdout)
    assert plan["fixtures"] == paths
    wrong = cli("evaluate", second, "--fixtures", interleaved, *common, "--plan", plan["seq"], "--off-record")
    assert wrong.exit_code == 2 and json.loads(wrong.stdout)["error"]["field"] == "plan"
    # On both: accepted only if every store's rules held.
    judged = cli("evaluate", second, *both, *common, "--plan", plan["seq"])
    assert judged.exit_code in (0, 1), judged.output
    data = json.loads(judged.stdout)
    assert data["calibration"]["store_holds_it"] and len(data["calibration"]["calibrated_on_all"]) == 2
    assert (data["decision"] == "accepted") == all(s["decision"] == "accepted" for s in data["stores"])
    assert set(data["failed_rules"]) == {rule for s in data["stores"] for rule in s["failed_rules"]}
    # Each store's suite rules read its own runs' aggregates.
    for store in data["stores"]:
        assert store["reasons"][0].startswith("throughput MAPE %")
    # A whole-model compare on one store is refused likewise, and judged on both.
    assert cli("compare", SHIPPED, "--fixtures", one_f_one_b, *common).exit_code == 4
    compared = cli("compare", SHIPPED, *both, *common)
    assert compared.exit_code in (0, 1), compared.output
    assert [s["fixtures"] for s in json.loads(compared.stdout)["stores"]] == paths
    assert cli("ledger", "verify", "--ledger", ledger).exit_code == 0


def test_a_store_given_twice_or_runs_in_two_stores_are_refused(tmp_path):
    store = store_of(tmp_path, "all", lambda name: True)
    other = store_of(tmp_path, "again", lambda name: True)
    for args in (("--fixtures", store, "--fixtures", store), ("--fixtures", store, "--fixtures", other)):
        refused = cli("evaluate", *args, "--model", SHIPPED, "--json")
        assert refused.exit_code == 2, refused.output
        error = json.loads(refused.stdout)["error"]
        assert error["field"] == "fixtures"
    assert "also in the store" in json.loads(cli("evaluate", "--fixtures", store, "--fixtures", other, "--json"
                                                 ).stdout)["error"]["message"]


def test_a_store_grown_since_its_calibration_still_holds_its_runs(tmp_path):
    """New captures added to a store the model was calibrated on (a grown store: the calibrated runs and more) still
    hold the calibration, with a warning; a store that lost one of those runs does not."""
    small = store_of(tmp_path, "small", lambda name: "interleaved" not in name)
    ledger, model = tmp_path / "ledger" / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(SHIPPED, model)
    common = ("--model", model, "--ledger", ledger, "--json")
    first, plan = wide_plan(tmp_path, ledger, "start the record on the small store")
    assert cli("evaluate", first, "--fixtures", small, *common, "--plan", plan["seq"], "--commit").exit_code == 0
    second = candidate(tmp_path, "host-b", 'action = "set"\nterm = "iteration_host_overhead"\nparams = { host_ms = 2.9 }')
    grown = store_of(tmp_path, "grown", lambda name: True)
    judged = cli("evaluate", second, "--fixtures", grown, *common)
    assert judged.exit_code in (0, 1), judged.output
    calibration = json.loads(judged.stdout)["calibration"]
    assert calibration["store_holds_it"] and "added since" in calibration["match"]
    shrunk = store_of(tmp_path, "shrunk", lambda name: "interleaved" not in name and "l6_h384" not in name)
    refused = cli("evaluate", second, "--fixtures", shrunk, *common)
    assert refused.exit_code == 4, refused.output
