"""The held-out promise: a configuration the ledger or the store holds out is never trained or scored on by accident.

The ledger is the memory. An audited report records the groups it scored as
test, and every judgement (evaluate, compare) and `ledger hold-out` records
the groups its store held in test, each by name and by the configuration of
each of its runs (`held_out_groups`: group -> `config:<sha256>` of each run's
launch and devices, `hops_calib.store.guard`): nothing a run measured, so no
entry lets a test truth be computed. Entries written before this rule hold
what the runs measured instead (the sha256 of each run's events.parquet, its
`timing:` events fingerprint, a table row's content hash); they are still
matched, and no new entry adds such a digest.

The verbs that read the train split (evaluate, compare, tune, crossval,
observe, predict ID, report --split train, plot timeline and parity, fixtures
list and show) refuse, or withhold the measurement of, a train run that is held
out: by its group's name, by its configuration (a copy, a near-copy, another
run of a held-out configuration: no tolerance on the measurement separates a
near-copy from a repeat, the repeats of one configuration agree within 0.07 %),
by the store's own test split (the same configuration under another group), or
by its own fixture record (an index.parquet edited to list a test run in
train). `--allow-held-out` goes on: a judgement then carries the override in
its entry (`held_out_override`), and a verb that records nothing else appends a
`held_out_override` entry, so the ledger knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.store.digests import TIMING_KEY
from hops_calib.store.guard import CONFIG_KEY, configuration_digest, held_out_ids

HELD_OUT_KEY = "held_out_groups"
OVERRIDE_KEY = "held_out_override"
OVERRIDE_KIND = "held_out_override"
RECORD_KIND = "held_out_record"
OWN_KIND = "store"  # the store's own test split, remembered beside the ledger's entries
OVERRIDE_FLAG = "--allow-held-out"


@dataclass(frozen=True)
class Leak:
    """A train group of a store that the ledger remembers as held out (by name, or by a run's events)."""

    group: str  # the store's train group
    ids: tuple[str, ...]  # its fixtures
    held_out_as: str  # the held-out group it is (its own name, or the group a copied run came from)
    # "name", "configuration" (a run of a held-out configuration), "record" (its own fixture record says test),
    # "content" (the same events file) or "timing" (the same events up to a shift of the clocks)
    by: str
    seq: int | None  # the ledger entry that held it out
    look: str  # what that entry was

    def named(self) -> str:
        """The group and its runs, and for a copy, which held-out group it copies."""
        runs = ", ".join(self.ids[:3]) + (", ..." if len(self.ids) > 3 else "")
        copy = (
            f": the same events as a run of held-out group {self.held_out_as!r}, a renamed copy"
            if self.by == "content"
            else f": the configuration of a run of held-out group {self.held_out_as!r} (a copy, a near-copy or "
            "another run of it)"
            if self.by == "configuration"
            else ": its own fixture record says test (the index lists it in train: delete index.parquet, it is "
            "rebuilt from the fixture folders)"
            if self.by == "record"
            else f": the same configuration and events as a run of held-out group {self.held_out_as!r} up to a shift "
            "of its timestamps, a copy"
            if self.by == "timing"
            else ""
        )
        return f"{self.group} ({runs}{copy})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "ids": list(self.ids),
            "held_out_as": self.held_out_as,
            "by": self.by,
            "seq": self.seq,
            "look": self.look,
        }


def describe(found: list[Leak], most: int = 8) -> str:
    """The groups, by the ledger entry that held them out: "by ledger entry 12 (an audited report ...): a (a_run1),
    b (b_run2); ..."."""
    by_entry: dict[tuple[Any, str], list[Leak]] = {}
    for leak in found:
        by_entry.setdefault((leak.seq, leak.look), []).append(leak)
    parts = []
    for (seq, look), leaks in by_entry.items():
        shown = ", ".join(leak.named() for leak in leaks[:most]) + (
            f", ... ({len(leaks)} groups)" if len(leaks) > most else ""
        )
        parts.append(
            f"by ledger entry {seq} ({look}): {shown}" if seq is not None else f"by the store ({look}): {shown}"
        )
    return "; ".join(parts)


class HeldOutInTrain(InputError):
    """A store that holds in train what the ledger remembers as held out."""


def _configurations(store, ids: Iterable[str]) -> dict[str, dict[str, list[str]]]:
    """group -> {"ids": its fixtures among `ids`, "digests": their configuration digests}."""
    groups: dict[str, dict[str, list[str]]] = {}
    for fixture in store.load_many(sorted(ids)):
        entry = groups.setdefault(fixture.group, {"ids": [], "digests": []})
        entry["ids"].append(fixture.id)
        entry["digests"].append(configuration_digest(fixture))
    return groups


def store_held_out(store) -> dict[str, list[str]]:
    """The store's test groups and their runs' configuration digests: what a ledger entry about this store
    remembers (nothing the runs measured)."""
    return {
        group: sorted(set(info["digests"]))
        for group, info in sorted(_configurations(store, held_out_ids(store)).items())
    }


def _look(entry: dict[str, Any]) -> str:
    kind = entry.get("kind", "?")
    if kind == OWN_KIND:
        return "its own test split"
    what = (
        "an audited report on the test split"
        if kind == "report"
        else "a record of a store's test split (ledger hold-out)"
        if kind == RECORD_KIND
        else f"{kind} of a store that held it in its test split"
    )
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
    """The store's train groups that are held out: by their own fixture record (an edited index), by the name the
    ledger remembers, by a run's configuration (the ledger's, or the store's own test split's), or by a run's
    events (entries written before configurations were recorded)."""
    held = held_out_ids(store)
    own = {"seq": None, "kind": OWN_KIND, HELD_OUT_KEY: store_held_out(store)}
    by_name, by_digest = remembered([own, *entries])
    by_name = {group: entry for group, entry in by_name.items() if entry is not own}
    train = list(store.ids("train"))
    found = []
    group_of = {row["id"]: row["group"] for row in store.rows()}
    recorded: dict[str, list[str]] = {}
    for fixture_id in train:
        if fixture_id in held:
            recorded.setdefault(group_of[fixture_id], []).append(fixture_id)
    for group, members in sorted(recorded.items()):
        found.append(Leak(group, tuple(members), group, "record", None, "its own fixture record"))
    rest = [i for i in train if i not in held]
    if not rest or not (by_name or by_digest):
        return found
    configs = _configurations(store, rest)
    measured = store.group_digests("train") if any(not d.startswith(CONFIG_KEY) for d in by_digest) else {}
    for group, info in sorted(configs.items()):
        ids = tuple(info["ids"])
        if group in by_name:
            entry = by_name[group]
            found.append(Leak(group, ids, group, "name", entry.get("seq"), _look(entry)))
            continue
        hit = next((d for d in info["digests"] if d in by_digest), None)
        if hit is not None:
            held_as, entry = by_digest[hit]
            found.append(Leak(group, ids, held_as, "configuration", entry.get("seq"), _look(entry)))
            continue
        old = (measured.get(group) or {}).get("digests", [])
        hit = next((d for d in sorted(old, key=_exact_first) if d in by_digest), None)
        if hit is not None:
            held_as, entry = by_digest[hit]
            found.append(
                Leak(
                    group,
                    ids,
                    held_as,
                    "timing" if hit.startswith(TIMING_KEY) else "content",
                    entry.get("seq"),
                    _look(entry),
                )
            )
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
    return (
        f"went on over {len(found)} held-out group(s) in the train split ({OVERRIDE_FLAG}), recorded{where}; "
        f"held out {describe(found)}"
    )


def _open_stores(fixtures_dirs: Path | str | Sequence[Path | str]) -> list:
    """The stores of a verb's --fixtures: one, or several judged as one union suite."""
    from hops_calib.loop.suite import open_store

    dirs = [fixtures_dirs] if isinstance(fixtures_dirs, (str, Path)) else list(fixtures_dirs)
    return [open_store(d) for d in dirs]


def guard_store(
    fixtures_dirs: Path | str | Sequence[Path | str], ledger_path: Path | str | None, verb: str, allow: bool
) -> list[str]:
    """`guard` for a verb that records nothing else, on each store given: refuse, or (with `allow`) append the
    override to the ledger; returns the warnings to print."""
    warnings = []
    for store in _open_stores(fixtures_dirs):
        found = guard(store, ledger_path, verb, allow)
        if found:
            warnings.append(override_warning(found, record_override(ledger_path, verb, store, found)))
    return warnings


def judgement_fields(
    fixtures_dirs: Path | str | Sequence[Path | str], ledger_path: Path | str | None, verb: str, allow: bool
) -> tuple[dict[str, Any], list[Leak]]:
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
            store.root,
            f"holds in its train split {len(found)} group(s) held out, {describe(found)}",
            field="split",
            hint=f"{verb} would fit or judge on the test split. {move_to_test(store, found)}; "
            f"{OVERRIDE_FLAG} goes on regardless, and the ledger records the override",
        )
    return found


def move_to_test(store, found: list[Leak]) -> str:
    """What to do about held-out groups in a store's train split: the runs to move, and the commands that move
    them (a stored split never moves, so their fixtures are deleted and ingested again with --split test)."""
    import shlex

    from hops_calib.store.fixture import source_path

    ids = [fixture_id for leak in found if leak.by != "record" for fixture_id in leak.ids]
    if not ids:
        return "Delete the store's index.parquet (it is rebuilt from the fixture folders)"
    sources = []
    for fixture_id in ids:
        try:
            recorded = store.meta(fixture_id).get("source")
        except Exception:  # noqa: BLE001 - a damaged record: the user names the job directory
            recorded = None
        sources.append(str(source_path(recorded, store.root)) if recorded else f"JOB_DIR_OF_{fixture_id}")
    root = Path(store.root)
    return (
        f"Move the run(s) {', '.join(ids)} to the test split: rm -r "
        + " ".join(shlex.quote(str(root / fixture_id)) for fixture_id in ids)
        + " && hops-calib ingest "
        + " ".join(shlex.quote(source) for source in sources)
        + f" --fixtures {shlex.quote(str(root))} --split test (a stored split never moves: the fixtures are "
        "deleted, then ingested again); for a source of runs, state the groups' split in its "
        'hops-calib-source.toml ([groups] GROUP = "test") so that a store ingested afresh from it holds '
        "them out"
    )


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
    return ledger.append(
        path,
        {
            "kind": OVERRIDE_KIND,
            "time": ledger.now_utc(),
            "verb": verb,
            "fixtures": str(store.root),
            **override_record(found),
            "code_revision": ledger.code_revision(),
        },
    )


def record_store(fixtures_dir: Path | str, ledger_path: Path | str | None) -> dict[str, Any] | None:
    """Append a `held_out_record` entry: the store's test groups (by name and configuration digest), remembered as
    held out from then on, with no look at them. For a store whose test split was assigned before the ledger
    recorded groups (entries older than this guard carry none, older entries carry measured digests, no
    configurations) or never judged on; None when the store has no test split, or when the ledger already remembers
    every group of it by name and every configuration of its runs (nothing is appended twice)."""
    from hops_calib.loop import ledger
    from hops_calib.loop.commits import check_appendable

    store = _open_stores(fixtures_dir)[0]
    held = store_held_out(store)
    by_name, by_digest = remembered(_entries(ledger_path))
    if not held or (set(held) <= set(by_name) and {d for ds in held.values() for d in ds} <= set(by_digest)):
        return None
    path = ledger.resolve(ledger_path)
    check_appendable(path)
    return ledger.append(
        path,
        {
            "kind": RECORD_KIND,
            "time": ledger.now_utc(),
            "fixtures": str(Path(store.root).resolve()),
            HELD_OUT_KEY: held,
            "code_revision": ledger.code_revision(),
        },
    )


def withheld(store, ledger_path: Path | str | None) -> dict[str, str]:
    """The store's train runs whose measurement a listing withholds (id -> why): each run of a held-out train group
    (`leaks`), by what held it out."""
    return {
        fixture_id: f"{describe([leak])}" for leak in leaks(store, _entries(ledger_path)) for fixture_id in leak.ids
    }


def held_out_reason(store, fixture_id: str, ledger_path: Path | str | None) -> str | None:
    """Why the train run `fixture_id` is held out (`withheld`), or None."""
    return withheld(store, ledger_path).get(fixture_id)


def refuse_held_out_run(fixtures_dir: Path | str, fixture_id: str, ledger_path: Path | str | None, verb: str) -> None:
    """HeldOutInTrain (exit 2) when the train run `fixture_id` is held out (`withheld`): a verb that shows one run's
    measurement (plot timeline) shows none of a held-out one."""
    store = _open_stores(fixtures_dir)[0]
    why = held_out_reason(store, fixture_id, ledger_path)
    if why:
        raise HeldOutInTrain(
            store.root,
            f"run {fixture_id} is held out, {why}",
            field="ID",
            hint=f"{verb} shows a run's measurement, which a held-out run keeps to the audited "
            "`hops-calib report --split test`; pick a train run that is not held out",
        )
