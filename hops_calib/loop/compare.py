"""Compare: gate a whole model against another on the train split (the end of a move against its start), record
the answer, and with `commit_into` keep the end or undo the move."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop import heldout
from hops_calib.loop.commits import check_appendable, refuse_foreign_ledger
from hops_calib.loop.evaluate import (
    JUDGEMENT_FIELDS,
    fixture_fields,
    floor_excess,
    judge,
    per_run_changes,
    record_and_write,
    run_errors,
)
from hops_calib.loop.gate import GateResult, Tolerances, looser_rules
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.ledger import resolve as resolve_ledger
from hops_calib.loop.plans import check_plan, check_rejudgement, refuse_unplanned_rules, rules
from hops_calib.loop.suite import TRAIN, ModelScore, load_suites, score_model, stall_series
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
    left_out: dict[str, Any] | None = None  # the train runs the models do not price (`Suite.left_out_summary`)
    calibration: Any = None  # hops_calib.loop.calibration.Check
    stall_free_computed: bool = False
    warnings: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.accepted else 1

    @property
    def status(self) -> str:
        return self.verdict.decision

    def to_dict(self) -> dict[str, Any]:
        """`compare --json`: `runs` are the model after's (the scored model); `before` / `after` the two models'."""
        return {
            "status": self.status,
            "split": TRAIN,
            "fixtures": str(self.fixtures_dir),
            "fixture_set_sha256": self.fixture_set_sha256,
            "before_model": str(self.before_path),
            "model_sha256_before": self.before_model.sha256,
            "after_model": str(self.after_path),
            "model_sha256_after": self.after_model.sha256,
            "scored_model": {
                "which": "the model after",
                "path": str(self.after_path),
                "sha256": self.after_model.sha256,
            },
            "base_model": {"path": str(self.before_path), "sha256": self.before_model.sha256},
            "ledger_path": str(self.ledger_path),
            "warnings": list(self.warnings),
            "rules": self.ledger_entry.get("rules"),
            "rejudges": self.ledger_entry.get("rejudges"),
            "earlier_judgements": self.ledger_entry.get("earlier_judgements", []),
            "note": self.note,
            "before": self.before.suite.to_dict(),
            "after": self.after.suite.to_dict(),
            "stall_noise": floor_excess(self.before, self.after),
            **self.verdict.to_dict(),
            "per_run": per_run_changes(
                self.before, self.after, self.verdict.runs_moved or (), self.stall_free_computed
            ),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "off_record": bool(self.ledger_entry.get("off_record")),
            "ledger": {
                "path": str(self.ledger_path),
                "seq": self.ledger_entry["seq"],
                "entry_sha256": self.ledger_entry["entry_sha256"],
            },
            "committed_into": str(self.committed_into) if self.committed_into is not None else None,
            "left_out": self.left_out or {"count": 0, "reasons": []},
            "looser_rules": looser_rules(self.verdict.tolerances),
            "runs": [run_errors(r, self.stall_free_computed) for r in self.after.runs],
            "fields": JUDGEMENT_FIELDS,
        }


def compare(
    fixtures_dir: Path | str | Sequence[Path | str],
    before_path: Path | str,
    *,
    after_path: Path | str | None = None,
    tolerances: Tolerances = Tolerances(),
    ledger_path: Path | str | None = None,
    note: str = "",
    commit_into: Path | str | None = None,
    plan: int | None = None,
    progress: Progress = QUIET,
    off_record: bool = False,
    allow_held_out: bool = False,
) -> Comparison:
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
    from hops_calib.loop.model_files import default_model, load_model

    ledger_path = resolve_ledger(ledger_path)
    check_appendable(ledger_path)
    refuse_unplanned_rules(tolerances, plan, "compare")
    if plan is not None:
        check_plan(ledger_path, plan, tolerances, "compare")
    held_out, found = heldout.judgement_fields(fixtures_dir, ledger_path, "compare", allow_held_out)
    if found:
        warn(f"warning: {heldout.override_warning(found)}")

    before_path = Path(before_path)
    after_path = Path(after_path) if after_path is not None else default_model()
    before_model, after_model = load_model(before_path), load_model(after_path)
    if before_model.sha256 == after_model.sha256:  # as evaluate refuses a candidate that changes nothing
        raise InputError(
            str(after_path),
            f"is the same model as {before_path} (sha256 {after_model.sha256[:12]}): there is no move to judge",
            field="model",
            hint="compare the model before a move's first step with the model after its last",
        )
    if commit_into is not None:  # refuse before scoring: a wrong file must not cost a ledger entry
        refuse_foreign_ledger(commit_into, ledger_path, "compare")
        _holds_an_end(Path(commit_into), before_model, after_model)(load_model(commit_into))
    suite = load_suites(fixtures_dir, TRAIN)
    if plan is not None:
        from hops_calib.loop.plans import check_plan_stores

        check_plan_stores(ledger_path, plan, suite, "compare")
    fixtures_dir = suite.fixtures_dir
    from hops_calib.loop import calibration

    scope = calibration.scope_of_models(before_model, after_model)
    check = calibration.check_store(
        calibration.read_record(ledger_path), scope, suite, "compare", off_record=off_record
    )
    links, repeated = check_rejudgement(
        list(ledger.read_entries(ledger_path)),
        "compare",
        before_model.sha256,
        after_model.sha256,
        suite.sha256,
        tolerances,
        plan,
        False,
        f"the move {before_path} -> {after_path}",
        str(after_path),
        ledger_path,
    )
    warnings = [*repeated, *check.warnings]  # the off-record reason, when there is one, stays last
    progress.start(2 * len(suite.ids))
    series = stall_series(suite) if tolerances.stall_free else None
    before = score_model(suite, before_model, origin=str(before_path), progress=progress, stall_free=series)
    after = score_model(suite, after_model, origin=str(after_path), progress=progress, stall_free=series)
    verdict = judge(suite, before, after, tolerances)
    unmoved = not verdict.runs_moved
    if unmoved and (not off_record or commit_into is not None):
        calibration.refuse_unmoved((), len(suite.ids), f"{after_path} against {before_path}", "compare", check)
    if unmoved:
        warnings.append(
            f"judged off the record (--off-record): {after_path} moves none of the {len(suite.ids)} runs' "
            f"predictions against {before_path} on this store"
        )
    entry = {
        "kind": "compare",
        "time": now_utc(),
        "note": note,
        "before_model_path": str(before_path),
        "model_path": str(after_path),
        "model_sha256_before": before_model.sha256,
        "model_sha256_after": after_model.sha256,
        **fixture_fields(suite),
        "split": TRAIN,
        "n_fixtures": len(suite.ids),
        **({"left_out": suite.left_out_summary} if suite.left_out else {}),
        **({"scope_devices": list(scope.devices)} if scope.devices else {}),
        "aggregates_before": before.suite.to_dict(),
        "aggregates_after": after.suite.to_dict(),
        **verdict.to_dict(),
        **({"plan_seq": plan} if plan is not None else {}),
        "rules": rules(plan, tolerances),
        **links,
        **({"off_record": True, "off_record_reason": warnings[-1]} if check.off_record or unmoved else {}),
        **held_out,
        "code_revision": code_revision(),
    }
    if commit_into is None:
        written = ledger.append(ledger_path, entry)
    else:
        kept = after_model if verdict.accepted else before_model
        entry.update(committed=True, committed_into=str(commit_into), model_sha256_committed=kept.sha256)
        written = record_and_write(
            Path(commit_into), _holds_an_end(Path(commit_into), before_model, after_model), kept, ledger_path, entry
        )
    return Comparison(
        fixtures_dir=Path(fixtures_dir),
        fixture_set_sha256=suite.sha256,
        before_path=before_path,
        before_model=before_model,
        after_path=after_path,
        after_model=after_model,
        before=before,
        after=after,
        verdict=verdict,
        note=note,
        ledger_path=Path(ledger_path),
        ledger_entry=written,
        committed_into=Path(commit_into) if commit_into is not None else None,
        left_out=suite.left_out_summary,
        calibration=check,
        stall_free_computed=series is not None,
        warnings=tuple(warnings),
    )


def _holds_an_end(path: Path, before: Model, after: Model) -> Callable[[Model], None]:
    """A check that a model file holds the model before or after a comparison (else nothing is committed)."""

    def check(current: Model) -> None:
        if current.sha256 not in (before.sha256, after.sha256):
            raise InputError(
                path,
                f"holds model {current.sha256[:12]}, neither the model before "
                f"({before.sha256[:12]}) nor the model after ({after.sha256[:12]}) this comparison; "
                "nothing was committed or recorded",
                field="commit",
                hint="commit into the model file the move's steps were committed into, or leave out --commit",
            )

    return check
