"""Where the shared (not redistributable) cluster traces live, for tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

REQUIRE_ENV = "HOPS_CALIB_REQUIRE_SHARED"
SHARED_ENV = "HOPS_CALIB_SHARED"


def shared_root() -> Path:
    """The shared/ folder: $HOPS_CALIB_SHARED, else ../shared beside the repository."""
    if os.environ.get(SHARED_ENV):
        return Path(os.environ[SHARED_ENV])
    return Path(__file__).resolve().parent.parent.parent / "shared"


def shared_runs_dir() -> Path:
    return shared_root() / "megatron-traces" / "hops"


def reference_csv() -> Path:
    return shared_root() / "reference" / "hops_results.csv"


def shared_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")
