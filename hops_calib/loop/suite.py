"""The fixtures a loop verb scores and a model's scores on them: a split of the store as a `Suite` (its
fixture set's sha256 names it in the ledger), `score_model` (predict and score every run), and `refuse_test_split`,
the guard every train-only verb calls (rule 2)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop.score import RunScore, SuiteScore, aggregate, score_prediction
from hops_calib.metrics import IterationMetrics, TimelineMetrics
from hops_calib.model import Model
from hops_calib.progress import QUIET, Progress, warn
from hops_calib.spec import Spec

TRAIN, TEST = "train", "test"
SPLITS = (TRAIN, TEST)


class ProtectedSplit(InputError):
    """A train-only verb asked to read the test split."""


def refuse_test_split(split: str, verb: str) -> None:
    """Rule 2: only the held-out report reads the test split."""
    if split == TEST:
        raise ProtectedSplit(
            verb,
            "refuses the test split: parameters and candidates are judged on train only",
            field="split",
            hint="the test split is read only by `hops-calib report --split "
            "test`, which prints suite aggregates and leaves an audit entry in the ledger",
        )
    if split not in SPLITS:
        raise InputError(verb, f"unknown split {split!r}", field="split", hint=f"expected one of {SPLITS}")


@dataclass(frozen=True)
class Suite:
    """The fixtures of one split, as a prediction and the scoring need them: spec and truth metrics, no events."""

    fixtures_dir: Path
    split: str
    ids: tuple[str, ...]
    specs: tuple[Spec, ...]
    truths: tuple[TimelineMetrics | IterationMetrics, ...]
    content_hashes: tuple[str, ...]
    groups: tuple[str, ...]  # each run's stored group (the configuration it repeats; a run table's own rows too)
    # Runs of the split the model does not price (tensor or data parallelism, ...): id -> why. Not in `ids`, not
    # scored, not in the fixture set's sha256 (which names what was scored); every suite verb says how many.
    left_out: dict[str, str] = field(default_factory=dict, compare=False)
    # A union of several stores' suites (`union_suite`): the stores' own suites, in order; () for one store.
    parts: tuple[Suite, ...] = field(default=(), compare=False)

    @property
    def stores(self) -> tuple[Suite, ...]:
        """The one-store suites this suite is made of (itself for one store)."""
        return self.parts or (self,)

    @property
    def left_out_summary(self) -> dict[str, Any]:
        """{"count", "reasons": [{"reason", "count", "runs" (up to 3)}]}, as the suite verbs' --json carry it."""
        return left_out_summary(self.left_out)

    @property
    def has_events(self) -> tuple[bool, ...]:
        return tuple(truth.has_events for truth in self.truths)

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
        raise InputError(
            fixtures_dir,
            "no fixture store here",
            hint=f"ingest runs first: hops-calib ingest SRC --fixtures {fixtures_dir}",
        )
    running = store.running()
    if running:  # an ingest writing now: its temporary folders are work in progress, not the remains of a crash
        warn(f"warning: {running}")
    else:
        store.check_finished()  # an ingest stopped part way: what to run (its index may lag its folders)
        unfinished = store.unfinished()
        if unfinished:  # (left by an ingest of a hops-calib before the journal) the fixtures there are whole
            warn(
                f"warning: {fixtures_dir}: an ingest stopped before it finished ({', '.join(unfinished[:3])}"
                f"{', ...' if len(unfinished) > 3 else ''}): the runs it was writing are not in the store; run the "
                "same hops-calib ingest again to finish it"
            )
    return store


def load_suite(fixtures_dir: Path | str, split: str) -> Suite:
    store = open_store(fixtures_dir)
    ids = store.ids(split)
    if not ids:
        raise InputError(
            fixtures_dir,
            f"the fixture store has no {split} fixtures",
            hint=f"ingest runs into it (hops-calib ingest SRC --fixtures {fixtures_dir})",
        )
    return _suite_of(store, fixtures_dir, split, ids)


def load_suites(fixtures_dirs: Path | str | Sequence[Path | str], split: str) -> Suite:
    """The suite of one store, or the union of several stores' suites (`union_suite`) when given several."""
    dirs = [fixtures_dirs] if isinstance(fixtures_dirs, (str, Path)) else list(fixtures_dirs)
    if not dirs:
        raise InputError("--fixtures", "no fixture store given", field="fixtures", hint="pass --fixtures DIR")
    resolved = [Path(d).resolve() for d in dirs]
    twice = sorted({str(d) for d in resolved if resolved.count(d) > 1})
    if twice:
        raise InputError(
            "--fixtures", f"the store {twice[0]} is given more than once", field="fixtures", hint="name each store once"
        )
    suites = [load_suite(d, split) for d in dirs]
    return suites[0] if len(suites) == 1 else union_suite(suites)


def union_suite(suites: Sequence[Suite]) -> Suite:
    """One suite of several stores' runs (a judgement covering every store a model is calibrated on): their runs in
    store order, its sha256 the fixture set of them all; `parts` keeps each store's suite (the gate's suite rules
    hold per store). A run id in two stores is refused: the stores would hold one run twice."""
    seen: dict[str, Path] = {}
    for suite in suites:
        for run_id in suite.ids:
            if run_id in seen:
                raise InputError(
                    suite.fixtures_dir,
                    f"run {run_id} is also in the store {seen[run_id]}",
                    field="fixtures",
                    hint="judge on stores that hold different runs (one store per set of runs)",
                )
            seen[run_id] = suite.fixtures_dir
    left_out = {k: v for suite in suites for k, v in suite.left_out.items()}
    return Suite(
        fixtures_dir=suites[0].fixtures_dir,
        split=suites[0].split,
        ids=tuple(i for s in suites for i in s.ids),
        specs=tuple(x for s in suites for x in s.specs),
        truths=tuple(x for s in suites for x in s.truths),
        content_hashes=tuple(x for s in suites for x in s.content_hashes),
        groups=tuple(x for s in suites for x in s.groups),
        left_out=left_out,
        parts=tuple(suites),
    )


def suite_if_any(fixtures_dir: Path | str, split: str) -> Suite | None:
    """`load_suite`, or None when the store has no fixtures in `split` (a store may hold one split only)."""
    store = open_store(fixtures_dir)
    ids = store.ids(split)
    return _suite_of(store, fixtures_dir, split, ids) if ids else None


def _suite_of(store, fixtures_dir: Path | str, split: str, ids: Sequence[str]) -> Suite:
    from hops_calib.store.guard import configuration_digest

    fixtures = store.load_many(list(ids))
    strays = [f.id for f in fixtures if f.split != split]
    if strays:  # the index lists them in this split, their own (digested) fixture.json says otherwise
        from hops_calib.store.digests import INDEX, StoreError

        raise StoreError(
            f"{Path(fixtures_dir) / INDEX}: lists {', '.join(strays[:3])} in the {split} split, which "
            f"their fixture.json does not; delete {INDEX} (it is rebuilt from the fixture folders)"
        )
    fixtures, left_out = priced(fixtures)
    if not fixtures:
        reasons = "; ".join(f"{r['count']}: {r['reason']}" for r in left_out_summary(left_out)["reasons"])
        raise InputError(
            fixtures_dir,
            f"none of the {len(left_out)} {split} fixtures is priced by the cost model ({reasons})",
            field="split",
            hint="ingest runs the model prices (one GPU per pipeline stage), or extend the model",
        )
    # a test suite's fixture set is named by its runs' configurations: its digest, in a look's ledger entry and
    # JSON, says nothing they measured (hops_calib.store.guard)
    hashes = tuple(configuration_digest(f) if split == "test" else f.content_hash for f in fixtures)
    return Suite(
        fixtures_dir=Path(fixtures_dir),
        split=split,
        ids=tuple(f.id for f in fixtures),
        specs=tuple(f.spec for f in fixtures),
        truths=tuple(f.truth.metrics for f in fixtures),
        content_hashes=hashes,
        groups=tuple(f.group for f in fixtures),
        left_out=left_out,
    )


def unknown_device(devices: Sequence[str], known: frozenset[str]) -> str | None:
    """Why a run on `devices` cannot be priced by any model of the catalog, or None."""
    unknown = sorted(set(devices) - known)
    if not unknown:
        return None
    return (
        f"device type {unknown[0]!r} is not in the catalog (hops_calib/model/devices.toml knows "
        f"{', '.join(sorted(known))})"
    )


def priced(fixtures: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """The fixtures the cost model prices (runs with events, iteration-level runs whose spec builds, on device types
    of the catalog), and run id -> why for the others: one unpriceable run is left out, never the whole store."""
    from hops_calib.loop.model_files import device_types

    kept, reasons = [], {}
    known = device_types()
    for fixture in fixtures:
        if fixture.kind == "events":
            reason = unknown_device(fixture.spec.devices, known)
        else:
            reason = unknown_device([str(fixture.hardware.get("gpu"))], known) or fixture.not_priced
        if reason is None:
            kept.append(fixture)
        else:
            reasons[fixture.id] = reason
    return kept, reasons


def left_out_summary(reasons: dict[str, str]) -> dict[str, Any]:
    """What a suite verb says of the runs it did not score (`reasons`: run id -> why): how many, and how many per
    reason, with up to 3 ids per reason."""
    by_reason: dict[str, list[str]] = {}
    for run_id, reason in sorted(reasons.items()):
        by_reason.setdefault(reason, []).append(run_id)
    return {
        "count": len(reasons),
        "reasons": [
            {"reason": reason, "count": len(ids), "runs": ids[:3]}
            for reason, ids in sorted(by_reason.items(), key=lambda item: -len(item[1]))
        ],
    }


@dataclass(frozen=True)
class ModelScore:
    runs: tuple[RunScore, ...]
    suite: SuiteScore
    # Per run (in order), the predicted phase durations (`Prediction.phase_ms`): what a candidate's per-run
    # changes show, so that an agent sees whether the quantity it targeted moved.
    phases: tuple[dict[tuple[str, int | None], float], ...] = ()


def score_model(
    suite: Suite,
    model: Model,
    *,
    origin: str,
    progress: Progress = QUIET,
    stall_free: Sequence[Any] | None = None,
    predictions: Sequence[Any] | None = None,
) -> ModelScore:
    """Predict every run of `suite` from its spec alone and score it against its truth.

    `progress` advances once per run; the caller starts it (it may score more than one model).
    `stall_free`: the runs' `stall_series(suite)`, to score each run's stall-free error as well.
    `predictions`: the model's predictions of the suite's runs, in order, when the caller already made them.
    """
    from hops_calib.model.predict import predict

    runs, phases = [], []
    for i, (fixture_id, spec, truth) in enumerate(zip(suite.ids, suite.specs, suite.truths)):
        try:
            prediction = predictions[i] if predictions is not None else predict(spec, model)
            score = score_prediction(
                fixture_id, truth, prediction, stall_free[i] if stall_free is not None else None, suite.groups[i]
            )
            runs.append(replace(score, predicted_memory_fraction=memory_fraction(spec, model, prediction)))
            phases.append(prediction.phase_ms(spec))
        except ValueError as error:
            raise InputError(
                origin, f"model {model.name!r} cannot be scored on fixture {fixture_id}: {error}"
            ) from None
        progress.advance(fixture_id)
    return ModelScore(runs=tuple(runs), suite=aggregate(runs), phases=tuple(phases))


def memory_fraction(spec: Spec, model: Model, prediction: Any) -> float | None:
    """The predicted peak memory of the run's fullest GPU over its memory (`model.memory.stage_memory` under the
    prediction's schedule, each stage against its device's `memory_bytes`); None where a device states no memory
    or the memory model cannot price the launch."""
    from hops_calib.model.memory import launch_memory_fraction

    try:
        return launch_memory_fraction(
            spec, lambda t: model.device(t).memory_bytes, prediction.result.peak_stage_activations
        )
    except ValueError:  # a launch the memory model cannot price
        return None


def stall_series(suite: Suite) -> tuple[Any, ...]:
    """Each run's iteration part series (its stalls), read from its events once for `score_model(stall_free=)`."""
    from hops_calib.metrics import timeline_iteration_part_series

    if suite.parts:
        return tuple(series for part in suite.parts for series in stall_series(part))
    store = open_store(suite.fixtures_dir)
    return tuple(
        timeline_iteration_part_series(store.load(fixture_id).timeline()) if events else None
        for fixture_id, events in zip(suite.ids, suite.has_events)
    )
