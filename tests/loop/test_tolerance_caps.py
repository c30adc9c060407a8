"""The gate's caps: a plan may loosen each tolerance up to its cap and no further, and every judgement under rules
looser than the defaults is marked, in `evaluate --json`, in `ledger show` and in the project's ledger as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import TOLERANCE_OPTIONS, app
from hops_calib.loop.gate import TOLERANCE_CAPS, TOLERANCE_FLAGS, Tolerances, beyond_caps, looser_rules
from hops_calib.loop.ledger import read_entries

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "hops_calib" / "model" / "models" / "baseline.toml"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_every_numeric_tolerance_has_a_cap_with_a_reason_and_the_flags_agree_with_the_cli():
    numeric = [name for name, value in Tolerances().to_dict().items() if not isinstance(value, str)]
    assert sorted(TOLERANCE_CAPS) == sorted(numeric)
    for name, (cap, reason) in TOLERANCE_CAPS.items():
        assert cap > getattr(Tolerances(), name) and len(reason) > 40
    assert TOLERANCE_FLAGS == {name: flag for name, flag, *_ in TOLERANCE_OPTIONS}
    assert looser_rules(Tolerances()) == [] and looser_rules(Tolerances(run_throughput_pp=1.0)) == []
    at_cap = Tolerances(**{name: cap for name, (cap, _) in TOLERANCE_CAPS.items()})
    assert not beyond_caps(at_cap) and len(looser_rules(at_cap)) == len(TOLERANCE_CAPS)
    [mark] = looser_rules(Tolerances(run_throughput_error="stall-free"))
    assert mark["tolerance"] == "run_throughput_error" and mark["cap"] is None
    # an entry older than the per-run reading has no `run_throughput_error`: read as the window error
    assert looser_rules({"throughput_mape_pp": 0.0, "run_throughput_pp": 2.0}) == []


@pytest.mark.parametrize("name", sorted(TOLERANCE_CAPS))
def test_a_plan_past_a_cap_is_refused_naming_the_tolerance_the_cap_and_the_hint(tmp_path, name):
    ledger = tmp_path / "ledger" / "ledger.jsonl"
    cap = TOLERANCE_CAPS[name][0]
    flag = TOLERANCE_FLAGS[name]
    refused = cli("ledger", "plan", "--note", "wider", "--ledger", ledger, "--new-ledger", flag, cap * 1.5, "--json")
    assert refused.exit_code == 2, refused.output
    error = json.loads(refused.stdout)["error"]
    assert error["field"] == flag and f"{name} = {cap * 1.5:g} beyond its cap {cap:g}" in error["problem"]
    assert f"{flag} <= {cap:g}" in error["hint"] and "fix that first" in error["hint"]
    assert not ledger.exists() or not list(read_entries(ledger))  # nothing appended
    # at the cap: recorded, and marked looser
    stated = cli("ledger", "plan", "--note", "at the cap", "--ledger", ledger, "--new-ledger", flag, cap)
    assert stated.exit_code == 0, stated.output
    assert "LOOSER than the defaults" in stated.stdout and f"cap {cap:g})" in stated.stdout
    shown = cli("ledger", "show", "--ledger", ledger, "--json")
    assert json.loads(shown.stdout)["looser_plans"]["1"][0]["tolerance"] == name


def test_the_projects_ledger_verifies_and_shows_its_wide_plans_marked_beyond_the_cap(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    shutil.copy(REPO / "ledger" / "ledger.jsonl", ledger)
    assert cli("ledger", "verify", "--ledger", ledger).exit_code == 0
    entries = {e["seq"]: e for e in read_entries(ledger)}
    # the plans at 5, 6, 10 and 19 pp per run, and the judgements made under them
    wide = {seq: e["tolerances"]["run_throughput_pp"] for seq, e in entries.items()
            if e.get("kind") == "plan" and e["tolerances"]["run_throughput_pp"] > TOLERANCE_CAPS["run_throughput_pp"][0]}
    assert sorted(set(wide.values())) == [5.0, 6.0, 10.0, 19.0]
    data = json.loads(cli("ledger", "show", "--ledger", ledger, "--json").stdout)
    for seq in wide:
        [mark] = [m for m in data["looser_plans"][str(seq)] if m["tolerance"] == "run_throughput_pp"]
        assert mark["beyond_cap"] and mark["value"] == wide[seq] and mark["default"] == 2.0
    under = [seq for seq, e in entries.items() if e.get("plan_seq") in wide]
    assert under
    for seq in under:
        assert any(m["beyond_cap"] for m in data["judgements"][str(seq)]["looser_rules"])
    text = {int(line.split()[0]): line for line in cli("ledger", "show", "--ledger", ledger).stdout.splitlines()}
    for seq in [*wide, *under]:
        assert "LOOSER than the defaults: " in text[seq] and "BEYOND the cap" in text[seq], text[seq]
    # a judgement under defaults carries no mark
    defaults = next(seq for seq, note in data["judgements"].items() if note["rules"] == "defaults")
    assert data["judgements"][defaults]["looser_rules"] == [] and "LOOSER" not in text[int(defaults)]
    # no judgement is made under a plan past the cap today: refused before anything is scored
    plan = max(wide)
    pinned = entries[plan]["candidates"][0]["path"]
    judged = cli("evaluate", REPO / pinned, "--fixtures", REPO / "fixtures", "--model", SHIPPED, "--ledger", ledger,
                 "--plan", plan, "--json")
    assert judged.exit_code == 2, judged.output
    error = json.loads(judged.stdout)["error"]
    assert f"plan {plan} holds run_throughput_pp" in error["problem"] and "before the caps" in error["hint"]
    assert len(list(read_entries(ledger))) == len(entries)


def test_a_judgement_under_looser_rules_is_marked_in_evaluate_json_and_ledger_show(tmp_path):
    ledger, model = tmp_path / "ledger" / "ledger.jsonl", tmp_path / "model.toml"
    shutil.copy(SHIPPED, model)
    change = tmp_path / "cpu-roofline.toml"
    change.write_text('id = "cpu-roofline"\nhypothesis = "h"\ngrounding = "g"\n\n[change]\naction = "set"\n'
                      'term = "decoder_roofline"\nparams = { "compute_efficiency@cpu" = 0.27 }\n')
    plan = json.loads(cli("ledger", "plan", "--note", "one stall's room", "--candidate", change, "--ledger", ledger, "--new-ledger",
                          "--tolerance-run-throughput-pp", "3.5", "--run-error", "stall-free", "--json").stdout)
    assert [m["tolerance"] for m in plan["looser_rules"]] == ["run_throughput_pp", "run_throughput_error"]
    judged = cli("evaluate", change, "--fixtures", REPO / "fixtures", "--model", model, "--ledger", ledger,
                 "--plan", plan["seq"], "--json")
    assert judged.exit_code in (0, 1), judged.output
    data = json.loads(judged.stdout)
    marks = {m["tolerance"]: m for m in data["looser_rules"]}
    assert marks["run_throughput_pp"] == {**marks["run_throughput_pp"], "value": 3.5, "default": 2.0, "cap": 4.0,
                                          "beyond_cap": False}
    assert marks["run_throughput_error"]["value"] == "stall-free"
    assert data["rules"]["looser_rules"] == data["looser_rules"] and "looser_rules" in data["fields"]
    assert "opposite sign" in data["fields"]["throughput_error_pct"]
    assert data["calibration"]["rule"].startswith("A judgement must cover every store")
    last = cli("ledger", "show", "--ledger", ledger).stdout.splitlines()[-1]
    assert "LOOSER than the defaults: run_throughput_pp 3.5 (default 2, cap 4)" in last
    # plain evaluate, under the defaults: no mark
    plain = json.loads(cli("evaluate", "--fixtures", REPO / "fixtures", "--model", model, "--json").stdout)
    assert plain["looser_rules"] == []
