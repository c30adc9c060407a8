"""The loop's verbs: predict, evaluate, compare, report, ledger and terms, printed as text or JSON, with the exit
codes of `hops_calib.cli.output`."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hops_calib.cli.output import EXIT_BROKEN_LEDGER, EXIT_OK, guarded, held_out_guard, print_json, refuse_job_dir_as_id
from hops_calib.errors import InputError, given_together
from hops_calib.loop.score import or_nan
from hops_calib.metrics import THROUGHPUT_UNIT, samples_per_s


def _ledger(path: Path | None) -> Path:
    """The ledger a verb uses: the one named, or the project's (which must exist; `hops_calib.loop.ledger.resolve`)."""
    from hops_calib.loop.ledger import resolve

    return resolve(path)


def _pct(value: float | None) -> str:
    return f"{value:+.1f}" if value is not None and math.isfinite(value) else "n/a"


def _num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "n/a"


# --- predict -------------------------------------------------------------------------------------

def _stage_rows(fixture, prediction) -> list[dict[str, Any]]:
    from hops_calib.timeline import BACKWARD, FORWARD

    truth, spec = fixture.truth, fixture.spec
    rows = []
    for predicted in prediction.stage_phase_ms(spec):
        stage = predicted.stage
        rows.append({
            "stage": stage, "device": predicted.device,
            "real_utilization": truth.metrics.utilization_per_stage[stage],
            "predicted_utilization": prediction.metrics.utilization_per_stage[stage],
            "real_forward_ms": truth.phase_median_ms(stage, FORWARD),
            "predicted_forward_ms": predicted.forward_ms,
            "real_backward_ms": truth.phase_median_ms(stage, BACKWARD),
            "predicted_backward_ms": predicted.backward_ms,
            "real_optimizer_ms": truth.optimizer_ms_per_stage[stage] if stage < len(truth.optimizer_ms_per_stage)
            else None,
            "predicted_optimizer_ms": predicted.optimizer_ms,
        })
    return rows


def launch_sections(spec, model, prediction, real=None, throughput_per_s=None):
    from hops_calib.cli.whatif import launch_sections as sections

    return sections(spec, model, prediction, real, throughput_per_s)


def _predict_one(fixture_id: str, fixtures: Path, model_path: Path | None, as_json: bool,
                 ledger_path: Path | None = None, allow_held_out: bool = False) -> int:
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.score import score_prediction
    from hops_calib.loop.suite import TEST, open_store, priced
    from hops_calib.model.predict import predict
    from hops_calib.store.fixture import NotPriced

    store = open_store(fixtures)
    fixture = store.load(fixture_id)
    if fixture.split == TEST:
        raise InputError(f"{fixtures}/{fixture_id}", "is in the test split, which is scored only in aggregate",
                         field="split", hint="`hops-calib report --split test` prints the held-out aggregates")
    held_out_guard(fixtures, ledger_path, "predict", allow_held_out)()
    model = load_model(model_path)
    _, reasons = priced([fixture])  # a device type outside the catalog first, then what the spec lacks
    if reasons:
        raise NotPriced(fixture.id, reasons[fixture.id])  # exit 2: names the run and why
    prediction = predict(fixture.spec, model)
    score = score_prediction(fixture.id, fixture.truth.metrics, prediction, group=fixture.group)
    if fixture.kind != "events":
        return _predict_measured(fixture, model, prediction, score, as_json)
    stages = _stage_rows(fixture, prediction)
    launch, launch_text = launch_sections(fixture.spec, model, prediction, fixture.truth.metrics)
    if as_json:
        print_json({"id": fixture.id, "run_id": fixture.id, "split": fixture.split, "schedule": prediction.schedule,
                     "model": model.name, "model_sha256": model.sha256, "errors": score.to_dict(),
                     "real": fixture.truth.metrics.to_dict(), "predicted": prediction.metrics.to_dict(),
                     "samples_per_s": _samples(fixture.truth.metrics, prediction.metrics, fixture.spec),
                     "stall_throughput_range": prediction.stall_throughput_range()._asdict(),
                     "stages": stages, **launch})
        return EXIT_OK
    real, pred, spec = fixture.truth.metrics, prediction.metrics, fixture.spec
    print(f"{fixture.id}  ({fixture.split}; {prediction.schedule}, pp={spec.pp}, {spec.microbatches} microbatches x "
          f"{spec.iterations} iterations; model {model.name} {model.sha256[:12]})")
    print(f"{'':24}{'real':>12}{'predicted':>12}{'error':>10}    (throughput: {THROUGHPUT_UNIT}, "
          f"{spec.model.micro_batch_size} sample(s) each)")
    print(f"{'throughput /s':24}{real.throughput_per_s:12.3f}{pred.throughput_per_s:12.3f}"
          f"{_pct(score.throughput_error_pct):>8} %"
          + (f"  (random stalls alone: +-{score.stall_noise_ape_pct:.1f} %; "
             f"{prediction.stall_throughput_range().text()})" if score.stall_noise_ape_pct else ""))
    print(f"{'steady throughput /s':24}{real.steady_throughput_per_s:12.3f}{pred.steady_throughput_per_s:12.3f}"
          f"{_pct(score.steady_throughput_error_pct):>8} %")
    samples = _samples(real, pred, spec)
    print(f"{'samples /s':24}{samples['real']:12.2f}{samples['predicted']:12.2f}"
          + (f"    (all {spec.dp} data-parallel replicas)" if spec.dp > 1 else ""))
    print(f"{'bubble %':24}{100 * real.bubble_ratio:12.1f}{100 * pred.bubble_ratio:12.1f}"
          f"{_pct(score.bubble_error_pp):>7} pp")
    print(f"{'iteration time ms':24}{real.iteration_time_ms:12.1f}{pred.iteration_time_ms:12.1f}")
    print(f"{'utilization rho':24}{'':24}{score.util_spearman_rho:10.2f}")
    print()
    print(f"{'stage':>5} {'device':8}{'util real':>10}{'pred':>7}{'fwd ms real':>13}{'pred':>8}"
          f"{'bwd ms real':>13}{'pred':>8}{'opt ms real':>13}{'pred':>8}")
    for row in stages:
        print(f"{row['stage']:>5} {row['device']:8}{row['real_utilization']:10.3f}{row['predicted_utilization']:7.3f}"
              f"{_num(row['real_forward_ms']):>13}{_num(row['predicted_forward_ms']):>8}"
              f"{_num(row['real_backward_ms']):>13}{_num(row['predicted_backward_ms']):>8}"
              f"{_num(row['real_optimizer_ms']):>13}{_num(row['predicted_optimizer_ms']):>8}")
    print("\n".join(launch_text))
    return EXIT_OK


def _samples(real, predicted, spec) -> dict[str, float | None]:
    """Real and predicted samples per second of every data-parallel replica (the text's `samples /s` row)."""
    return {side: samples_per_s(metrics.throughput_per_s, spec.model.micro_batch_size, spec.dp)
            for side, metrics in (("real", real), ("predicted", predicted))}


def _predict_measured(fixture, model, prediction, score, as_json: bool) -> int:
    """`predict ID` of a run measured at iteration level: throughput and iteration time (no events: no stages)."""
    real, pred, spec = fixture.truth.metrics, prediction.metrics, fixture.spec
    # samples/s from the throughputs the score compares (the text's throughput row), for text and JSON alike
    mb = spec.model.micro_batch_size
    samples = {side: samples_per_s(throughput, mb, spec.dp) for side, throughput
               in (("real", score.real_throughput_per_s), ("predicted", score.predicted_throughput_per_s))}
    launch, launch_text = launch_sections(spec, model, prediction, real, score.predicted_throughput_per_s)
    if as_json:
        print_json({"id": fixture.id, "run_id": fixture.id, "kind": fixture.kind, "split": fixture.split,
                    "schedule": prediction.schedule, "model": model.name, "model_sha256": model.sha256,
                    "errors": score.to_dict(), "real": real.to_dict(), "predicted": pred.to_dict(),
                    "samples_per_s": samples, **launch})
        return EXIT_OK
    print(f"{fixture.id}  ({fixture.split}; measured at iteration level; {prediction.schedule}, pp={spec.pp}, "
          f"{spec.microbatches} microbatches; model {model.name} {model.sha256[:12]})")
    print(f"{'':24}{'real':>12}{'predicted':>12}{'error':>10}    (throughput: {THROUGHPUT_UNIT}; real over the "
          "kept iterations, predicted over the simulated steady state)")
    print(f"{'throughput /s':24}{score.real_throughput_per_s:12.3f}{score.predicted_throughput_per_s:12.3f}"
          f"{_pct(score.throughput_error_pct):>8} %")
    print(f"{'samples /s':24}{samples['real']:12.2f}{samples['predicted']:12.2f}    "
          f"(x micro batch {mb} x data parallel {spec.dp})")
    print(f"{'iteration time ms':24}{real.iteration_time_ms:12.1f}{pred.iteration_time_ms:12.1f}")
    print("\n".join(launch_text))
    return EXIT_OK


def _print_runs(runs) -> None:
    width = max(len(r.run_id) for r in runs)
    # The stall-free error when it was scored (evaluate --run-error stall-free); '-' where a trace cannot give it.
    free = any(r.stall_free_error_pct is not None for r in runs)
    print(f"{'run':{width}}  {'tput err %':>10} {'steady err %':>12} {'bubble err pp':>13} {'rho':>6}"
          + (f" {'stall-free err %':>16}" if free else ""))
    for r in runs:
        print(f"{r.run_id:{width}}  {_pct(r.throughput_error_pct):>10} {_pct(r.steady_throughput_error_pct):>12} "
              f"{_pct(r.bubble_error_pp):>13} {_num(r.util_spearman_rho):>6}"
              + (f" {_pct(r.stall_free_error_pct) if r.stall_free_error_pct is not None else '-':>16}"
                 if free else ""))


def _on(suite, metric: str) -> str:
    """' (on N runs)' where a metric was scored on fewer runs than the suite has (those without events)."""
    count = suite.count(metric)
    return "" if count == suite.n_fixtures else f" (on {count} runs with events)"


def _print_suite(label: str, suite) -> None:
    print(f"{label}: {suite.n_fixtures} fixtures, throughput MAPE {suite.throughput_mape_pct:.2f} % (median "
          f"{suite.throughput_median_ape_pct:.2f} %), steady throughput MAPE {suite.steady_throughput_mape_pct:.2f} %, "
          + (f"bubble MAE {or_nan(suite.bubble_mae_pp):.2f} pp{_on(suite, 'bubble')}, mean utilization rho "
             f"{or_nan(suite.util_spearman_mean):.3f}{_on(suite, 'utilization')}; " if suite.bubble_mae_pp is not None else
             "no bubble or utilization (no run has events); ")
          + f"stall-noise floor of the throughput MAPE {suite.stall_noise_mape_pct:.2f} % (what random stalls alone "
          f"would cost an otherwise exact model on these runs; the model is "
          f"{suite.throughput_mape_pct - suite.stall_noise_mape_pct:+.2f} pp from it)")
    print_timers(suite)


def print_timers(suite) -> None:
    """Megatron's logged timers against the simulation's (hops_calib/loop/timers.py), where runs logged them."""
    from hops_calib.cli.render.evaluate import timers_text

    if suite.timers:
        print("  " + timers_text(suite.timers))


def _print_left_out(left_out: dict[str, Any] | None) -> None:
    """How many runs of the split the suite left out (the model does not price them), and why."""
    if not left_out or not left_out.get("count"):
        return
    print(f"left out {left_out['count']} run(s) the model does not price:")
    for reason in left_out["reasons"]:
        print(f"  {reason['count']:5d}  {reason['reason']} (e.g. {', '.join(reason['runs'])})")


def predict_command(fixture_id: str | None, all_train: bool, fixtures: Path, model_path: Path | None,
                    as_json: bool, job: Path | None = None, schedules: Sequence[str] = (),
                    fixtures_defaulted: bool = False, cluster: Path | None = None,
                    perturbations: dict | None = None, ledger_path: Path | None = None,
                    allow_held_out: bool = False, kernels: bool = False, kernel_stage: int | None = None) -> int:
    def run() -> int:
        refuse_job_dir_as_id(fixture_id, fixtures, "`hops-calib predict --job DIR`")
        choices = {f"ID {fixture_id}": fixture_id is not None, "--all": all_train, f"--job {job}": job is not None}
        if sum(choices.values()) != 1:
            raise InputError("predict", f"{given_together(choices)}give one of a fixture ID, --all (every train "
                             "fixture) or --job DIR (a configuration that has not run)", field="ID")
        if schedules and job is None:
            raise InputError("predict", "--schedule applies to --job (a fixture is predicted as it ran)",
                             field="--schedule")
        given = [name for name, value in (perturbations or {}).items() if value not in (None, [])]
        if given and job is None:
            raise InputError("predict", f"--{given[0].replace('_', '-')} applies to --job (a fixture is predicted as "
                             "it ran)", field=f"--{given[0].replace('_', '-')}")
        if (kernels or kernel_stage is not None) and job is None:
            raise InputError("predict", "--kernels applies to --job (the kernel table of a configuration's stage)",
                             field="--kernels")
        if kernel_stage is not None and not kernels:
            raise InputError("predict", "--kernel-stage chooses the stage of --kernels", field="--kernel-stage",
                             hint="add --kernels")
        if job is not None:
            from hops_calib.cli.whatif import predict_job

            return predict_job(job, model_path, schedules, fixtures, fixtures_defaulted, as_json, cluster,
                               perturbations, kernels=kernels, kernel_stage=kernel_stage)
        if fixture_id is not None:
            return _predict_one(fixture_id, fixtures, model_path, as_json, ledger_path, allow_held_out)
        from hops_calib.loop.evaluate import evaluate
        from hops_calib.progress import progress_bar

        with progress_bar("predict", quiet=as_json) as progress:
            result = evaluate(fixtures, model_path=model_path, progress=progress, ledger_path=ledger_path,
                              allow_held_out=allow_held_out, verb="predict")
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict())
        else:
            _print_runs(result.before.runs)
            _print_suite(f"model {result.model.name} ({result.model.sha256[:12]}) on the train split",
                         result.before.suite)
            _print_left_out(result.left_out)
        return EXIT_OK

    return guarded(run, as_json)


# --- evaluate ------------------------------------------------------------------------------------

def evaluate_command(candidate: Path | None, fixtures: Path | Sequence[Path], model_path: Path | None, as_json: bool, commit: bool,
                     ledger_path: Path | None, split: str, tolerances: dict[str, float | str | None],
                     plan: int | None = None, off_record: bool = False, again: bool = False,
                     allow_held_out: bool = False) -> int:
    def run() -> int:
        from hops_calib.loop.evaluate import evaluate
        from hops_calib.loop.gate import Tolerances
        from hops_calib.progress import progress_bar

        limits = _limits(tolerances, "evaluate", ledger_path, plan, judged=candidate is not None)
        with progress_bar("evaluate", quiet=as_json) as progress:
            result = evaluate(fixtures, model_path=model_path, candidate_path=candidate, tolerances=limits,
                              ledger_path=ledger_path, commit=commit, split=split, plan=plan, progress=progress,
                              off_record=off_record, again=again, allow_held_out=allow_held_out)
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict(), result.status)
            return result.exit_code
        if result.verdict is None:
            _print_runs(result.before.runs)
            _print_suite(f"model {result.model.name} ({result.model.sha256[:12]}) on the {result.split} split",
                         result.before.suite)
            _print_left_out(result.left_out)
            print(f"model file {result.model_path}; ledger {result.ledger_path or '(none: no checkout)'}")
            print(f"tolerances a candidate must meet: {limits.describe()}"
                  + (" (the defaults; other rules only from a plan: hops-calib ledger plan)"
                     if limits == Tolerances() else ""))
            return EXIT_OK
        _print_candidate(result)
        return result.exit_code

    return guarded(run, as_json)


def _limits(tolerances: dict[str, float | str | None], verb: str, ledger_path: Path | None, plan: int | None,
            judged: bool):
    """The tolerances of a judgement: the defaults, or, with --plan N, plan N's; tolerance options only where
    nothing is judged (plain evaluate: --run-error stall-free scores the stall-free error). A judgement's rules other
    than the defaults are stated beforehand in a plan (`ledger plan`), never given with the judgement."""
    from hops_calib.cli import TOLERANCE_OPTIONS

    given = [name for name, value in tolerances.items() if value is not None]
    if judged and given:
        flags = [flag for name, flag, *_ in TOLERANCE_OPTIONS if name in given]
        raise InputError(verb, f"{', '.join(flags)}: a judgement's rules come from a plan recorded before it, not "
                         "from options of the judging command", field=flags[0],
                         hint="state them first: hops-calib ledger plan --note WHY --candidate FILE "
                              + " ".join(f"{flag} ..." for flag in flags)
                              + f" (--rejudge SEQ if the change was judged before), then {verb} ... --plan N")
    if plan is None:
        return _tolerance_limits(tolerances, verb)
    if given:
        raise InputError(verb, f"--plan {plan} fixes the tolerances; {', '.join(given)} given as well", field="plan",
                         hint="drop the tolerance options: the plan's are the ones stated beforehand")
    from hops_calib.loop.plans import plan_tolerances

    return plan_tolerances(ledger_path, plan)


def _tolerance_limits(tolerances: dict[str, float | str | None], verb: str):
    from hops_calib.loop.gate import Tolerances
    from hops_calib.loop.plans import refuse_beyond_caps

    try:
        given: dict[str, Any] = {name: value for name, value in tolerances.items() if value is not None}
        limits = Tolerances(**given)
    except ValueError as error:
        from hops_calib.cli import TOLERANCE_OPTIONS

        option = next((flag for name, flag, *_ in TOLERANCE_OPTIONS if f" {name} " in f" {error} "), "tolerance")
        raise InputError(verb, str(error), field=option,
                         hint="window or stall-free" if option == "--run-error" else
                         "give a finite number >= 0 (the gate's defaults: hops_calib.loop.gate.Tolerances)") from None
    refuse_beyond_caps(limits, verb)
    return limits


def _print_candidate(result) -> None:
    candidate = result.candidate
    print(f"candidate {candidate.id} ({candidate.origin}): {candidate.change.describe()}")
    print(f"hypothesis: {candidate.hypothesis}")
    print(f"model {result.model_path} ({result.model.sha256[:12]}) -> {result.candidate_model.sha256[:12]} on "
          f"{result.before.suite.n_fixtures} {result.split} fixtures ({result.fixture_set_sha256[:12]}, "
          f"{', '.join(s['fixtures'] for s in result.stores) if result.stores else result.fixtures_dir}); "
          f"ledger {result.ledger_path}")
    _print_left_out(result.left_out)
    check = result.calibration
    if check is not None:
        print(f"calibration: {check.scope.describe()} was calibrated on "
              + (f"{check.describe_calibrated()} ({check.how or 'OFF THE RECORD'})" if check.calibrated else
                 "nothing yet (no committed change in the ledger)"))
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
            print(f"  {old.run_id:{width}}  {_pct(old.throughput_error_pct):>8} -> {_pct(new.throughput_error_pct):<8}"
                  f"        {_pct(old.bubble_error_pp):>7} -> {_pct(new.bubble_error_pp)}")


def _print_gate(before, after, verdict) -> None:
    """The aggregates before and after, the regressed runs, the decision and its reasons."""
    print(f"{'':30}{'before':>10}{'after':>10}")
    for label, field in (("throughput MAPE %", "throughput_mape_pct"),
                         ("throughput median APE %", "throughput_median_ape_pct"),
                         ("steady throughput MAPE %", "steady_throughput_mape_pct"),
                         ("bubble MAE pp", "bubble_mae_pp"), ("mean utilization rho", "util_spearman_mean")):
        print(f"{label:30}{_num(getattr(before, field), 3):>10}{_num(getattr(after, field), 3):>10}")
    if verdict.regressions:
        print("regressed runs:")
        for regression in verdict.regressions:
            print(f"  {regression.describe()}")
    for label, suite in (("before", before), ("after", after)):
        print(f"stall-noise floor {label}: {suite.stall_noise_mape_pct:.3f} % (throughput MAPE "
              f"{suite.throughput_mape_pct - suite.stall_noise_mape_pct:+.3f} pp above it)")
    print(f"decision: {verdict.decision.upper()}"
          + ("" if verdict.within_noise is None else
             " (the suite MAPE change is within noise: its bootstrap interval straddles 0)" if verdict.within_noise
             else " (the suite MAPE change is beyond noise)"))
    for reason in verdict.reasons:
        print(f"  - {reason}")
    print(f"tolerances: {verdict.tolerances.describe()}")
    from hops_calib.loop.gate import describe_looser, looser_rules

    if looser_rules(verdict.tolerances):
        print(describe_looser(looser_rules(verdict.tolerances)))


# --- compare -------------------------------------------------------------------------------------

def compare_command(before: Path, fixtures: Path | Sequence[Path], model_path: Path | None, note: str, ledger_path: Path | None,
                    as_json: bool, tolerances: dict[str, float | str | None], commit_into: Path | None = None,
                    plan: int | None = None, off_record: bool = False, allow_held_out: bool = False) -> int:
    def run() -> int:
        from hops_calib.loop.compare import compare
        from hops_calib.progress import progress_bar

        limits = _limits(tolerances, "compare", ledger_path, plan, judged=True)
        with progress_bar("compare", quiet=as_json) as progress:
            result = compare(fixtures, before, after_path=model_path, tolerances=limits, ledger_path=ledger_path,
                             note=note, commit_into=commit_into, plan=plan, progress=progress,
                             off_record=off_record, allow_held_out=allow_held_out)
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict(), result.status)
            return result.exit_code
        print(f"compare {result.before_path} ({result.before_model.sha256[:12]}) -> {result.after_path} "
              f"({result.after_model.sha256[:12]}) on {result.before.suite.n_fixtures} train fixtures "
              f"({result.fixture_set_sha256[:12]})" + (f": {note}" if note else ""))
        _print_left_out(result.left_out)
        _print_gate(result.before.suite, result.after.suite, result.verdict)
        if result.committed_into is not None:
            kept = "the model after" if result.verdict.accepted else "the model before (the move is undone)"
            print(f"committed {kept} into {result.committed_into}")
        print(f"ledger: entry {result.ledger_entry['seq']} appended to {result.ledger_path}")
        return result.exit_code

    return guarded(run, as_json)


# --- report --------------------------------------------------------------------------------------

def report_command(split: str | None, fixtures: Path, model_path: Path | None, ledger_path: Path | None, as_json: bool,
                   html: Path | None = None, again: bool = False, preview: bool = False,
                   against: Path | None = None) -> int:
    def run() -> int:
        from hops_calib.loop.report import preview_look, report
        from hops_calib.loop.suite import TEST, TRAIN
        from hops_calib.progress import progress_bar

        nonlocal split
        if split is None:
            if not preview:
                raise InputError("report", "say which split to report", field="split",
                                 hint=f"--split {TEST} is an audited look at the held-out split (the ledger counts "
                                      f"every one); --split {TRAIN} reports the train split; --preview says what a "
                                      "held-out look would tell without taking it")
            split = TEST
        if against is not None and not preview:
            raise InputError("report", "--against compares predictions without looking; it goes with --preview",
                             field="against", hint="hops-calib report --preview --against OLD_MODEL.toml")
        if split == TRAIN:  # per-run errors of the train split (--html): none of a held-out run
            held_out_guard(fixtures, ledger_path, "report --split train", False)()
        if preview:
            seen = preview_look(fixtures, split=split, model_path=model_path, ledger_path=ledger_path,
                                against=against)
            if as_json:
                print_json(seen)
                return EXIT_OK
            if seen["against"] is not None:
                print(f"the model {seen['model_sha256'][:12]} predicts {seen['against']['changed']} of {seen['of']} "
                      f"{split} configurations otherwise than {against} ({seen['against']['model_sha256'][:12]})")
            if seen["repeat_of"] is not None:
                print(f"a look at the {split} split now would repeat entry {seen['repeat_of']}: the model "
                      f"{seen['model_sha256'][:12]} is that look's, or predicts all {seen['of']} configurations as "
                      "it did, on runs it scored; so `report` would refuse it (read its result with `hops-calib "
                      "ledger looks`)")
            elif seen["changed_since"] is not None:
                since = seen["changed_since"]
                print(f"a look at the {split} split now: the model {seen['model_sha256'][:12]} predicts "
                      f"{since['changed']} of {since['of']} configurations otherwise than the look of entry "
                      f"{since['seq']} (no result read, nothing appended)")
            else:
                print(f"a look at the {split} split now: no earlier look recorded its predictions, so the ledger has "
                      "nothing to compare with; --against OLD_MODEL compares with a model file (no result read, "
                      "nothing appended)")
            return EXIT_OK

        if html is not None:
            from hops_calib.plot.html import check_html_path

            check_html_path(html)  # before the audit entry: a bad name must not cost one
        with progress_bar("report", quiet=as_json) as progress:
            result = report(fixtures, split=split, model_path=model_path, ledger_path=ledger_path,
                            progress=progress, again=again)
        if html is not None:
            from hops_calib.plot.html import write_report

            write_report(html, result, fixtures, model_path)
        if as_json:
            print_json(result.to_dict())
        else:
            what = "held-out report" if result.split == TEST else "report (not held out)"
            _print_suite(f"{what}, {result.split} split, model {result.model_sha256[:12]}", result.suite)
            _print_left_out(result.left_out)
            if result.train is not None:
                print(f"the same model on train: throughput MAPE {result.train.throughput_mape_pct:.2f} % (stall-noise "
                      f"floor {result.train.stall_noise_mape_pct:.2f} %); {result.split} minus train: "
                      f"{result.gap_to_train_pp:+.2f} pp, of which the floors differ by "
                      f"{result.suite.stall_noise_mape_pct - result.train.stall_noise_mape_pct:+.2f} pp")
            if result.intervals is not None:
                print(result.interval_sentence())
            if result.outside_train is not None:
                from hops_calib.model.coverage import outside_sentence

                print(f"of the {result.split} split, {outside_sentence(result.outside_train)}: there the model "
                      "extrapolates (predict --job DIR --fixtures names the features of one configuration)")
            if result.changed_since is not None:
                since = result.changed_since
                print(f"predictions changed since the look of entry {since['seq']} on {since['changed']} of "
                      f"{since['of']} configurations")
            if "repeat_of" in result.ledger_entry:
                print(f"a repeat of entry {result.ledger_entry['repeat_of']} (--again): the same model or the same "
                      "predictions, on runs it scored")
            if result.audited:
                print(f"audit entry {result.ledger_entry['seq']} appended to {result.ledger_path}")
            else:
                print(f"nothing appended to the ledger: the {result.split} split is not held out")
            if html is not None:
                print(f"wrote {html}")
        return EXIT_OK

    return guarded(run, as_json)


# --- ledger --------------------------------------------------------------------------------------

def ledger_show_command(ledger_path: Path | None, last: int | None, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop.ledger import read_entries, warn_if_broken

        warn_if_broken(ledger_path)
        entries = list(read_entries(ledger_path))
        if last is not None:
            entries = entries[-last:] if last > 0 else []
        from hops_calib.loop.gate import describe_looser, looser_rules
        from hops_calib.loop.heldout import HELD_OUT_KEY, OVERRIDE_KEY, OVERRIDE_KIND, RECORD_KIND
        from hops_calib.loop.plans import judgement_notes

        notes = judgement_notes(list(read_entries(ledger_path)))
        if as_json:
            print_json({"ledger": str(ledger_path), "entries": entries,
                        "judgements": {str(seq): note for seq, note in notes.items()
                                       if seq in {e.get("seq") for e in entries}},
                        # plans stating rules looser than the defaults, each with its default and cap
                        "looser_plans": {str(e["seq"]): looser_rules(e["tolerances"]) for e in entries
                                         if e.get("kind") == "plan" and isinstance(e.get("tolerances"), dict)
                                         and looser_rules(e["tolerances"])}})
            return EXIT_OK
        if not entries:
            print(f"{ledger_path}: no entries")
        for e in entries:
            aggregates_before, aggregates_after = e.get("aggregates_before") or {}, e.get("aggregates_after") or {}
            if e.get("kind") == "plan":
                what = f"plan: {e.get('note', '')}" + "".join(f" [pins {c.get('id')}]" for c in e.get("candidates", []))
                what += (f" [{describe_looser(looser_rules(e['tolerances']))}]"
                         if isinstance(e.get("tolerances"), dict) and looser_rules(e["tolerances"]) else "")
                what += f" [rejudges entry {e['rejudges']}]" if e.get("rejudges") is not None else ""
            elif e.get("kind") == "report":
                aggregates = e.get("aggregates", {})
                what = (f"report {e.get('split')}: MAPE {aggregates.get('throughput_mape_pct', float('nan')):.2f} %, "
                        f"bubble MAE {or_nan(aggregates.get('bubble_mae_pp')):.2f} pp")
            elif e.get("kind") == "compare":
                what = (f"compare {e.get('before_model_path')} -> {e.get('model_path')}: MAPE "
                        f"{aggregates_before.get('throughput_mape_pct', float('nan')):.2f} -> "
                        f"{aggregates_after.get('throughput_mape_pct', float('nan')):.2f} %"
                        + (f" ({e['note']})" if e.get("note") else "")
                        + ((", kept" if e.get("decision") == "accepted" else ", undone") + f" in {e['committed_into']}"
                           if e.get("committed") else ""))
            elif e.get("kind") == OVERRIDE_KIND:
                groups = [leak.get("group") for leak in e.get(OVERRIDE_KEY) or []]
                what = (f"{e.get('verb')} on {e.get('fixtures')} went on over held-out group(s) "
                        f"{', '.join(map(str, groups))} (--allow-held-out)")
            elif e.get("kind") == RECORD_KIND:
                what = (f"held out the {len(e.get(HELD_OUT_KEY) or {})} test group(s) of {e.get('fixtures')} "
                        "(ledger hold-out; nothing scored)")
            else:
                candidate = e.get("candidate") or {}
                what = (f"{candidate.get('id')} ({candidate.get('change')}): MAPE "
                        f"{aggregates_before.get('throughput_mape_pct', float('nan')):.2f} -> "
                        f"{aggregates_after.get('throughput_mape_pct', float('nan')):.2f} %"
                        + (", committed" if e.get("committed") else ""))
            seq = e.get("seq")
            note = notes.get(seq) if isinstance(seq, int) else None
            if note is not None:
                what += _judgement_note(note)
            if e.get("kind") != OVERRIDE_KIND and e.get(OVERRIDE_KEY):
                what += " [over held-out groups: --allow-held-out]"
            print(f"{e.get('seq'):>4} {e.get('time', '')[:19]} {e.get('decision', e.get('kind', '')):9} {what}")
        return EXIT_OK

    return guarded(run, as_json)


def _judgement_note(note: dict[str, Any]) -> str:
    """`ledger show`'s words on a judgement's rules, earlier judgements of its change and the model file written."""
    from hops_calib.loop.gate import Tolerances, describe_looser

    text = (" (default rules)" if note["rules"] == "defaults" else f" (under {note['rules']})"
            if note["rules"].startswith("plan ") else f" ({note['rules']})")
    if note["tolerances"]:
        text += f" [tolerances: {Tolerances(**note['tolerances']).describe()}]"
    if note.get("looser_rules"):
        text += f" [{describe_looser(note['looser_rules'])}]"
    if note["rejudges"] is not None:
        text += f"; judges again the change of entry {note['rejudges']}"
    elif note["earlier_judgements"]:
        text += "; the same change was judged in entry " + ", ".join(map(str, note["earlier_judgements"]))
    if note["model_written"]:
        text += f"; wrote {note['model_written']}"
        if note["model_outside_checkout"]:
            text += " (WARNING: not a checkout's model file)"
    return text


def ledger_plan_command(ledger_path: Path | None, note: str, tolerances: dict[str, float | str | None], as_json: bool,
                        candidates: tuple[Path, ...] = (), rejudges: int | None = None,
                        fixtures: tuple[Path, ...] = ()) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop.plans import record_plan

        limits = _tolerance_limits(tolerances, "ledger plan")
        entry = record_plan(ledger_path, note, limits, candidates, rejudges, fixtures)
        from hops_calib.loop.gate import describe_looser, looser_rules

        if as_json:
            print_json({**entry, "looser_rules": looser_rules(limits)})
        else:
            print(f"plan entry {entry['seq']} appended to {ledger_path}: {note}")
            print(f"tolerances stated: {limits.describe()}")
            if looser_rules(limits):
                print(describe_looser(looser_rules(limits)) + ": every judgement under this plan is marked so")
            if entry.get("rejudges") is not None:
                print(f"judges again the change of ledger entry {entry['rejudges']} (the new entry links to it)")
            if entry.get("fixtures"):
                print(f"stores: {', '.join(entry['fixtures'])} (fixture set {entry['fixture_set_sha256'][:12]})")
            for pinned in entry.get("candidates", []):
                print(f"candidate pinned: {pinned['id']} ({pinned['path']}, text sha256 {pinned['text_sha256'][:12]})")
            print(f"judge under it with: hops-calib evaluate CANDIDATE --plan {entry['seq']} | "
                  f"hops-calib compare BEFORE --model AFTER --plan {entry['seq']}")
        return EXIT_OK

    return guarded(run, as_json)


def ledger_looks_command(ledger_path: Path | None, split: str, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.cli.render.tables import text_table
        from hops_calib.loop.ledger import held_out_looks, read_entries, warn_if_broken

        warn_if_broken(ledger_path)
        looks = held_out_looks(read_entries(ledger_path), split)
        models = {look.model_sha256 for look in looks}
        repeats = sum(look.repeat_of is not None for look in looks)
        if as_json:
            print_json({"ledger": str(ledger_path), "split": split, "looks": [look.to_dict() for look in looks],
                         "distinct_models": len(models), "repeated_looks": repeats})
            return EXIT_OK
        print(f"{ledger_path}: {len(looks)} look(s) at the {split} split, at {len(models)} distinct model(s); "
              f"{repeats} repeated an earlier look (the same runs, and the same model or the same predictions)")
        if looks:
            rows = [[str(look.seq), look.time[:16], look.model_sha256[:12], f"{look.throughput_mape_pct:.2f}",
                     f"{or_nan(look.bubble_mae_pp):.2f}",
                     (f"{look.gap_to_train_pp:+.2f}" if look.gap_to_train_pp is not None else "")
                     + (f" ({look.gap_interval_pp[0]:+.2f} to {look.gap_interval_pp[1]:+.2f})"
                        if look.gap_interval_pp is not None else ""),
                     str(look.evaluations_since), str(look.changes_since),
                     str(look.predictions_moved) if look.predictions_moved is not None else "",
                     f"of {look.repeat_of}" if look.repeat_of is not None else ""] for look in looks]
            print(text_table(["seq", "time", "model", "MAPE %", "bubble pp", "gap to train pp", "evaluated since",
                              "model changes since", "predictions moved", "repeat"], rows,
                             right={0, 3, 4, 5, 6, 7, 8}))
        return EXIT_OK

    return guarded(run, as_json)


def ledger_verify_command(ledger_path: Path | None, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop.commits import unwritten_problems
        from hops_calib.loop.ledger import verify

        result = verify(ledger_path)
        # a commit whose model write did not happen (a crash between the append and the write)
        result.problems += unwritten_problems(ledger_path)
        if as_json:
            print_json(result.to_dict(), "ok" if result.ok else "broken_ledger")
        elif result.ok:
            print(f"{ledger_path}: {result.entries} entries, chain intact; head sha256 {result.head_sha256}; "
                  f"{result.committed_prefix_note}")
        else:
            for problem in result.problems:
                print(f"{ledger_path}:{problem.line}: {problem.message}" if problem.line is not None
                      else f"{ledger_path}: {problem.message}", file=sys.stderr)
            print(f"{ledger_path}: {len(result.problems)} problem(s) in {result.entries} entries"
                  + (f"; {result.committed_prefix_note}" if result.committed_prefix_note else ""), file=sys.stderr)
        return EXIT_OK if result.ok else EXIT_BROKEN_LEDGER

    return guarded(run, as_json)


def ledger_export_command(ledger_path: Path | None, out: Path) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop.ledger import export_parquet, warn_if_broken

        warn_if_broken(ledger_path)
        rows = export_parquet(ledger_path, out)
        print(f"wrote {rows} entries to {out}")
        return EXIT_OK

    return guarded(run)


def ledger_hold_out_command(fixtures: Path, ledger_path: Path | None, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop.heldout import HELD_OUT_KEY, record_store

        entry = record_store(fixtures, ledger_path)
        if as_json:
            print_json({"ledger": str(ledger_path), "fixtures": str(fixtures),
                        "appended": entry["seq"] if entry else None,
                        "groups": sorted(entry[HELD_OUT_KEY]) if entry else []}, "ok")
        elif entry:
            print(f"{ledger_path}: entry {entry['seq']} holds out the {len(entry[HELD_OUT_KEY])} test group(s) of "
                  f"{fixtures}; every verb refuses them in a train split from now on")
        else:
            print(f"{ledger_path}: nothing appended: {fixtures} has no test split, or the ledger already holds out "
                  "every group of it, by name and by every run's digest and fingerprint")
        return EXIT_OK

    return guarded(run, as_json)


def ledger_repair_command(ledger_path: Path | None, as_json: bool = False) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = _ledger(ledger_path)
        from hops_calib.loop import commits
        from hops_calib.loop.ledger import repair

        aside = repair(ledger_path)
        written = commits.repair(ledger_path)
        if as_json:
            print_json({"ledger": str(ledger_path), "set_aside": str(aside) if aside else None,
                        "repaired": bool(aside), "commits": list(written)})
            return EXIT_OK
        print(f"{ledger_path}: incomplete last line moved to {aside}" if aside else
              f"{ledger_path}: nothing to repair (last line complete)")
        for line in written:
            print(line)
        return EXIT_OK

    return guarded(run, as_json)


# --- terms ---------------------------------------------------------------------------------------

def terms_command(model_path: Path | None, as_json: bool) -> int:
    """Every cost term the package implements, whether the model activates it, and its parameters."""
    def run() -> int:
        from hops_calib.loop.model_files import default_model, load_model
        from hops_calib.model import TERMS

        model = load_model(model_path)
        rows: list[dict[str, Any]] = []
        for name, term in TERMS.items():
            active = model.active(name)
            values = active.params() if active else {}
            overrides = {n: v for n, v in values.items() if "@" in n}
            rows.append({"term": name, "active": active is not None, "summary": term.summary(),
                         "params": [{"name": p.name, "value": values.get(p.name), "default": p.default,
                                     "low": p.low, "high": p.high, "unit": p.unit, "doc": p.doc,
                                     "per_device": p.per_device, "choices": list(p.choices),
                                     "by_device": {n.partition("@")[2]: v for n, v in overrides.items()
                                                   if n.partition("@")[0] == p.name}} for p in term.params]})
        devices = [{"type": d.type, "name": d.name,
                    **{c: {"value": v, "source": d.source(c)} for c, v in d.constants().items()}}
                   for d in model.devices]
        if as_json:
            print_json({"model": str(model_path or default_model()), "model_sha256": model.sha256, "terms": rows,
                         "devices": devices})
            return EXIT_OK
        print(f"model {model.name} ({model_path or default_model()}), sha256 {model.sha256[:12]}")
        for row in rows:
            print(f"{'*' if row['active'] else ' '} {row['term']}: {row['summary']}")
            for p in row["params"]:
                value = "" if p["value"] is None else f" = {p['value']:g}"
                per_device = " per device type" if p["per_device"] else ""
                values_taken = (f"one of {', '.join(f'{c:g}' for c in p['choices'])}" if p["choices"]
                                else f"[{p['low']:g}, {p['high']:g}]")
                print(f"      {p['name']}{value} (default {p['default']:g}, {values_taken} "
                      f"{p['unit']}{per_device}): {p['doc']}")
                for device, device_value in sorted(p["by_device"].items()):
                    print(f"        @{device} = {device_value:g}")
        print("  (* = active in this model)")
        for device in model.devices:
            print(f"device {device.type}: {device.name}: " + ", ".join(
                f"{c} {v:.4g}" for c, v in device.constants().items()))
        return EXIT_OK

    return guarded(run, as_json)


# --- candidate new -------------------------------------------------------------------------------

def candidate_new_command(term: str, candidate_id: str | None, folder: Path, model_path: Path | None,
                          as_json: bool, devices: tuple[str, ...] = ()) -> int:
    def run() -> int:
        from hops_calib.loop.candidate import write_scaffold
        from hops_calib.loop.model_files import default_model, load_model

        model = load_model(model_path)
        path = write_scaffold(term, model, folder, candidate_id, devices)
        if as_json:
            print_json({"path": str(path), "id": path.stem, "term": term, "model": str(model_path or default_model()),
                        "text": path.read_text(encoding="utf-8")})
        else:
            print(f"wrote {path}: fill in its hypothesis and grounding, keep only the values you change, then "
                  f"hops-calib ledger plan --note \"...\" --candidate {path} and hops-calib evaluate {path} "
                  "--fixtures DIR --plan N")
        return EXIT_OK

    return guarded(run, as_json)
