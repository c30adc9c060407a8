"""Evaluate: score the model on the train split; with a one-term candidate, gate it, append a ledger entry for every
judgement, and with `commit=True` write an accepted candidate into the model file.

This module returns results; `hops_calib.cli.evaluate` prints them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop import heldout
from hops_calib.loop.candidate import Candidate, read_candidate, refuse_placeholders
from hops_calib.loop.commits import check_appendable, ledger_disagrees, refuse_foreign_ledger
from hops_calib.loop.gate import GateResult, Tolerances, gate, looser_rules
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.ledger import resolve as resolve_ledger
from hops_calib.loop.plans import check_plan, check_rejudgement, judgements, refuse_unplanned_rules, rules
from hops_calib.loop.suite import TRAIN, ModelScore, load_suites, refuse_test_split, score_model, stall_series
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
    # The split's runs the model does not price, left out of the scores (`Suite.left_out_summary`).
    left_out: dict[str, Any] | None = None
    calibration: Any = None  # hops_calib.loop.calibration.Check of a judgement
    stall_free_computed: bool = False
    # Each store's path when several were judged together (`--fixtures` repeated); () for one.
    stores: tuple[dict[str, Any], ...] = ()

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict is None or self.verdict.accepted else 1

    @property
    def status(self) -> str:
        return "ok" if self.verdict is None else self.verdict.decision

    @property
    def current(self) -> ModelScore:
        """The scores being reported: the candidate's when there is one, else the model's."""
        return self.after or self.before

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `evaluate --json`: top-level aggregates and runs are the scored model's: the candidate's when
        there is one (`scored_model`), else the model's; `before` / `after` hold the base and the candidate model's."""
        data: dict[str, Any] = {
            "status": self.status,
            "split": self.split,
            **self.current.suite.to_dict(),
            "fixtures": ([s["fixtures"] for s in self.stores] if self.stores else str(self.fixtures_dir)),
            "fixture_set_sha256": self.fixture_set_sha256,
            **({"fixture_sets": list(self.stores)} if self.stores else {}),
            "model": str(self.model_path),
            "model_sha256": self.model.sha256,
            "ledger_path": str(self.ledger_path) if self.ledger_path is not None else None,
            "tolerances": self.tolerances.to_dict(),
            "warnings": list(self.warnings),
            "left_out": self.left_out or {"count": 0, "reasons": []},
        }
        data["scored_model"] = {"which": "model", "path": str(self.model_path), "sha256": self.model.sha256}
        data["scored_model_sha256"] = self.model.sha256  # whose numbers the top level holds
        data["stall_noise"] = floor_excess(self.before, self.after)
        candidate_model, entry = self.candidate_model, self.ledger_entry
        if (
            self.candidate is not None
            and self.verdict is not None
            and self.after is not None
            and candidate_model is not None
            and entry is not None
        ):  # (a judgement always has both)
            data.update(
                {
                    "scored_model": {
                        "which": "candidate (the base model with the candidate's change)",
                        "path": self.candidate.origin,
                        "sha256": candidate_model.sha256,
                    },
                    "base_model": {"path": str(self.model_path), "sha256": self.model.sha256},
                    "scored_model_sha256": candidate_model.sha256,
                    "candidate": candidate_record(self.candidate),
                    "candidate_model_sha256": candidate_model.sha256,
                    "plan_seq": entry.get("plan_seq"),
                    "rules": entry.get("rules"),
                    "earlier_judgements": entry.get("earlier_judgements", []),
                    "rejudges": entry.get("rejudges"),
                    "repeat_of": entry.get("repeat_of"),
                    "before": self.before.suite.to_dict(),
                    "after": self.after.suite.to_dict(),
                    **self.verdict.to_dict(),
                    "per_run": per_run_changes(
                        self.before, self.after, self.verdict.runs_moved or (), self.stall_free_computed
                    ),
                    "calibration": self.calibration.to_dict() if self.calibration is not None else None,
                    "off_record": bool(entry.get("off_record")),
                    "committed": self.committed,
                    "ledger": {
                        "path": str(self.ledger_path),
                        "seq": entry["seq"],
                        "entry_sha256": entry["entry_sha256"],
                    },
                }
            )
        data["looser_rules"] = looser_rules(self.tolerances)
        data["runs"] = [run_errors(r, self.stall_free_computed) for r in self.current.runs]
        data["fields"] = JUDGEMENT_FIELDS
        return data


# What the numbers of `evaluate --json` and `compare --json` mean (`fields`), as AGENTS.md says.
JUDGEMENT_FIELDS = {
    "looser_rules": "the judgement's rules looser than the gate's defaults, [] under the defaults: each tolerance "
    "above its default (tolerance, value, default, cap, beyond_cap, cap_reason; a plan past the cap "
    "is refused, so beyond_cap is true only of ledger entries older than the caps) and a per-run rule "
    "reading the stall-free error; ledger show and the results tables mark them the same way",
    "throughput_error_pct": "a run's throughput error, predicted minus real over real, % (positive: the model "
    "predicts the run too fast, its time too short; the opposite sign of observe's bias_ms)",
    "mean_error_pct": "the mean of throughput_error_pct over the runs (signed: positive, predicted too fast)",
    "bubble_error_pp": "predicted minus real idle share (bubble ratio), pp; not_measured on a run without per-phase "
    "events",
    "stall_free_error_pct": "throughput_error_pct with the random retransmission stalls taken out of both sides "
    "(--run-error stall-free computes it, where the trace has optimizer events)",
    "within_noise": "the suite MAPE change's paired bootstrap interval (mape_change_interval_pp) straddles 0",
    "rules": "where the rules came from (from: defaults or plan N) and their tolerances",
}


RUN_ERRORS = ("throughput_error_pct", "steady_throughput_error_pct", "bubble_error_pp", "stall_free_error_pct")
STALL_FREE_OPTION = "--run-error stall-free"


# Why a run has no bubble error: the idle share is read from per-phase events, which a run measured by its
# iteration times alone (a Megatron log, a table row) does not have; no option computes it.
NO_BUBBLE = (
    "not_measured (the run has no per-phase events, only iteration times: its idle share cannot be read; "
    "no option computes it)"
)


def _error_value(run, field: str, stall_free_computed: bool) -> float | str:
    """One of a run's errors; where absent, why, never a bare null: the bubble error of a run without events is not
    measured (`NO_BUBBLE`); the stall-free one "not_computed" (and the option that computes it) or why it cannot be
    computed."""
    value = getattr(run, field)
    if value is not None:
        return value
    if field == "bubble_error_pp":
        return NO_BUBBLE
    if not stall_free_computed:
        return f"not_computed ({STALL_FREE_OPTION} computes it)"
    return "cannot be computed: the trace has no optimizer events to read the silent stretch (stalls) from"


def run_errors(run, stall_free_computed: bool) -> dict[str, Any]:
    """A run's scores as `--json` gives them: `RunScore.to_dict`, the stall-free error explained when absent."""
    data = run.to_dict()
    data["stall_free_error_pct"] = _error_value(run, "stall_free_error_pct", stall_free_computed)
    return data


def per_run_changes(
    before: ModelScore, after: ModelScore, moved: Sequence[str], stall_free_computed: bool
) -> list[dict[str, Any]]:
    """Per run: the base model's and the scored model's errors (window and steady throughput, bubble, stall-free)
    and their difference (after - before; of the signed errors, and of the absolute ones the gate reads)."""
    after_by_id = {r.run_id: r for r in after.runs}
    after_phases = dict(zip((r.run_id for r in after.runs), after.phases))
    rows = []
    for old, was_phases in itertools.zip_longest(before.runs, before.phases):
        new = after_by_id[old.run_id]
        row: dict[str, Any] = {
            "run_id": old.run_id,
            "moved": old.run_id in moved,
            "before": {},
            "after": {},
            "delta": {},
            "abs_delta": {},
        }
        if row["moved"] and was_phases is not None and old.run_id in after_phases:
            row["phases_moved"] = phase_changes(was_phases, after_phases[old.run_id])
        for field in RUN_ERRORS:
            was, now = (_error_value(r, field, stall_free_computed) for r in (old, new))
            row["before"][field], row["after"][field] = was, now
            if isinstance(was, float) and isinstance(now, float):
                row["delta"][field], row["abs_delta"][field] = now - was, abs(now) - abs(was)
            else:
                row["delta"][field] = row["abs_delta"][field] = was if isinstance(was, str) else now
        rows.append(row)
    return rows


def phase_name(quantity: str, stage: int | None) -> str:
    """A phase duration's name in the JSON: 'stage 2 forward_ms', 'silent_ms (median)', 'silent_ms (mean)'."""
    part, _, how = quantity.partition(".")
    if stage is not None:
        return f"stage {stage} {part}_ms"
    return f"{part}_ms ({'mean over iterations' if how == 'mean' else 'median'})"


def phase_changes(
    before: dict[tuple[str, int | None], float], after: dict[tuple[str, int | None], float]
) -> dict[str, dict[str, float]]:
    """The predicted phase durations that changed (a stage's forward/backward per microbatch and optimizer step,
    the iteration's span, silent stretch, optimizer and rest), before and after, ms: the mechanism half of a
    hypothesis, checked run by run."""
    out = {}
    for key, was in before.items():
        now = after.get(key)
        if now is not None and abs(now - was) > 1e-9 * max(abs(now), abs(was), 1e-12):
            out[phase_name(*key)] = {"before": was, "after": now, "delta": now - was}
    return out


def floor_excess(before: ModelScore, after: ModelScore | None = None) -> dict[str, Any]:
    """The stall-noise floor (what random stalls alone cost a model exact in all else, from the model's own placed
    stalls: it moves with the model) and each model's throughput MAPE in excess of it."""

    def one(score: ModelScore) -> dict[str, float]:
        suite = score.suite
        return {
            "floor_pct": suite.stall_noise_mape_pct,
            "throughput_mape_pct": suite.throughput_mape_pct,
            "excess_pp": suite.throughput_mape_pct - suite.stall_noise_mape_pct,
        }

    data: dict[str, Any] = {"before": one(before)}
    if after is not None:
        data["after"] = one(after)
        data["excess_change_pp"] = data["after"]["excess_pp"] - data["before"]["excess_pp"]
    return data


def _reused_id(judged: Sequence[dict[str, Any]], candidate: Candidate) -> list[str]:
    """A warning when the ledger judged another text under this candidate's id: the id no longer names one
    change, and the ledger's history of it mixes two."""
    others = [
        e for e in judged if e["candidate"].get("id") == candidate.id and e["candidate"].get("text") != candidate.text
    ]
    if not others:
        return []
    seqs = ", ".join(str(e.get("seq")) for e in others[:5]) + (", ..." if len(others) > 5 else "")
    return [
        f"{candidate.origin}: candidate id {candidate.id!r} was judged before with another text (ledger entry "
        f"{seqs}): give a changed candidate a new id, so each id names one change in the ledger"
    ]


def _other_checkouts(model_path: Path, ledger_path: Path | str) -> list[str]:
    """A warning when the model file and the ledger lie in two different checkouts: the ledger would record a
    judgement of a model whose history it does not hold."""
    from hops_calib.loop.checkout import checkout_of

    model_home, ledger_home = checkout_of(model_path), checkout_of(ledger_path)
    if model_home is None and ledger_home is not None:
        return [
            f"the model {model_path} lies outside any checkout, the ledger {ledger_path} in {ledger_home}: the "
            "ledger records a judgement (and with --commit a change) of a file that is not the checkout's model"
        ]
    if model_home is None or ledger_home is None or model_home == ledger_home:
        return []
    return [
        f"the model {model_path} is in the checkout {model_home}, the ledger {ledger_path} in {ledger_home}: "
        "judge a checkout's model with its own ledger (run from inside the checkout without --model/--ledger)"
    ]


def _stem_is_id(candidate: Candidate) -> list[str]:
    """A warning when the file's name is not its id (the naming scheme: experiments/ID.toml)."""
    stem = Path(candidate.origin).stem
    if stem == candidate.id:
        return []
    return [
        f"{candidate.origin}: the file is named {stem!r}, its id is {candidate.id!r}: name a candidate file by its "
        f"id (experiments/{candidate.id}.toml), so the ledger's id finds the file"
    ]


def candidate_record(candidate: Candidate) -> dict[str, Any]:
    return {
        "id": candidate.id,
        "path": candidate.origin,
        "change": candidate.change.describe(),
        "target": candidate.change.target,
        "hypothesis": candidate.hypothesis,
        "text": candidate.text,
    }


def evaluate(
    fixtures_dir: Path | str | Sequence[Path | str],
    *,
    model_path: Path | str | None = None,
    candidate_path: Path | str | None = None,
    tolerances: Tolerances = Tolerances(),
    ledger_path: Path | str | None = None,
    commit: bool = False,
    split: str = TRAIN,
    plan: int | None = None,
    progress: Progress = QUIET,
    off_record: bool = False,
    again: bool = False,
    allow_held_out: bool = False,
    verb: str = "evaluate",
) -> Evaluation:
    """Score the model on the train split; with a candidate, gate it, record it, and commit it if asked and accepted.

    `progress` sees one unit per prediction (two per run with a candidate). `plan`: the ledger entry (`ledger
    plan`) whose tolerances this judgement was stated under beforehand; they must be the ones given.

    A candidate is judged only on the runs the part of the model it changes was calibrated on (the ledger's record,
    `hops_calib.loop.calibration`), and only when it moves at least one run's prediction there; `off_record`
    judges it anyway and marks the entry (a change that moves no run is never committed). `again`: judge a
    change the ledger already judged on this model and fixture set once more under the same rules (refused
    otherwise; other rules need a plan naming the earlier judgement: `hops_calib.loop.plans.check_rejudgement`).
    `tolerances` other than the defaults only with `plan` (`plans.refuse_unplanned_rules`).

    `fixtures_dir`: one store, or several judged as one union suite: the gate's rules must hold on each store's
    runs (`gate.gate_stores`), the entry lists each store's fixture set (`fixture_sets`), and the judgement must
    cover every store the changed part was calibrated on.
    A store holding in train a group the ledger remembers as held out is refused unless `allow_held_out`, which
    the ledger records (`hops_calib.loop.heldout`; `verb` names the command in that record).
    """
    from hops_calib.loop import calibration
    from hops_calib.loop.ledger import default_ledger
    from hops_calib.loop.model_files import default_model, edited_since_written, load_model

    refuse_test_split(split, "evaluate")
    if plan is not None and candidate_path is None:
        raise InputError(
            "evaluate",
            "--plan judges a candidate; there is none",
            field="plan",
            hint="pass the candidate file the plan was stated for",
        )
    if commit and candidate_path is None:
        raise InputError(
            "evaluate",
            "--commit needs a candidate to commit",
            field="commit",
            hint="pass a candidate file: hops-calib evaluate experiments/X.toml --commit",
        )
    for flag, given in (("--off-record", off_record), ("--again", again)):
        if given and candidate_path is None:
            raise InputError(
                "evaluate",
                f"{flag} applies to the judgement of a candidate; there is none",
                field=flag.lstrip("-"),
                hint="pass a candidate file, or leave the option out",
            )
    candidate = read_candidate(candidate_path) if candidate_path is not None else None
    judged_in: Path | None = None  # the ledger a judgement is recorded in: set exactly when there is a candidate
    if candidate is not None:
        refuse_placeholders(candidate)
        judged_in = ledger_path = resolve_ledger(ledger_path)  # only a judgement is recorded: scoring needs none
        check_appendable(judged_in)
    elif ledger_path is None:
        try:  # named in the output all the same: the ledger a judgement here would be recorded in
            ledger_path = default_ledger()
        except InputError:
            ledger_path = None
    if candidate is not None:
        refuse_unplanned_rules(tolerances, plan, "evaluate")
    if plan is not None and judged_in is not None:  # (a plan without a candidate is refused above)
        check_plan(judged_in, plan, tolerances, "evaluate", candidate)
    if candidate is not None:
        held_out, found = heldout.judgement_fields(fixtures_dir, ledger_path, verb, allow_held_out)
        held_out_warnings = [heldout.override_warning(found)] if found else []
    else:  # nothing else is recorded: an override is an entry of its own
        held_out, held_out_warnings = {}, heldout.guard_store(fixtures_dir, ledger_path, verb, allow_held_out)
    model_path = Path(model_path) if model_path is not None else default_model()
    model = load_model(model_path)
    if commit and judged_in is not None:  # refused before scoring: no entry for a commit that must not happen
        refuse_foreign_ledger(model_path, judged_in, "evaluate")
    warnings = held_out_warnings + [w for w in (edited_since_written(model_path, model),) if w]
    warnings += ledger_disagrees(model_path, ledger_path)
    if judged_in is not None:
        warnings += _other_checkouts(model_path, judged_in)
    judged = judgements(judged_in) if judged_in is not None else []
    if candidate is not None:
        warnings += _stem_is_id(candidate) + _reused_id(judged, candidate)
    candidate_model = candidate.apply(model) if candidate is not None else None
    suite = load_suites(fixtures_dir, split)
    if plan is not None and judged_in is not None:
        from hops_calib.loop.plans import check_plan_stores

        check_plan_stores(judged_in, plan, suite, "evaluate")
    fixtures_dir = suite.fixtures_dir
    check = None
    links: dict[str, Any] = {}
    if candidate is not None and candidate_model is not None and judged_in is not None:
        from hops_calib.loop.ledger import read_entries

        links, repeated = check_rejudgement(
            list(read_entries(judged_in)),
            "evaluate",
            model.sha256,
            candidate_model.sha256,
            suite.sha256,
            tolerances,
            plan,
            again,
            f"candidate {candidate.id} ({candidate.change.describe()})",
            candidate.origin,
            judged_in,
        )
        warnings += repeated
        check = calibration.check_store(
            calibration.read_record(judged_in),
            calibration.scope_of_change(candidate.change),
            suite,
            "evaluate",
            off_record=off_record,
        )
        warnings += check.warnings
    progress.start(len(suite.ids) * (2 if candidate is not None else 1))
    series = stall_series(suite) if tolerances.stall_free else None
    before = score_model(suite, model, origin=str(model_path), progress=progress, stall_free=series)
    scored = Evaluation(
        split=split,
        fixtures_dir=Path(fixtures_dir),
        fixture_set_sha256=suite.sha256,
        model_path=model_path,
        model=model,
        tolerances=tolerances,
        before=before,
        stall_free_computed=series is not None,
        ledger_path=Path(ledger_path) if ledger_path is not None else None,
        left_out=suite.left_out_summary,
        stores=tuple(store_fields(part) for part in suite.parts),
        warnings=tuple(warnings),
    )
    if candidate is None or candidate_model is None or judged_in is None or check is None:  # (all four, or none)
        return scored

    after = score_model(suite, candidate_model, origin=candidate.origin, progress=progress, stall_free=series)
    verdict = judge(suite, before, after, tolerances)
    moved = verdict.runs_moved or ()
    unmoved = not moved
    if unmoved and (not off_record or commit):
        calibration.refuse_unmoved(
            moved, len(suite.ids), f"candidate {candidate.id} ({candidate.change.describe()})", "evaluate", check
        )  # --commit of a value no run tested: refused even so
    marked = check.off_record or unmoved
    if unmoved:
        warnings.append(
            f"judged off the record (--off-record): {candidate.id} moves none of the {len(suite.ids)} "
            "runs' predictions on this store"
        )
    entry = {
        "kind": "evaluate",
        "time": now_utc(),
        "candidate": candidate_record(candidate),
        "model_path": str(model_path),
        "model_sha256_before": model.sha256,
        "model_sha256_after": candidate_model.sha256,
        **fixture_fields(suite),
        "split": split,
        "n_fixtures": len(suite.ids),
        **({"left_out": suite.left_out_summary} if suite.left_out else {}),
        "aggregates_before": before.suite.to_dict(),
        "aggregates_after": after.suite.to_dict(),
        **verdict.to_dict(),
        "committed": bool(commit and verdict.accepted),
        **({"plan_seq": plan} if plan is not None else {}),
        "rules": rules(plan, tolerances),
        **links,
        **({"off_record": True, "off_record_reason": warnings[-1]} if marked else {}),
        **held_out,
        "code_revision": code_revision(),
    }
    if entry["committed"]:
        written = _commit(model_path, model, candidate_model, judged_in, entry)
    else:
        from hops_calib.loop import ledger

        written = ledger.append(judged_in, entry)
    return replace(
        scored,
        warnings=tuple(warnings),
        candidate=candidate,
        candidate_model=candidate_model,
        after=after,
        verdict=verdict,
        ledger_entry=written,
        committed=entry["committed"],
        calibration=check,
    )


def fixture_fields(suite) -> dict[str, Any]:
    """What a judgement's ledger entry says of its runs: the fixture set's sha256, the store's path, the run ids and
    their device types (the calibration record reads them: `hops_calib.loop.calibration`). For several stores
    (`Suite.parts`): the union's sha256, the paths, and each store's own fields in `fixture_sets`."""
    if not suite.parts:
        return store_fields(suite, with_count=False)
    from hops_calib.loop.calibration import store_devices

    return {
        "fixture_set_sha256": suite.sha256,
        "fixtures": [str(Path(p.fixtures_dir).resolve()) for p in suite.parts],
        "fixture_devices": list(store_devices(suite)),
        "fixture_sets": [store_fields(part) for part in suite.parts],
    }


def store_fields(suite, with_count: bool = True) -> dict[str, Any]:
    """One store's fixture set as a judgement records it."""
    from hops_calib.loop.calibration import store_devices

    return {
        "fixture_set_sha256": suite.sha256,
        "fixtures": str(Path(suite.fixtures_dir).resolve()),
        "fixture_runs": sorted(suite.ids),
        "fixture_devices": list(store_devices(suite)),
        **({"n_fixtures": len(suite.ids)} if with_count else {}),
    }


def judge(suite, before: ModelScore, after: ModelScore, tolerances: Tolerances) -> GateResult:
    """The gate's verdict of `after` against `before` on `suite`: on one store, `gate`; on several, each store's
    rules (`gate_stores`)."""
    if not suite.parts:
        return gate(before.runs, after.runs, before.suite, after.suite, tolerances)
    from hops_calib.loop.gate import gate_stores

    return gate_stores(
        before.runs, after.runs, [(str(Path(p.fixtures_dir).resolve()), p.ids) for p in suite.parts], tolerances
    )


def _commit(
    model_path: Path, model: Model, changed: Model, ledger_path: Path | str, entry: dict[str, Any]
) -> dict[str, Any]:
    """Record the accepted candidate, then write it into the model file, refusing if the file moved meanwhile.

    Under the model file's lock: the file must still hold the model the
    candidate was judged against (another commit may have landed since); the
    ledger entry is appended first, so a model file never changes unrecorded.
    """

    def still_judged(current: Model) -> None:
        if current.sha256 != model.sha256:
            raise InputError(
                model_path,
                f"the model file changed while the candidate was evaluated (sha256 "
                f"{model.sha256[:12]} -> {current.sha256[:12]}); nothing was committed or recorded",
                hint="evaluate the candidate again against the current model",
            )

    return record_and_write(model_path, still_judged, changed, ledger_path, entry)


def record_and_write(
    model_path: Path,
    check: Callable[[Model], None],
    written_model: Model,
    ledger_path: Path | str,
    entry: dict[str, Any],
) -> dict[str, Any]:
    """Under the model file's lock: `check` what it holds (raises to refuse), append `entry`, write the model."""
    from filelock import FileLock

    from hops_calib.loop import ledger
    from hops_calib.loop.model_files import load_model, write_model

    with FileLock(str(model_path) + ".lock", timeout=ledger.LOCK_TIMEOUT_S):
        check(load_model(model_path))
        written = ledger.append(ledger_path, entry)
        write_model(model_path, written_model, written)
    return written
