"""Which runs a judgement must be made on: the fixture set the model was calibrated on, read from the ledger.

Every accepted change committed into a model (`evaluate --commit`, `compare --commit` keeping the model after) is
a ledger entry that names the fixture set it was judged on (`fixture_set_sha256`; since issue #22 also the run ids,
`fixture_runs`, the runs' device types, `fixture_devices`, and the store's path, `fixtures`). A candidate is
judged where the part of the model it changes was calibrated:

- values of one device type (`NAME@TYPE` parameters, unset ones, a device constant of TYPE): the fixture set of
  the latest committed change judged on runs of TYPE;
- anything else (a term's shared values, adding or removing a term): the fixture set of the latest committed
  change to that term, or, for a term never changed, of the latest committed change that was not of some device
  types' values only (those calibrate their device types, not the shared values);
- a whole model (`compare`): the scope of what differs between the two models (`scope_of_models`: a move whose
  steps changed one device type's values is judged where that device type was calibrated), else the fixture set
  of the latest committed change that was not of device values only. A committed compare counts for the device
  types its scope named (`scope_devices`; for an entry older than that field, the steps it judged whole, found
  in the ledger as the committed evaluations leading from its model before to its model after).

A judgement may cover several stores (`--fixtures` repeated; its entry lists each store's fixture set in
`fixture_sets`): a change committed on several stores calibrated its scope on all of them, and a later judgement of
that scope must cover every one (more stores are fine); a device-only change needs only the stores of its device
types among them.

A store holds that fixture set when its train split has the same `fixture_set_sha256`, or the same run ids (the
same runs re-ingested: said as a warning), or, for an entry older than these fields, the same device types and
number of runs; or those and more (runs added to the store since: said as a warning), as more stores are fine. Entries older than `fixture_devices` count for the device types their change named. A ledger
with no committed change calibrates nothing: any store may start it. `OffRecord` is the refusal (exit 4);
`evaluate/compare/tune --off-record` judge anyway and mark the entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError

# Which stores a judgement must cover: the one rule, stated the same in AGENTS.md and in every judgement's
# `calibration.rule` (tests/loop/test_fields.py checks that the two agree).
COVERAGE_RULE = (
    "A judgement must cover every store the part it changes was calibrated on, and may cover more. A change of one "
    "device type's values only (NAME@TYPE parameters, that type's constants) was calibrated on the stores of the "
    "latest committed change judged on that type's runs; any other change (a term's shared values, adding or "
    "removing a term, a whole model) on the stores of the latest committed change to that term, or, for a term "
    "never changed, of the latest committed change that was not of device values only. A judgement missing one of "
    "them is refused (exit 4, the hint lists every --fixtures to pass) unless --off-record marks it."
)


class OffRecord(InputError):
    """A judgement on runs the model was not calibrated on, or of a change that moves no run."""

    kind = "off_record"
    exit_code = 4  # hops_calib.cli.output.EXIT_OFF_RECORD


@dataclass(frozen=True)
class Scope:
    """What part of the model a change touches: one term's shared values, or some device types' values."""

    term: str | None = None  # the term whose shared values (or presence) change; None for device-only changes
    devices: tuple[str, ...] = ()  # device types whose own values change (NAME@TYPE, a device constant)
    whole_model: bool = False  # compare: any part

    @property
    def was(self) -> str:
        """The verb that agrees with `describe()` ("the model ... was", "the shared values ... were")."""
        return "was" if self.whole_model else "were"

    def describe(self) -> str:
        if self.whole_model:
            return "the model as a whole"
        if self.term is not None:
            return f"the shared values of term {self.term}"
        return "the values of device type(s) " + ", ".join(self.devices)


def scope_of_change(change) -> Scope:
    """The `Scope` of a candidate's `Change`."""
    if change.action == "set_device":
        return Scope(devices=(change.device,))
    names = [*change.params, *change.unset]
    if change.action == "set" and names and all("@" in name for name in names):
        return Scope(devices=tuple(sorted({name.partition("@")[2] for name in names})))
    return Scope(term=change.term)


def scope_of_models(before, after) -> Scope:
    """The `Scope` of the difference between two models (`Model`s): the device types whose own values differ
    (NAME@TYPE parameters, device constants) when nothing shared differs, else the whole model."""
    a, b = before.canonical(), after.canonical()
    devices: set[str] = set()
    for device in set(a["devices"]) | set(b["devices"]):
        if a["devices"].get(device) != b["devices"].get(device):
            devices.add(device)
    for term in set(a["terms"]) | set(b["terms"]):
        if term not in a["terms"] or term not in b["terms"]:
            return Scope(whole_model=True)
        x, y = a["terms"][term], b["terms"][term]
        for name in set(x) | set(y):
            if x.get(name) == y.get(name):
                continue
            if "@" not in name:
                return Scope(whole_model=True)
            devices.add(name.partition("@")[2])
    return Scope(devices=tuple(sorted(devices))) if devices else Scope(whole_model=True)


def scope_of_params(term: str, names: Sequence[str]) -> Scope:
    """The `Scope` of a change to `names` of `term` (tune's --only; all parameters when empty)."""
    if names and all("@" in name for name in names):
        return Scope(devices=tuple(sorted({name.partition("@")[2] for name in names})))
    return Scope(term=term)


@dataclass(frozen=True)
class FixtureSet:
    """A fixture set as the ledger knows it, from the committed entries judged on it."""

    sha256: str
    n_runs: int | None
    runs: tuple[str, ...] | None  # recorded since #22
    devices: tuple[str, ...]  # recorded since #22, else the device types its entries' changes named
    path: str | None
    entries: tuple[int, ...]

    @property
    def gone(self) -> bool:
        """Whether the recorded store folder is not on this machine (recorded on another, or removed since)."""
        return bool(self.path) and not Path(str(self.path)).is_dir()

    def store_option(self) -> str:
        """What a judgement passes for this fixture set: `--fixtures PATH` where the recorded store is there, else the
        checkout's own store for the CPU captures, else `--fixtures DIR` (built by `rebuild_note`)."""
        if self.path and not self.gone:
            return f"--fixtures {self.path}"
        own = self._checkout_store()
        return f"--fixtures {own}" if own is not None else "--fixtures DIR"

    def rebuild_note(self) -> str:
        """How to build the store again, for a store gone from this machine or lying outside a checkout (in /tmp,
        say: gone in the next session); "" for a store in a checkout, or one the checkout ships."""
        from hops_calib.loop.checkout import checkout_of

        if not self.runs or (self.path and not self.gone and checkout_of(Path(self.path) / "x") is not None):
            return ""
        if self.gone and self._checkout_store() is not None:
            return f"{self.path} is gone: the checkout's store of its CPU captures holds its runs"
        where = f"{self.path} is gone" if self.gone else f"where {self.path} is gone"
        return f"{where}, build it again: `{rebuild_command(self.runs)}`"

    def _checkout_store(self) -> Path | None:
        from hops_calib.loop.checkout import default_checkout

        checkout = default_checkout()
        if (
            self.runs
            and all(run.startswith("cpu_") for run in self.runs)
            and checkout is not None
            and (checkout / "fixtures").is_dir()
        ):
            return checkout / "fixtures"
        return None

    def describe(self) -> str:
        where = (
            f", store {self.path}"
            + (f" (no longer there: rebuild it with `{rebuild_command(self.runs or ())}`)" if self.gone else "")
            if self.path
            else ""
        )
        devices = f" on {', '.join(self.devices)}" if self.devices else ""
        runs = f"{self.n_runs} train runs" if self.n_runs is not None else "train runs"
        seqs = self.entries
        entries = (
            f"ledger entry {seqs[0]}"
            if len(seqs) == 1
            else f"ledger entries {', '.join(map(str, seqs[:3]))}{', ...' if len(seqs) > 4 else ''}"
            + (f", {seqs[-1]}" if len(seqs) > 3 else "")
        )
        return f"fixture set {self.sha256[:12]} ({runs}{devices}{where}; {entries})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixture_set_sha256": self.sha256,
            "n_runs": self.n_runs,
            "devices": list(self.devices),
            "fixtures": self.path if self.path else NO_PATH,
            "fixtures_exists": bool(self.path and Path(self.path).is_dir()),
            "ledger_entries": list(self.entries),
            **({"rebuild": rebuild_command(self.runs or ())} if self.gone else {}),
        }


# Where the runs of the project's stores come from, by their ids' prefix: the command that rebuilds a store the
# ledger names but this machine lacks (a path recorded on another machine or in another session).
RUN_SOURCES = (
    ("cpu_", "traces"),  # the repository's CPU captures (its store: fixtures/)
    ("vtrain_", "../shared/public-runs/vtrain/ground_truth_single.csv"),
    ("dgxc", "../shared/public-runs/dgxc-h100"),
    ("exp", "../shared/megatron-traces/hops"),
)


def rebuild_command(runs: Iterable[str]) -> str:
    """`hops-calib ingest SRC... --split auto --fixtures DIR` for the sources of `runs` (`RUN_SOURCES`); SRC where
    a run's id names none."""
    sources = {next((src for prefix, src in RUN_SOURCES if run.startswith(prefix)), "SRC") for run in runs} or {"SRC"}
    return f"hops-calib ingest {' '.join(sorted(sources))} --split auto --fixtures DIR"


# What `calibrated_on.fixtures` says when no entry judged on the fixture set recorded its store's path.
NO_PATH = (
    "not recorded: no ledger entry judged on this fixture set names its store (entries before issue #22 did "
    "not); a store whose train split holds the same runs is that fixture set"
)


def _committed_changes(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries that changed a model file with a judged change: accepted and committed evaluations, and
    committed compares that kept the model after."""
    return [
        e
        for e in entries
        if e.get("kind") in ("evaluate", "compare")
        and e.get("committed")
        and e.get("decision") == "accepted"
        and e.get("fixture_set_sha256")
    ]


def _device_only(entry: dict[str, Any]) -> bool:
    """Whether a committed change was of some device types' values only (they calibrate those device types)."""
    term, devices = _named(entry)
    if entry.get("kind") == "compare":
        return bool(devices)
    return term is None and bool(devices)


def _compare_scopes(changes: Sequence[dict[str, Any]]) -> None:
    """Give each committed compare entry older than `scope_devices` the device types of the steps it judged whole:
    the committed evaluations that lead, model by model, from its model before to its model after, when every one
    of them changed device values only (then the move did). Sets `_scope_devices` on the entry (in memory)."""
    for k, entry in enumerate(changes):
        if entry.get("kind") != "compare" or "scope_devices" in entry:
            continue
        after, devices = entry.get("model_sha256_after"), set()
        for step in reversed(changes[:k]):
            if step.get("kind") != "evaluate" or step.get("model_sha256_after") != after:
                break
            term, named = _named(step)
            if term is not None or not named:
                break
            devices |= named
            after = step.get("model_sha256_before")
            if after == entry.get("model_sha256_before"):
                entry["_scope_devices"] = sorted(devices)
                break


def _named(entry: dict[str, Any]) -> tuple[str | None, set[str]]:
    """The term whose shared values (or presence) an evaluate entry's change touched (None for a change of some
    device types' values only), and the device types it named. A compare names no term, and the device types of
    its scope when that was of device values only."""
    from hops_calib.loop.candidate import parse_candidate

    if entry.get("kind") == "compare":
        return None, set(entry.get("scope_devices") or entry.get("_scope_devices") or ())
    text = (entry.get("candidate") or {}).get("text")
    if not text:
        return None, set()
    try:
        change = parse_candidate(text, origin=f"ledger entry {entry.get('seq')}").change
    except InputError:  # a term since renamed or removed: the entry names nothing this version can read
        return None, set()
    scope = scope_of_change(change)
    named = {name.partition("@")[2] for name in [*change.params, *change.unset] if "@" in name}
    return scope.term, named | set(scope.devices)


def _stores_of(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each store a judgement covered: (its fixture set's sha256, the fields describing it: `fixtures`,
    `fixture_runs`, `fixture_devices`, `n_fixtures`): the entry's `fixture_sets`, else the entry itself (one store)."""
    if entry.get("fixture_sets"):
        return [(part["fixture_set_sha256"], part) for part in entry["fixture_sets"]]
    return [(entry["fixture_set_sha256"], entry)]


@dataclass(frozen=True)
class Record:
    """The model's calibration record: the committed changes, in ledger order, with the fixture sets they used."""

    changes: tuple[dict[str, Any], ...]
    sets: dict[str, FixtureSet]

    @property
    def empty(self) -> bool:
        return not self.changes

    def calibrated_on(self, scope: Scope) -> tuple[FixtureSet, str] | None:
        """The (first) fixture set a change of `scope` must be judged on and why; None when the record is empty."""
        found = self.calibrated_sets(scope)
        return None if found is None else (found[0][0], found[1])

    def calibrated_sets(self, scope: Scope) -> tuple[tuple[FixtureSet, ...], str] | None:
        """Every fixture set a change of `scope` must be judged on (one per store the change that calibrated it
        covered) and why; None when the record is empty."""
        if not self.changes:
            return None
        if scope.whole_model or scope.term is not None:  # device-only changes calibrate their devices, not these
            shared = [e for e in self.changes if not _device_only(e)]
            changes = shared or list(self.changes)
        else:
            changes = list(self.changes)
        for entry in reversed(changes):
            term, _ = _named(entry)
            sets = tuple(self.sets[sha] for sha, _ in _stores_of(entry))
            hit = tuple(fs for fs in sets if set(scope.devices) & set(fs.devices)) if scope.devices else ()
            if hit:
                common = sorted(set(scope.devices) & {d for fs in hit for d in fs.devices})
                return hit, (
                    f"the latest committed change judged on {', '.join(common)} runs is ledger entry {entry['seq']}"
                )
            if scope.term is not None and term == scope.term:
                return sets, (
                    f"the latest committed change to term {scope.term}'s shared values is ledger entry {entry['seq']}"
                )
        latest = changes[-1]
        what = (
            "no committed change was judged on runs of " + ", ".join(scope.devices)
            if scope.devices
            else f"no committed change touched term {scope.term}'s shared values"
            if scope.term
            else "the model as a whole"
        )
        return (
            tuple(self.sets[sha] for sha, _ in _stores_of(latest)),
            f"{what}: the latest committed change is ledger entry {latest['seq']}",
        )


def read_record(ledger_path: Path | str | None) -> Record:
    """The calibration record of the ledger at `ledger_path` (empty when there is none)."""
    from hops_calib.loop.ledger import read_entries

    entries = list(read_entries(ledger_path)) if ledger_path is not None else []
    changes = _committed_changes(entries)
    _compare_scopes(changes)
    # A store's path is provenance (the fixture set's sha256 is its identity): the latest any judgement recorded.
    paths = {
        sha: part["fixtures"]
        for e in entries
        if e.get("kind") in ("evaluate", "compare") and e.get("fixture_set_sha256")
        for sha, part in _stores_of(e)
        if isinstance(part.get("fixtures"), str)
    }
    grouped: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for entry in changes:
        for sha, part in _stores_of(entry):
            grouped.setdefault(sha, []).append((entry, part))
    sets = {}
    for sha, group in grouped.items():
        devices: set[str] = set()
        runs, path = None, None
        for entry, part in group:
            devices |= set(part.get("fixture_devices") or ()) | (_named(entry)[1] if part is entry else set())
            runs = tuple(part["fixture_runs"]) if part.get("fixture_runs") else runs
            path = part.get("fixtures") if isinstance(part.get("fixtures"), str) else path
        sets[sha] = FixtureSet(
            sha256=sha,
            n_runs=group[-1][1].get("n_fixtures"),
            runs=runs,
            devices=tuple(sorted(devices)),
            path=paths.get(sha, path),
            entries=tuple(e["seq"] for e, _ in group),
        )
    return Record(changes=tuple(changes), sets=sets)


@dataclass(frozen=True)
class Check:
    """The outcome of `check_store`: where the scope was calibrated, whether this store holds it, and the notes."""

    scope: Scope
    calibrated: FixtureSet | None  # None: the ledger records no committed change
    why: str
    holds: bool
    how: str  # "same fixture set", "same runs re-ingested" (or "... and N added since"), "same device types and run
    # count" (or "... and N runs more"), "", "no record"
    off_record: bool  # judged anyway (--off-record) although the store does not hold it
    warnings: tuple[str, ...] = ()
    calibrated_all: tuple[FixtureSet, ...] = ()  # every fixture set the scope was calibrated on (`calibrated` first)

    def describe_calibrated(self) -> str:
        sets = self.calibrated_all or ((self.calibrated,) if self.calibrated else ())
        return " and ".join(fs.describe() for fs in sets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope.describe(),
            "calibrated_on": self.calibrated.to_dict() if self.calibrated else None,
            "calibrated_on_all": [
                fs.to_dict() for fs in self.calibrated_all or ((self.calibrated,) if self.calibrated else ())
            ],
            "why": self.why,
            "store_holds_it": self.holds,
            "match": self.how or None,
            "off_record": self.off_record,
            "rule": COVERAGE_RULE,
        }


def store_devices(suite) -> tuple[str, ...]:
    return tuple(sorted({device for spec in suite.specs for device in spec.devices}))


def _match(suite, calibrated: FixtureSet) -> str:
    """How one store's `suite` holds `calibrated` ("" when it does not). A store whose train split grew (runs added
    since, as captures are) holds it too, as a judgement on more stores does: every run the part was fitted to is
    judged again, each under the per-run rules."""
    if suite.sha256 == calibrated.sha256:
        return "same fixture set"
    if calibrated.runs is not None and set(calibrated.runs) <= set(suite.ids):
        return (
            "same runs re-ingested"
            if len(calibrated.runs) == len(set(suite.ids))
            else f"same runs and {len(set(suite.ids)) - len(calibrated.runs)} added since"
        )
    if (
        calibrated.runs is None
        and calibrated.devices
        and tuple(calibrated.devices) == store_devices(suite)
        and calibrated.n_runs is not None
        and calibrated.n_runs <= len(suite.ids)
    ):
        return (
            "same device types and run count"
            if calibrated.n_runs == len(suite.ids)
            else f"same device types and {len(suite.ids) - calibrated.n_runs} runs more"
        )
    return ""


def check_store(record: Record, scope: Scope, suite, verb: str, *, off_record: bool = False) -> Check:
    """Refuse (OffRecord) a judgement of `scope` on `suite` (one store, or the union of several: `Suite.stores`)
    unless its stores hold every fixture set the scope was calibrated on, or `off_record` (then the Check says so)."""
    found = record.calibrated_sets(scope)
    if found is None:
        return Check(
            scope, None, "the ledger records no committed change: nothing is calibrated yet", True, "no record", False
        )
    sets, why = found
    hows, warnings, missing = [], [], []
    for calibrated in sets:
        matched = [(part, how) for part in suite.stores for how in (_match(part, calibrated),) if how]
        if not matched:
            missing.append(calibrated)
            continue
        part, how = matched[0]
        hows.append(how)
        if how != "same fixture set":
            grown = " added since" in how or " runs more" in how
            warnings.append(
                f"{part.fixtures_dir}: fixture set {part.sha256[:12]} is not the {calibrated.describe()} "
                f"{scope.describe()} {scope.was} calibrated on, but holds {how.replace('same', 'the same')}"
                + (
                    ": judged on them and the runs added (the first judgement committed here records this fixture set)"
                    if grown
                    else " (re-ingested or recaptured): judged as the same runs"
                )
            )
    how = "; ".join(dict.fromkeys(hows))
    if not missing:
        return Check(scope, sets[0], why, True, how, False, tuple(warnings), sets)
    if len(sets) == 1 and len(suite.stores) == 1:
        calibrated = sets[0]
        message = (
            f"{scope.describe()}: calibrated on {calibrated.describe()} ({why}); the store "
            f"{suite.fixtures_dir} holds fixture set {suite.sha256[:12]} ({len(suite.ids)} train runs on "
            f"{', '.join(store_devices(suite))}): a judgement here would not be on the runs the model was "
            "fitted to"
        )
    else:
        given = ", ".join(f"{part.fixtures_dir} ({part.sha256[:12]})" for part in suite.stores)
        message = (
            f"{scope.describe()}: calibrated on {' and '.join(fs.describe() for fs in sets)} ({why}); the "
            f"judgement's store(s) {given} omit {' and '.join(fs.describe() for fs in missing)}: a judgement "
            "must cover every store the model was fitted to"
        )
    if not off_record:
        paths = [fs.path for fs in sets]
        raise OffRecord(
            verb,
            message,
            field="fixtures",
            hint=(
                ("judge it on that store: " if len(sets) == 1 else "judge it on all of them: ")
                + " ".join(fs.store_option() for fs in sets)
                + "".join(f" ({note})" for fs in sets if (note := fs.rebuild_note()))
                if all(paths)
                else f"judge it on a store of those runs (--fixtures DIR: `{rebuild_command(sets[0].runs or ())}`"
                "); the ledger records no path for "
                "it (entries before issue #22 did not: the next judgement there records one)"
            )
            + "; or, to judge it here anyway and mark the ledger entry off_record, --off-record",
        )
    return Check(scope, sets[0], why, False, "", True, (f"judged off the record (--off-record): {message}",), sets)


def refuse_unmoved(runs_moved: Sequence[str], n_runs: int, what: str, verb: str, check: Check | None) -> None:
    """Refuse a judgement whose change moves no run's prediction on this store: it would hold the suite by testing
    nothing, and commit a value no run tested."""
    if runs_moved:
        return
    where = (
        f"; {check.scope.describe()} {check.scope.was} calibrated on {check.describe_calibrated()}"
        if check is not None and check.calibrated is not None
        else ""
    )
    raise OffRecord(
        verb,
        f"{what} moves none of the {n_runs} runs' predictions on this store: a judgement here "
        f"would test nothing{where}",
        field="fixtures",
        hint="judge it on the runs it prices (--fixtures DIR); --off-record judges it here anyway "
        "(never committed: no run tested the value)",
    )
