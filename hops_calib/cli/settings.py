"""Command layer: defaults a user sets once instead of on every command line: the fixture store and the cluster file.

Looked up in this order, first found wins:

1. the environment: `HOPS_CALIB_FIXTURES` (a fixture store), `HOPS_CALIB_CLUSTER` (a cluster file; set and empty:
   no cluster);
2. a project file, `hops-calib.toml`, in the current directory or the nearest parent that has one:

   ```toml
   [defaults]
   fixtures = "/data/hops-fixtures"   # relative paths are relative to this file
   cluster = "cluster.yaml"
   storage = "postgresql://hops@db-host/hops_calib"   # tune's optuna storage (a URL, kept as written)
   ```

3. the built-in default: `./fixtures` of the current directory (the shipped CPU store at the repository's root),
   and no cluster.

An option given on the command line always wins over all three (`--no-cluster`: none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hops_calib.errors import InputError, parse_toml

PROJECT_FILE = "hops-calib.toml"
FIXTURES_ENV = "HOPS_CALIB_FIXTURES"
CLUSTER_ENV = "HOPS_CALIB_CLUSTER"
STORAGE_ENV = "HOPS_CALIB_STORAGE"
_KEYS = {"fixtures", "cluster", "storage"}
_URLS = {"storage"}  # values kept as written (not paths)


@dataclass(frozen=True)
class Setting:
    path: Path | None
    origin: str  # where it came from, in words ("HOPS_CALIB_FIXTURES", "/x/hops-calib.toml", "the default")


def project_file(start: Path | None = None) -> Path | None:
    """The nearest `hops-calib.toml` from `start` (default: the current directory) upwards, or None."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PROJECT_FILE
        if candidate.is_file():
            return candidate
    return None


def _project_value(key: str, start: Path | None) -> tuple[str, Path] | None:
    """`key` under [defaults] of the nearest project file, as written, and the file; None when not set."""
    path = project_file(start)
    if path is None:
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    data = parse_toml(text, str(path), allowed_keys={"defaults"})
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InputError(
            str(path),
            "is not a table",
            field="defaults",
            hint='write [defaults] with fixtures = "DIR", cluster = "FILE" and/or storage = "URL"',
        )
    unknown = sorted(set(defaults) - _KEYS)
    if unknown:
        raise InputError(
            str(path),
            f"unknown key {unknown[0]!r}",
            field=f"defaults.{unknown[0]}",
            hint=f"[defaults] takes {', '.join(sorted(_KEYS))}",
        )
    value = defaults.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InputError(
            str(path),
            f"is {value!r}",
            field=f"defaults.{key}",
            hint="give a URL as a string" if key in _URLS else "give a path as a string",
        )
    return value, path


def _from_project(key: str, start: Path | None) -> Setting | None:
    found = _project_value(key, start)
    if found is None:
        return None
    value, path = found
    return Setting((path.parent / value).resolve() if not Path(value).is_absolute() else Path(value), str(path))


def default_fixtures(start: Path | None = None) -> Setting:
    """The fixture store a command uses when --fixtures is not given."""
    if os.environ.get(FIXTURES_ENV):
        return Setting(Path(os.environ[FIXTURES_ENV]), FIXTURES_ENV)
    return _from_project("fixtures", start) or Setting(
        Path("fixtures"), "the default, ./fixtures in the current directory"
    )


def default_cluster(start: Path | None = None) -> Setting:
    """The cluster file a command uses when --cluster is not given (path None: no cluster). HOPS_CALIB_CLUSTER set
    but empty means no cluster, whatever a project file says."""
    if CLUSTER_ENV in os.environ:
        value = os.environ[CLUSTER_ENV]
        return Setting(Path(value) if value else None, CLUSTER_ENV)
    return _from_project("cluster", start) or Setting(None, "none given")


def default_storage(start: Path | None = None) -> tuple[str | None, str]:
    """tune's optuna storage URL when --storage is not given, and where it was set: $HOPS_CALIB_STORAGE, else
    `storage` under [defaults] of the nearest hops-calib.toml, else none (the study in memory)."""
    if os.environ.get(STORAGE_ENV):
        return os.environ[STORAGE_ENV], STORAGE_ENV
    found = _project_value("storage", start)
    return (found[0], str(found[1])) if found is not None else (None, "none given")


def cluster_choice(path: Path | None, given: bool, off: bool) -> Setting:
    """The cluster a verb uses: none with --no-cluster; the file of --cluster (origin "--cluster"); else the
    default and where it was set."""
    if off:
        return Setting(None, "--no-cluster")
    if given:
        return Setting(path, "--cluster")
    return Setting(path, default_cluster().origin if path is not None else "none given")
