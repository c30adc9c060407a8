"""Ingest of the real cluster runs: spec from configuration only, grouped stable split, idempotent re-ingest."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from hops_calib import timeline as tl
from hops_calib.spec import build_spec, split_layers
from hops_calib.store import FixtureStore, group_of, hashed_split
from hops_calib.store.ingest import ingest
from hops_calib.trace import find_job_dirs


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_every_shared_run_becomes_a_fixture(shared_runs, shared_store):
    job_dirs = find_job_dirs(shared_runs)
    index = shared_store.index()
    assert sorted(index["id"]) == sorted(d.name for d in job_dirs)
    assert set(index["split"]) == {"train", "test"}
    # No configuration straddles the split.
    assert (index.groupby("group")["split"].nunique() == 1).all()
    # Every cluster run is Megatron's non-interleaved 1F1B, whatever its label says.
    assert set(index["schedule"]) == {"1f1b"}
    for row in index.itertuples():
        if "gpipe" in row.id:
            assert row.declared_schedule == "gpipe"
        elif "zero_bubble" in row.id:
            assert row.declared_schedule == "zb_h1"
    assert {"gpipe", "zb_h1"} <= set(index["declared_schedule"])


def test_fixture_loads_with_spec_truth_events_and_timeline(shared_runs, shared_store):
    for fixture_id in shared_store.ids()[:3] + shared_store.ids("test")[:2]:
        fixture = shared_store.load(fixture_id)
        assert fixture.id == fixture_id and fixture.split in ("train", "test")
        assert fixture.spec == build_spec(shared_runs / fixture_id)
        timeline = fixture.timeline()
        assert list(timeline.columns) == list(tl.COLUMNS)
        assert timeline["start_ms"].min() == 0.0
        assert sorted(timeline["stage"].unique()) == list(range(fixture.spec.pp))
        assert len(fixture.events) == fixture.quality["events"] == len(timeline)
        transfers = timeline[timeline["kind"] == tl.TRANSFER]
        forward = transfers[transfers["phase"] == tl.FORWARD]
        assert (forward["peer_stage"] == forward["stage"] + 1).all()


def test_ids_filter_by_split(shared_store):
    index = shared_store.index()
    train, test = shared_store.ids("train"), shared_store.ids("test")
    assert sorted(train + test) == sorted(index["id"]) and not set(train) & set(test)


def test_reingest_of_unchanged_runs_changes_nothing(shared_runs, shared_store):
    before = _snapshot(shared_store.root)
    report = ingest([shared_runs], shared_store, split="auto")
    assert report.ok and report.count("unchanged") == len(report.outcomes) == shared_store.index().shape[0]
    assert _snapshot(shared_store.root) == before


def test_spec_is_built_without_opening_the_event_logs(shared_runs, monkeypatch):
    opened: list[str] = []
    real_open, real_os_open = io.open, os.open

    def spy(file, *args, **kwargs):
        if not isinstance(file, int):  # (an fd os.open gave, which the os.open spy saw)
            opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    def os_spy(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return real_os_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    monkeypatch.setattr(os, "open", os_spy)
    job_dir = sorted(shared_runs.iterdir())[0]
    spec = build_spec(job_dir)
    assert opened, "the spy saw no file reads; it is not watching the right function"
    assert not [path for path in opened if "megatron_trace" in path]
    assert spec.pp == len(json.loads((job_dir / "hops_trace_map.json").read_text())["stages"])


def test_spec_reads_uneven_layer_splits_and_declared_labels(shared_runs):
    for job_dir in find_job_dirs(shared_runs):
        args = (job_dir / "megatron_args.txt").read_text().split()
        spec = build_spec(job_dir)
        value = lambda flag: int(args[args.index(flag) + 1]) if flag in args else None  # noqa: E731
        assert sum(spec.layers_per_stage) == value("--num-layers")
        assert spec.pp == value("--pipeline-model-parallel-size")
        if value("--decoder-first-pipeline-num-layers") is not None:
            assert spec.layers_per_stage[0] == value("--decoder-first-pipeline-num-layers")
            assert spec.layers_per_stage[-1] == value("--decoder-last-pipeline-num-layers")
        assert spec.microbatches == value("--global-batch-size")  # micro batch 1, dp 1
        assert spec.iterations == value("--train-iters") - 2
        assert spec.schedule == "1f1b" and spec.vp == 1
        assert len(spec.links) == spec.pp - 1
        assert all(fit.latency_ms >= 0 and fit.bytes_per_ms > 0 for fit in spec.links)


def test_split_layers_spreads_the_rest_evenly():
    assert split_layers(18, 6, first=8, last=2) == (8, 2, 2, 2, 2, 2)
    assert split_layers(12, 4) == (3, 3, 3, 3)
    assert split_layers(10, 4, first=1, last=1) == (1, 4, 4, 1)
    with pytest.raises(ValueError, match="cannot be split"):
        split_layers(10, 4, first=2)


def test_split_is_grouped_and_stable_when_runs_are_added(shared_runs, shared_store, tmp_path):
    job_dirs = find_job_dirs(shared_runs)
    # A store that first sees only a third of the runs, then all of them.
    partial = FixtureStore(tmp_path / "fixtures")
    first = job_dirs[::3]
    assert ingest(first, partial, split="auto").ok
    first_splits = dict(zip(partial.index()["id"], partial.index()["split"]))
    assert ingest([shared_runs], partial, split="auto").ok
    final = dict(zip(partial.index()["id"], partial.index()["split"]))
    assert {k: final[k] for k in first_splits} == first_splits
    assert final == dict(zip(shared_store.index()["id"], shared_store.index()["split"]))
    for run_id, split in final.items():
        assert split == hashed_split(group_of(run_id))


def test_forced_split_and_stored_split_win_over_the_hash(shared_runs, tmp_path):
    job_dirs = find_job_dirs(shared_runs)
    pair = [d for d in job_dirs if group_of(d.name) == group_of(job_dirs[-1].name) or d == job_dirs[0]]
    store = FixtureStore(tmp_path / "fixtures")
    one = job_dirs[0]
    forced = "test" if hashed_split(group_of(one.name)) == "train" else "train"
    assert ingest([one], store, split=forced).ok
    assert store.load(one.name).split == forced
    # A later auto ingest keeps the stored split; forcing the other split is refused (groups never straddle).
    assert ingest(pair, store).ok and store.load(one.name).split == forced
    other = "train" if forced == "test" else "test"
    report = ingest([one], store, split=other)
    assert not report.ok and "straddle" in report.rejected[0].error


def test_copied_run_with_changed_content_is_updated_in_place(shared_runs, tmp_path):
    job_dir = tmp_path / "runs" / sorted(shared_runs.iterdir())[0].name
    shutil.copytree(sorted(shared_runs.iterdir())[0], job_dir)
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([job_dir], store).outcomes[0].status == "new"
    old_hash = store.load(job_dir.name).content_hash
    (job_dir / "manifest.yaml").write_text((job_dir / "manifest.yaml").read_text() + "note: edited\n")
    outcome = ingest([job_dir], store).outcomes[0]
    assert outcome.status == "updated"
    assert store.load(job_dir.name).content_hash != old_hash
    assert not [p for p in store.root.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_an_ingest_stopped_midway_is_said_and_the_next_one_finishes_it(shared_runs, tmp_path, capsys):
    from hops_calib.loop.suite import open_store

    runs = sorted(shared_runs.iterdir())[:2]
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest(runs[:1], store).ok
    capsys.readouterr()
    open_store(store.root)
    assert capsys.readouterr().err == ""  # a finished store says nothing
    # what a killed ingest leaves while writing the second run: its temporary folder, half filled
    leftover = store.root / f".tmp-{runs[1].name}-0badc0de"
    leftover.mkdir()
    (leftover / "spec.json").write_text("{")
    assert store.unfinished() == [leftover.name] and store.ids() == [runs[0].name]
    open_store(store.root)
    warning = capsys.readouterr().err
    assert "an ingest stopped before it finished" in warning and leftover.name in warning and "ingest again" in warning
    assert ingest(runs, store).ok  # the same ingest again: the leftover goes, the missing run lands
    assert store.unfinished() == [] and store.ids() == sorted(r.name for r in runs)
    open_store(store.root)
    assert capsys.readouterr().err == ""


def test_a_source_beside_the_store_is_recorded_relative_so_the_store_travels_with_its_folder(repo_root, tmp_path):
    """The shipped store records `traces/NAME` (beside `fixtures/`), not the path of the machine that ingested it:
    a moved copy of the folder re-ingests its runs as unchanged; a source elsewhere is recorded whole."""
    shipped = FixtureStore(repo_root / "fixtures")
    assert shipped.ids() and all(
        json.loads((repo_root / "fixtures" / fid / "fixture.json").read_text())["source"] == f"traces/{fid}"
        for fid in shipped.ids())

    name = "cpu_1f1b_l4_h512_s256_m4_run1"
    project = tmp_path / "project"
    shutil.copytree(repo_root / "traces" / name, project / "traces" / name)
    store = FixtureStore(project / "fixtures")
    assert ingest([project / "traces"], store).outcomes[0].status == "new"
    assert store.load(name).meta["source"] == f"traces/{name}"
    assert store.index().set_index("id").loc[name, "source"] == f"traces/{name}"
    from hops_calib.store.views import show_dict
    assert show_dict(store.load(name))["source"] == str((project / "traces" / name).resolve())  # shown as a path

    moved = tmp_path / "moved"
    shutil.move(project, moved)
    assert ingest([moved / "traces"], FixtureStore(moved / "fixtures")).outcomes[0].status == "unchanged"

    outside = tmp_path / "elsewhere" / name
    shutil.copytree(moved / "traces" / name, outside)
    other = FixtureStore(tmp_path / "stores" / "fixtures")
    ingest([outside], other)
    assert other.load(name).meta["source"] == str(outside.resolve())
