"""Plans: the rules of a judgement (its tolerances, and the candidates it is for, pinned by their text's sha256),
recorded in the ledger before it; `evaluate --plan N` and `compare --plan N` judge under exactly those rules."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

from hops_calib.errors import InputError
from hops_calib.loop.candidate import Candidate, read_candidate
from hops_calib.loop.gate import Tolerances
from hops_calib.loop.ledger import check_appendable, resolve as resolve_ledger
from hops_calib.loop.ledger import code_revision, now_utc


def judgements(ledger_path: Path | str) -> list[dict[str, Any]]:
    """The ledger's candidate judgements (evaluate entries), in order; none when the ledger does not exist yet."""
    from hops_calib.loop import ledger

    return [e for e in ledger.read_entries(ledger_path) if e.get("kind") == "evaluate" and e.get("candidate")]


def _text_sha256(candidate: Candidate) -> str:
    return _text_sha256_of(candidate.text)


def _text_sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def record_plan(ledger_path: Path | str, note: str, tolerances: Tolerances,
                candidates: Sequence[Path | str] = ()) -> dict[str, Any]:
    """Append a plan entry: what is about to be tried and the tolerances it will be judged under, before any of
    its evaluations. `evaluate --plan N` and `compare --plan N` then judge under exactly those tolerances and cite it.
    `candidates`: the candidate files the plan is for, pinned by their text's sha256: `evaluate --plan N` then
    refuses any other candidate, an edited one included.
    """
    from hops_calib.loop import ledger

    ledger_path = resolve_ledger(ledger_path)
    check_appendable(ledger_path)
    if not note.strip():
        raise InputError("ledger plan", "a plan needs a note", field="note",
                         hint="say what will be tried and why these tolerances, e.g. --note 'move 060-062: ...'")
    pinned = [read_candidate(path) for path in candidates]  # a candidate that cannot be read is refused now
    judged = {_text_sha256_of(e["candidate"].get("text", "")): e for e in judgements(ledger_path)}
    for candidate in pinned:
        earlier = judged.get(_text_sha256(candidate))
        if earlier is not None:
            raise InputError(candidate.origin, f"this candidate text was already judged: ledger entry "
                             f"{earlier.get('seq')} ({earlier.get('decision')}, id {candidate.id!r}); a plan states "
                             "the rules before a judgement, not after it", field="candidate",
                             hint="if the rules are new, write a new candidate (a new id) and plan that one; the "
                                  "earlier judgement stands in the ledger")
    return ledger.append(ledger_path, {"kind": "plan", "time": now_utc(), "note": note,
                                       "tolerances": tolerances.to_dict(),
                                       **({"candidates": [{"id": c.id, "path": c.origin, "text_sha256": _text_sha256(c)}
                                                          for c in pinned]} if pinned else {}),
                                       "code_revision": code_revision()})


def read_plan(ledger_path: Path | str, seq: int) -> dict[str, Any]:
    """The plan entry `seq` of the ledger; a clear refusal when it is missing or is not a plan."""
    from hops_calib.loop import ledger

    ledger_path = resolve_ledger(ledger_path)
    for entry in ledger.read_entries(ledger_path):
        if entry.get("seq") == seq:
            if entry.get("kind") != "plan":
                raise InputError(ledger_path, f"entry {seq} is a {entry.get('kind')} entry, not a plan",
                                 field="plan", hint="`hops-calib ledger show` lists the entries; `hops-calib ledger "
                                                    "plan --note ...` records one")
            return entry
    raise InputError(ledger_path, f"has no entry {seq}", field="plan",
                     hint="record the plan first: hops-calib ledger plan --note ... [tolerance options]")


def plan_tolerances(ledger_path: Path | str, seq: int, entry: dict[str, Any] | None = None) -> Tolerances:
    """Plan `seq`'s tolerances (from `entry` when the caller has read it)."""
    entry = entry if entry is not None else read_plan(ledger_path, seq)
    try:
        return Tolerances(**entry["tolerances"])
    except (TypeError, ValueError) as error:
        raise InputError(ledger_path, f"plan {seq} holds tolerances this version cannot read: {error}",
                         field="plan") from None


def check_plan(ledger_path: Path | str, seq: int, tolerances: Tolerances, verb: str,
               candidate: Candidate | None = None) -> None:
    """Refuse a judgement under plan `seq` with other tolerances than the plan's, or, where the plan pinned its
    candidates, with a candidate that is not one of them as they were when the plan was recorded."""
    entry = read_plan(ledger_path, seq)
    stated = plan_tolerances(ledger_path, seq, entry)
    if stated != tolerances:
        raise InputError(verb, f"the tolerances given differ from plan {seq}'s ({stated.describe()})", field="plan",
                         hint="a planned judgement keeps the rules stated before it; pass --plan alone")
    pinned = entry.get("candidates")
    if candidate is not None and pinned and _text_sha256(candidate) not in {c["text_sha256"] for c in pinned}:
        same_id = [c for c in pinned if c["id"] == candidate.id]
        raise InputError(candidate.origin, f"is not a candidate plan {seq} stated ("
                         + ", ".join(f"{c['id']} from {c['path']}" for c in pinned) + ")"
                         + (f": {candidate.id} was edited after the plan" if same_id else ""), field="plan",
                         hint="judge the candidate as it was planned, or state a new plan for this one "
                              "(hops-calib ledger plan --candidate FILE ...)")
