"""Evaluate: score the model on the train split; with a one-term candidate, gate it, append a ledger entry for every
judgement, and with `commit=True` write an accepted candidate into the model file.

This module returns results; `hops_calib.cli.loop` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hops_calib.errors import InputError
from hops_calib.loop import heldout
from hops_calib.loop.candidate import Candidate, read_candidate
from hops_calib.loop.gate import GateResult, Tolerances, gate
from hops_calib.loop.ledger import check_appendable, resolve as resolve_ledger
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.plans import check_plan, judgements
from hops_calib.loop.suite import ModelScore, TRAIN, load_suite, refuse_test_split, score_model, stall_series
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress


@dataclass(frozen=True)
class Evaluation:
    split: str
    fixtures_dir: Path
    fixture_set_sha256: str
    model_path: Path
    model: Model
    tolerances: Tolerances
    before: ModelScore
    candidate: Candidate | None = None
    candidate_model: Model | None = None
    after: ModelScore | None = None
    verdict: GateResult | None = None
    ledger_path: Path | None = None
    ledger_entry: dict[str, Any] | None = None
    committed: bool = False
    # What the user should know that does not stop the judgement (a hand-edited model file, a reused candidate id).
    warnings: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict is None or self.verdict.accepted else 1

    @property
    def current(self) -> ModelScore:
        """The scores being reported: the candidate's when there is one, else the model's."""
        return self.after or self.before

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `evaluate --json`: top-level aggregates and runs are the candidate's when there is one."""
        data: dict[str, Any] = {"split": self.split, **self.current.suite.to_dict(),
                                "fixtures": str(self.fixtures_dir), "fixture_set_sha256": self.fixture_set_sha256,
                                "model": str(self.model_path), "model_sha256": self.model.sha256,
                                "tolerances": self.tolerances.to_dict(), "warnings": list(self.warnings)}
        data["scored_model_sha256"] = self.model.sha256  # whose numbers the top level holds
        if self.candidate is not None and self.verdict is not None and self.after is not None:
            data.update({
                "scored_model_sha256": self.candidate_model.sha256,
                "candidate": candidate_record(self.candidate),
                "candidate_model_sha256": self.candidate_model.sha256,
                "plan_seq": self.ledger_entry.get("plan_seq"),
                "before": self.before.suite.to_dict(),
                "after": self.after.suite.to_dict(),
                **self.verdict.to_dict(),
                "committed": self.committed,
                "ledger": {"path": str(self.ledger_path), "seq": self.ledger_entry["seq"],
                           "entry_sha256": self.ledger_entry["entry_sha256"]},
            })
        data["runs"] = [r.to_dict() for r in self.current.runs]
        return data


PLACEHOLDER = "FILL IN"  # what `tune` writes where only a person (or an agent) can give the reason


def _refuse_placeholders(candidate: Candidate) -> None:
    """A candidate whose hypothesis or grounding still holds tune's placeholder is not judged: the ledger keeps
    every judgement for good, and one without its reason would say nothing about why it was tried."""
    from hops_calib.errors import line_of

    for key in ("hypothesis", "grounding"):
        if PLACEHOLDER in getattr(candidate, key):
            raise InputError(candidate.origin, f"its {key} still says {PLACEHOLDER!r}", field=key,
                             line=line_of(candidate.text, None, key),
                             hint=f"write the {key} (why this change, on what physical ground) in place of the "
                                  "placeholder tune left, then evaluate it")


def _reused_id(judged: Sequence[dict[str, Any]], candidate: Candidate) -> list[str]:
    """A warning when the ledger judged another text under this candidate's id: the id no longer names one
    change, and the ledger's history of it mixes two."""
    others = [e for e in judged
              if e["candidate"].get("id") == candidate.id and e["candidate"].get("text") != candidate.text]
    if not others:
        return []
    seqs = ", ".join(str(e.get("seq")) for e in others[:5]) + (", ..." if len(others) > 5 else "")
    return [f"{candidate.origin}: candidate id {candidate.id!r} was judged before with another text (ledger entry "
            f"{seqs}): give a changed candidate a new id, so each id names one change in the ledger"]


def _repeated_judgement(judged: Sequence[dict[str, Any]], candidate: Candidate, model_sha256: str,
                        fixture_set_sha256: str) -> list[str]:
    """A notice when the ledger already judged this very candidate text on this model and these fixtures: the new
    entry will repeat that judgement (it is recorded all the same; every attempt is)."""
    same = [e for e in judged
            if e["candidate"].get("text") == candidate.text and e.get("model_sha256_before") == model_sha256
            and e.get("fixture_set_sha256") == fixture_set_sha256]
    if not same:
        return []
    last = same[-1]
    return [f"{candidate.origin}: ledger entry {last.get('seq')} already judged this candidate text on this model and "
            f"fixture set ({last.get('decision')}); this evaluation repeats it and is recorded as another entry"]


def candidate_record(candidate: Candidate) -> dict[str, Any]:
    return {"id": candidate.id, "path": candidate.origin, "change": candidate.change.describe(),
            "target": candidate.change.target, "hypothesis": candidate.hypothesis, "text": candidate.text}


def evaluate(fixtures_dir: Path | str, *, model_path: Path | str | None = None,
             candidate_path: Path | str | None = None, tolerances: Tolerances = Tolerances(),
             ledger_path: Path | str | None = None, commit: bool = False, split: str = TRAIN,
             plan: int | None = None, progress: Progress = QUIET, allow_held_out: bool = False,
             verb: str = "evaluate") -> Evaluation:
    """Score the model on the train split; with a candidate, gate it, record it, and commit it if asked and accepted.

    `progress` sees one unit per prediction (two per run with a candidate). `plan`: the ledger entry (`ledger
    plan`) whose tolerances this judgement was stated under beforehand; they must be the ones given. A store
    holding in train a group the ledger remembers as held out is refused unless `allow_held_out`, which the
    ledger records (`hops_calib.loop.heldout`).
    """
    from hops_calib.loop.model_files import DEFAULT_MODEL, edited_since_written, load_model

    refuse_test_split(split, "evaluate")
    if plan is not None and candidate_path is None:
        raise InputError("evaluate", "--plan judges a candidate; there is none", field="plan",
                         hint="pass the candidate file the plan was stated for")
    if commit and candidate_path is None:
        raise InputError("evaluate", "--commit needs a candidate to commit", field="commit",
                         hint="pass a candidate file: hops-calib evaluate experiments/X.toml --commit")
    candidate = read_candidate(candidate_path) if candidate_path is not None else None
    if candidate is not None:
        _refuse_placeholders(candidate)
        ledger_path = resolve_ledger(ledger_path)  # only a judgement is recorded: scoring alone needs no ledger
        check_appendable(ledger_path)
    if plan is not None:
        check_plan(ledger_path, plan, tolerances, "evaluate", candidate)
    if candidate is not None:
        held_out, found = heldout.judgement_fields(fixtures_dir, ledger_path, verb, allow_held_out)
        held_out_warnings = [heldout.override_warning(found)] if found else []
    else:  # nothing else is recorded: an override is an entry of its own
        held_out, held_out_warnings = {}, heldout.guard_store(fixtures_dir, ledger_path, verb, allow_held_out)
    model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL
    model = load_model(model_path)
    warnings = held_out_warnings + [w for w in (edited_since_written(model_path, model),) if w]
    judged = judgements(ledger_path) if candidate is not None else []
    if candidate is not None:
        warnings += _reused_id(judged, candidate)
    candidate_model = candidate.apply(model) if candidate is not None else None
    suite = load_suite(fixtures_dir, split)
    if candidate is not None:
        warnings += _repeated_judgement(judged, candidate, model.sha256, suite.sha256)
    progress.start(len(suite.ids) * (2 if candidate is not None else 1))
    series = stall_series(suite) if tolerances.stall_free else None
    before = score_model(suite, model, origin=str(model_path), progress=progress, stall_free=series)
    common = dict(split=split, fixtures_dir=Path(fixtures_dir), fixture_set_sha256=suite.sha256,
                  model_path=model_path, model=model, tolerances=tolerances, before=before, warnings=tuple(warnings))
    if candidate is None:
        return Evaluation(**common)

    after = score_model(suite, candidate_model, origin=candidate.origin, progress=progress, stall_free=series)
    verdict = gate(before.runs, after.runs, before.suite, after.suite, tolerances)
    entry = {
        "kind": "evaluate",
        "time": now_utc(),
        "candidate": candidate_record(candidate),
        "model_path": str(model_path),
        "model_sha256_before": model.sha256,
        "model_sha256_after": candidate_model.sha256,
        "fixture_set_sha256": suite.sha256,
        "split": split,
        "n_fixtures": len(suite.ids),
        "aggregates_before": before.suite.to_dict(),
        "aggregates_after": after.suite.to_dict(),
        **verdict.to_dict(),
        "committed": bool(commit and verdict.accepted),
        **({"plan_seq": plan} if plan is not None else {}),
        **held_out,
        "code_revision": code_revision(),
    }
    if entry["committed"]:
        written = _commit(model_path, model, candidate_model, ledger_path, entry)
    else:
        from hops_calib.loop import ledger

        written = ledger.append(ledger_path, entry)
    return Evaluation(**common, candidate=candidate, candidate_model=candidate_model, after=after, verdict=verdict,
                      ledger_path=Path(ledger_path), ledger_entry=written, committed=entry["committed"])


def _commit(model_path: Path, model: Model, changed: Model, ledger_path: Path | str, entry: dict[str, Any]
            ) -> dict[str, Any]:
    """Record the accepted candidate, then write it into the model file, refusing if the file moved meanwhile.

    Under the model file's lock: the file must still hold the model the
    candidate was judged against (another commit may have landed since); the
    ledger entry is appended first, so a model file never changes unrecorded.
    """
    def still_judged(current: Model) -> None:
        if current.sha256 != model.sha256:
            raise InputError(model_path, f"the model file changed while the candidate was evaluated (sha256 "
                             f"{model.sha256[:12]} -> {current.sha256[:12]}); nothing was committed or recorded",
                             hint="evaluate the candidate again against the current model")

    return record_and_write(model_path, still_judged, changed, ledger_path, entry)


def record_and_write(model_path: Path, check: Callable[[Model], None], written_model: Model,
                      ledger_path: Path | str, entry: dict[str, Any]) -> dict[str, Any]:
    """Under the model file's lock: `check` what it holds (raises to refuse), append `entry`, write the model."""
    from filelock import FileLock

    from hops_calib.loop import ledger
    from hops_calib.loop.model_files import load_model, write_model

    with FileLock(str(model_path) + ".lock", timeout=ledger.LOCK_TIMEOUT_S):
        check(load_model(model_path))
        written = ledger.append(ledger_path, entry)
        write_model(model_path, written_model)
    return written
