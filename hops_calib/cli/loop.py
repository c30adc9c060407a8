"""The `predict` verb's body: a fixture's prediction against its run, or the train split's per-run errors and
suite (a job that has not run is `hops_calib.cli.whatif`'s), printed as text or JSON with the exit codes of
`hops_calib.cli.output`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hops_calib.cli.output import EXIT_OK, guarded, held_out_guard, print_json, refuse_job_dir_as_id
from hops_calib.cli.scores import num as _num
from hops_calib.cli.scores import pct as _pct
from hops_calib.cli.scores import print_left_out as _print_left_out
from hops_calib.cli.scores import print_runs as _print_runs
from hops_calib.cli.scores import print_suite as _print_suite
from hops_calib.errors import InputError, given_together
from hops_calib.metrics import THROUGHPUT_UNIT, samples_per_s

# --- predict -------------------------------------------------------------------------------------


def _stage_rows(fixture, prediction) -> list[dict[str, Any]]:
    from hops_calib.timeline import BACKWARD, FORWARD

    truth, spec = fixture.truth, fixture.spec
    rows = []
    for predicted in prediction.stage_phase_ms(spec):
        stage = predicted.stage
        rows.append(
            {
                "stage": stage,
                "device": predicted.device,
                "real_utilization": truth.metrics.utilization_per_stage[stage],
                "predicted_utilization": prediction.metrics.utilization_per_stage[stage],
                "real_forward_ms": truth.phase_median_ms(stage, FORWARD),
                "predicted_forward_ms": predicted.forward_ms,
                "real_backward_ms": truth.phase_median_ms(stage, BACKWARD),
                "predicted_backward_ms": predicted.backward_ms,
                "real_optimizer_ms": truth.optimizer_ms_per_stage[stage]
                if stage < len(truth.optimizer_ms_per_stage)
                else None,
                "predicted_optimizer_ms": predicted.optimizer_ms,
            }
        )
    return rows


def launch_sections(spec, model, prediction, real=None, throughput_per_s=None):
    from hops_calib.cli.whatif import launch_sections as sections

    return sections(spec, model, prediction, real, throughput_per_s)


def _predict_one(
    fixture_id: str,
    fixtures: Path,
    model_path: Path | None,
    as_json: bool,
    ledger_path: Path | None = None,
    allow_held_out: bool = False,
) -> int:
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.score import score_prediction
    from hops_calib.loop.suite import TEST, open_store, priced
    from hops_calib.model.predict import predict
    from hops_calib.store.fixture import NotPriced

    store = open_store(fixtures)
    fixture = store.load(fixture_id)
    if fixture.split == TEST:
        raise InputError(
            f"{fixtures}/{fixture_id}",
            "is in the test split, which is scored only in aggregate",
            field="split",
            hint="`hops-calib report --split test` prints the held-out aggregates",
        )
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
        print_json(
            {
                "id": fixture.id,
                "run_id": fixture.id,
                "split": fixture.split,
                "schedule": prediction.schedule,
                "model": model.name,
                "model_sha256": model.sha256,
                "errors": score.to_dict(),
                "real": fixture.truth.metrics.to_dict(),
                "predicted": prediction.metrics.to_dict(),
                "samples_per_s": _samples(fixture.truth.metrics, prediction.metrics, fixture.spec),
                "stall_throughput_range": prediction.stall_throughput_range()._asdict(),
                "stages": stages,
                **launch,
            }
        )
        return EXIT_OK
    real, pred, spec = fixture.truth.metrics, prediction.metrics, fixture.spec
    print(
        f"{fixture.id}  ({fixture.split}; {prediction.schedule}, pp={spec.pp}, {spec.microbatches} microbatches x "
        f"{spec.iterations} iterations; model {model.name} {model.sha256[:12]})"
    )
    print(
        f"{'':24}{'real':>12}{'predicted':>12}{'error':>10}    (throughput: {THROUGHPUT_UNIT}, "
        f"{spec.model.micro_batch_size} sample(s) each)"
    )
    print(
        f"{'throughput /s':24}{real.throughput_per_s:12.3f}{pred.throughput_per_s:12.3f}"
        f"{_pct(score.throughput_error_pct):>8} %"
        + (
            f"  (random stalls alone: +-{score.stall_noise_ape_pct:.1f} %; "
            f"{prediction.stall_throughput_range().text()})"
            if score.stall_noise_ape_pct
            else ""
        )
    )
    print(
        f"{'steady throughput /s':24}{real.steady_throughput_per_s:12.3f}{pred.steady_throughput_per_s:12.3f}"
        f"{_pct(score.steady_throughput_error_pct):>8} %"
    )
    samples = _samples(real, pred, spec)
    print(
        f"{'samples /s':24}{samples['real']:12.2f}{samples['predicted']:12.2f}"
        + (f"    (all {spec.dp} data-parallel replicas)" if spec.dp > 1 else "")
    )
    print(
        f"{'bubble %':24}{100 * real.bubble_ratio:12.1f}{100 * pred.bubble_ratio:12.1f}"
        f"{_pct(score.bubble_error_pp):>7} pp"
    )
    print(f"{'iteration time ms':24}{real.iteration_time_ms:12.1f}{pred.iteration_time_ms:12.1f}")
    print(f"{'utilization rho':24}{'':24}{score.util_spearman_rho:10.2f}")
    print()
    print(
        f"{'stage':>5} {'device':8}{'util real':>10}{'pred':>7}{'fwd ms real':>13}{'pred':>8}"
        f"{'bwd ms real':>13}{'pred':>8}{'opt ms real':>13}{'pred':>8}"
    )
    for row in stages:
        print(
            f"{row['stage']:>5} {row['device']:8}{row['real_utilization']:10.3f}{row['predicted_utilization']:7.3f}"
            f"{_num(row['real_forward_ms']):>13}{_num(row['predicted_forward_ms']):>8}"
            f"{_num(row['real_backward_ms']):>13}{_num(row['predicted_backward_ms']):>8}"
            f"{_num(row['real_optimizer_ms']):>13}{_num(row['predicted_optimizer_ms']):>8}"
        )
    print("\n".join(launch_text))
    return EXIT_OK


def _samples(real, predicted, spec) -> dict[str, float | None]:
    """Real and predicted samples per second of every data-parallel replica (the text's `samples /s` row)."""
    return {
        side: samples_per_s(metrics.throughput_per_s, spec.model.micro_batch_size, spec.dp)
        for side, metrics in (("real", real), ("predicted", predicted))
    }


def _predict_measured(fixture, model, prediction, score, as_json: bool) -> int:
    """`predict ID` of a run measured at iteration level: throughput and iteration time (no events: no stages)."""
    real, pred, spec = fixture.truth.metrics, prediction.metrics, fixture.spec
    # samples/s from the throughputs the score compares (the text's throughput row), for text and JSON alike
    mb = spec.model.micro_batch_size
    samples = {
        side: samples_per_s(throughput, mb, spec.dp)
        for side, throughput in (("real", score.real_throughput_per_s), ("predicted", score.predicted_throughput_per_s))
    }
    launch, launch_text = launch_sections(spec, model, prediction, real, score.predicted_throughput_per_s)
    if as_json:
        print_json(
            {
                "id": fixture.id,
                "run_id": fixture.id,
                "kind": fixture.kind,
                "split": fixture.split,
                "schedule": prediction.schedule,
                "model": model.name,
                "model_sha256": model.sha256,
                "errors": score.to_dict(),
                "real": real.to_dict(),
                "predicted": pred.to_dict(),
                "samples_per_s": samples,
                **launch,
            }
        )
        return EXIT_OK
    print(
        f"{fixture.id}  ({fixture.split}; measured at iteration level; {prediction.schedule}, pp={spec.pp}, "
        f"{spec.microbatches} microbatches; model {model.name} {model.sha256[:12]})"
    )
    print(
        f"{'':24}{'real':>12}{'predicted':>12}{'error':>10}    (throughput: {THROUGHPUT_UNIT}; real over the "
        "kept iterations, predicted over the simulated steady state)"
    )
    print(
        f"{'throughput /s':24}{score.real_throughput_per_s:12.3f}{score.predicted_throughput_per_s:12.3f}"
        f"{_pct(score.throughput_error_pct):>8} %"
    )
    print(
        f"{'samples /s':24}{samples['real']:12.2f}{samples['predicted']:12.2f}    "
        f"(x micro batch {mb} x data parallel {spec.dp})"
    )
    print(f"{'iteration time ms':24}{real.iteration_time_ms:12.1f}{pred.iteration_time_ms:12.1f}")
    print("\n".join(launch_text))
    return EXIT_OK


def predict_command(
    fixture_id: str | None,
    all_train: bool,
    fixtures: Path,
    model_path: Path | None,
    as_json: bool,
    job: Path | None = None,
    schedules: Sequence[str] = (),
    fixtures_defaulted: bool = False,
    cluster: Path | None = None,
    perturbations: dict | None = None,
    ledger_path: Path | None = None,
    allow_held_out: bool = False,
    kernels: bool = False,
    kernel_stage: int | None = None,
) -> int:
    def run() -> int:
        refuse_job_dir_as_id(fixture_id, fixtures, "`hops-calib predict --job DIR`")
        choices = {f"ID {fixture_id}": fixture_id is not None, "--all": all_train, f"--job {job}": job is not None}
        if sum(choices.values()) != 1:
            raise InputError(
                "predict",
                f"{given_together(choices)}give one of a fixture ID, --all (every train "
                "fixture) or --job DIR (a configuration that has not run)",
                field="ID",
            )
        if schedules and job is None:
            raise InputError(
                "predict", "--schedule applies to --job (a fixture is predicted as it ran)", field="--schedule"
            )
        given = [name for name, value in (perturbations or {}).items() if value not in (None, [])]
        if given and job is None:
            raise InputError(
                "predict",
                f"--{given[0].replace('_', '-')} applies to --job (a fixture is predicted as it ran)",
                field=f"--{given[0].replace('_', '-')}",
            )
        if (kernels or kernel_stage is not None) and job is None:
            raise InputError(
                "predict", "--kernels applies to --job (the kernel table of a configuration's stage)", field="--kernels"
            )
        if kernel_stage is not None and not kernels:
            raise InputError(
                "predict", "--kernel-stage chooses the stage of --kernels", field="--kernel-stage", hint="add --kernels"
            )
        if job is not None:
            from hops_calib.cli.whatif import predict_job

            return predict_job(
                job,
                model_path,
                schedules,
                fixtures,
                fixtures_defaulted,
                as_json,
                cluster,
                perturbations,
                kernels=kernels,
                kernel_stage=kernel_stage,
            )
        if fixture_id is not None:
            return _predict_one(fixture_id, fixtures, model_path, as_json, ledger_path, allow_held_out)
        from hops_calib.loop.evaluate import evaluate
        from hops_calib.progress import progress_bar

        with progress_bar("predict", quiet=as_json) as progress:
            result = evaluate(
                fixtures,
                model_path=model_path,
                progress=progress,
                ledger_path=ledger_path,
                allow_held_out=allow_held_out,
                verb="predict",
            )
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if as_json:
            print_json(result.to_dict())
        else:
            _print_runs(result.before.runs)
            _print_suite(
                f"model {result.model.name} ({result.model.sha256[:12]}) on the train split", result.before.suite
            )
            _print_left_out(result.left_out)
        return EXIT_OK

    return guarded(run, as_json)
