"""crossval on the real runs: folds hold whole configurations of the train split, each refit never sees its fold,
and the numbers it prints are the loop's own scores of those refits."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.errors import InputError
from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import load_suite, score_model
from hops_calib.model import resolve_params
from hops_calib.research.crossval import crossval, fold_groups, subset
from hops_calib.store.split import group_of

TERM, PARAM = "link_transfer", "burst_mib"


@pytest.fixture(scope="module")
def result(shared_fixtures):
    return crossval(TERM, shared_fixtures, folds=3, evaluations=8, seed=7, only=(PARAM,))


def test_folds_hold_whole_train_configurations_and_never_a_test_run(result, shared_store):
    train, test = set(shared_store.ids("train")), set(shared_store.ids("test"))
    held = [run for fold in result.folds for run in fold.ids]
    assert sorted(held) == sorted(train)  # every train run held out exactly once
    assert not set(held) & test
    for fold in result.folds:
        assert {group_of(run) for run in fold.ids} == set(fold.groups)
        others = {group_of(run) for f in result.folds if f is not fold for run in f.ids}
        assert not set(fold.groups) & others  # repeats of a configuration never straddle two folds
    # The same seed deals the same folds; another seed deals other ones.
    groups = tuple(shared_store.load(i).group for i in sorted(train))
    assert fold_groups(groups, 3, 7) == fold_groups(groups, 3, 7) == [f.groups for f in result.folds]
    assert fold_groups(groups, 3, 8) != fold_groups(groups, 3, 7)


def test_each_refit_is_scored_on_its_fold_and_its_complement_as_evaluate_would(result, shared_fixtures):
    suite = load_suite(shared_fixtures, "train")
    model = load_model(None)
    base = model.active(TERM).params()
    current = score_model(suite, model, origin="test")
    assert result.current == current.suite
    for fold in result.folds:
        refit = model.with_term(resolve_params(TERM, {**base, **fold.params}, origin="test"))
        on_fold = score_model(subset(suite, fold.ids), refit, origin="test")
        rest = tuple(i for i in suite.ids if i not in fold.ids)
        assert fold.held_out == on_fold.suite
        assert fold.in_sample == score_model(subset(suite, rest), refit, origin="test").suite
        assert {r.run_id: r.throughput_error_pct for r in on_fold.runs} == {k: h for k, (_, h) in fold.errors.items()}
        now = {r.run_id: r.throughput_error_pct for r in current.runs}
        assert {k: c for k, (c, _) in fold.errors.items()} == {k: now[k] for k in fold.ids}
        assert set(fold.params) == {PARAM}
    # The same search on every train run, scored there: the yardstick of the search itself.
    full = model.with_term(resolve_params(TERM, {**base, **result.full_params}, origin="test"))
    assert result.full == score_model(suite, full, origin="test").suite
    # The cross-validated MAPE pools every train run's held-out error.
    pooled = [abs(h) for fold in result.folds for _, h in fold.errors.values()]
    assert result.held_out.n_fixtures == len(suite.ids)
    assert result.held_out.throughput_mape_pct == pytest.approx(sum(pooled) / len(pooled))
    assert result.optimism_pp == pytest.approx(result.held_out.throughput_mape_pct - result.in_sample_mape_pct)


def test_a_refit_never_reads_the_truths_of_its_fold(shared_fixtures, result, monkeypatch):
    # Make fold 0's runs look twice as fast as they were: its refit must not move, its held-out score must.
    import dataclasses

    import hops_calib.research.crossval as cv_module

    fold0 = set(result.folds[0].ids)
    real_load = cv_module.load_problem

    def doctored(*args, **kwargs):
        problem = real_load(*args, **kwargs)
        truths = tuple(dataclasses.replace(t, throughput_per_s=2 * t.throughput_per_s) if run in fold0 else t
                       for run, t in zip(problem.suite.ids, problem.suite.truths))
        return dataclasses.replace(problem, suite=dataclasses.replace(problem.suite, truths=truths))

    monkeypatch.setattr(cv_module, "load_problem", doctored)
    again = crossval(TERM, shared_fixtures, folds=3, evaluations=8, seed=7, only=(PARAM,))
    assert again.folds[0].params == result.folds[0].params
    assert again.folds[0].held_out.throughput_mape_pct != pytest.approx(result.folds[0].held_out.throughput_mape_pct)
    # Fold 0's fitting runs are untouched, and so is its score on them.
    assert again.folds[0].in_sample == result.folds[0].in_sample


def test_crossval_cli_prints_the_summary_and_json(shared_fixtures):
    runner = CliRunner()
    text = runner.invoke(app, ["crossval", TERM, "--only", PARAM, "--folds", "2", "--evaluations", "3",
                               "--fixtures", str(shared_fixtures)])
    assert text.exit_code == 0, text.output
    assert "cross-validated" in text.stdout and "optimism" in text.stdout and "configurations held out" in text.stdout
    assert "the same refit on every train run" in text.stdout
    data = json.loads(runner.invoke(app, ["crossval", TERM, "--only", PARAM, "--folds", "2", "--evaluations", "3",
                                          "--fixtures", str(shared_fixtures), "--json"]).stdout)
    assert data["split"] == "train" and len(data["folds"]) == 2 and set(data["full_refit"]["params"]) == {PARAM}
    assert data["optimism_pp"] == pytest.approx(data["cross_validated"]["throughput_mape_pct"]
                                                - data["in_sample_mape_pct"])


def test_bad_requests_name_the_option_and_the_range(shared_fixtures):
    n_configs = len({group_of(i) for i in load_suite(shared_fixtures, "train").ids})
    for folds in (1, n_configs + 1):
        with pytest.raises(InputError, match=f"choose 2 to {n_configs} folds") as error:
            crossval(TERM, shared_fixtures, folds=folds, evaluations=1)
        assert error.value.field == "folds"
    with pytest.raises(InputError, match="unknown term") as unknown:
        crossval("no_such_term", shared_fixtures, evaluations=1)
    assert str(unknown.value).startswith("crossval")  # the command the user ran, not the one it borrows from
    with pytest.raises(InputError, match="evaluations"):
        crossval(TERM, shared_fixtures, evaluations=0)
    bad = CliRunner().invoke(app, ["crossval", TERM, "--folds", "1", "--fixtures", str(shared_fixtures)])
    assert bad.exit_code == 2 and "folds" in bad.output


def test_a_refit_starts_from_the_term_defaults_not_from_the_values_fitted_on_every_run(shared_fixtures):
    from hops_calib.model.terms import TERMS

    shipped = load_model(None).active(TERM).params()[PARAM]
    default = TERMS[TERM].defaults()[PARAM]
    assert shipped != default  # else this test could not tell them apart
    # One evaluation: the search has only its start to return.
    start = crossval(TERM, shared_fixtures, folds=2, evaluations=1, only=(PARAM,))
    assert all(fold.params[PARAM] == pytest.approx(default) for fold in start.folds)
    with pytest.raises(InputError, match="only switch parameters"):
        crossval("layer_dispatch_floor", shared_fixtures, folds=2, evaluations=1, only=("step_after_receive_only",))


def test_components_mode_reports_the_objective_it_refit(shared_fixtures):
    from hops_calib.research.tune import load_problem

    result = crossval("optimizer_step", shared_fixtures, folds=2, evaluations=3, objective="components",
                      only=("fixed_ms",))
    problem = load_problem("optimizer_step", shared_fixtures, None, "components", ("fixed_ms",))
    for fold in result.folds:
        refit = problem.model_with(fold.params)
        rest = tuple(i for i in problem.suite.ids if i not in fold.ids)
        held = _subproblem(problem, fold.ids)
        assert fold.held_out_component_pct == pytest.approx(held.component_mape(refit))
        assert fold.in_sample_component_pct == pytest.approx(_subproblem(problem, rest).component_mape(refit))
    assert result.current_component_pct == pytest.approx(problem.component_mape(problem.model))
    assert result.full_component_pct == pytest.approx(problem.component_mape(problem.model_with(result.full_params)))
    data = result.to_dict()["component_mape_pct"]
    assert data["cross_validated"] == pytest.approx(result.held_out_component_pct)
    # In suite mode there is no component error to report.
    suite_mode = crossval(TERM, shared_fixtures, folds=2, evaluations=1, only=(PARAM,))
    assert suite_mode.to_dict()["component_mape_pct"] is None


def _subproblem(problem, ids):
    import dataclasses

    keep = [i for i, run in enumerate(problem.suite.ids) if run in set(ids)]
    return dataclasses.replace(problem, suite=subset(problem.suite, tuple(ids)),
                               real_components=tuple(problem.real_components[i] for i in keep))


def test_shared_refits_one_value_for_every_device_in_place_of_the_per_device_ones(shared_fixtures):
    term, names = "layer_launch_floor", ("forward_ms_per_layer", "backward_ms_per_layer")
    shipped = load_model(None)
    per_device = sorted(k for k in shipped.active(term).params() if k.partition("@")[0] in names and "@" in k)
    assert per_device  # the shipped model has per-device floors, else there is nothing to test
    result = crossval(term, shared_fixtures, folds=2, evaluations=2, only=names, shared=True)
    assert list(result.dropped) == per_device
    assert result.model_sha256 == shipped.sha256  # the model asked about, not the stripped one
    suite = load_suite(shared_fixtures, "train")
    assert result.current == score_model(suite, shipped, origin="test").suite
    kept = {k: v for k, v in shipped.active(term).params().items() if k not in per_device}
    for fold in result.folds:
        assert set(fold.params) == set(names)
        refit = shipped.with_term(resolve_params(term, {**kept, **fold.params}, origin="test"))
        assert not any("@" in k and k.partition("@")[0] in names for k in refit.active(term).params())
        assert fold.held_out == score_model(subset(suite, fold.ids), refit, origin="test").suite
    with pytest.raises(InputError, match="one device's value"):
        crossval(term, shared_fixtures, folds=2, evaluations=1, only=("forward_ms_per_layer@l4",), shared=True)
    with pytest.raises(InputError, match="no per-device value"):
        crossval(TERM, shared_fixtures, folds=2, evaluations=1, only=(PARAM,), shared=True)


def test_also_refits_other_terms_parameters_together_with_the_term(shared_fixtures):
    also = ("layer_dispatch_floor:step_ms",)
    result = crossval(TERM, shared_fixtures, folds=2, evaluations=4, only=(PARAM,), also=also)
    shipped = load_model(None)
    suite = load_suite(shared_fixtures, "train")
    assert result.also == also
    assert result.current_params == {PARAM: shipped.active(TERM).params()[PARAM],
                                     "layer_dispatch_floor:step_ms": shipped.active("layer_dispatch_floor").params()[
                                         "step_ms"]}
    for fold in result.folds:
        assert set(fold.params) == {PARAM, "layer_dispatch_floor:step_ms"}
        refit = shipped.with_term(resolve_params(TERM, {**shipped.active(TERM).params(), PARAM: fold.params[PARAM]},
                                                 origin="test"))
        dispatch = {**refit.active("layer_dispatch_floor").params(),
                    "step_ms": fold.params["layer_dispatch_floor:step_ms"]}
        refit = refit.with_term(resolve_params("layer_dispatch_floor", dispatch, origin="test"))
        assert fold.held_out == score_model(subset(suite, fold.ids), refit, origin="test").suite
    # One evaluation: both start from their terms' defaults.
    from hops_calib.model.terms import TERMS

    start = crossval(TERM, shared_fixtures, folds=2, evaluations=1, only=(PARAM,), also=also)
    assert start.folds[0].params["layer_dispatch_floor:step_ms"] == TERMS["layer_dispatch_floor"].defaults()["step_ms"]
    for bad, message in ((("nope:x",), "known term"), (("layer_dispatch_floor:nope",), "has no parameter"),
                         (("step_ms",), "TERM:PARAM")):
        with pytest.raises(InputError, match=message):
            crossval(TERM, shared_fixtures, folds=2, evaluations=1, only=(PARAM,), also=bad)


def test_also_refuses_a_parameter_already_refit(shared_fixtures):
    with pytest.raises(InputError, match="host_ms of iteration_host_overhead is refit already as"):
        crossval("iteration_host_overhead", shared_fixtures, folds=3, evaluations=1, only=("host_ms",),
                 also=("iteration_host_overhead:host_ms",))
    with pytest.raises(InputError, match="given twice"):
        crossval("iteration_host_overhead", shared_fixtures, folds=3, evaluations=1, only=("host_ms",),
                 also=("optimizer_step:fixed_ms", "optimizer_step:fixed_ms"))


def test_a_fold_whose_refit_falls_short_of_the_current_values_is_flagged_and_left_out_of_the_verdict(
        shared_fixtures):
    # The walkthrough's case: with 40 evaluations one fold's refit stays at the term's default, worse on its own
    # fitting runs than the shipped value; its value must not make the folds "disagree".
    cli = CliRunner().invoke(app, ["crossval", "iteration_host_overhead", "--only", "host_ms", "--folds", "3",
                                   "--evaluations", "40", "--fixtures", str(shared_fixtures), "--json"])
    assert cli.exit_code == 0, cli.output
    data = json.loads(cli.stdout)
    suite = load_suite(shared_fixtures, "train")
    current = {r.run_id: abs(r.throughput_error_pct) for r in score_model(suite, load_model(None), origin="t").runs}
    short = [f for f in data["folds"] if f["fell_short"]]
    assert short and data["short_folds"] == [f["fold"] for f in short]
    for fold in data["folds"]:
        fitting = [run for run in suite.ids if run not in fold["runs"]]
        assert fold["current_in_sample_objective"] == pytest.approx(sum(current[r] for r in fitting) / len(fitting))
        assert fold["in_sample_objective"] == pytest.approx(fold["in_sample"]["throughput_mape_pct"])
        assert fold["fell_short"] == (fold["in_sample_objective"] > fold["current_in_sample_objective"] + 0.1)
    assert any(f"fold {f['fold']}: its refit scores" in w for f in short for w in data["warnings"])
    # Over every fold the values lie more than 1.5x apart (the old verdict); over the sound folds they do not.
    values = [f["params"]["host_ms"] for f in data["folds"]]
    sound = [f["params"]["host_ms"] for f in data["folds"] if not f["fell_short"]]
    assert max(values) > 1.5 * min(values) and max(sound) <= 1.5 * min(sound)
    assert data["disagreeing_params"] == {} and data["verdicts"] == []
