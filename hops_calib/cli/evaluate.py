"""The judging verbs: `evaluate` (score the model; gate a candidate) and `compare` (gate a whole model against
another), printed as text or JSON with the exit codes of `hops_calib.cli.output`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from hops_calib.cli.options import (
    ALLOW_HELD_OUT_OPTION,
    FIXTURES_MANY_OPTION,
    LEDGER_OPTION,
    MODEL_OPTION,
    OFF_RECORD_OPTION,
    PLAN_OPTION,
    TOLERANCE_OPTIONS,
    fixtures_given,
    with_tolerances,
)
from hops_calib.cli.output import EXIT_OK, guarded, print_json
from hops_calib.cli.scores import num, pct, print_left_out, print_runs, print_suite
from hops_calib.errors import InputError


@with_tolerances
def evaluate(
    candidate: Path | None = typer.Argument(None, help="Candidate file (experiments/*.toml): one term changed."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    commit: bool = typer.Option(False, "--commit", help="Write an accepted candidate into the model file."),
    ledger: Path = LEDGER_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
    plan: int | None = PLAN_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    again: bool = typer.Option(
        False,
        "--again",
        help="Judge again a change the ledger already judged on this model "
        "and fixture set, under the same rules (refused otherwise: it "
        "would repeat it; other rules need `ledger plan --rejudge`).",
    ),
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Score the model on the train split; with a candidate, gate it and record the answer.

    Exit 0 accepted (or no candidate), 1 rejected, 2 invalid input, 4 refused: the store is not the one the model
    was calibrated on, or the candidate moves no run (see README, exit codes). A judgement is under the gate's
    defaults (hops_calib.loop.gate.Tolerances) or, with --plan N, under plan N's tolerances.
    """
    stores = fixtures_given(fixtures)

    def run() -> int:
        from hops_calib.loop.evaluate import evaluate as judge
        from hops_calib.loop.gate import Tolerances
        from hops_calib.progress import progress_bar

        limits = _limits(tolerances or {}, "evaluate", ledger, plan, judged=candidate is not None)
        with progress_bar("evaluate", quiet=as_json) as progress:
            result = judge(
                stores,
                model_path=model,
                candidate_path=candidate,
                tolerances=limits,
                ledger_path=ledger,
                commit=commit,
                split=split,
                plan=plan,
                progress=progress,
                off_record=off_record,
                again=again,
                allow_held_out=allow_held_out,
            )
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict(), result.status)
            return result.exit_code
        if result.verdict is None:
            print_runs(result.before.runs)
            print_suite(
                f"model {result.model.name} ({result.model.sha256[:12]}) on the {result.split} split",
                result.before.suite,
            )
            print_left_out(result.left_out)
            print(f"model file {result.model_path}; ledger {result.ledger_path or '(none: no checkout)'}")
            print(
                f"tolerances a candidate must meet: {limits.describe()}"
                + (
                    " (the defaults; other rules only from a plan: hops-calib ledger plan)"
                    if limits == Tolerances()
                    else ""
                )
            )
            return EXIT_OK
        _print_candidate(result)
        return result.exit_code

    raise typer.Exit(guarded(run, as_json))


@with_tolerances
def compare(
    before: Path = typer.Argument(..., help="The model file to compare against (e.g. the model before a move)."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    note: str = typer.Option("", "--note", help="What the comparison judges (e.g. 'move 029-035'), for the ledger."),
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
    commit_into: Path | None = typer.Option(
        None,
        "--commit",
        help="Carry the verdict out in this model file (the one the move's steps were committed "
        "into, e.g. the shipped model): the model after if accepted, BEFORE if rejected.",
    ),
    plan: int | None = PLAN_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Gate a whole model (--model, default the shipped one) against BEFORE on the train split; record the answer.

    For a move: candidates that hold the suite only together land one by one, each with the relaxed tolerances it
    needed; this judges the end against the start under the usual ones, and with --commit keeps the end or undoes
    the move. Exit 0 accepted, 1 rejected, 2 invalid, 4 off the record (another store than the model's, or the
    models predict every run alike).
    """
    stores = fixtures_given(fixtures)

    def run() -> int:
        from hops_calib.loop.compare import compare as judge
        from hops_calib.progress import progress_bar

        limits = _limits(tolerances or {}, "compare", ledger, plan, judged=True)
        with progress_bar("compare", quiet=as_json) as progress:
            result = judge(
                stores,
                before,
                after_path=model,
                tolerances=limits,
                ledger_path=ledger,
                note=note,
                commit_into=commit_into,
                plan=plan,
                progress=progress,
                off_record=off_record,
                allow_held_out=allow_held_out,
            )
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict(), result.status)
            return result.exit_code
        print(
            f"compare {result.before_path} ({result.before_model.sha256[:12]}) -> {result.after_path} "
            f"({result.after_model.sha256[:12]}) on {result.before.suite.n_fixtures} train fixtures "
            f"({result.fixture_set_sha256[:12]})" + (f": {note}" if note else "")
        )
        print_left_out(result.left_out)
        _print_gate(result.before.suite, result.after.suite, result.verdict)
        if result.committed_into is not None:
            kept = "the model after" if result.verdict.accepted else "the model before (the move is undone)"
            print(f"committed {kept} into {result.committed_into}")
        print(f"ledger: entry {result.ledger_entry['seq']} appended to {result.ledger_path}")
        return result.exit_code

    raise typer.Exit(guarded(run, as_json))


def _limits(
    tolerances: dict[str, float | str | None], verb: str, ledger_path: Path | None, plan: int | None, judged: bool
):
    """The tolerances of a judgement: the defaults, or, with --plan N, plan N's; tolerance options only where
    nothing is judged (plain evaluate: --run-error stall-free scores the stall-free error). A judgement's rules other
    than the defaults are stated beforehand in a plan (`ledger plan`), never given with the judgement."""
    given = [name for name, value in tolerances.items() if value is not None]
    if judged and given:
        flags = [flag for name, flag, *_ in TOLERANCE_OPTIONS if name in given]
        raise InputError(
            verb,
            f"{', '.join(flags)}: a judgement's rules come from a plan recorded before it, not "
            "from options of the judging command",
            field=flags[0],
            hint="state them first: hops-calib ledger plan --note WHY --candidate FILE "
            + " ".join(f"{flag} ..." for flag in flags)
            + f" (--rejudge SEQ if the change was judged before), then {verb} ... --plan N",
        )
    if plan is None:
        return tolerance_limits(tolerances, verb)
    if given:
        raise InputError(
            verb,
            f"--plan {plan} fixes the tolerances; {', '.join(given)} given as well",
            field="plan",
            hint="drop the tolerance options: the plan's are the ones stated beforehand",
        )
    from hops_calib.loop.plans import plan_tolerances

    return plan_tolerances(ledger_path, plan)


def tolerance_limits(tolerances: dict[str, float | str | None], verb: str):
    from hops_calib.loop.gate import Tolerances
    from hops_calib.loop.plans import refuse_beyond_caps

    try:
        given: dict[str, Any] = {name: value for name, value in tolerances.items() if value is not None}
        limits = Tolerances(**given)
    except ValueError as error:
        option = next((flag for name, flag, *_ in TOLERANCE_OPTIONS if f" {name} " in f" {error} "), "tolerance")
        raise InputError(
            verb,
            str(error),
            field=option,
            hint="window or stall-free"
            if option == "--run-error"
            else "give a finite number >= 0 (the gate's defaults: hops_calib.loop.gate.Tolerances)",
        ) from None
    refuse_beyond_caps(limits, verb)
    return limits


def _print_candidate(result) -> None:
    candidate = result.candidate
    print(f"candidate {candidate.id} ({candidate.origin}): {candidate.change.describe()}")
    print(f"hypothesis: {candidate.hypothesis}")
    print(
        f"model {result.model_path} ({result.model.sha256[:12]}) -> {result.candidate_model.sha256[:12]} on "
        f"{result.before.suite.n_fixtures} {result.split} fixtures ({result.fixture_set_sha256[:12]}, "
        f"{', '.join(s['fixtures'] for s in result.stores) if result.stores else result.fixtures_dir}); "
        f"ledger {result.ledger_path}"
    )
    print_left_out(result.left_out)
    check = result.calibration
    if check is not None:
        print(
            f"calibration: {check.scope.describe()} was calibrated on "
            + (
                f"{check.describe_calibrated()} ({check.how or 'OFF THE RECORD'})"
                if check.calibrated
                else "nothing yet (no committed change in the ledger)"
            )
        )
    moved = result.verdict.runs_moved or ()
    if moved:
        _print_moved(result.before, result.after, moved)
    _print_gate(result.before.suite, result.after.suite, result.verdict)
    if result.committed:
        print(f"committed into {result.model_path}")
    elif result.verdict.accepted:
        print(f"not committed (pass --commit to write it into {result.model_path})")
    print(f"ledger: entry {result.ledger_entry['seq']} appended to {result.ledger_path}")


def _print_moved(before, after, moved) -> None:
    """The runs the change moved: window error before -> after, and the bubble error's change."""
    after_by_id = {r.run_id: r for r in after.runs}
    width = max(len(i) for i in moved)
    print(f"runs moved ({len(moved)}): {'run':{width}}  tput err % before -> after   bubble err pp before -> after")
    for old in before.runs:
        if old.run_id in moved:
            new = after_by_id[old.run_id]
            print(
                f"  {old.run_id:{width}}  {pct(old.throughput_error_pct):>8} -> {pct(new.throughput_error_pct):<8}"
                f"        {pct(old.bubble_error_pp):>7} -> {pct(new.bubble_error_pp)}"
            )


def _print_gate(before, after, verdict) -> None:
    """The aggregates before and after, the regressed runs, the decision and its reasons."""
    print(f"{'':30}{'before':>10}{'after':>10}")
    for label, field in (
        ("throughput MAPE %", "throughput_mape_pct"),
        ("throughput median APE %", "throughput_median_ape_pct"),
        ("steady throughput MAPE %", "steady_throughput_mape_pct"),
        ("bubble MAE pp", "bubble_mae_pp"),
        ("mean utilization rho", "util_spearman_mean"),
    ):
        print(f"{label:30}{num(getattr(before, field), 3):>10}{num(getattr(after, field), 3):>10}")
    if verdict.regressions:
        print("regressed runs:")
        for regression in verdict.regressions:
            print(f"  {regression.describe()}")
    for label, suite in (("before", before), ("after", after)):
        print(
            f"stall-noise floor {label}: {suite.stall_noise_mape_pct:.3f} % (throughput MAPE "
            f"{suite.throughput_mape_pct - suite.stall_noise_mape_pct:+.3f} pp above it)"
        )
    print(
        f"decision: {verdict.decision.upper()}"
        + (
            ""
            if verdict.within_noise is None
            else " (the suite MAPE change is within noise: its bootstrap interval straddles 0)"
            if verdict.within_noise
            else " (the suite MAPE change is beyond noise)"
        )
    )
    for reason in verdict.reasons:
        print(f"  - {reason}")
    print(f"tolerances: {verdict.tolerances.describe()}")
    from hops_calib.loop.gate import describe_looser, looser_rules

    if looser_rules(verdict.tolerances):
        print(describe_looser(looser_rules(verdict.tolerances)))
