"""The store never eats its input, and a fixture changed after ingest is refused, not scored.

Runs on the repository's own CPU captures (traces/), so it needs no ../shared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.store import FixtureStore, StoreError
from hops_calib.store.ingest import ingest

RUN = "cpu_1f1b_l4_h512_s256_m4_run1"


@pytest.fixture
def job(repo_root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "runs" / RUN
    shutil.copytree(repo_root / "traces" / RUN, target)
    return target


def _jsonl(root: Path) -> list[Path]:
    return sorted(root.rglob("*.jsonl"))


@pytest.mark.parametrize("where", ["same", "inside"])
def test_a_store_that_overlaps_the_jobs_is_refused_and_the_traces_stay(job: Path, where: str):
    before = {p: p.read_bytes() for p in _jsonl(job.parent)}
    store_dir = job.parent if where == "same" else job / "fixtures"
    result = CliRunner().invoke(app, ["ingest", str(job.parent), "--fixtures", str(store_dir)])
    assert result.exit_code == 2, result.output
    assert {p: p.read_bytes() for p in _jsonl(job.parent)} == before  # not one trace replaced
    assert not (job / "fixtures").exists()
    message = " ".join(result.output.split())
    assert ("not a fixture store" in message) if where == "same" else ("inside the job directory" in message)


def test_a_folder_in_the_way_of_a_fixture_is_never_replaced(job: Path, tmp_path: Path):
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store).ok
    foreign = tmp_path / "fixtures" / "cpu_1f1b_l4_h512_s256_m4_run2"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    other = job.parent / foreign.name  # a run whose id is that folder's name
    shutil.copytree(job, other)
    report = ingest([other], store)
    assert not report.ok and "is in the way" in report.rejected[0].error
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_file_or_a_foreign_folder_as_the_store_is_refused(job: Path, tmp_path: Path):
    as_file = tmp_path / "store.txt"
    as_file.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        ingest([job], FixtureStore(as_file))
    foreign = tmp_path / "papers"
    foreign.mkdir()
    (foreign / "draft.tex").write_text("x")
    with pytest.raises(StoreError, match="not a fixture store"):
        ingest([job], FixtureStore(foreign))
    assert sorted(p.name for p in foreign.iterdir()) == ["draft.tex"]


def test_a_source_with_no_job_makes_no_store(tmp_path: Path):
    report = ingest([tmp_path / "nowhere"], FixtureStore(tmp_path / "new-store"))
    assert not report.ok and "does not exist" in report.rejected[0].error
    assert not (tmp_path / "new-store").exists()


def test_a_hand_edited_fixture_is_refused_and_the_next_ingest_rewrites_it(job: Path, tmp_path: Path):
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store, split="train").ok
    truth_file = store.root / RUN / "truth.json"
    real = store.load(RUN).truth.metrics.throughput_per_s
    truth = json.loads(truth_file.read_text())
    truth["metrics"]["throughput_per_s"] = real * 1.5
    truth_file.write_text(json.dumps(truth))
    result = CliRunner().invoke(app, ["evaluate", "--fixtures", str(store.root)])
    assert result.exit_code == 2
    assert f"{truth_file}: changed after ingest" in " ".join(result.output.split())
    again = ingest([job], store)
    assert again.count("updated") == 1 and any("changed or damaged" in w for w in again.outcomes[0].warnings)
    assert store.load(RUN).truth.metrics.throughput_per_s == real
    assert ingest([job], store).count("unchanged") == 1


@pytest.mark.parametrize("damage", ["truth", "events", "meta"])
def test_a_damaged_fixture_is_named_with_what_to_do(job: Path, tmp_path: Path, damage: str):
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store, split="train").ok
    folder = store.root / RUN
    if damage == "truth":
        (folder / "truth.json").write_text('{"broken": ')
    elif damage == "events":
        (folder / "events.parquet").unlink()
    else:
        (folder / "fixture.json").write_text('{"x')
    if damage == "events":
        with pytest.raises(StoreError, match="events.parquet: cannot be read"):
            store.load(RUN).events
    else:
        with pytest.raises(StoreError, match="ingest the run's job again"):
            store.load(RUN)
    report = ingest([job], store)
    assert report.ok and report.count("unchanged") == 0
    assert store.load(RUN).events is not None


@pytest.mark.parametrize("tamper", ["events", "split", "digests"])
def test_every_file_of_a_fixture_is_held_to_what_ingest_wrote(job: Path, repo_root: Path, tmp_path: Path,
                                                                 tamper: str):
    other = job.parent / "cpu_1f1b_l4_h512_s512_m6_run1"
    shutil.copytree(repo_root / "traces" / other.name, other)
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job, other], store, split="test").ok
    folder = store.root / RUN
    meta_file = folder / "fixture.json"
    if tamper == "events":  # another run's events in their place
        shutil.copy(store.root / other.name / "events.parquet", folder / "events.parquet")
        fixture = store.load(RUN)
        with pytest.raises(StoreError, match="events.parquet: changed after ingest"):
            fixture.events
    else:
        meta = json.loads(meta_file.read_text())
        if tamper == "split":  # a test run moved to train by hand: it would show its measurements
            meta["split"] = "train"
        else:  # the digests taken out, and the truth edited
            del meta["fixture_sha256"], meta["file_sha256"]
        meta_file.write_text(json.dumps(meta))
        with pytest.raises(StoreError, match="fixture.json: (changed after ingest|has no digests)"):
            store.load(RUN)
        result = CliRunner().invoke(app, ["fixtures", "show", RUN, "--fixtures", str(store.root), "--json"])
        assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "input"
    again = ingest([job], store)
    assert again.count("updated") == 1 and store.load(RUN).split == "test"  # the group's split, not the edit
    assert len(store.load(RUN).events) > 0 and ingest([job], store).count("unchanged") == 1


def test_an_index_that_moves_a_fixture_to_another_split_is_refused(job: Path, tmp_path: Path):
    import pandas as pd

    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store, split="test").ok
    index_file = store.root / "index.parquet"
    index = pd.read_parquet(index_file)
    index["split"] = "train"
    index.to_parquet(index_file, index=False)
    result = CliRunner().invoke(app, ["evaluate", "--fixtures", str(store.root)])
    assert result.exit_code == 2 and "delete index.parquet" in " ".join(result.output.split())
    index_file.unlink()
    assert store.ids("train") == [] and store.ids("test") == [RUN]  # rebuilt from the fixtures themselves


def test_links_to_job_directories_are_followed_once(job: Path, repo_root: Path, tmp_path: Path):
    picked = tmp_path / "picked"
    picked.mkdir()
    (picked / "mine").symlink_to(job, target_is_directory=True)
    (picked / "again").symlink_to(job, target_is_directory=True)  # the same run twice: found once
    (picked / "loop").symlink_to(picked, target_is_directory=True)  # a link back up ends there
    other = repo_root / "traces" / "cpu_1f1b_l4_h512_s512_m6_run1"
    (picked / "other").symlink_to(other, target_is_directory=True)
    report = ingest([picked], FixtureStore(tmp_path / "fixtures"))
    assert report.ok and sorted(o.run_id for o in report.outcomes) == sorted([RUN, other.name])


def test_a_fixture_folder_holding_another_runs_copy_is_refused_and_the_next_ingest_rewrites_it(
        job: Path, repo_root: Path, tmp_path: Path):
    """A whole, digested fixture copied over another run's folder passes every file digest: the folder's name and
    the fixture's own id must agree, else the copy would be scored (or listed) as the run whose folder it took."""
    other = job.parent / "cpu_1f1b_l4_h512_s512_m6_run1"
    shutil.copytree(repo_root / "traces" / other.name, other)
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store, split="train").ok and ingest([other], store, split="test").ok
    shutil.rmtree(store.root / RUN)
    shutil.copytree(store.root / other.name, store.root / RUN)  # the test run's fixture, in the train run's folder
    fresh = FixtureStore(store.root)
    with pytest.raises(StoreError, match=f"is the fixture of run '{other.name}', not of '{RUN}'"):
        fresh.load(RUN)
    assert not fresh.intact(RUN)
    result = CliRunner().invoke(app, ["evaluate", "--fixtures", str(store.root), "--ledger",
                                      str(tmp_path / "ledger.jsonl"), "--new-ledger"])
    assert result.exit_code == 2 and f"delete {store.root / RUN}" in " ".join(result.output.split())
    (store.root / "index.parquet").unlink()  # rebuilt from the folders: the copy is listed under neither name twice
    assert FixtureStore(store.root).ids() == [other.name]
    again = ingest([job], store)
    assert again.count("updated") == 1 and store.load(RUN).split == "train" and store.load(RUN).id == RUN
    assert FixtureStore(store.root).ids("train") == [RUN] and FixtureStore(store.root).ids("test") == [other.name]


def test_a_reader_sees_no_run_of_a_first_ingest_until_it_finishes(job: Path, repo_root: Path, tmp_path: Path):
    """Later ingests replace the index at their end, and readers read only the index: a store's first ingest
    writes an empty index before its first fixture folder, so that readers meanwhile see an empty store rather
    than the runs written so far; a first ingest that stores nothing leaves only its lock, as before."""
    other = job.parent / "cpu_1f1b_l4_h512_s512_m6_run1"
    shutil.copytree(repo_root / "traces" / other.name, other)
    root = tmp_path / "fixtures"
    seen: list[list[str]] = []
    report = ingest([job.parent], FixtureStore(root), on_run=lambda outcome: seen.append(FixtureStore(root).ids()))
    assert report.ok and len(seen) == 2
    assert seen == [[], []]  # the first run's folder was in place while the second was read: not listed
    assert FixtureStore(root).ids() == sorted([RUN, other.name])
    # the same with the index deleted by hand: while an ingest writes, its folders are not read as the store
    (root / "index.parquet").unlink()
    third = job.parent / "cpu_1f1b_l4_h768_s256_m8_run1"
    shutil.copytree(repo_root / "traces" / third.name, third)
    seen.clear()
    assert ingest([third], FixtureStore(root), on_run=lambda outcome: seen.append(FixtureStore(root).ids())).ok
    assert seen == [[]] and len(FixtureStore(root).ids()) == 3
    empty = tmp_path / "empty"
    assert not ingest([job.parent / "missing"], FixtureStore(empty)).ok and not empty.exists()
    (job / "megatron_args.txt").write_text("garbage\n")
    bad = FixtureStore(tmp_path / "bad")
    assert not ingest([job], bad).ok
    assert [p.name for p in bad.root.iterdir()] == [".lock"]


def test_a_copy_of_a_stored_run_under_another_id_is_refused(job: Path, repo_root: Path, tmp_path: Path):
    """A copy of a stored run under a new name (as is, or with every timestamp shifted) would be split by its own
    name: a test run's copy could land in train, and the store would count one measurement twice. Ingest refuses it,
    naming the run it copies and its split, whether that run was stored before or comes in the same ingest; the run
    itself, under its own id, is ingested as ever, and another run of the same configuration is no copy."""
    from job_copies import copy_job, shifted_copy

    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job], store, split="test").ok
    copies = [copy_job(job, tmp_path / "copies" / "fresh_run1"), shifted_copy(job, tmp_path / "shifted" / "fresh_run1",
                                                                               1000)]
    for copy in copies:
        report = ingest([copy], store)
        assert report.count("rejected") == 1, [o.status for o in report.outcomes]
        assert (f"run 'fresh_run1' of {copy} is a copy of run '{RUN}' of this store (test split): the same "
                "configuration and events") in report.rejected[0].error
        assert FixtureStore(store.root).ids() == [RUN]  # nothing of the copy was written
    fresh = FixtureStore(tmp_path / "fresh")
    report = ingest([job, copies[1]], fresh)  # the run and its copy in one ingest: the copy is refused
    assert [o.status for o in report.outcomes] == ["new", "rejected"] and FixtureStore(fresh.root).ids() == [RUN]
    assert ingest([job], store).count("unchanged") == 1
    repeat = job.parent / "cpu_1f1b_l4_h512_s256_m4_run2"  # the same configuration, measured again
    shutil.copytree(repo_root / "traces" / repeat.name, repeat)
    assert ingest([repeat], store).count("new") == 1
    assert store.meta(RUN)["events_fingerprint"] != store.meta(repeat.name)["events_fingerprint"]
