"""`hops-calib fixtures list/show` on the ingested shared runs."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hops_calib.cli import app

LIST_KEYS = {"id", "split", "group", "schedule", "declared_schedule", "pp", "microbatches", "devices",
             "throughput_per_s", "bubble_ratio", "iteration_time_ms", "content_hash"}


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_list_json_has_one_object_per_fixture(shared_store):
    result = _run("fixtures", "list", "--fixtures", str(shared_store.root), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "ok"
    rows = data["fixtures"]
    index = shared_store.index()
    assert [r["id"] for r in rows] == list(index["id"])
    for row in rows:
        assert LIST_KEYS <= set(row)
        assert len(row["devices"]) == row["pp"]
        if row["split"] == "train":
            assert row["schedule"] == "1f1b" and 0 < row["bubble_ratio"] < 1 and row["throughput_per_s"] > 0
        else:  # held out: what the run measured is withheld, how it was configured is not
            assert row["split"] == "test" and row["held_out"] is True
            assert row["schedule"] is None and row["bubble_ratio"] is None and row["throughput_per_s"] is None
    assert {r["split"] for r in rows} == {"train", "test"}


def test_list_table_names_every_fixture(shared_store):
    result = _run("fixtures", "list", "--fixtures", str(shared_store.root))
    assert result.exit_code == 0
    for fixture_id in shared_store.ids():
        assert fixture_id in result.stdout
    assert f"{len(shared_store.ids())} fixtures" in result.stdout


def test_show_json_and_text_of_a_train_fixture(shared_store):
    fixture_id = shared_store.ids("train")[0]
    fixture = shared_store.load(fixture_id)
    result = _run("fixtures", "show", fixture_id, "--fixtures", str(shared_store.root), "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["id"] == fixture_id and shown["split"] == "train" and "held_out" not in shown
    assert shown["utilization_per_stage"] == list(fixture.truth.metrics.utilization_per_stage)
    assert len(shown["stages"]) == fixture.spec.pp
    for stage in shown["stages"]:
        assert stage["forward_median_ms"] == fixture.truth.phase_median_ms(stage["stage"], "FORWARD")
        assert stage["backward_median_ms"] > 0
    assert shown["configuration"]["layers_per_stage"] == list(fixture.spec.layers_per_stage)
    text = _run("fixtures", "show", fixture_id, "--fixtures", str(shared_store.root)).stdout
    for needle in (fixture_id, "schedule", "bubble", "idle", "fwd ms", "bwd ms", "quality", fixture.spec.devices[0]):
        assert needle in text


def test_show_of_a_test_fixture_gives_its_configuration_and_withholds_what_it_measured(shared_store):
    fixture_id = shared_store.ids("test")[0]
    fixture = shared_store.load(fixture_id)
    shown = json.loads(_run("fixtures", "show", fixture_id, "--fixtures", str(shared_store.root), "--json").stdout)
    assert shown["split"] == "test" and "report --split test" in shown["held_out"]
    assert shown["configuration"]["layers_per_stage"] == list(fixture.spec.layers_per_stage)
    assert shown["devices"] == list(fixture.spec.devices) and len(shown["links"]) == len(fixture.spec.links)
    for measured in ("throughput_per_s", "bubble_ratio", "utilization_per_stage", "stages", "idle_ms", "schedule"):
        assert measured not in shown
    text = _run("fixtures", "show", fixture_id, "--fixtures", str(shared_store.root)).stdout
    assert fixture_id in text and "held out" in text and "report --split test" in text
    assert "fwd ms" not in text and "bubble" not in text and f"{fixture.truth.metrics.throughput_per_s:.3f}" not in text


def test_unknown_fixture_and_missing_store_are_clear_errors(shared_store, tmp_path):
    result = _run("fixtures", "show", "no_such_run", "--fixtures", str(shared_store.root))
    assert result.exit_code == 2 and "no fixture 'no_such_run'" in result.stderr
    result = _run("fixtures", "show", "../etc", "--fixtures", str(shared_store.root))
    assert result.exit_code == 2 and "escape" in result.stderr
    result = _run("fixtures", "list", "--fixtures", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "hops-calib ingest" in result.stderr


def test_ingest_is_quiet_when_stdout_is_not_a_terminal(shared_runs, shared_store):
    result = _run("ingest", str(shared_runs), "--fixtures", str(shared_store.root), "--split", "auto")
    assert result.exit_code == 0
    n = len(shared_store.ids())
    assert result.stdout.strip().splitlines() == [
        f"{n} runs: 0 new, 0 updated, {n} unchanged, 0 rejected; store {shared_store.root} holds {n} fixtures "
        f"(train {len(shared_store.ids('train'))}, test {len(shared_store.ids('test'))})"]
    assert result.stderr == ""


def test_ingest_refuses_bad_options_with_exit_code_2(shared_runs, tmp_path):
    run = str(sorted(shared_runs.iterdir())[0])
    result = _run("ingest", run, "--fixtures", str(tmp_path / "fx"), "--split", "holdout")
    assert result.exit_code == 2 and "unknown split 'holdout'" in result.stderr
    result = _run("ingest", run, "--fixtures", str(tmp_path / "fx"), "--test-fraction", "1.5")
    assert result.exit_code == 2 and "--test-fraction 1.5" in result.stderr
    result = _run("ingest", str(tmp_path / "nowhere"), "--fixtures", str(tmp_path / "fx"))
    assert result.exit_code == 2 and "does not exist" in result.stderr  # nothing could be stored: bad input


def test_ingest_says_which_split_each_new_run_went_to_and_how_to_force_train(repo_root, tmp_path):
    from hops_calib.store import FixtureStore
    from hops_calib.store.views import MAX_NAMED

    store = tmp_path / "fx"
    result = _run("ingest", str(repo_root / "traces"), "--fixtures", str(store))
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    index = FixtureStore(store).index()
    for split in ("train", "test"):
        named = next(line for line in lines if line.startswith(f"to {split}: ")).removeprefix(f"to {split}: ")
        # and why: the project's captures state each group's split beside them (traces/hops-calib-source.toml)
        named, _, why = named.partition(" (")
        assert "hops-calib-source.toml names the group's split ([groups])" in why
        expected = sorted(index[index["split"] == split]["id"])
        # at most MAX_NAMED ids are named, then how many more
        named, _, more = named.partition(" and ")
        assert named.split(", ") == expected[:MAX_NAMED]
        assert more == (f"{len(expected) - MAX_NAMED} more" if len(expected) > MAX_NAMED else "")
    assert "--split train" in lines[-1]
    again = _run("ingest", str(repo_root / "traces"), "--fixtures", str(store))
    assert len(again.stdout.strip().splitlines()) == 1  # nothing written, no split to tell


def test_show_and_list_agree_on_samples_per_s_of_every_shipped_run(repo_root):
    """`fixtures show` counts every data-parallel replica as `fixtures list` does (a d2 run ships in fixtures/)."""
    store = str(repo_root / "fixtures")
    rows = json.loads(_run("fixtures", "list", "--fixtures", store, "--json").stdout)["fixtures"]
    data_parallel = [row for row in rows if row["split"] == "train" and (row["configuration"]["dp"] or 1) > 1]
    assert data_parallel, "the shipped store has a data-parallel train run"
    for row in rows:
        if row["split"] != "train":
            continue
        shown = json.loads(_run("fixtures", "show", row["id"], "--fixtures", store, "--json").stdout)
        assert shown["samples_per_s"] == row["samples_per_s"], row["id"]
        text = _run("fixtures", "show", row["id"], "--fixtures", store).stdout
        assert f"{row['samples_per_s']:.2f} samples/s" in text, row["id"]


def test_listing_a_job_directory_as_a_store_suggests_an_ingest_that_works(repo_root, tmp_path):
    """`fixtures list --fixtures <job dir>` is bad input (exit 2) whose suggestion runs: ingest the job into a store;
    before, it listed nothing (exit 0) and suggested ingesting into the job directory, which ingest refuses."""
    import re
    import shutil

    job = tmp_path / "cpu_1f1b_l4_h384_s128_m4_run1"
    shutil.copytree(repo_root / "traces" / job.name, job)
    result = _run("fixtures", "list", "--fixtures", str(job))
    assert result.exit_code == 2 and "is a job directory, not a fixture store" in result.stderr
    suggested = re.search(r"hops-calib (ingest \S+ --fixtures) STORE", result.stderr)
    assert suggested and suggested.group(1) == f"ingest {job} --fixtures"
    store = tmp_path / "store"
    assert _run(*suggested.group(1).split(), str(store)).exit_code == 0
    listed = _run("fixtures", "list", "--fixtures", str(store))
    assert listed.exit_code == 0 and job.name in listed.stdout
    # any other folder that is no store is said to be one, as ingest would say
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x\n")
    result = _run("fixtures", "list", "--fixtures", str(tmp_path / "notes"))
    assert result.exit_code == 2 and "is not a fixture store" in result.stderr
