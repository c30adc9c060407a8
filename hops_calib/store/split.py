"""Store room: the grouped, stable train/test split.

Runs of one configuration (`exp2_1_all_nodes_run51` and `..._run93`) form a
group and always share a split. A new group's split is decided by a hash of
its key alone, so adding runs never moves an existing one; once assigned, a
group's split is stored with its fixtures and never recomputed.
"""

from __future__ import annotations

import hashlib
import re

SPLITS = ("train", "test")
DEFAULT_TEST_FRACTION = 0.3
_RUN_SUFFIX = re.compile(r"_run\d+$")


def group_of(run_id: str) -> str:
    """The configuration a run repeats: its id without the trailing `_run<N>`."""
    return _RUN_SUFFIX.sub("", run_id)


def hashed_split(group: str, test_fraction: float = DEFAULT_TEST_FRACTION) -> str:
    """'test' for a stable pseudo-random `test_fraction` of group keys, else 'train'."""
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test fraction {test_fraction} is not between 0 and 1")
    draw = int.from_bytes(hashlib.sha256(group.encode("utf-8")).digest()[:8], "big") / 2.0**64
    return "test" if draw < test_fraction else "train"
