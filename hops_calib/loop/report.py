"""The held-out report: suite aggregates only on the test split, with an audit entry in the ledger for every look;
what a look would tell (`preview_look`), and the bootstrap intervals of a report's MAPE and gap to train."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop import heldout
from hops_calib.loop.commits import check_appendable
from hops_calib.loop.ledger import RUN_KEYS, code_revision, now_utc
from hops_calib.loop.ledger import resolve as resolve_ledger
from hops_calib.loop.score import RunScore, SuiteScore
from hops_calib.loop.suite import SPLITS, TEST, TRAIN, Suite, load_suite, open_store, score_model, suite_if_any
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress


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
    # The split's runs the model does not price, left out of the aggregates (`Suite.left_out_summary`).
    left_out: dict[str, Any] | None = None

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
        line = (
            f"{bounds['level']:.0%} interval over {bounds['resampled']} (bootstrap, {bounds['draws']} draws): "
            f"MAPE {low:.2f}-{high:.2f} %"
        )
        if "gap_to_train_pp" in bounds:
            train_low, train_high = bounds["train_throughput_mape_pct"]
            gap_low, gap_high = bounds["gap_to_train_pp"]
            line += (
                f", train {train_low:.2f}-{train_high:.2f} %, {self.split} minus train {gap_low:+.2f} to "
                f"{gap_high:+.2f} pp"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        entry = self.ledger_entry
        return {
            "split": self.split,
            "fixture_set_sha256": entry.get("fixture_set_sha256"),
            **self.suite.to_dict(),
            "model": entry.get("model_path"),
            "model_sha256": self.model_sha256,
            "train": self.train.to_dict() if self.train is not None else None,
            "gap_to_train_pp": self.gap_to_train_pp,
            "outside_train": self.outside_train,
            "predictions_changed": self.changed_since,
            "intervals": self.intervals,
            "left_out": self.left_out or {"count": 0, "reasons": []},
            "ledger": {
                "path": str(self.ledger_path),
                "seq": self.ledger_entry["seq"],
                "entry_sha256": self.ledger_entry["entry_sha256"],
            }
            if self.audited
            else None,
        }


def prediction_digest(prediction: Any) -> str:
    """A short digest of one prediction's `score.prediction_fingerprint`: two models with the same digests on a
    split are scored alike there. Made from the prediction alone, before any result is read."""
    from hops_calib.loop.score import prediction_fingerprint

    metrics = prediction.metrics
    fingerprint = prediction_fingerprint(
        metrics.throughput_per_s,
        metrics.steady_throughput_per_s,
        metrics.bubble_ratio,
        metrics.utilization_per_stage,
        prediction.stall_noise_ape_pct,
    )
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


class RepeatedLook(InputError):
    """A held-out report whose answer the ledger already holds: the model predicts every configuration as an
    earlier look's did."""

    def __init__(self, split: str, entry: dict[str, Any], n: int, fixture_set: str) -> None:
        self.seq = int(entry["seq"])
        model = str(entry.get("model_sha256", ""))[:12]
        same = (
            "the same model"
            if "prediction_digests" not in entry
            else f"model {model}, whose predictions on all {n} {split} configurations are this model's"
        )
        if entry.get("fixture_set_sha256") != fixture_set:  # (`ledger.look_repeats`)
            same = (
                f"model {model} on runs this look scores, under another fixture set (the runs re-ingested, moved "
                f"or renamed, or runs added or dropped since): the same model, or this model's predictions of "
                f"every run"
            )
        super().__init__(
            "report",
            f"this look would repeat entry {self.seq} ({same}): its result is already in "
            f"the ledger, and nothing was scored or appended",
            field="split",
            hint=f"read it with `hops-calib ledger looks`; a change that moves no {split} prediction "
            "tells nothing new there. Pass --again to look anyway (recorded as a repeat)",
        )


def _earlier_looks(ledger_path: Path | str, split: str, fixture_set: str | None) -> list[dict[str, Any]]:
    """The ledger's looks at `split`, in order: on `fixture_set`, or on any fixture set (None)."""
    from hops_calib.loop import ledger

    if not Path(ledger_path).exists():
        return []
    return [
        e
        for e in ledger.read_entries(ledger_path)
        if e.get("kind") == "report" and e.get("split") == split and fixture_set in (None, e.get("fixture_set_sha256"))
    ]


def run_keys(suite: Suite) -> list[list[str]]:
    """Each run of a suite, in order, by what names it and how it was configured, without naming it and without
    anything it measured: [sha256 of its id, its configuration digest (`hops_calib.store.guard`)], 16 hex digits
    each. A later look at the same runs, re-ingested, moved or renamed, shares one of them. (Entries written before
    carry a measured digest as the second key: they match no later look by it, only by the id.)"""
    from hops_calib.store.guard import CONFIG_KEY, configuration_digest

    store = open_store(suite.fixtures_dir)
    keys = []
    for fixture in store.load_many(list(suite.ids)):
        keys.append(
            [
                hashlib.sha256(f"run id {fixture.id}".encode()).hexdigest()[:16],
                configuration_digest(fixture)[len(CONFIG_KEY) :][:16],
            ]
        )
    return keys


def _look_inputs(fixtures_dir: Path | str, split: str, model_path: Path | str | None) -> tuple[Path, Model, Suite]:
    from hops_calib.loop.model_files import default_model, load_model

    if split not in SPLITS:
        raise InputError("report", f"unknown split {split!r}", field="split", hint=f"expected one of {SPLITS}")
    model_path = Path(model_path) if model_path is not None else default_model()
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


def _look_against_earlier(suite: Suite, model: Model, model_path: Path, split: str, ledger_path: Path | None):
    """The model's predictions of `suite`, their digests, the suite's `run_keys` (None for train), the earlier look
    this one would repeat (or None), and {"seq", "changed", "of"} against the latest earlier look on the same
    fixture set that recorded its digests (or None). `ledger_path`: a held-out look's ledger (None for train)."""
    from hops_calib.loop.ledger import look_repeats, predictions_moved

    predictions, digests = _predicted_digests(suite, model, model_path, split)
    if split == TRAIN or ledger_path is None:
        return predictions, digests, None, None, None
    keys = run_keys(suite)
    earlier = _earlier_looks(ledger_path, split, None)
    # The same model whose predictions moved (the simulator's code changed) is no repeat: its look tells what the
    # code change did. Where a look recorded no digests (before they existed), the same model stands in. A look at
    # another fixture set repeats one whose runs it shares (`look_repeats`): re-ingesting or moving the runs, or
    # adding some, does not make the same model's look new.
    repeat = next((e for e in reversed(earlier) if look_repeats(e, suite.sha256, model.sha256, digests, keys)), None)
    recorded = next(
        (e for e in reversed(earlier) if e.get("prediction_digests") and e.get("fixture_set_sha256") == suite.sha256),
        None,
    )
    changed_since = None
    if recorded is not None:
        changed_since = {
            "seq": int(recorded["seq"]),
            "of": len(digests),
            "changed": predictions_moved(recorded["prediction_digests"], digests),
        }
    return predictions, digests, keys, repeat, changed_since


def preview_look(
    fixtures_dir: Path | str,
    *,
    split: str = TEST,
    model_path: Path | str | None = None,
    ledger_path: Path | str | None = None,
    against: Path | str | None = None,
) -> dict[str, Any]:
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
    _, digests, _keys, repeat, changed_since = _look_against_earlier(suite, model, model_path, split, ledger_path)
    compared = None
    if against is not None:
        from hops_calib.loop.model_files import load_model

        other = load_model(against)
        _, theirs = _predicted_digests(suite, other, against, split)
        compared = {"model_sha256": other.sha256, "changed": predictions_moved(theirs, digests)}
    return {
        "split": split,
        "model_sha256": model.sha256,
        "of": len(digests),
        "repeat_of": int(repeat["seq"]) if repeat is not None else None,
        "changed_since": changed_since,
        "against": compared,
    }


BOOTSTRAP_DRAWS, INTERVAL_LEVEL = 2000, 0.95


def bootstrap_intervals(runs: Sequence[RunScore], train_runs: Sequence[RunScore] | None = None) -> dict[str, Any]:
    """95 % intervals of the throughput MAPE over configurations: resample a split's configurations (repeats
    together) with replacement, seeded, and read the MAPE's spread; with train's runs, also train's and the
    held-out minus train gap's (the two splits resampled independently). Aggregates only: no run is named."""
    from hops_calib.loop.score import interval, mape_draws

    draws = mape_draws(runs, [r.group for r in runs], draws=BOOTSTRAP_DRAWS, seed=0)
    out: dict[str, Any] = {
        "level": INTERVAL_LEVEL,
        "draws": BOOTSTRAP_DRAWS,
        "resampled": "configurations",
        "throughput_mape_pct": interval(draws, INTERVAL_LEVEL),
    }
    if train_runs is not None:
        train_draws = mape_draws(train_runs, [r.group for r in train_runs], draws=BOOTSTRAP_DRAWS, seed=1)
        out["train_throughput_mape_pct"] = interval(train_draws, INTERVAL_LEVEL)
        out["gap_to_train_pp"] = interval(draws - train_draws, INTERVAL_LEVEL)
    return out


def report(
    fixtures_dir: Path | str,
    *,
    split: str = TEST,
    model_path: Path | str | None = None,
    ledger_path: Path | str | None = None,
    progress: Progress = QUIET,
    again: bool = False,
) -> Report:
    """Suite aggregates on `split` (the held-out test split by default), and for it an audit entry in the ledger
    (a train report appends nothing: `Report.audited` is False).

    Only aggregates leave this function: no per-run error, so nobody can tune
    against single held-out runs through it. A held-out look whose model predicts every configuration as an
    earlier look's model did (same digests, or the same model), or that shares runs with an earlier look on
    another fixture set (`ledger.look_repeats`), is refused before anything is scored (`RepeatedLook`), unless
    `again`: its answer is in the ledger already. The entry records the predictions' digests and the runs'
    `run_keys` in the suite's order (no fixture id), so that later looks can be compared with it.
    """
    from hops_calib.loop import ledger

    # A train report reads and appends nothing; a held-out look needs the project's ledger (or the one named).
    audit_ledger = resolve_ledger(ledger_path) if split != TRAIN else None
    if audit_ledger is not None:
        check_appendable(audit_ledger)
        ledger_path = audit_ledger
    model_path, model, suite = _look_inputs(fixtures_dir, split, model_path)
    # The predictions first, from the configurations alone: whether this look can tell anything new.
    predictions, digests, keys, repeat, changed_since = _look_against_earlier(
        suite, model, model_path, split, audit_ledger
    )
    if repeat is not None and not again:
        raise RepeatedLook(split, repeat, len(digests), suite.sha256)
    # Beside a held-out report, the same model on train: the distance the calibration promise is judged by.
    train_suite = suite_if_any(fixtures_dir, TRAIN) if split != TRAIN else None
    progress.start(len(suite.ids) + (len(train_suite.ids) if train_suite is not None else 0))
    scored = score_model(suite, model, origin=str(model_path), progress=progress, predictions=predictions)
    train_scored = score_model(train_suite, model, origin=str(model_path), progress=progress) if train_suite else None
    train = train_scored.suite if train_scored is not None else None
    intervals = bootstrap_intervals(scored.runs, train_scored.runs if train_scored is not None else None)
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
        **({"left_out": suite.left_out_summary} if suite.left_out else {}),
        "aggregates": scored.suite.to_dict(),
        **({"train_aggregates": train.to_dict()} if train is not None else {}),
        **({"outside_train": outside} if outside is not None else {}),
        "intervals": intervals,
        "prediction_digests": digests,
        **({RUN_KEYS: keys} if keys is not None else {}),
        **({"repeat_of": int(repeat["seq"])} if repeat is not None else {}),
        # the groups this look held out, by name and by their runs' events: never trained on from now on
        **({heldout.HELD_OUT_KEY: heldout.store_held_out(open_store(fixtures_dir))} if split == TEST else {}),
        "decision": "audit",
        "code_revision": code_revision(),
    }
    # Only a look at the held-out split is audited; the train split may be read at will, so a train report
    # leaves the ledger alone (its record, unappended, still describes the page it may write).
    written = ledger.append(audit_ledger, entry) if audit_ledger is not None else entry
    return Report(
        split=split,
        suite=scored.suite,
        model_sha256=model.sha256,
        ledger_path=Path(ledger_path) if ledger_path is not None else None,
        ledger_entry=written,
        train=train,
        outside_train=outside,
        changed_since=changed_since,
        intervals=intervals,
        left_out=suite.left_out_summary,
    )


def recorded_report(
    fixtures_dir: Path | str,
    *,
    split: str = TEST,
    model_path: Path | str | None = None,
    ledger_path: Path | str | None = None,
) -> Report | None:
    """The latest audit entry already in the ledger for this model, split and fixture set, as a `Report`; None if
    there is none. Nothing is scored and nothing is appended: quoting a held-out result again is not a new look.
    """
    from hops_calib.loop.model_files import default_model, load_model

    ledger_path = resolve_ledger(ledger_path)
    model_path = Path(model_path) if model_path is not None else default_model()
    model_sha = load_model(model_path).sha256
    found = next(
        (
            e
            for e in reversed(_earlier_looks(ledger_path, split, load_suite(fixtures_dir, split).sha256))
            if e.get("model_sha256") == model_sha
        ),
        None,
    )
    if found is None:
        return None
    known = {f.name for f in fields(SuiteScore)}

    def suite_score(aggregates: dict[str, Any]) -> SuiteScore:
        return SuiteScore(**{k: v for k, v in aggregates.items() if k in known})

    train = found.get("train_aggregates")
    return Report(
        split=split,
        suite=suite_score(found["aggregates"]),
        model_sha256=model_sha,
        ledger_path=Path(ledger_path),
        ledger_entry=found,
        train=suite_score(train) if train is not None else None,
        outside_train=found.get("outside_train"),
        left_out=found.get("left_out"),
    )
