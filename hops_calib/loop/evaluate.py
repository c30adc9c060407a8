"""The loop: score a model on the train split, gate a one-term candidate, record the answer, audit the test split.

- `evaluate` scores the model (and a candidate's changed model) on the train
  split, applies the gate, appends a ledger entry for every candidate, and with
  `commit=True` writes an accepted candidate into the model file.
- `report` scores the held-out split, returns suite aggregates only, and
  appends an audit entry to the ledger every time.
- `refuse_test_split` is the guard every train-only verb calls (rule 2).

This module returns results; `hops_calib.cli.loop` prints them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

from hops_calib.loop.candidate import Candidate, read_candidate
from hops_calib.errors import InputError
from hops_calib.loop.gate import GateResult, Tolerances, gate
from hops_calib.loop.ledger import code_revision, now_utc
from hops_calib.loop.ledger import check_appendable, resolve as resolve_ledger
from hops_calib.metrics import TimelineMetrics
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress, warn
from hops_calib.loop.score import RunScore, SuiteScore, aggregate, score_prediction
from hops_calib.spec import Spec

TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)


class ProtectedSplit(InputError):
    """A train-only verb asked to read the test split."""


def refuse_test_split(split: str, verb: str) -> None:
    """Rule 2: only the held-out report reads the test split."""
    if split == TEST:
        raise ProtectedSplit(verb, "refuses the test split: parameters and candidates are judged on train only",
                             field="split", hint="the test split is read only by `hops-calib report --split "
                             "test`, which prints suite aggregates and leaves an audit entry in the ledger")
    if split not in SPLITS:
        raise InputError(verb, f"unknown split {split!r}", field="split", hint=f"expected one of {SPLITS}")


@dataclass(frozen=True)
class Suite:
    """The fixtures of one split, as a prediction and the scoring need them: spec and truth metrics, no events."""

    fixtures_dir: Path
    split: str
    ids: tuple[str, ...]
    specs: tuple[Spec, ...]
    truths: tuple[TimelineMetrics, ...]
    content_hashes: tuple[str, ...]

    @property
    def sha256(self) -> str:
        """Hash of the fixture set: which runs, at which content."""
        return fixture_set_digest(self.ids, self.content_hashes)


def fixture_set_digest(ids: Sequence[str], content_hashes: Sequence[str]) -> str:
    """The `fixture_set_sha256` of the ledger and every --json: which runs, at which content."""
    listing = "\n".join(f"{i} {h}" for i, h in sorted(zip(ids, content_hashes)))
    return hashlib.sha256(listing.encode()).hexdigest()


def open_store(fixtures_dir: Path | str):
    """The fixture store of the loop's verbs. Its loaders raise FixtureFileError (a StoreError: exit 2) naming the
    file and line of a fixture that is not as ingest wrote it, and saying to ingest its job again."""
    from hops_calib.store import FixtureStore

    store = FixtureStore(fixtures_dir)
    if not store.exists():
        raise InputError(fixtures_dir, "no fixture store here",
                         hint=f"ingest runs first: hops-calib ingest SRC --fixtures {fixtures_dir}")
    unfinished = store.unfinished()
    if unfinished:  # the fixtures there are whole, but the runs being written when it stopped are missing
        warn(f"warning: {fixtures_dir}: an ingest stopped before it finished ({', '.join(unfinished[:3])}"
             f"{', ...' if len(unfinished) > 3 else ''}): the runs it was writing are not in the store; run the "
             "same hops-calib ingest again to finish it")
    return store


def load_suite(fixtures_dir: Path | str, split: str) -> Suite:
    store = open_store(fixtures_dir)
    ids = store.ids(split)
    if not ids:
        raise InputError(fixtures_dir, f"the fixture store has no {split} fixtures",
                         hint=f"ingest runs into it (hops-calib ingest SRC --fixtures {fixtures_dir})")
    return _suite_of(store, fixtures_dir, split, ids)


def _suite_if_any(fixtures_dir: Path | str, split: str) -> Suite | None:
    """`load_suite`, or None when the store has no fixtures in `split` (a store may hold one split only)."""
    store = open_store(fixtures_dir)
    ids = store.ids(split)
    return _suite_of(store, fixtures_dir, split, ids) if ids else None


def _suite_of(store, fixtures_dir: Path | str, split: str, ids: Sequence[str]) -> Suite:
    fixtures = [store.load(fixture_id) for fixture_id in ids]
    strays = [f.id for f in fixtures if f.split != split]
    if strays:  # the index lists them in this split, their own (digested) fixture.json says otherwise
        from hops_calib.store.fixture_store import INDEX, StoreError

        raise StoreError(f"{Path(fixtures_dir) / INDEX}: lists {', '.join(strays[:3])} in the {split} split, which "
                         f"their fixture.json does not; delete {INDEX} (it is rebuilt from the fixture folders)")
    return Suite(fixtures_dir=Path(fixtures_dir), split=split, ids=tuple(ids),
                 specs=tuple(f.spec for f in fixtures), truths=tuple(f.truth.metrics for f in fixtures),
                 content_hashes=tuple(f.content_hash for f in fixtures))


@dataclass(frozen=True)
class ModelScore:
    runs: tuple[RunScore, ...]
    suite: SuiteScore


def score_model(suite: Suite, model: Model, *, origin: str, progress: Progress = QUIET,
                stall_free: Sequence[Any] | None = None, predictions: Sequence[Any] | None = None) -> ModelScore:
    """Predict every run of `suite` from its spec alone and score it against its truth.

    `progress` advances once per run; the caller starts it (it may score more than one model).
    `stall_free`: the runs' `stall_series(suite)`, to score each run's stall-free error as well.
    `predictions`: the model's predictions of the suite's runs, in order, when the caller already made them.
    """
    from hops_calib.model.predict import predict

    runs = []
    for i, (fixture_id, spec, truth) in enumerate(zip(suite.ids, suite.specs, suite.truths)):
        try:
            prediction = predictions[i] if predictions is not None else predict(spec, model)
            runs.append(score_prediction(fixture_id, truth, prediction,
                                         stall_free[i] if stall_free is not None else None))
        except ValueError as error:
            raise InputError(origin, f"model {model.name!r} cannot be scored on fixture {fixture_id}: {error}"
                             ) from None
        progress.advance(fixture_id)
    return ModelScore(runs=tuple(runs), suite=aggregate(runs))


def stall_series(suite: Suite) -> tuple[Any, ...]:
    """Each run's iteration part series (its stalls), read from its events once for `score_model(stall_free=)`."""
    from hops_calib.metrics import timeline_iteration_part_series

    store = open_store(suite.fixtures_dir)
    return tuple(timeline_iteration_part_series(store.load(fixture_id).timeline()) for fixture_id in suite.ids)


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


def _judgements(ledger_path: Path | str) -> list[dict[str, Any]]:
    """The ledger's candidate judgements (evaluate entries), in order; none when the ledger does not exist yet."""
    from hops_calib.loop import ledger

    return [e for e in ledger.read_entries(ledger_path) if e.get("kind") == "evaluate" and e.get("candidate")]


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
             plan: int | None = None, progress: Progress = QUIET) -> Evaluation:
    """Score the model on the train split; with a candidate, gate it, record it, and commit it if asked and accepted.

    `progress` sees one unit per prediction (two per run with a candidate). `plan`: the ledger entry (`ledger
    plan`) whose tolerances this judgement was stated under beforehand; they must be the ones given.
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
    model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL
    model = load_model(model_path)
    warnings = [w for w in (edited_since_written(model_path, model),) if w]
    judged = _judgements(ledger_path) if candidate is not None else []
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

    return _record_and_write(model_path, still_judged, changed, ledger_path, entry)


def _record_and_write(model_path: Path, check: Callable[[Model], None], written_model: Model,
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
            commit_into: Path | str | None = None, plan: int | None = None, progress: Progress = QUIET) -> Comparison:
    """Gate a whole model file (`after_path`, default the shipped one) against another on the train split; record it.

    For a move: one-term candidates that hold the suite only together land one by one, each recorded with the
    relaxed tolerances it needed; this judges the model after the last step against the model before the first
    under the tolerances given (those single candidates are held to), and leaves that judgement in the ledger.

    With `commit_into` (a model file holding the model before or after, usually the shipped one the steps were
    committed into) the verdict is carried out there: the model after if accepted, the model before if
    rejected, so a rejected move is undone in the file and in the ledger's history alike.

    `plan`: the ledger entry (`ledger plan`) whose tolerances the move was to be judged under, stated before its
    steps were evaluated; they must be the ones given.
    """
    from hops_calib.loop import ledger
    from hops_calib.loop.model_files import DEFAULT_MODEL, load_model

    ledger_path = resolve_ledger(ledger_path)
    check_appendable(ledger_path)
    if plan is not None:
        check_plan(ledger_path, plan, tolerances, "compare")

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
        "code_revision": code_revision(),
    }
    if commit_into is None:
        written = ledger.append(ledger_path, entry)
    else:
        kept = after_model if verdict.accepted else before_model
        entry.update(committed=True, committed_into=str(commit_into), model_sha256_committed=kept.sha256)
        written = _record_and_write(Path(commit_into), _holds_an_end(Path(commit_into), before_model, after_model),
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


@dataclass(frozen=True)
class Report:
    split: str
    suite: SuiteScore
    model_sha256: str
    ledger_path: Path | None  # None: a train report, which reads and appends nothing
    ledger_entry: dict[str, Any]
    # The same model on the train split, beside a held-out report: how far the held-out MAPE is from it.
    train: SuiteScore | None = None
    # Beside a held-out report: how many of its configurations lie outside the train runs, and in which features
    # (hops_calib.model.coverage.outside_counts; configurations only).
    outside_train: dict[str, Any] | None = None
    # Against the latest earlier look at this split and fixture set that recorded its predictions: its entry,
    # and on how many configurations this model predicts otherwise ({"seq", "changed", "of"}); None if none.
    changed_since: dict[str, int] | None = None
    # Configuration-bootstrap intervals of the MAPE (and beside a held-out report, of train's and of the gap):
    # `bootstrap_intervals`.
    intervals: dict[str, Any] | None = None

    @property
    def audited(self) -> bool:
        """Whether the report is in the ledger (a look at the held-out split; a train report is not recorded)."""
        return "seq" in self.ledger_entry

    @property
    def gap_to_train_pp(self) -> float | None:
        """Held-out throughput MAPE minus train throughput MAPE (pp), for a held-out report."""
        return self.suite.throughput_mape_pct - self.train.throughput_mape_pct if self.train is not None else None

    def interval_sentence(self) -> str | None:
        """The intervals in words: '95% interval over configurations (...): MAPE a-b %, train c-d %, ...'."""
        if self.intervals is None:
            return None
        bounds = self.intervals
        low, high = bounds["throughput_mape_pct"]
        line = (f"{bounds['level']:.0%} interval over {bounds['resampled']} (bootstrap, {bounds['draws']} draws): "
                f"MAPE {low:.2f}-{high:.2f} %")
        if "gap_to_train_pp" in bounds:
            train_low, train_high = bounds["train_throughput_mape_pct"]
            gap_low, gap_high = bounds["gap_to_train_pp"]
            line += (f", train {train_low:.2f}-{train_high:.2f} %, {self.split} minus train {gap_low:+.2f} to "
                     f"{gap_high:+.2f} pp")
        return line

    def to_dict(self) -> dict[str, Any]:
        entry = self.ledger_entry
        return {"split": self.split, "fixture_set_sha256": entry.get("fixture_set_sha256"), **self.suite.to_dict(),
                "model": entry.get("model_path"), "model_sha256": self.model_sha256,
                "train": self.train.to_dict() if self.train is not None else None,
                "gap_to_train_pp": self.gap_to_train_pp, "outside_train": self.outside_train,
                "predictions_changed": self.changed_since, "intervals": self.intervals,
                "ledger": {"path": str(self.ledger_path), "seq": self.ledger_entry["seq"],
                           "entry_sha256": self.ledger_entry["entry_sha256"]} if self.audited else None}


def prediction_digest(prediction: Any) -> str:
    """A short digest of one prediction's `score.prediction_fingerprint`: two models with the same digests on a
    split are scored alike there. Made from the prediction alone, before any result is read."""
    from hops_calib.loop.score import prediction_fingerprint

    metrics = prediction.metrics
    fingerprint = prediction_fingerprint(metrics.throughput_per_s, metrics.steady_throughput_per_s,
                                         metrics.bubble_ratio, metrics.utilization_per_stage,
                                         prediction.stall_noise_ape_pct)
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


class RepeatedLook(InputError):
    """A held-out report whose answer the ledger already holds: the model predicts every configuration as an
    earlier look's did."""

    def __init__(self, split: str, entry: dict[str, Any], n: int) -> None:
        self.seq = int(entry["seq"])
        same = ("the same model" if "prediction_digests" not in entry else
                f"model {str(entry.get('model_sha256', ''))[:12]}, whose predictions on all {n} {split} "
                f"configurations are this model's")
        super().__init__("report", f"this look would repeat entry {self.seq} ({same}): its result is already in "
                         f"the ledger, and nothing was scored or appended", field="split",
                         hint=f"read it with `hops-calib ledger looks`; a change that moves no {split} prediction "
                              "tells nothing new there. Pass --again to look anyway (recorded as a repeat)")


def _earlier_looks(ledger_path: Path | str, split: str, fixture_set: str) -> list[dict[str, Any]]:
    from hops_calib.loop import ledger

    if not Path(ledger_path).exists():
        return []
    return [e for e in ledger.read_entries(ledger_path) if e.get("kind") == "report" and e.get("split") == split
            and e.get("fixture_set_sha256") == fixture_set]


def _look_inputs(fixtures_dir: Path | str, split: str, model_path: Path | str | None) -> tuple[Path, Model, Suite]:
    from hops_calib.loop.model_files import DEFAULT_MODEL, load_model

    if split not in SPLITS:
        raise InputError("report", f"unknown split {split!r}", field="split", hint=f"expected one of {SPLITS}")
    model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL
    model = load_model(model_path)
    suite = load_suite(fixtures_dir, split)
    return model_path, model, suite


def _predicted_digests(suite: Suite, model: Model, model_path: Path | str, split: str) -> tuple[list[Any], list[str]]:
    """The model's predictions of `suite`'s configurations and their digests (no result is read)."""
    from hops_calib.model.predict import predict

    try:
        predictions = [predict(spec, model) for spec in suite.specs]
    except ValueError as error:
        raise InputError(str(model_path), f"model {model.name!r} cannot predict the {split} split: {error}") from None
    return predictions, [prediction_digest(p) for p in predictions]


def _look_against_earlier(suite: Suite, model: Model, model_path: Path, split: str, ledger_path: Path | str):
    """The model's predictions of `suite`, their digests, the earlier look this one would repeat (or None), and
    {"seq", "changed", "of"} against the latest earlier look that recorded its digests (or None)."""
    from hops_calib.loop.ledger import predictions_moved, repeats

    predictions, digests = _predicted_digests(suite, model, model_path, split)
    earlier = _earlier_looks(ledger_path, split, suite.sha256) if split != TRAIN else []
    # The same model whose predictions moved (the simulator's code changed) is no repeat: its look tells what the
    # code change did. Where a look recorded no digests (before they existed), the same model stands in.
    repeat = next((e for e in reversed(earlier) if repeats(e, model.sha256, digests)), None)
    recorded = next((e for e in reversed(earlier) if e.get("prediction_digests")), None)
    changed_since = None
    if recorded is not None:
        changed_since = {"seq": int(recorded["seq"]), "of": len(digests),
                         "changed": predictions_moved(recorded["prediction_digests"], digests)}
    return predictions, digests, repeat, changed_since


def preview_look(fixtures_dir: Path | str, *, split: str = TEST, model_path: Path | str | None = None,
                 ledger_path: Path | str | None = None, against: Path | str | None = None) -> dict[str, Any]:
    """What a `report` of `split` would tell that the ledger does not: from the model's predictions of the
    configurations alone (no result is scored, nothing is appended). {"split", "model_sha256", "of",
    "repeat_of": the look it would repeat or None, "changed_since": as Report.changed_since, "against": with
    `against` (another model file, e.g. the one an earlier look without digests was made with), on how many
    configurations the two models predict otherwise: {"model_sha256", "changed"}}."""
    from hops_calib.loop.ledger import predictions_moved

    ledger_path = resolve_ledger(ledger_path)
    from hops_calib.loop.ledger import warn_if_broken

    warn_if_broken(ledger_path)
    model_path, model, suite = _look_inputs(fixtures_dir, split, model_path)
    _, digests, repeat, changed_since = _look_against_earlier(suite, model, model_path, split, ledger_path)
    compared = None
    if against is not None:
        from hops_calib.loop.model_files import load_model

        other = load_model(against)
        _, theirs = _predicted_digests(suite, other, against, split)
        compared = {"model_sha256": other.sha256, "changed": predictions_moved(theirs, digests)}
    return {"split": split, "model_sha256": model.sha256, "of": len(digests),
            "repeat_of": int(repeat["seq"]) if repeat is not None else None, "changed_since": changed_since,
            "against": compared}


BOOTSTRAP_DRAWS, INTERVAL_LEVEL = 2000, 0.95


def bootstrap_intervals(ids: Sequence[str], runs: Sequence[RunScore], train_ids: Sequence[str] | None = None,
                        train_runs: Sequence[RunScore] | None = None) -> dict[str, Any]:
    """95 % intervals of the throughput MAPE over configurations: resample a split's configurations (repeats
    together) with replacement, seeded, and read the MAPE's spread; with train's runs, also train's and the
    held-out minus train gap's (the two splits resampled independently). Aggregates only: no run is named."""
    from hops_calib.loop.score import interval, mape_draws
    from hops_calib.store.split import group_of

    draws = mape_draws(runs, [group_of(i) for i in ids], draws=BOOTSTRAP_DRAWS, seed=0)
    out: dict[str, Any] = {"level": INTERVAL_LEVEL, "draws": BOOTSTRAP_DRAWS, "resampled": "configurations",
                           "throughput_mape_pct": interval(draws, INTERVAL_LEVEL)}
    if train_runs is not None and train_ids is not None:
        train_draws = mape_draws(train_runs, [group_of(i) for i in train_ids], draws=BOOTSTRAP_DRAWS, seed=1)
        out["train_throughput_mape_pct"] = interval(train_draws, INTERVAL_LEVEL)
        out["gap_to_train_pp"] = interval(draws - train_draws, INTERVAL_LEVEL)
    return out


def report(fixtures_dir: Path | str, *, split: str = TEST, model_path: Path | str | None = None,
           ledger_path: Path | str | None = None, progress: Progress = QUIET, again: bool = False) -> Report:
    """Suite aggregates on `split` (the held-out test split by default), and for it an audit entry in the ledger
    (a train report appends nothing: `Report.audited` is False).

    Only aggregates leave this function: no per-run error, so nobody can tune
    against single held-out runs through it. A held-out look whose model predicts every configuration as an
    earlier look's model did (same digests, or the same model) is refused before anything is scored
    (`RepeatedLook`), unless `again`: its answer is in the ledger already. The entry records the predictions'
    digests in the suite's order (no fixture id), so that later looks can be compared with it.
    """
    from hops_calib.loop import ledger

    # A train report reads and appends nothing; a held-out look needs the project's ledger (or the one named).
    ledger_path = resolve_ledger(ledger_path) if split != TRAIN else ledger_path
    if split != TRAIN:
        check_appendable(ledger_path)
    model_path, model, suite = _look_inputs(fixtures_dir, split, model_path)
    # The predictions first, from the configurations alone: whether this look can tell anything new.
    predictions, digests, repeat, changed_since = _look_against_earlier(suite, model, model_path, split, ledger_path)
    if repeat is not None and not again:
        raise RepeatedLook(split, repeat, len(digests))
    # Beside a held-out report, the same model on train: the distance the calibration promise is judged by.
    train_suite = _suite_if_any(fixtures_dir, TRAIN) if split != TRAIN else None
    progress.start(len(suite.ids) + (len(train_suite.ids) if train_suite is not None else 0))
    scored = score_model(suite, model, origin=str(model_path), progress=progress, predictions=predictions)
    train_scored = score_model(train_suite, model, origin=str(model_path), progress=progress) if train_suite else None
    train = train_scored.suite if train_scored is not None else None
    intervals = bootstrap_intervals(suite.ids, scored.runs, train_suite.ids if train_suite else None,
                                    train_scored.runs if train_scored is not None else None)
    outside = None
    if train_suite is not None:
        from hops_calib.model.coverage import coverage, outside_counts

        outside = outside_counts(suite.specs, coverage(train_suite.specs))
    entry = {
        "kind": "report",
        "time": now_utc(),
        "model_path": str(model_path),
        "model_sha256": model.sha256,
        "fixture_set_sha256": suite.sha256,
        "split": split,
        "n_fixtures": len(suite.ids),
        "aggregates": scored.suite.to_dict(),
        **({"train_aggregates": train.to_dict()} if train is not None else {}),
        **({"outside_train": outside} if outside is not None else {}),
        "intervals": intervals,
        "prediction_digests": digests,
        **({"repeat_of": int(repeat["seq"])} if repeat is not None else {}),
        "decision": "audit",
        "code_revision": code_revision(),
    }
    # Only a look at the held-out split is audited; the train split may be read at will, so a train report
    # leaves the ledger alone (its record, unappended, still describes the page it may write).
    written = ledger.append(ledger_path, entry) if split != TRAIN else entry
    return Report(split=split, suite=scored.suite, model_sha256=model.sha256,
                  ledger_path=Path(ledger_path) if ledger_path is not None else None, ledger_entry=written,
                  train=train, outside_train=outside, changed_since=changed_since,
                  intervals=intervals)


def recorded_report(fixtures_dir: Path | str, *, split: str = TEST, model_path: Path | str | None = None,
                    ledger_path: Path | str | None = None) -> Report | None:
    """The latest audit entry already in the ledger for this model, split and fixture set, as a `Report`; None if
    there is none. Nothing is scored and nothing is appended: quoting a held-out result again is not a new look.
    """
    from hops_calib.loop.model_files import DEFAULT_MODEL, load_model

    ledger_path = resolve_ledger(ledger_path)
    model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL
    model_sha = load_model(model_path).sha256
    found = next((e for e in reversed(_earlier_looks(ledger_path, split, load_suite(fixtures_dir, split).sha256))
                  if e.get("model_sha256") == model_sha), None)
    if found is None:
        return None
    known = {f.name for f in fields(SuiteScore)}

    def suite_score(aggregates: dict[str, Any]) -> SuiteScore:
        return SuiteScore(**{k: v for k, v in aggregates.items() if k in known})

    train = found.get("train_aggregates")
    return Report(split=split, suite=suite_score(found["aggregates"]), model_sha256=model_sha,
                  ledger_path=Path(ledger_path), ledger_entry=found,
                  train=suite_score(train) if train is not None else None, outside_train=found.get("outside_train"))


# --- plans: the rules of a judgement, recorded before it --------------------------------------------------------

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
    judged = {_text_sha256_of(e["candidate"].get("text", "")): e for e in _judgements(ledger_path)}
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
