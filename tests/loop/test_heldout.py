"""The held-out promise (issue #21): once the ledger has seen a group held out, no verb trains or scores on it by
accident, under its own name or as a renamed copy; a store without such groups is untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hops_calib.store import FixtureStore
from hops_calib.store.guard import configuration_digest
from job_copies import copy_job, shifted_copy
from ledger_args import with_new_ledger

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("HOPS_CALIB_PROGRESS", None)
    return subprocess.run([sys.executable, "-m", "hops_calib", *with_new_ledger(args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


def flat(text: str) -> str:
    return " ".join(text.split())


def entries(ledger: Path) -> list[dict]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


@pytest.fixture(scope="module")
def looked(shared_runs: Path, shared_fixtures: Path, tmp_path_factory) -> tuple[Path, str, Path]:
    """A ledger whose one entry is an audited look at the shared store's test split; a test run of it; its job."""
    ledger = tmp_path_factory.mktemp("heldout") / "ledger.jsonl"
    done = cli("report", "--split", "test", "--fixtures", str(shared_fixtures), "--ledger", str(ledger), "--new-ledger")
    assert done.returncode == 0, done.stderr
    test_id = FixtureStore(shared_fixtures).ids("test")[0]
    return ledger, test_id, shared_runs / test_id


def test_a_copy_of_a_test_run_with_its_timestamps_shifted_is_refused(looked, shared_runs: Path, shared_fixtures: Path,
                                                                      tmp_path: Path):
    """The ledger remembers each held-out run by its configuration alone (no digest of what it measured): a copy
    whose timestamps were shifted by a microsecond is refused as a run of that configuration. So is a genuine repeat
    of a held-out configuration in another store: the repeats of one configuration agree within 0.07 % (exp1_1),
    closer than a near-copy x 1.001, so no tolerance on the measurement could let one through and not the other."""
    ledger, test_id, job = looked
    (entry,) = entries(ledger)
    assert all(d.startswith("config:") for digests in entry["held_out_groups"].values() for d in digests)
    copy = shifted_copy(job, tmp_path / "src" / "fresh_run1", 1000)
    store = tmp_path / "fixtures"
    assert cli("ingest", str(copy), "--fixtures", str(store), "--split", "train").returncode == 0
    stored = FixtureStore(store).meta("fresh_run1")
    assert stored["file_sha256"]["events.parquet"] not in json.dumps(entry)  # not the held-out events file
    group = FixtureStore(shared_fixtures).meta(test_id)["group"]
    for verb in (["evaluate"], ["observe"], ["tune", "decoder_roofline", "--trials", "1"]):
        done = cli(*verb, "--fixtures", str(store), "--ledger", str(ledger))
        assert done.returncode == 2, (verb, done.stdout, done.stderr)
        assert (f"fresh (fresh_run1: the configuration of a run of held-out group '{group}' (a copy, a near-copy or "
                "another run of it))") in flat(done.stderr)
    overridden = tmp_path / "own.jsonl"
    shutil.copy(ledger, overridden)
    assert cli("observe", "--fixtures", str(store), "--ledger", str(overridden), "--allow-held-out").returncode == 0
    assert entries(overridden)[-1]["held_out_override"][0]["by"] == "configuration"
    assert len(entries(ledger)) == 1
    # two runs of one configuration measured apart: the same configuration, refused all the same
    runs = sorted(p.name for p in shared_runs.iterdir() if p.name.startswith("exp2_1_all_nodes_run"))
    assert len(runs) == 2
    held, other = tmp_path / "held", tmp_path / "other"
    assert cli("ingest", str(shared_runs / runs[0]), "--fixtures", str(held), "--split", "test").returncode == 0
    own = tmp_path / "repeats.jsonl"
    assert cli("ledger", "hold-out", "--fixtures", str(held), "--ledger", str(own), "--new-ledger").returncode == 0
    repeat = copy_job(shared_runs / runs[1], tmp_path / "src2" / "fresh_run1")
    assert cli("ingest", str(repeat), "--fixtures", str(other), "--split", "train").returncode == 0
    assert FixtureStore(other).load("fresh_run1").spec.model == FixtureStore(held).load(runs[0]).spec.model
    done = cli("evaluate", "--fixtures", str(other), "--ledger", str(own))
    assert done.returncode == 2, done.stderr
    assert "fresh (fresh_run1: the configuration of a run of held-out group 'exp2_1_all_nodes'" in flat(done.stderr)


def test_the_look_remembers_its_held_out_groups_by_name_and_configuration(looked, shared_fixtures: Path):
    ledger, test_id, _ = looked
    (entry,) = entries(ledger)
    store = FixtureStore(shared_fixtures)
    groups = entry["held_out_groups"]
    assert set(groups) == {store.meta(i)["group"] for i in store.ids("test")}
    meta = store.meta(test_id)
    assert groups[meta["group"]] == [configuration_digest(store.load(test_id))]
    assert meta["file_sha256"]["events.parquet"] not in json.dumps(entry)
    assert meta["events_fingerprint"] not in json.dumps(entry)


def test_a_renamed_copy_of_a_test_run_in_a_train_store_is_refused(looked, shared_fixtures: Path, tmp_path: Path):
    ledger, test_id, job = looked
    copy = copy_job(job, tmp_path / "src" / "innocent_looking_run1")
    store = tmp_path / "fixtures"
    assert cli("ingest", str(copy), "--fixtures", str(store), "--split", "train").returncode == 0
    model = str(REPO / "hops_calib" / "model" / "models" / "baseline.toml")
    for verb in (["evaluate"], ["predict", "innocent_looking_run1"], ["observe"], ["compare", model],
                 ["tune", "decoder_roofline", "--trials", "1"], ["crossval", "decoder_roofline", "--folds", "2"]):
        done = cli(*verb, "--fixtures", str(store), "--ledger", str(ledger))
        message = flat(done.stderr)
        assert done.returncode == 2, (verb, done.stdout, done.stderr)
        assert ("holds in its train split 1 group(s) held out, by ledger entry 1 (an audited "
                "report on the test split") in message
        assert ("innocent_looking (innocent_looking_run1: the configuration of a run of held-out group "
                f"'{FixtureStore(shared_fixtures).meta(test_id)['group']}' (a copy, a near-copy or another run of it))") in message
        assert "--allow-held-out" in message
    assert len(entries(ledger)) == 1  # refusals record nothing


def test_a_held_out_copy_in_the_second_of_several_stores_is_refused(looked, repo_root: Path, tmp_path: Path):
    """A judgement over several stores (a union suite) guards every store it is given, not only the first."""
    ledger, _, job = looked
    copy = copy_job(job, tmp_path / "src" / "innocent_looking_run1")
    store = tmp_path / "fixtures"
    assert cli("ingest", str(copy), "--fixtures", str(store), "--split", "train").returncode == 0
    clean = repo_root / "fixtures"
    for verb in (["evaluate"], ["tune", "decoder_roofline", "--trials", "1"]):
        done = cli(*verb, "--fixtures", str(clean), "--fixtures", str(store), "--ledger", str(ledger))
        assert done.returncode == 2, (verb, done.stdout, done.stderr)
        assert "holds in its train split 1 group(s) held out" in flat(done.stderr)
        assert str(store) in flat(done.stderr)
    assert len(entries(ledger)) == 1  # refusals record nothing


def test_ledger_hold_out_records_a_stores_test_groups_without_a_look(shared_runs: Path, shared_fixtures: Path,
                                                                      tmp_path: Path):
    """A store whose test split no report or judgement recorded (entries older than the guard carry no groups) is
    held out by `ledger hold-out`: a renamed copy of one of its test runs in a train store is refused from then on;
    holding the same store out again appends nothing."""
    ledger = tmp_path / "ledger.jsonl"
    store = FixtureStore(shared_fixtures)
    test_id = store.ids("test")[0]
    copy = copy_job(shared_runs / test_id, tmp_path / "src" / "innocent_looking_run1")
    train_store = tmp_path / "fixtures"
    assert cli("ingest", str(copy), "--fixtures", str(train_store), "--split", "train").returncode == 0
    before = cli("evaluate", "--fixtures", str(train_store), "--ledger", str(ledger), "--new-ledger")
    assert before.returncode == 0, before.stderr  # nothing remembered yet: the copy is scored
    held = cli("ledger", "hold-out", "--fixtures", str(shared_fixtures), "--ledger", str(ledger), "--json",
               "--new-ledger")
    assert held.returncode == 0, held.stderr
    (entry,) = entries(ledger)
    assert entry["kind"] == "held_out_record" and json.loads(held.stdout)["appended"] == entry["seq"]
    assert set(entry["held_out_groups"]) == {store.meta(i)["group"] for i in store.ids("test")}
    after = cli("evaluate", "--fixtures", str(train_store), "--ledger", str(ledger))
    assert after.returncode == 2
    assert "a record of a store's test split (ledger hold-out)" in flat(after.stderr)
    again = cli("ledger", "hold-out", "--fixtures", str(shared_fixtures), "--ledger", str(ledger), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["appended"] is None
    assert len(entries(ledger)) == 1


def test_the_same_test_run_forced_into_train_is_refused_by_name(looked, tmp_path: Path):
    ledger, test_id, job = looked
    store = tmp_path / "fixtures"
    assert cli("ingest", str(job), "--fixtures", str(store), "--split", "train").returncode == 0
    done = cli("evaluate", "--fixtures", str(store), "--ledger", str(ledger))
    group = FixtureStore(store).meta(test_id)["group"]
    assert done.returncode == 2, done.stderr
    assert f"held out, by ledger entry 1 (an audited report on the test split" in flat(done.stderr)
    assert f"{group} ({test_id})" in flat(done.stderr)


def test_the_override_goes_on_and_the_ledger_records_it(looked, tmp_path: Path):
    ledger, test_id, job = looked
    own = tmp_path / "ledger.jsonl"
    shutil.copy(ledger, own)
    copy = copy_job(job, tmp_path / "src" / "innocent_looking_run1")
    store = tmp_path / "fixtures"
    assert cli("ingest", str(copy), "--fixtures", str(store), "--split", "train").returncode == 0
    done = cli("evaluate", "--fixtures", str(store), "--ledger", str(own), "--allow-held-out")
    assert done.returncode == 0, done.stderr
    assert ("went on over 1 held-out group(s) in the train split (--allow-held-out), recorded (ledger entry 2); held "
            "out by ledger entry 1") in flat(done.stderr)
    override = entries(own)[-1]
    assert override["kind"] == "held_out_override" and override["verb"] == "evaluate"
    assert override["held_out_override"][0]["group"] == "innocent_looking"
    assert override["held_out_override"][0]["by"] == "configuration"
    shown = cli("ledger", "show", "--ledger", str(own))
    assert "evaluate on" in shown.stdout and "went on over held-out group(s) innocent_looking" in shown.stdout


def test_a_store_without_held_out_groups_is_untouched(looked, repo_root: Path, tmp_path: Path):
    ledger, _, _ = looked
    store = tmp_path / "fixtures"
    assert cli("ingest", str(repo_root / "traces"), "--fixtures", str(store)).returncode == 0
    before = ledger.read_bytes()
    for verb in (["evaluate"], ["observe"], ["predict", FixtureStore(store).ids("train")[0]]):
        done = cli(*verb, "--fixtures", str(store), "--ledger", str(ledger))
        assert done.returncode == 0, (verb, done.stderr)
        assert "held out" not in done.stderr
    assert ledger.read_bytes() == before


def test_an_older_entry_with_measured_digests_still_guards_and_hold_out_adds_configurations(
        looked, shared_fixtures: Path, tmp_path: Path):
    """An entry written before configurations were recorded (as the repository's ledger holds: each run's events
    sha256, with or without its timing fingerprint) still refuses a renamed copy (by content) and, with the
    fingerprint, a shifted one (by timing); an entry with the events digest only lets a shifted copy pass.
    `ledger hold-out` of the same store then appends the configurations (once), and the copy is refused by them."""
    from hops_calib.loop import ledger as ledger_module

    _, test_id, job = looked
    own = tmp_path / "ledger.jsonl"
    store = FixtureStore(shared_fixtures)
    older = {group: [d for d in info["digests"] if not d.startswith("timing:")]
             for group, info in store.group_digests("test").items()}
    ledger_module.append(own, {"kind": "held_out_record", "time": ledger_module.now_utc(),
                               "fixtures": str(shared_fixtures), "held_out_groups": older})
    renamed, shifted = tmp_path / "renamed", tmp_path / "shifted"
    assert cli("ingest", str(copy_job(job, tmp_path / "src" / "fresh_run1")), "--fixtures", str(renamed),
               "--split", "train").returncode == 0
    done = cli("evaluate", "--fixtures", str(renamed), "--ledger", str(own))
    assert done.returncode == 2 and "the same events as a run of held-out group" in flat(done.stderr), done.stderr
    copy = shifted_copy(job, tmp_path / "src2" / "fresh_run1", 1000)
    assert cli("ingest", str(copy), "--fixtures", str(shifted), "--split", "train").returncode == 0
    assert cli("evaluate", "--fixtures", str(shifted), "--ledger", str(own)).returncode == 0
    with_timing = tmp_path / "timing.jsonl"
    ledger_module.append(with_timing, {"kind": "held_out_record", "time": ledger_module.now_utc(),
                                       "fixtures": str(shared_fixtures),
                                       "held_out_groups": {g: i["digests"] for g, i in
                                                           store.group_digests("test").items()}})
    done = cli("evaluate", "--fixtures", str(shifted), "--ledger", str(with_timing))
    assert done.returncode == 2 and "up to a shift of its timestamps, a copy" in flat(done.stderr), done.stderr
    for appended in (True, False):
        held = cli("ledger", "hold-out", "--fixtures", str(shared_fixtures), "--ledger", str(own), "--json")
        assert held.returncode == 0 and (json.loads(held.stdout)["appended"] is not None) == appended
    assert len(entries(own)) == 2
    assert all(d.startswith("config:") for ds in entries(own)[-1]["held_out_groups"].values() for d in ds)
    done = cli("evaluate", "--fixtures", str(shifted), "--ledger", str(own))
    assert done.returncode == 2 and "the configuration of a run of held-out group" in flat(done.stderr)


def test_the_refusal_names_the_runs_and_the_commands_that_move_them_to_test(repo_root: Path, tmp_path: Path):
    """The shipped store's test groups held out (`ledger hold-out`), then a store of traces/ split by the hash alone
    (no [groups] in its source file): evaluate refuses it, naming the runs and the commands that move them to
    test; those commands, run as given, make a store evaluate scores."""
    import re
    import shlex

    ledger = tmp_path / "ledger.jsonl"
    assert cli("ledger", "hold-out", "--fixtures", str(repo_root / "fixtures"), "--ledger", str(ledger),
               "--new-ledger").returncode == 0
    source = tmp_path / "traces"
    shutil.copytree(repo_root / "traces", source)
    (source / "hops-calib-source.toml").write_text('split = "auto"\n')
    store = tmp_path / "hashed"
    assert cli("ingest", str(source), "--fixtures", str(store)).returncode == 0
    held = set(FixtureStore(repo_root / "fixtures").ids("test"))
    leaked = sorted(held & set(FixtureStore(store).ids("train")))
    assert leaked  # the hash puts some of the shipped store's test groups in train
    done = cli("evaluate", "--fixtures", str(store), "--ledger", str(ledger))
    message = flat(done.stderr)
    assert done.returncode == 2 and f"Move the run(s) {', '.join(leaked)} to the test split" in message
    command = re.search(r"rm -r .*? --split test", message).group(0)
    assert all(str(store / run) in command and str(source / run) in command for run in leaked)
    for part in command.split(" && "):
        words = shlex.split(part)
        if words[0] == "hops-calib":
            assert cli(*words[1:]).returncode == 0
        else:
            assert subprocess.run(words, timeout=TIMEOUT_S).returncode == 0
    assert set(FixtureStore(store).ids("test")) >= held
    done = cli("evaluate", "--fixtures", str(store), "--ledger", str(ledger))
    assert done.returncode == 0, done.stderr
