"""A store of iteration-level runs holds the all-reduce tables they are priced with: the published vTrain table and
its A100 tables (../shared/public-runs/vtrain/, read in place; copied only into the test's own temporary folder
where a test must change or remove them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import need_public_runs
from hops_calib.store import FixtureStore
from hops_calib.store.collectives import COLLECTIVES_DIR, HARDWARE_KEY
from hops_calib.store.fixture_store import FixtureFileError
from hops_calib.store.ingest import ingest


@pytest.fixture(scope="module")
def vtrain_dir(allreduce_dir) -> Path:
    return need_public_runs("vtrain", "ground_truth_single.csv").parent


def _priced_predictions(store: FixtureStore, limit: int = 6) -> dict[str, float]:
    from hops_calib.loop.model_files import default_model, load_model
    from hops_calib.model.predict import predict

    model = load_model(default_model())
    # pipelines on one GPU per stage: every hop between stages is priced from the node's tables (ring formula)
    pipelines = (f for f in store.load_all("train") if f.launch["pipeline_model_parallel_size"] > 1
                 and f.launch["tensor_model_parallel_size"] == f.launch["data_parallel_size"] == 1)
    priced = sorted((f for f in pipelines if f.not_priced is None), key=lambda f: f.id)[:limit]
    assert priced
    return {f.id: predict(f.spec, model).metrics.iteration_time_ms for f in priced}


def test_the_vtrain_runs_share_one_stored_copy_of_their_tables(vtrain_dir, tmp_path):
    store = FixtureStore(tmp_path / "fx")
    assert ingest([vtrain_dir / "ground_truth_single.csv"], store, split="auto").ok
    (stored,) = (store.root / COLLECTIVES_DIR).iterdir()
    fixtures = store.load_all()
    assert len(fixtures) == 1440 and {f.hardware[HARDWARE_KEY] for f in fixtures} == {stored.stem}
    assert not any("collective_tables" in f.hardware for f in fixtures)  # no path to the source anywhere
    # the stored tables are the published ones, table for table (the digest is the file's own sha256)
    from hops_calib.store.collectives import load_collectives
    from hops_calib.trace.collective_bench import read_collective_tables

    assert load_collectives(store.root, stored.stem) == read_collective_tables(vtrain_dir / "allreduce-a100")


def _own_copy(vtrain_dir: Path, tmp_path: Path) -> tuple[Path, FixtureStore]:
    """The vTrain table (linked) beside a copy of its all-reduce tables that the test may change, ingested."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "ground_truth_single.csv").symlink_to(vtrain_dir / "ground_truth_single.csv")
    shutil.copytree(vtrain_dir / "allreduce-a100", source / "allreduce-a100")
    store = FixtureStore(tmp_path / "fx")
    assert ingest([source / "ground_truth_single.csv"], store, split="auto").ok
    return source, store


def test_a_moved_store_predicts_without_the_source_tables_and_a_changed_copy_is_refused(vtrain_dir, tmp_path):
    source, store = _own_copy(vtrain_dir, tmp_path)
    before = _priced_predictions(store)
    # the source's tables gone and the store moved: the same predictions, from the store alone
    shutil.rmtree(source / "allreduce-a100")
    moved = tmp_path / "elsewhere" / "fx"
    moved.parent.mkdir()
    shutil.move(store.root, moved)
    assert _priced_predictions(FixtureStore(moved)) == before
    # a stored table edited by hand: refused naming the file, not silently priced otherwise
    (stored,) = (moved / COLLECTIVES_DIR).iterdir()
    data = json.loads(stored.read_text())
    data[0]["points"][0][1] *= 2
    stored.write_text(json.dumps(data))
    with pytest.raises(FixtureFileError, match="changed after ingest wrote it") as err:
        _priced_predictions(FixtureStore(moved))
    assert str(stored) in str(err.value) and "ingest the runs' source again" in str(err.value)
    stored.unlink()
    with pytest.raises(FixtureFileError, match="is missing"):
        _priced_predictions(FixtureStore(moved))


def test_changed_source_tables_are_read_again_by_the_next_ingest(vtrain_dir, tmp_path):
    source, store = _own_copy(vtrain_dir, tmp_path)
    before = _priced_predictions(store)
    assert ingest([source / "ground_truth_single.csv"], FixtureStore(store.root), split="auto").count("unchanged") == 1440
    # a slower node: every in-place time of the tables doubled
    for table in (source / "allreduce-a100").iterdir():
        lines = table.read_text().splitlines()
        rows = [line.split(",") for line in lines[1:] if line.strip()]
        table.write_text("\n".join([lines[0], *(",".join(r[:5] + [str(float(r[5]) * 2)] + r[6:]) for r in rows)]))
    again = ingest([source / "ground_truth_single.csv"], FixtureStore(store.root), split="auto")
    assert again.ok and again.count("unchanged") == 0
    after = _priced_predictions(FixtureStore(store.root))
    assert after.keys() == before.keys() and all(after[i] > before[i] for i in before)
    assert len(list((store.root / COLLECTIVES_DIR).iterdir())) == 2  # content-addressed: the old copy stays


def test_a_run_of_an_older_store_that_named_its_tables_folder_is_left_out_with_the_reason(vtrain_dir, tmp_path):
    from dataclasses import replace

    store = FixtureStore(tmp_path / "fx")
    assert ingest([vtrain_dir / "ground_truth_single.csv"], store, split="auto").ok
    priced = next(f for f in store.load_all("train") if f.not_priced is None)
    # as ingest v1 wrote it: the source folder's path in place of the stored tables' digest
    older = replace(priced, hardware={"gpu": "a100", "gpus_per_node": 8,
                                      "collective_tables": str(vtrain_dir / "allreduce-a100")})
    assert "ingest its source again" in older.not_priced and "allreduce-a100" in older.not_priced
