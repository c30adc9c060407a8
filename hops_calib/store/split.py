"""Store room: the grouped, stable train/test split.

Runs of one configuration (`exp2_1_all_nodes_run51` and `..._run93`) form a
group and always share a split. A new group's split is decided by a hash of
its key alone, so adding runs never moves an existing one; once assigned, a
group's split is stored with its fixtures and never recomputed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import NamedTuple

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


# A source states the split its runs need in this file, beside them (in a source folder, or in the folder of a run
# table or log, or of a job directory): `split = "auto"` (the grouped, hashed split calibration sets need), "train"
# or "test", optionally `test_fraction`, and optionally a `[groups]` table naming groups and their split
# (`"cpu_1f1b_l4_h768_s256_m8" = "test"`), which wins over `split` for those groups: a store ingested afresh from the
# source then splits them as the store they were first ingested into did. A source that states nothing is the
# user's own: its runs go to train unless `ingest --split` asks otherwise.
SOURCE_FILE = "hops-calib-source.toml"
STATED = "source"  # ingest's default: the split the source states, else train
OWN_DEFAULT = "train"


def assigned_split(
    group: str, split: str, test_fraction: float = DEFAULT_TEST_FRACTION, groups: Mapping[str, str] | None = None
) -> str:
    """The split a group not yet stored goes to: the one the source names for it (`groups`), else `split`, where
    "auto" is the grouped, hashed split."""
    named = (groups or {}).get(group)
    if named is not None:
        return named
    return split if split != "auto" else hashed_split(group, test_fraction)


class Stated(NamedTuple):
    """What a source states of its runs' split (`stated_split`)."""

    split: str  # "auto", "train" or "test"
    test_fraction: float
    why: str  # "PATH states split = ..." or "your own source: train unless --split asks"
    groups: dict[str, str]  # the groups its [groups] table names, with their split
    groups_why: str = ""  # "PATH names the group's split ([groups])"


def stated_split(path, test_fraction: float = DEFAULT_TEST_FRACTION) -> Stated:
    """What the source at `path` states for its runs' split (`SOURCE_FILE` in `path` itself when a folder, or in
    its parent folder); train, as the user's own, where it states nothing. ValueError naming the file and field
    for a file that cannot be read."""
    import tomllib
    from pathlib import Path

    path = Path(path)
    for folder in ([path] if path.is_dir() else []) + [path.parent]:
        sidecar = folder / SOURCE_FILE
        if not sidecar.is_file():
            continue
        try:
            data = tomllib.loads(sidecar.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise ValueError(
                f"{sidecar}: cannot be read as TOML ({error}); it states how ingest splits the runs "
                f'beside it: split = "auto", "train" or "test"'
            ) from None
        split = data.get("split")
        if split not in ("auto",) + SPLITS:
            raise ValueError(
                f'{sidecar}: field \'split\' is {split!r}; give "auto" (the grouped, hashed split), "train" or "test"'
            )
        fraction = data.get("test_fraction", test_fraction)
        if not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{sidecar}: field 'test_fraction' is {fraction!r}; give a number between 0 and 1")
        return Stated(
            split,
            float(fraction),
            f"{sidecar} states split = {split!r}",
            _stated_groups(sidecar, data),
            f"{sidecar} names the group's split ([groups])",
        )
    return Stated(
        OWN_DEFAULT,
        test_fraction,
        ("your own source (no " + SOURCE_FILE + " beside it): train; --split auto for the grouped train/test split"),
        {},
    )


def _stated_groups(sidecar, data: dict) -> dict[str, str]:
    groups = data.get("groups", {})
    if not isinstance(groups, dict):
        raise ValueError(
            f'{sidecar}: field \'groups\' is {groups!r}; give a table of group = "train" or "test" '
            '([groups] then lines such as "cpu_1f1b_l4_h384_s128_m4" = "train")'
        )
    for group, split in groups.items():
        if split not in SPLITS:
            raise ValueError(f'{sidecar}: field \'groups.{group}\' is {split!r}; give "train" or "test"')
        if group_of(group) != group:
            raise ValueError(
                f"{sidecar}: field 'groups.{group}' names a run, not a group; give its group "
                f"{group_of(group)!r} (the run id without _run<N>: repeats of a configuration share "
                "a split)"
            )
    return dict(groups)
