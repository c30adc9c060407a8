"""Fixtures of the research room's tests."""

from __future__ import annotations

import pytest

from tests.conftest import need_public_runs


@pytest.fixture(scope="session")
def vtrain(tmp_path_factory):
    """The published vTrain table (../shared/public-runs/vtrain/, read in place) ingested once per session."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    table = need_public_runs("vtrain", "ground_truth_single.csv")
    store = FixtureStore(tmp_path_factory.mktemp("vt") / "fx")
    assert ingest([table], store, split="auto").ok
    return store
