"""The held-out promise: a group the ledger has seen held out is never trained or scored on by accident.

The ledger is the memory. An audited report records the groups it scored as
test, and every judgement (evaluate, compare) records the groups its store held
in test, each by name and by what its runs measured (`held_out_groups`: group
-> the sha256 of each run's events.parquet, which a renamed copy of a run
shares, and its `events_fingerprint` as `timing:<sha256>`, which a copy with
its timestamps shifted shares too; a table's run by its row's content hash).
The verbs that read the train split (evaluate, compare, tune, crossval,
observe, predict ID) refuse a store that holds such a group in train, or a run
whose events are a held-out run's, naming the groups and the entry that held
them out, unless `--allow-held-out` is given: a judgement then carries the
override in its entry (`held_out_override`), and a verb that records nothing
else appends a `held_out_override` entry, so the ledger knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.store.digests import TIMING_KEY

HELD_OUT_KEY = "held_out_groups"
OVERRIDE_KEY = "held_out_override"
OVERRIDE_KIND = "held_out_override"
RECORD_KIND = "held_out_record"
OVERRIDE_FLAG = "--allow-held-out"


@dataclass(frozen=True)
class Leak:
    """A train group of a store that the ledger remembers as held out (by name, or by a run's events)."""

    group: str  # the store's train group
    ids: tuple[str, ...]  # its fixtures
    held_out_as: str  # the held-out group it is (its own name, or the group a copied run came from)
    by: str  # "name", "content" (the same events file) or "timing" (the same events up to a shift of the clocks)
    seq: int | None  # the ledger entry that held it out
    look: str  # what that entry was

    def named(self) -> str:
        """The group and its runs, and for a copy, which held-out group it copies."""
        runs = ", ".join(self.ids[:3]) + (", ..." if len(self.ids) > 3 else "")
        copy = (f": the same events as a run of held-out group {self.held_out_as!r}, a renamed copy"
                if self.by == "content" else
                f": the same configuration and events as a run of held-out group {self.held_out_as!r} up to a shift "
                "of its timestamps, a copy" if self.by == "timing" else "")
        return f"{self.group} ({runs}{copy})"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "ids": list(self.ids), "held_out_as": self.held_out_as, "by": self.by,
                "seq": self.seq, "look": self.look}


def describe(found: list[Leak], most: int = 8) -> str:
    """The groups, by the ledger entry that held them out: "by ledger entry 12 (an audited report ...): a (a_run1),
    b (b_run2); ..."."""
    by_entry: dict[tuple[Any, str], list[Leak]] = {}
    for leak in found:
        by_entry.setdefault((leak.seq, leak.look), []).append(leak)
    parts = []
    for (seq, look), leaks in by_entry.items():
        shown = ", ".join(leak.named() for leak in leaks[:most]) + (f", ... ({len(leaks)} groups)"
                                                                     if len(leaks) > most else "")
        parts.append(f"by ledger entry {seq} ({look}): {shown}")
    return "; ".join(parts)


class HeldOutInTrain(InputError):
    """A store that holds in train what the ledger remembers as held out."""


def store_held_out(store) -> dict[str, list[str]]:
    """The store's test groups and their runs' events digests: what a ledger entry about this store remembers."""
    return {group: sorted(info["digests"]) for group, info in sorted(store.group_digests("test").items())}


def _look(entry: dict[str, Any]) -> str:
    kind = entry.get("kind", "?")
    what = ("an audited report on the test split" if kind == "report"
            else "a record of a store's test split (ledger hold-out)" if kind == RECORD_KIND
            else f"{kind} of a store that held it in its test split")
    return f"{what}, {entry.get('time', '?')}"


def remembered(entries: Iterable[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[str, dict]]]:
    """(group name -> the first entry that held it out, events digest -> (its group, that entry))."""
    by_name: dict[str, dict[str, Any]] = {}
    by_digest: dict[str, tuple[str, dict[str, Any]]] = {}
    for entry in entries:
        for group, digests in (entry.get(HELD_OUT_KEY) or {}).items():
            by_name.setdefault(group, entry)
            for digest in digests or ():
                by_digest.setdefault(digest, (group, entry))
    return by_name, by_digest


def leaks(store, entries: Iterable[dict[str, Any]]) -> list[Leak]:
    """The store's train groups the ledger's entries remember as held out, by name or by a run's events."""
    by_name, by_digest = remembered(entries)
    if not by_name:
        return []
    found = []
    for group, info in sorted(store.group_digests("train").items()):
        ids = tuple(info["ids"])
        if group in by_name:
            entry = by_name[group]
            found.append(Leak(group, ids, group, "name", entry.get("seq"), _look(entry)))
            continue
        hit = next((d for d in sorted(info["digests"], key=_exact_first) if d in by_digest), None)
        if hit is not None:
            held, entry = by_digest[hit]
            found.append(Leak(group, ids, held, "timing" if hit.startswith(TIMING_KEY) else "content",
                              entry.get("seq"), _look(entry)))
    return found


def _exact_first(digest: str) -> bool:
    """Sort key: a run's exact events digest before its fingerprint (an exact copy is named as one)."""
    return digest.startswith(TIMING_KEY)


def _entries(ledger_path: Path | str | None) -> list[dict[str, Any]]:
    from hops_calib.loop.ledger import LedgerError, read_entries, resolve

    try:
        path = resolve(ledger_path)
    except LedgerError:  # no ledger at all (no checkout, none named): nothing is remembered
        return []
    return list(read_entries(path)) if Path(path).is_file() else []


def override_warning(found: list[Leak], entry: dict[str, Any] | None = None) -> str:
    """What a verb that went on over held-out groups (--allow-held-out) says."""
    where = f" (ledger entry {entry['seq']})" if entry else " (in its ledger entry)"
    return (f"went on over {len(found)} held-out group(s) in the train split ({OVERRIDE_FLAG}), recorded{where}; "
            f"held out {describe(found)}")


def _open_stores(fixtures_dirs: Path | str | Sequence[Path | str]) -> list:
    """The stores of a verb's --fixtures: one, or several judged as one union suite."""
    from hops_calib.loop.suite import open_store

    dirs = [fixtures_dirs] if isinstance(fixtures_dirs, (str, Path)) else list(fixtures_dirs)
    return [open_store(d) for d in dirs]


def guard_store(fixtures_dirs: Path | str | Sequence[Path | str], ledger_path: Path | str | None, verb: str,
                allow: bool) -> list[str]:
    """`guard` for a verb that records nothing else, on each store given: refuse, or (with `allow`) append the
    override to the ledger; returns the warnings to print."""
    warnings = []
    for store in _open_stores(fixtures_dirs):
        found = guard(store, ledger_path, verb, allow)
        if found:
            warnings.append(override_warning(found, record_override(ledger_path, verb, store, found)))
    return warnings


def judgement_fields(fixtures_dirs: Path | str | Sequence[Path | str], ledger_path: Path | str | None, verb: str,
                     allow: bool) -> tuple[dict[str, Any], list[Leak]]:
    """For a judgement (evaluate with a candidate, compare) on one store or several: `guard` each, then the fields
    its entry carries: the stores' test groups (remembered as held out from then on) and, when it went on over
    held-out groups, the override."""
    found: list[Leak] = []
    held: dict[str, Any] = {}
    for store in _open_stores(fixtures_dirs):
        found += guard(store, ledger_path, verb, allow)
        held.update(store_held_out(store))
    return {**({HELD_OUT_KEY: held} if held else {}), **override_record(found)}, found


def guard(store, ledger_path: Path | str | None, verb: str, allow: bool) -> list[Leak]:
    """Refuse (HeldOutInTrain, exit 2) a store holding in train a group the ledger remembers as held out; with
    `allow`, return those groups for the caller to record (see `record_override`)."""
    found = leaks(store, _entries(ledger_path))
    if found and not allow:
        raise HeldOutInTrain(
            store.root, f"holds in its train split {len(found)} group(s) the ledger remembers as held out, "
                        f"{describe(found)}",
            field="split",
            hint=f"{verb} would fit or judge on the test split. Ingest these runs into the store's test split (or "
                 f"leave them out); {OVERRIDE_FLAG} goes on regardless, and the ledger records the override")
    return found


def override_record(found: list[Leak]) -> dict[str, Any]:
    """What a judgement's entry carries when it went on with `--allow-held-out` over held-out groups."""
    return {OVERRIDE_KEY: [leak.to_dict() for leak in found]} if found else {}


def record_override(ledger_path: Path | str | None, verb: str, store, found: list[Leak]) -> dict[str, Any] | None:
    """Append a `held_out_override` entry for a verb that records nothing else (tune, crossval, observe,
    predict); None when there was nothing to override."""
    if not found:
        return None
    from hops_calib.loop import ledger
    from hops_calib.loop.commits import check_appendable

    path = ledger.resolve(ledger_path)
    check_appendable(path)
    return ledger.append(path, {"kind": OVERRIDE_KIND, "time": ledger.now_utc(), "verb": verb,
                                "fixtures": str(store.root), **override_record(found),
                                "code_revision": ledger.code_revision()})


def record_store(fixtures_dir: Path | str, ledger_path: Path | str | None) -> dict[str, Any] | None:
    """Append a `held_out_record` entry: the store's test groups (by name and events digest), remembered as held out
    from then on, with no look at them. For a store whose test split was assigned before the ledger recorded groups
    (entries older than this guard carry none, entries older than the fingerprints carry no `timing:` keys) or
    never judged on; None when the store has no test split, or when the ledger already remembers every group of it
    by name and every digest of its runs (nothing is appended twice)."""
    from hops_calib.loop import ledger
    from hops_calib.loop.commits import check_appendable

    store = _open_stores(fixtures_dir)[0]
    held = store_held_out(store)
    by_name, by_digest = remembered(_entries(ledger_path))
    if not held or (set(held) <= set(by_name) and {d for ds in held.values() for d in ds} <= set(by_digest)):
        return None
    path = ledger.resolve(ledger_path)
    check_appendable(path)
    return ledger.append(path, {"kind": RECORD_KIND, "time": ledger.now_utc(), "fixtures": str(Path(store.root).resolve()),
                                HELD_OUT_KEY: held, "code_revision": ledger.code_revision()})
