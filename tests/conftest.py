"""Shared test fixtures: the real cluster runs in ../shared, skipped or required."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from hops_calib.shared import REQUIRE_ENV, shared_required, shared_runs_dir

REPO = Path(__file__).resolve().parent.parent

# Property tests judge behaviour, not speed: Hypothesis' per-example deadline (200 ms by default) is a timing
# assertion, and on a loaded 2-core machine it failed a correct test. No deadline, and no too-slow health check.
settings.register_profile("hops-calib", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hops-calib")


def need_shared_runs() -> Path:
    """The shared runs folder; skip (or fail under HOPS_CALIB_REQUIRE_SHARED=1) when absent."""
    runs = shared_runs_dir()
    if runs.is_dir() and any(runs.iterdir()):
        return runs
    message = (f"shared Megatron traces not found at {runs} (set HOPS_CALIB_SHARED to the shared/ folder); "
               "they are not redistributable, so the repository does not ship them")
    if shared_required():
        pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires them")
    pytest.skip(message)


def need_public_runs(*parts: str) -> Path:
    """A path under ../shared/public-runs/ (the vTrain set: read in place, never vendored); skip (or fail under
    HOPS_CALIB_REQUIRE_SHARED=1) when absent."""
    from hops_calib.shared import shared_root

    path = shared_root().joinpath("public-runs", *parts)
    if path.exists():
        return path
    message = f"{path} is not there (shared/ is not in the repository)"
    if shared_required():
        pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires it")
    pytest.skip(message)


@pytest.fixture(scope="session")
def allreduce_dir() -> Path:
    """The published A100 all-reduce tables (../shared/public-runs/vtrain/allreduce-a100/)."""
    return need_public_runs("vtrain", "allreduce-a100")


@pytest.fixture(scope="session")
def vtrain(tmp_path_factory):
    """The published vTrain table (../shared/public-runs/vtrain/, read in place) ingested once per session."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    table = need_public_runs("vtrain", "ground_truth_single.csv")
    store = FixtureStore(tmp_path_factory.mktemp("vt") / "fx")
    assert ingest([table], store, split="auto").ok
    return store


@pytest.fixture(scope="session")
def shared_runs() -> Path:
    return need_shared_runs()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_store(shared_runs, tmp_path_factory):
    """The 56 shared runs ingested once per test session into a temporary fixture store."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(tmp_path_factory.mktemp("shared-store") / "fixtures")
    report = ingest([shared_runs], store, split="auto")
    assert report.ok, [o.error for o in report.rejected]
    return store


@pytest.fixture(scope="session")
def shared_fixtures(shared_store) -> Path:
    """Folder of the shared runs' fixture store (ingested once per session by `shared_store`), for CLI tests.

    Read-only by convention: tests that change a store ingest into their own tmp_path.
    """
    return shared_store.root


# The plain, uncalibrated model (roofline per layer + link fits): tests of the model room and of the loop use it
# instead of the shipped model, which the calibration campaign keeps changing.
PLAIN_MODEL_TOML = """
[model]
name = "plain"
description = "roofline per decoder layer and the link benchmark's fits, nothing else"

[terms.decoder_roofline]
compute_efficiency = 0.5
memory_efficiency = 0.8
backward_factor = 2.0

[terms.link_transfer]
"""


def plain_model():
    from hops_calib.loop.model_files import load_catalog
    from hops_calib.model import parse_model

    return parse_model(PLAIN_MODEL_TOML, origin="tests/conftest.py:PLAIN_MODEL_TOML", catalog=load_catalog())


# A model with a term for every part of an iteration (decoder layers, links, the embedding all-reduce in the
# silent stretch, the optimizer step, host time before the next iteration), for tests of observe and tune.
ITERATION_TERMS_MODEL = """
[model]
name = "iteration-terms"

[terms.decoder_roofline]
compute_efficiency = 0.1

[terms.link_transfer]

[terms.embedding_grad_allreduce]

[terms.optimizer_step]
memory_efficiency = 0.1

[terms.iteration_host_overhead]
host_ms = 3.0
"""


@pytest.fixture(scope="session")
def iteration_terms_model(tmp_path_factory) -> Path:
    """Path of a model file with ITERATION_TERMS_MODEL."""
    path = tmp_path_factory.mktemp("models") / "iteration-terms.toml"
    path.write_text(ITERATION_TERMS_MODEL)
    return path


# A PostgreSQL database for the distributed-study tests ($HOPS_CALIB_TEST_POSTGRES, a URL that .ci/run sets after
# starting a local server); without it the tests skip saying why, and fail under HOPS_CALIB_REQUIRE_POSTGRES=1.
POSTGRES_URL_ENV, REQUIRE_POSTGRES_ENV = "HOPS_CALIB_TEST_POSTGRES", "HOPS_CALIB_REQUIRE_POSTGRES"


def _postgres_unavailable(why: str):
    import os

    if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
        pytest.fail(f"{why}, and {REQUIRE_POSTGRES_ENV}=1 requires the PostgreSQL test to run")
    pytest.skip(why)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    import os

    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        _postgres_unavailable(f"no PostgreSQL database given (${POSTGRES_URL_ENV} unset; .ci/run starts one and sets it)")
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("select 1"))
        engine.dispose()
    except ModuleNotFoundError as error:
        _postgres_unavailable(f"no PostgreSQL driver ({error}; pip install -e '.[db]')")
    except Exception as error:  # noqa: BLE001 - any reason the server cannot be reached
        _postgres_unavailable(f"PostgreSQL at {url.split('@')[-1]} is not reachable: {type(error).__name__}")
    return url
