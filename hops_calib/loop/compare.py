"""Compare: gate a whole model against another on the train split (the end of a move against its start), record
the answer, and with `commit_into` keep the end or undo the move."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hops_calib.errors import InputError
from hops_calib.loop import heldout
from hops_calib.loop.evaluate import record_and_write
from hops_calib.loop.gate import GateResult, Tolerances, gate
from hops_calib.loop.ledger import check_appendable, resolve as resolve_ledger
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.plans import check_plan
from hops_calib.loop.suite import ModelScore, TRAIN, load_suite, score_model, stall_series
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress, warn


@dataclass(frozen=True)
class Comparison:
    """One model file gated against another on the train split (`hops-calib compare`)."""

    fixtures_dir: Path
    fixture_set_sha256: str
    before_path: Path
    before_model: Model
    after_path: Path
    after_model: Model
    before: ModelScore
    after: ModelScore
    verdict: GateResult
    note: str
    ledger_path: Path
    ledger_entry: dict[str, Any]
    committed_into: Path | None = None  # the model file the verdict was carried out in (--commit)

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.accepted else 1

    def to_dict(self) -> dict[str, Any]:
        return {"split": TRAIN, "fixtures": str(self.fixtures_dir), "fixture_set_sha256": self.fixture_set_sha256,
                "before_model": str(self.before_path), "model_sha256_before": self.before_model.sha256,
                "after_model": str(self.after_path), "model_sha256_after": self.after_model.sha256,
                "note": self.note, "before": self.before.suite.to_dict(), "after": self.after.suite.to_dict(),
                **self.verdict.to_dict(),
                "ledger": {"path": str(self.ledger_path), "seq": self.ledger_entry["seq"],
                           "entry_sha256": self.ledger_entry["entry_sha256"]},
                "committed_into": str(self.committed_into) if self.committed_into is not None else None,
                "runs": [r.to_dict() for r in self.after.runs]}


def compare(fixtures_dir: Path | str, before_path: Path | str, *, after_path: Path | str | None = None,
            tolerances: Tolerances = Tolerances(), ledger_path: Path | str | None = None, note: str = "",
            commit_into: Path | str | None = None, plan: int | None = None, progress: Progress = QUIET,
            allow_held_out: bool = False) -> Comparison:
    """Gate a whole model file (`after_path`, default the shipped one) against another on the train split; record it.

    For a move: one-term candidates that hold the suite only together land one by one, each recorded with the
    relaxed tolerances it needed; this judges the model after the last step against the model before the first
    under the tolerances given (those single candidates are held to), and leaves that judgement in the ledger.

    With `commit_into` (a model file holding the model before or after, usually the shipped one the steps were
    committed into) the verdict is carried out there: the model after if accepted, the model before if
    rejected, so a rejected move is undone in the file and in the ledger's history alike.

    `plan`: the ledger entry (`ledger plan`) whose tolerances the move was to be judged under, stated before its
    steps were evaluated; they must be the ones given. `allow_held_out`: as for `evaluate`.
    """
    from hops_calib.loop import ledger
    from hops_calib.loop.model_files import DEFAULT_MODEL, load_model

    ledger_path = resolve_ledger(ledger_path)
    check_appendable(ledger_path)
    if plan is not None:
        check_plan(ledger_path, plan, tolerances, "compare")
    held_out, found = heldout.judgement_fields(fixtures_dir, ledger_path, "compare", allow_held_out)
    if found:
        warn(f"warning: {heldout.override_warning(found)}")

    before_path = Path(before_path)
    after_path = Path(after_path) if after_path is not None else DEFAULT_MODEL
    before_model, after_model = load_model(before_path), load_model(after_path)
    if before_model.sha256 == after_model.sha256:  # as evaluate refuses a candidate that changes nothing
        raise InputError(str(after_path), f"is the same model as {before_path} (sha256 {after_model.sha256[:12]}): "
                         "there is no move to judge", field="model",
                         hint="compare the model before a move's first step with the model after its last")
    if commit_into is not None:  # refuse before scoring: a wrong file must not cost a ledger entry
        _holds_an_end(Path(commit_into), before_model, after_model)(load_model(commit_into))
    suite = load_suite(fixtures_dir, TRAIN)
    progress.start(2 * len(suite.ids))
    series = stall_series(suite) if tolerances.stall_free else None
    before = score_model(suite, before_model, origin=str(before_path), progress=progress, stall_free=series)
    after = score_model(suite, after_model, origin=str(after_path), progress=progress, stall_free=series)
    verdict = gate(before.runs, after.runs, before.suite, after.suite, tolerances)
    entry = {
        "kind": "compare",
        "time": now_utc(),
        "note": note,
        "before_model_path": str(before_path),
        "model_path": str(after_path),
        "model_sha256_before": before_model.sha256,
        "model_sha256_after": after_model.sha256,
        "fixture_set_sha256": suite.sha256,
        "split": TRAIN,
        "n_fixtures": len(suite.ids),
        "aggregates_before": before.suite.to_dict(),
        "aggregates_after": after.suite.to_dict(),
        **verdict.to_dict(),
        **({"plan_seq": plan} if plan is not None else {}),
        **held_out,
        "code_revision": code_revision(),
    }
    if commit_into is None:
        written = ledger.append(ledger_path, entry)
    else:
        kept = after_model if verdict.accepted else before_model
        entry.update(committed=True, committed_into=str(commit_into), model_sha256_committed=kept.sha256)
        written = record_and_write(Path(commit_into), _holds_an_end(Path(commit_into), before_model, after_model),
                                    kept, ledger_path, entry)
    return Comparison(fixtures_dir=Path(fixtures_dir), fixture_set_sha256=suite.sha256, before_path=before_path,
                      before_model=before_model, after_path=after_path, after_model=after_model,
                      before=before, after=after, verdict=verdict, note=note,
                      ledger_path=Path(ledger_path), ledger_entry=written,
                      committed_into=Path(commit_into) if commit_into is not None else None)


def _holds_an_end(path: Path, before: Model, after: Model) -> Callable[[Model], None]:
    """A check that a model file holds the model before or after a comparison (else nothing is committed)."""
    def check(current: Model) -> None:
        if current.sha256 not in (before.sha256, after.sha256):
            raise InputError(path, f"holds model {current.sha256[:12]}, neither the model before "
                             f"({before.sha256[:12]}) nor the model after ({after.sha256[:12]}) this comparison; "
                             "nothing was committed or recorded", field="commit",
                             hint="commit into the model file the move's steps were committed into, or leave out "
                                  "--commit")
    return check
