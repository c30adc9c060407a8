"""Repeats of one configuration in a run table (each row with its own run_id) form one stored group, and every
fold, bootstrap draw and repeat spread is formed from that group, never from the run id. Runs: the published
vTrain table's pure-pipeline runs (../shared/public-runs/vtrain/, read in place), some of them measured twice."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import need_public_runs
from hops_calib.store import FixtureStore, group_of
from hops_calib.store.ingest import ingest
from hops_calib.trace.vtrain import translate


@pytest.fixture(scope="module")
def repeats_store(allreduce_dir, tmp_path_factory):
    """A run table of vTrain's t = d = 1 runs in its own columns, every third configuration measured again (its
    published time x (1 + N(0, 1 %)), seeded), each row with a run_id that does not name its configuration."""
    folder = need_public_runs("vtrain", "ground_truth_single.csv").parent
    published = pd.read_csv(folder / "ground_truth_single.csv")
    pipeline = published[(published["tensor parallelism"] == 1) & (published["data parallelism"] == 1)]
    rows = []
    for _, row in pipeline.iterrows():
        rows.append(translate(row.to_dict()))
    again = [dict(r) for r in rows[::3]]
    noise = np.random.default_rng(5).normal(0.0, 0.01, len(again))
    for row, e in zip(again, noise):
        row["iteration_time_ms"] *= 1 + e
    table = pd.DataFrame(rows + again).drop(columns=["world_size"], errors="ignore")
    table["gpu"], table["gpus_per_node"] = "a100", 8
    table["run_id"] = [f"sweep-{k:04d}" for k in np.random.default_rng(6).permutation(len(table))]
    root = tmp_path_factory.mktemp("repeats")
    (root / "calibration").mkdir()
    (root / "calibration" / "allreduce").symlink_to(allreduce_dir)
    table.to_csv(root / "sweep.csv", index=False)
    store = FixtureStore(root / "fx")
    assert ingest([root / "sweep.csv"], store).ok
    assert len(store.ids()) == len(rows) + len(again)
    return store


def test_repeats_share_a_stored_group_that_the_run_id_does_not_name(repeats_store):
    fixtures = repeats_store.load_all()
    by_group: dict[str, list] = {}
    for f in fixtures:
        by_group.setdefault(f.group, []).append(f)
    repeated = [g for g in by_group.values() if len(g) > 1]
    assert repeated and all(len({f.split for f in g}) == 1 for g in repeated)
    assert all(len({group_of(f.id) for f in g}) == len(g) for g in repeated)  # the ids alone would part them


def test_crossval_folds_and_the_suite_hold_whole_stored_groups(repeats_store):
    from hops_calib.loop.suite import load_suite
    from hops_calib.research.crossval import crossval

    suite = load_suite(repeats_store.root, "train")
    stored = {f.id: f.group for f in repeats_store.load_all("train")}
    assert dict(zip(suite.ids, suite.groups)) == {i: stored[i] for i in suite.ids}
    result = crossval("decoder_roofline", repeats_store.root, folds=3, evaluations=2, seed=3,
                      only=("compute_efficiency@a100",))
    held = [run for fold in result.folds for run in fold.ids]
    assert sorted(held) == sorted(suite.ids)
    for fold in result.folds:
        assert {stored[run] for run in fold.ids} == set(fold.groups)
        others = {stored[run] for f in result.folds if f is not fold for run in f.ids}
        assert not set(fold.groups) & others  # a configuration's repeats never straddle two folds
    assert {r.group for fold in result.folds for r in fold.runs} == set(stored[i] for i in suite.ids)
    assert any(len([i for i in fold.ids if stored[i] == g]) > 1 for fold in result.folds for g in fold.groups)
