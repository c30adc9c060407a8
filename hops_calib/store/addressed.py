"""Store room: content-addressed files of a store (`<store>/.<kind>/<sha256>.json`), named by the sha256 of their
text, so that a store stands alone: the measured tables its runs are priced with (all-reduce tables:
`store.collectives`; GEMM and memory-kernel tables: `store.components`) are kept in it, written once per content,
and refused on reading when changed, torn or missing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from hops_calib.files import atomic_write
from hops_calib.store.digests import FixtureFileError, text_digest


def digest_of(text: str) -> str:
    return text_digest(text)


def put_text(store_root: Path, folder: str, text: str) -> str:
    """Keep `text` in the store's `folder` under its digest (once: a file of the same digest is already it); the
    digest."""
    digest = digest_of(text)
    path = Path(store_root) / folder / f"{digest}.json"
    if not (path.is_file() and _file_ok(path, digest)):
        atomic_write(path, text)
    return digest


def _file_ok(path: Path, digest: str) -> bool:
    try:
        return digest_of(path.read_text(encoding="utf-8")) == digest
    except (OSError, UnicodeDecodeError):
        return False


def load_parsed(
    store_root: Path, folder: str, digest: str, parse: Callable[[Any], Any], *, what: str, hint: str
) -> Any:
    """`parse` of the JSON of the store's file `folder/<digest>.json`, checked against its digest (`get_text`);
    a file checked once is read again only when it changes (its mtime or size)."""
    path = Path(store_root).resolve() / folder / f"{digest}.json"
    return _load(str(path), digest, stamp_of(path), parse, what, hint)


@lru_cache(maxsize=32)
def _load(
    path_text: str, digest: str, stamp: tuple[int, int] | None, parse: Callable[[Any], Any], what: str, hint: str
) -> Any:
    import json

    return parse(json.loads(get_text(Path(path_text), digest, what=what, hint=hint)))


def stamp_of(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of a file, to key a cache of what was read from it; None when it is not there."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def get_text(path: Path, digest: str, *, what: str, hint: str) -> str:
    """The text of a content-addressed file, checked against its digest; FixtureFileError naming the file when it is
    missing, unreadable or not the text its name says (`what` says what the file holds)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FixtureFileError(path, f"is missing ({what})", hint=hint) from None
    except (OSError, UnicodeDecodeError) as err:
        raise FixtureFileError(path, f"cannot be read: {err}", hint=hint) from None
    if digest_of(text) != digest:
        raise FixtureFileError(
            path, "changed after ingest wrote it (its sha256 is not the one its name and its runs record)", hint=hint
        )
    return text
