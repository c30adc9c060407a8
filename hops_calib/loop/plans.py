"""Plans: the rules of a judgement (its tolerances, and the candidates it is for, pinned by their text's sha256),
recorded in the ledger before it; `evaluate --plan N` and `compare --plan N` judge under exactly those rules.

The protocol (issue #22's walkthrough): a judgement's rules are the gate's defaults (`Tolerances()`, recorded as
`rules: {"from": "defaults"}`) or a plan's (`rules: {"from": "plan N"}`); other tolerances come from a plan only.
A judgement's identity is the change it judges: the model before and after it (so the same change written under
another id or in another file is the same change) and the fixture set it is judged on. A change the ledger already
judged on that model and fixture set is judged again only under a plan that names the earlier judgement
(`ledger plan --rejudge SEQ`), and the new entry links to it (`rejudges`); `--again` repeats a judgement under the
very rules it had."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop.candidate import Candidate, read_candidate, refuse_placeholders
from hops_calib.loop.commits import check_appendable
from hops_calib.loop.gate import CAP_HINT, TOLERANCE_FLAGS, Tolerances, beyond_caps, looser_rules
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.ledger import resolve as resolve_ledger


def judgements(ledger_path: Path | str) -> list[dict[str, Any]]:
    """The ledger's candidate judgements (evaluate entries), in order; none when the ledger does not exist yet."""
    from hops_calib.loop import ledger

    return [e for e in ledger.read_entries(ledger_path) if e.get("kind") == "evaluate" and e.get("candidate")]


def _text_sha256(candidate: Candidate) -> str:
    return _text_sha256_of(candidate.text)


def _text_sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def record_plan(
    ledger_path: Path | str,
    note: str,
    tolerances: Tolerances,
    candidates: Sequence[Path | str] = (),
    rejudges: int | None = None,
    fixtures: Sequence[Path | str] = (),
) -> dict[str, Any]:
    """Append a plan entry: what is about to be tried and the tolerances it will be judged under, before any of
    its evaluations. `evaluate --plan N` and `compare --plan N` then judge under exactly those tolerances and cite it.
    `candidates`: the candidate files the plan is for, pinned by their text's sha256: `evaluate --plan N` then
    refuses any other candidate, an edited one included. `rejudges`: the earlier judgement (a ledger seq) of the
    change this plan judges again under its rules; a pinned candidate whose text was judged before needs it.
    `fixtures`: the store(s) the plan's judgements will be made on (their train split's fixture set is recorded,
    and `evaluate/compare --plan N` refuse others); a candidate text judged before only on other runs is then not
    judged again (a judgement covering more stores is a new judgement).
    """
    from hops_calib.loop import ledger

    ledger_path = resolve_ledger(ledger_path)
    refuse_beyond_caps(tolerances, "ledger plan")
    check_appendable(ledger_path)
    if not note.strip():
        raise InputError(
            "ledger plan",
            "a plan needs a note",
            field="note",
            hint="say what will be tried and why these tolerances, e.g. --note 'move 060-062: ...'",
        )
    pinned = [read_candidate(path) for path in candidates]  # a candidate that cannot be read is refused now
    for candidate in pinned:  # a plan pins the text: one still holding the placeholder could never be judged
        refuse_placeholders(candidate)
    entries = list(ledger.read_entries(ledger_path))
    named: dict[str, Any] | None = None  # the entry judged again (--rejudge)
    if rejudges is not None:
        named = next((e for e in entries if e.get("seq") == rejudges), None)
        if named is None or named.get("kind") not in JUDGEMENT_KINDS:
            raise InputError(
                "ledger plan",
                f"--rejudge {rejudges}: ledger entry {rejudges} "
                + ("does not exist" if named is None else f"is a {named.get('kind')} entry, not a judgement"),
                field="rejudge",
                hint="name the evaluate (or compare) entry whose change this plan judges again "
                "(hops-calib ledger show)",
            )
        if not pinned and named.get("kind") == "evaluate":
            raise InputError(
                "ledger plan",
                f"--rejudge {rejudges} needs the candidate judged again (--candidate FILE)",
                field="candidate",
                hint="pin the candidate that makes the same change",
            )
    stores = None
    if fixtures:
        from hops_calib.loop.suite import TRAIN, load_suites

        stores = load_suites(list(fixtures), TRAIN)
    if named is not None and stores is not None and named.get("fixture_set_sha256") not in (None, stores.sha256):
        raise InputError(
            "ledger plan",
            f"--rejudge {rejudges}: ledger entry {rejudges} judged fixture set "
            f"{str(named.get('fixture_set_sha256'))[:12]}, and this plan's --fixtures hold "
            f"{stores.sha256[:12]}: a judgement on other runs is not the same judgement again",
            field="rejudge",
            hint="leave out --rejudge (the judgement on these stores is a new one), "
            f"or plan on the stores entry {rejudges} judged",
        )
    judged = {
        _text_sha256_of(e["candidate"].get("text", "")): e
        for e in entries
        if e.get("kind") == "evaluate"
        and e.get("candidate")
        and (stores is None or e.get("fixture_set_sha256") == stores.sha256)
    }
    for candidate in pinned:
        earlier = judged.get(_text_sha256(candidate))
        if earlier is not None and rejudges is None:
            raise InputError(
                candidate.origin,
                f"this candidate text was already judged: ledger entry "
                f"{earlier.get('seq')} ({earlier.get('decision')}, id {candidate.id!r}); a plan states "
                "the rules before a judgement, not after it",
                field="candidate",
                hint=f"to judge the same change again under other rules, name the earlier judgement "
                f"(--rejudge {earlier.get('seq')}) and say in --note why the rules differ; the new "
                "entry links to it. A copy under a new id is the same change and is refused the "
                "same way",
            )
    return ledger.append(
        ledger_path,
        {
            "kind": "plan",
            "time": now_utc(),
            "note": note,
            "tolerances": tolerances.to_dict(),
            **({"rejudges": rejudges} if rejudges is not None else {}),
            **(
                {
                    "fixtures": [str(Path(p.fixtures_dir).resolve()) for p in stores.stores],
                    "fixture_set_sha256": stores.sha256,
                }
                if stores is not None
                else {}
            ),
            **(
                {"candidates": [{"id": c.id, "path": c.origin, "text_sha256": _text_sha256(c)} for c in pinned]}
                if pinned
                else {}
            ),
            "code_revision": code_revision(),
        },
    )


JUDGEMENT_KINDS = ("evaluate", "compare")
DEFAULTS = "defaults"


def rules(plan: int | None, tolerances: Tolerances) -> dict[str, Any]:
    """Where a judgement's rules came from, as its ledger entry and JSON say: a plan's, or the gate's defaults, and
    the rules looser than the defaults (`looser_rules`: [] when none)."""
    return {
        "from": f"plan {plan}" if plan is not None else DEFAULTS,
        "plan_seq": plan,
        "tolerances": tolerances.to_dict(),
        "default_tolerances": tolerances == Tolerances(),
        "looser_rules": looser_rules(tolerances),
    }


def refuse_beyond_caps(tolerances: Tolerances, verb: str, plan: int | None = None) -> None:
    """Refuse tolerances past their cap (`gate.TOLERANCE_CAPS`), naming each, its cap and the cap's reason; `plan`:
    the ledger plan that holds them (recorded before the caps existed: it stays in the ledger, judged under never)."""
    over = beyond_caps(tolerances)
    if not over:
        return
    name, _value, cap, _reason = over[0]
    where = f"plan {plan} holds " if plan is not None else ""
    raise InputError(
        verb,
        where + "; ".join(f"{n} = {v:g} beyond its cap {c:g} ({r})" for n, v, c, r in over),
        field=TOLERANCE_FLAGS[name],
        hint=(
            f"state a plan within the caps ({TOLERANCE_FLAGS[name]} <= {cap:g}); "
            if plan is None
            else f"plan {plan} was recorded before the caps: state a new plan within them "
            f"({TOLERANCE_FLAGS[name]} <= {cap:g}); "
        )
        + CAP_HINT,
    )


def refuse_unplanned_rules(tolerances: Tolerances, plan: int | None, verb: str) -> None:
    """Refuse a judgement under tolerances other than the defaults without a plan: rules are stated before the
    judgement (`ledger plan`), never chosen with it."""
    if plan is None and tolerances != Tolerances():
        changed = [
            f"{name}={value}" for name, value in tolerances.to_dict().items() if value != getattr(Tolerances(), name)
        ]
        raise InputError(
            verb,
            f"tolerances other than the defaults ({', '.join(changed)}) come only from a plan "
            "recorded before the judgement",
            field="tolerances",
            hint="state them first: hops-calib ledger plan --note WHY --candidate FILE --tolerance-... "
            f"(--rejudge SEQ if the change was judged before), then {verb} ... --plan N",
        )


def earlier_judgements(
    entries: Sequence[dict[str, Any]],
    kind: str | None,
    model_before: str | None,
    model_after: str | None,
    fixture_set_sha256: str | None,
) -> list[dict[str, Any]]:
    """The ledger's judgements of the same change: `kind` entries from the same model before to the same model
    after, on the same fixture set (whatever the candidate's id, file or wording; None: an entry's missing field,
    matched as written)."""
    return [
        e
        for e in entries
        if e.get("kind") == kind
        and e.get("model_sha256_before") == model_before
        and e.get("model_sha256_after") == model_after
        and e.get("fixture_set_sha256") == fixture_set_sha256
    ]


def check_rejudgement(
    entries: Sequence[dict[str, Any]],
    kind: str,
    model_before: str,
    model_after: str,
    fixture_set_sha256: str,
    tolerances: Tolerances,
    plan: int | None,
    again: bool,
    what: str,
    origin: str,
    ledger_path: Path | str,
) -> tuple[dict[str, Any], list[str]]:
    """Refuse a judgement of a change the ledger already judged on this model and fixture set, unless its plan names
    the latest earlier judgement (`ledger plan --rejudge SEQ`), or `again` repeats it under the very same rules.
    Returns the entry's fields linking it to the earlier judgements, and the warnings."""
    same = earlier_judgements(entries, kind, model_before, model_after, fixture_set_sha256)
    named = read_plan(ledger_path, plan).get("rejudges") if plan is not None else None
    if named is not None and named not in {e.get("seq") for e in same}:
        raise InputError(
            origin,
            f"plan {plan} names ledger entry {named} as the judgement it revisits, but {what} "
            "is not the change that entry judged on this model and fixture set",
            field="plan",
            hint="judge the change the plan names, or state a plan for this one",
        )
    if not same:
        return {}, []
    last = same[-1]
    seqs = [e.get("seq") for e in same]
    links = {"earlier_judgements": seqs}
    state = f"{last.get('decision')}{', committed' if last.get('committed') else ', not committed'}"
    earlier_rules = f"plan {last['plan_seq']}" if last.get("plan_seq") is not None else DEFAULTS
    if named == last.get("seq"):
        return {**links, "rejudges": named}, [
            f"{what}: ledger entry {named} judged this change before ({state}, rules {earlier_rules}); plan {plan} "
            "names it, so it is judged again and the entry links to it"
        ]
    if named is not None:
        raise InputError(
            origin,
            f"plan {plan} names ledger entry {named}, but the latest judgement of {what} on this "
            f"model and fixture set is entry {last.get('seq')}",
            field="plan",
            hint=f"state a plan naming the latest one: hops-calib ledger plan --rejudge {last.get('seq')}",
        )
    same_rules = last.get("tolerances") == tolerances.to_dict()
    if again and same_rules:
        return {**links, "repeat_of": last.get("seq")}, [
            f"{what}: ledger entry {last.get('seq')} already judged this change on this model and fixture set "
            f"({state}); this evaluation repeats it under the same rules (--again) and is recorded as another entry"
        ]
    rules_said = (
        "under the same rules"
        if same_rules
        else f"under other rules (rules {earlier_rules}: {Tolerances(**last['tolerances']).describe()})"
        if isinstance(last.get("tolerances"), dict)
        else "under other rules"
    )
    raise InputError(
        origin,
        f"ledger entry {last.get('seq')} already judged this change ({what}; id "
        f"{(last.get('candidate') or {}).get('id')!r}, {state}) on this model and fixture set "
        f"{rules_said}: the change, not the file, is what is judged, so a copy under a new id or "
        "another file is the same judgement",
        field="candidate",
        hint=("--commit goes on the judging evaluation; " if kind == "evaluate" else "")
        + f"to judge it again under other rules, state them first in a plan that names the earlier "
        f"judgement: hops-calib ledger plan --rejudge {last.get('seq')} --note WHY --candidate FILE "
        "[--tolerance-...], then --plan N" + ("; --again repeats it under the same rules" if same_rules else ""),
    )


def read_plan(ledger_path: Path | str | None, seq: int) -> dict[str, Any]:
    """The plan entry `seq` of the ledger (None: the project's); a clear refusal when it is missing or is not a
    plan."""
    from hops_calib.loop import ledger

    ledger_path = resolve_ledger(ledger_path)
    for entry in ledger.read_entries(ledger_path):
        if entry.get("seq") == seq:
            if entry.get("kind") != "plan":
                raise InputError(
                    ledger_path,
                    f"entry {seq} is a {entry.get('kind')} entry, not a plan",
                    field="plan",
                    hint="`hops-calib ledger show` lists the entries; `hops-calib ledger plan --note ...` records one",
                )
            return entry
    raise InputError(
        ledger_path,
        f"has no entry {seq}",
        field="plan",
        hint="record the plan first: hops-calib ledger plan --note ... [tolerance options]",
    )


def plan_tolerances(ledger_path: Path | str | None, seq: int, entry: dict[str, Any] | None = None) -> Tolerances:
    """Plan `seq`'s tolerances (from `entry` when the caller has read it) in the ledger (None: the project's)."""
    entry = entry if entry is not None else read_plan(ledger_path, seq)
    try:
        return Tolerances(**entry["tolerances"])
    except (TypeError, ValueError) as error:
        raise InputError(
            resolve_ledger(ledger_path), f"plan {seq} holds tolerances this version cannot read: {error}", field="plan"
        ) from None


def check_plan(
    ledger_path: Path | str, seq: int, tolerances: Tolerances, verb: str, candidate: Candidate | None = None
) -> None:
    """Refuse a judgement under plan `seq` with other tolerances than the plan's, or, where the plan pinned its
    candidates, with a candidate that is not one of them as they were when the plan was recorded."""
    entry = read_plan(ledger_path, seq)
    stated = plan_tolerances(ledger_path, seq, entry)
    refuse_beyond_caps(stated, verb, plan=seq)
    if stated != tolerances:
        raise InputError(
            verb,
            f"the tolerances given differ from plan {seq}'s ({stated.describe()})",
            field="plan",
            hint="a planned judgement keeps the rules stated before it; pass --plan alone",
        )
    pinned = entry.get("candidates")
    if candidate is not None and pinned and _text_sha256(candidate) not in {c["text_sha256"] for c in pinned}:
        same_id = [c for c in pinned if c["id"] == candidate.id]
        raise InputError(
            candidate.origin,
            f"is not a candidate plan {seq} stated ("
            + ", ".join(f"{c['id']} from {c['path']}" for c in pinned)
            + ")"
            + (f": {candidate.id} was edited after the plan" if same_id else ""),
            field="plan",
            hint="judge the candidate as it was planned, or state a new plan for this one "
            "(hops-calib ledger plan --candidate FILE ...)",
        )


def check_plan_stores(ledger_path: Path | str, seq: int, suite, verb: str) -> None:
    """Refuse a judgement under plan `seq` on other stores than the plan named (`ledger plan --fixtures`)."""
    entry = read_plan(ledger_path, seq)
    stated = entry.get("fixture_set_sha256")
    if stated is not None and stated != suite.sha256:
        raise InputError(
            verb,
            f"plan {seq} was stated for the train runs of {', '.join(entry.get('fixtures', []))} "
            f"(fixture set {stated[:12]}); this judgement's stores hold fixture set {suite.sha256[:12]}",
            field="plan",
            hint="judge on the stores the plan names: "
            + " ".join(f"--fixtures {path}" for path in entry.get("fixtures", [])),
        )


def judgement_notes(entries: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """What `ledger show` says of each judgement beside its numbers: its rules (`plan N` or the defaults, with the
    tolerances where they are not the defaults), the earlier judgements of the same change on the same model and
    fixture set (recorded since issue #22's walkthrough, else found by that identity), and the model file a commit
    wrote, with whether it is not a checkout's model file (hops_calib/model/models/NAME.toml of some checkout: a
    copy elsewhere, e.g. in /tmp, is a change the ledger records but no checkout holds)."""
    notes: dict[int, dict[str, Any]] = {}
    seen: list[dict[str, Any]] = []
    for entry in entries:
        if entry.get("kind") not in JUDGEMENT_KINDS:
            continue
        tolerances = entry.get("tolerances")
        # an entry older than `run_throughput_error` read the window error, the default
        default = (
            isinstance(tolerances, dict) and {"run_throughput_error": "window", **tolerances} == Tolerances().to_dict()
        )
        earlier = entry.get("earlier_judgements")
        if earlier is None:
            earlier = [
                e.get("seq")
                for e in earlier_judgements(
                    seen,
                    entry.get("kind"),
                    entry.get("model_sha256_before"),
                    entry.get("model_sha256_after"),
                    entry.get("fixture_set_sha256"),
                )
            ]
        written = entry.get("committed_into") or (entry.get("model_path") if entry.get("committed") else None)
        note: dict[str, Any] = {
            "rules": (
                f"plan {entry['plan_seq']}"
                if entry.get("plan_seq") is not None
                else DEFAULTS
                if default
                else "rules given with the judgement (an entry older than plans)"
            ),
            "tolerances": None if default else tolerances,
            "looser_rules": looser_rules(tolerances) if isinstance(tolerances, dict) else [],
            "earlier_judgements": earlier,
            "rejudges": entry.get("rejudges"),
            "model_written": written,
            "model_outside_checkout": bool(written and not _in_a_checkout(written)),
        }
        notes[entry["seq"]] = note
        seen.append(entry)
    return notes


def _in_a_checkout(model_path: str) -> bool:
    """Whether a model file path names a checkout's model file (…/hops_calib/model/models/NAME.toml; the path as
    recorded, so that an entry made in another worktree or clone of the project still reads as one)."""
    parts = Path(model_path).parts
    return len(parts) >= 4 and parts[-4:-1] == ("hops_calib", "model", "models")
