"""A user's own runs go to train unless asked: `ingest` puts a source in train unless it states another split
(hops-calib-source.toml beside it) or `--split` asks; it says where each run went and why (`runs[].split_from`,
`counts`). On copies of real cluster runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.store.split import SOURCE_FILE, group_of, hashed_split


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def own_runs(shared_runs: Path, folder: Path) -> list[str]:
    """Copies of two real runs, one of a group the hashed split puts in test and one of a train group."""
    runs = sorted(p.name for p in shared_runs.iterdir() if p.is_dir())
    test = next(r for r in runs if hashed_split(group_of(r)) == "test")
    train = next(r for r in runs if hashed_split(group_of(r)) == "train")
    folder.mkdir()
    for run in (test, train):
        shutil.copytree(shared_runs / run, folder / run)
    return [test, train]


def test_own_runs_go_to_train_and_ingest_says_where_and_why(shared_runs, tmp_path):
    test, train = own_runs(shared_runs, tmp_path / "mine")
    done = cli("ingest", tmp_path / "mine", "--fixtures", tmp_path / "fx", "--json")
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert {r["run_id"]: r["split"] for r in data["runs"]} == {test: "train", train: "train"}
    assert all("your own source" in r["split_from"] and "--split auto" in r["split_from"] for r in data["runs"])
    assert data["counts"] == {**data["counts"], "runs": 2, "stored": 2, "new": 2, "rejected": 0, "train": 2,
                              "test": 0, "store_fixtures": 2, "store_train": 2, "store_test": 0}
    text = cli("ingest", tmp_path / "mine", "--fixtures", tmp_path / "fx2").stdout
    assert "to train: " in text and "your own source" in text and "to test" not in text
    # a stored group keeps its split: the same runs again, nothing moves, and they say why
    again = json.loads(cli("ingest", tmp_path / "mine", "--fixtures", tmp_path / "fx", "--json").stdout)
    assert all(r["split_from"].startswith("kept: ") for r in again["runs"])
    assert again["counts"]["unchanged"] == 2 and again["counts"]["train"] == 2


def test_the_grouped_split_when_asked_or_when_the_source_states_it(shared_runs, tmp_path):
    test, train = own_runs(shared_runs, tmp_path / "sweep")
    asked = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "a", "--split", "auto",
                           "--json").stdout)
    assert {r["run_id"]: r["split"] for r in asked["runs"]} == {test: "test", train: "train"}
    assert {r["split_from"] for r in asked["runs"]} == {"--split auto"}
    assert (asked["counts"]["train"], asked["counts"]["test"]) == (1, 1)
    # the source states it: a calibration set's own file beside its runs
    (tmp_path / "sweep" / SOURCE_FILE).write_text('split = "auto"\n')
    stated = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "b", "--json").stdout)
    assert {r["run_id"]: r["split"] for r in stated["runs"]} == {test: "test", train: "train"}
    assert all(f"{SOURCE_FILE} states split = 'auto'" in r["split_from"] for r in stated["runs"])
    # one run of it ingested alone: the file beside its folder still says so
    alone = json.loads(cli("ingest", tmp_path / "sweep" / test, "--fixtures", tmp_path / "c", "--json").stdout)
    assert alone["runs"][0]["split"] == "test"
    # a file that cannot say: refused, naming it and the field
    (tmp_path / "sweep" / SOURCE_FILE).write_text('split = "holdout"\n')
    bad = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "d", "--json").stdout)
    assert all(r["status"] == "rejected" and SOURCE_FILE in r["error"] and "'split'" in r["error"]
               for r in bad["runs"])


def test_a_store_ingested_afresh_from_traces_splits_as_the_shipped_store(repo_root, tmp_path):
    """traces/hops-calib-source.toml names each group's split ([groups]): a fresh store of traces/ holds every run
    in the split the shipped fixtures/ store holds it in, and `evaluate` (the project's ledger) scores it."""
    from hops_calib.store import FixtureStore

    done = cli("ingest", repo_root / "traces", "--fixtures", tmp_path / "f", "--json")
    assert done.exit_code == 0, done.output
    fresh, shipped = FixtureStore(tmp_path / "f").index(), FixtureStore(repo_root / "fixtures").index()
    assert dict(zip(fresh["id"], fresh["split"])) == dict(zip(shipped["id"], shipped["split"]))
    assert set(fresh["split"]) == {"train", "test"}
    named = [r for r in json.loads(done.stdout)["runs"] if "names the group's split" in r["split_from"]]
    assert len(named) == len(fresh)
    scored = cli("evaluate", "--fixtures", tmp_path / "f")
    assert scored.exit_code == 0, scored.output
    assert f"on the train split: {int((fresh['split'] == 'train').sum())} fixtures" in scored.stdout


def test_the_source_file_names_the_split_of_groups(shared_runs, tmp_path):
    """A [groups] entry wins over `split` for its group; a store that holds the group already keeps it, saying the
    file disagrees; an entry that is not train/test, or names a run rather than a group, is refused by field."""
    test, train = own_runs(shared_runs, tmp_path / "sweep")
    sidecar = tmp_path / "sweep" / SOURCE_FILE
    sidecar.write_text(f'split = "auto"\n[groups]\n"{group_of(test)}" = "train"\n')
    data = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "a", "--json").stdout)
    runs = {r["run_id"]: r for r in data["runs"]}
    assert runs[test]["split"] == "train" and "names the group's split ([groups])" in runs[test]["split_from"]
    assert runs[train]["split"] == "train" and "states split = 'auto'" in runs[train]["split_from"]
    sidecar.write_text(f'split = "auto"\n[groups]\n"{group_of(test)}" = "test"\n')
    again = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "a", "--json").stdout)
    runs = {r["run_id"]: r for r in again["runs"]}
    assert runs[test]["split"] == "train" and runs[test]["status"] == "unchanged"
    (warning,) = runs[test]["warnings"]
    assert f"puts group '{group_of(test)}' in test, but this store keeps it in train" in warning
    fresh = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "b", "--json").stdout)
    assert {r["run_id"]: r["split"] for r in fresh["runs"]} == {test: "test", train: "train"}
    for entry, field in ((f'"{group_of(test)}" = "holdout"', f"'groups.{group_of(test)}'"),
                         (f'"{test}" = "test"', "names a run, not a group")):
        sidecar.write_text(f'split = "auto"\n[groups]\n{entry}\n')
        bad = json.loads(cli("ingest", tmp_path / "sweep", "--fixtures", tmp_path / "c", "--json").stdout)
        assert all(r["status"] == "rejected" and str(sidecar) in r["error"] and field in r["error"]
                   for r in bad["runs"]), bad["runs"]
