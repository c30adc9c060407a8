"""Defaults set once (hops_calib.cli.settings): environment, then the nearest hops-calib.toml, then ./fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.errors import InputError
from hops_calib.cli.settings import CLUSTER_ENV, FIXTURES_ENV, default_cluster, default_fixtures


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(FIXTURES_ENV, raising=False)
    monkeypatch.delenv(CLUSTER_ENV, raising=False)


def test_without_a_setting_the_store_is_fixtures_of_the_current_directory(tmp_path):
    assert default_fixtures(tmp_path).path == Path("fixtures") and default_cluster(tmp_path).path is None


def test_the_nearest_project_file_sets_both_relative_to_itself(tmp_path):
    (tmp_path / "hops-calib.toml").write_text('[defaults]\nfixtures = "store"\ncluster = "/abs/cluster.yaml"\n')
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert default_fixtures(deep).path == (tmp_path / "store").resolve()
    assert default_cluster(deep).path == Path("/abs/cluster.yaml")
    assert default_fixtures(deep).origin == str((tmp_path / "hops-calib.toml").resolve())


def test_the_environment_wins_over_the_project_file(tmp_path, monkeypatch):
    (tmp_path / "hops-calib.toml").write_text('[defaults]\nfixtures = "store"\n')
    monkeypatch.setenv(FIXTURES_ENV, "/elsewhere")
    assert default_fixtures(tmp_path).path == Path("/elsewhere")


@pytest.mark.parametrize("text, field, line", [('[defaults]\nfixture = "x"\n', "defaults.fixture", None),
                                               ('[defaults]\nfixtures = 3\n', "defaults.fixtures", None),
                                               ('[defaults\n', None, 1)])
def test_a_bad_project_file_is_named(tmp_path, text, field, line):
    (tmp_path / "hops-calib.toml").write_text(text)
    with pytest.raises(InputError) as caught:
        default_fixtures(tmp_path)
    assert caught.value.origin.endswith("hops-calib.toml") and caught.value.field == field
    assert caught.value.line == line
