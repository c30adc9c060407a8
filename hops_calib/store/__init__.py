"""Store room: the Parquet fixture store (atomic writes, index, grouped train/test split) and ingest into it."""

from hops_calib.store.digests import StoreError
from hops_calib.store.fixture import Fixture
from hops_calib.store.split import DEFAULT_TEST_FRACTION, group_of, hashed_split
from hops_calib.store.writer import FixtureStore

__all__ = ["DEFAULT_TEST_FRACTION", "Fixture", "FixtureStore", "StoreError", "group_of", "hashed_split"]
