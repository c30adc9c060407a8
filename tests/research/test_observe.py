"""observe on the real runs: parts add up on both sides, contributors are ranked by the MAPE they carry, train only."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.suite import ProtectedSplit
from hops_calib.research.observe import observe, part_fixed_errors, stages_fixed_errors

@pytest.fixture(scope="module")
def model_path(iteration_terms_model):
    return iteration_terms_model


@pytest.fixture(scope="module")
def observation(shared_fixtures, model_path):
    return observe(shared_fixtures, model_path=model_path)


def test_parts_add_up_to_the_iteration_time_on_both_sides(observation):
    assert observation.runs
    for run in observation.runs:
        assert run.real_parts.iteration_ms == pytest.approx(run.real_metrics.iteration_time_ms, rel=1e-9)
        assert run.predicted_parts.iteration_ms == pytest.approx(run.prediction.metrics.iteration_time_ms, rel=1e-9)
        assert run.real_parts.span_ms > 0 and run.predicted_parts.span_ms > 0
        if run.real_parts.optimizer_traced:  # the real silent stretch is the untraced work before the optimizer
            assert run.real_parts.silent_ms > 0 and run.real_parts.optimizer_ms > 0


def test_contributors_are_ranked_by_contribution_and_each_is_the_mape_it_removes(observation):
    ranked = observation.ranked
    # #22: ranked by the fixable part of the contribution (the contribution less the repeat noise's share)
    fixable = [c.fixable_mape_pp for c in ranked]
    assert fixable == sorted(fixable, reverse=True)
    assert {c.quantity for c in ranked} == {"span", "silent", "optimizer", "rest", "forward", "backward"}
    suite_mape = observation.suite.throughput_mape_pct
    runs = {r.id: r for r in observation.runs}
    for contributor in (ranked[0], next(c for c in ranked if c.level == "run")):
        # Recompute from the per-run counterfactuals: the suite's MAPE with this quantity exact on the group.
        fixed = {r.id: abs(r.score.throughput_error_pct) for r in observation.runs}
        members = [r for r in observation.runs if contributor.group == _group_of(r, contributor)]
        for run in members:
            if contributor.level == "run":
                errors = part_fixed_errors(run, contributor.quantity)
            else:
                stages = frozenset(s.stage for s in run.stages if _stage_in(run, s.stage, contributor))
                errors = stages_fixed_errors(run, contributor.quantity, stages)
            if errors is not None:
                fixed[run.id] = abs(errors[0])
        assert suite_mape - np.mean(list(fixed.values())) == pytest.approx(contributor.contribution_pp, abs=1e-9)
        dominant = [d["contribution_pp"] for d in contributor.dominant_runs]
        assert dominant == sorted(dominant, reverse=True) and all(d > 0 for d in dominant)
        assert all(d["id"] in runs for d in contributor.dominant_runs)
    assert "predicting it exactly" in ranked[0].sentence() and ranked[0].dominant_runs[0]["id"] in ranked[0].sentence()
    # a residual in % is the mean residual over the mean real time: it never reads opposite to the one in ms
    for c in list(ranked) + list(observation.overall):
        if c.real_ms_mean > 0:
            assert c.residual_pct == pytest.approx(c.residual_ms_mean / c.real_ms_mean * 100.0)
            assert c.residual_pct * c.residual_ms_mean >= 0


def _group_of(run, contributor):
    from hops_calib.research.observe import run_groups, stage_groups

    if contributor.level == "run":
        return run_groups(run.spec)[contributor.dimension]
    values = {stage_groups(run.spec, s.stage)[contributor.dimension] for s in run.stages}
    return contributor.group if contributor.group in values else None


def _stage_in(run, stage, contributor):
    from hops_calib.research.observe import stage_groups

    return stage_groups(run.spec, stage)[contributor.dimension] == contributor.group


def test_counterfactual_of_an_exact_quantity_changes_nothing_and_a_slower_stage_lowers_throughput(observation):
    run = max(observation.runs, key=lambda r: r.spec.pp)
    exact = replace(run, stages=tuple(replace(s, real_forward_ms=s.predicted_forward_ms) for s in run.stages))
    everything = frozenset(range(run.spec.pp))
    unchanged = stages_fixed_errors(exact, "forward", everything)
    assert unchanged == pytest.approx((run.score.throughput_error_pct, run.score.steady_throughput_error_pct))
    slower = replace(run, stages=tuple(replace(s, real_forward_ms=2 * s.predicted_forward_ms) for s in run.stages))
    assert stages_fixed_errors(slower, "forward", everything)[0] < run.score.throughput_error_pct
    # A part predicted exactly: the predicted period loses exactly its residual.
    residual = run.part_residual_ms("silent")
    steady = run.prediction.metrics.steady_throughput_per_s * run.prediction.metrics.iteration_time_ms / (
        run.prediction.metrics.iteration_time_ms - residual)
    real = run.real_metrics.steady_throughput_per_s
    assert part_fixed_errors(run, "silent")[1] == pytest.approx((steady - real) / real * 100)


def test_slowest_stage_follows_the_stage_times_misplaced_when_another_stage_is_priced_slowest(observation):
    from hops_calib.research.observe import BOTTLENECK_MARGIN, bottleneck

    rows = {b.run_id: b for b in observation.bottlenecks}
    assert rows and all(b.real_ms > 0 and b.predicted_ms > 0 for b in rows.values())
    # a run whose slowest stage is clearly slower than another stage, in the traces
    run, other = next((r, s) for r in sorted(observation.runs, key=lambda r: -r.spec.pp) if r.id in rows
                      for s in r.stages if s.stage != rows[r.id].real_stage
                      and s.real_forward_ms + s.real_backward_ms < (1 - 2 * BOTTLENECK_MARGIN) * rows[r.id].real_ms)
    # priced exactly, the model finds the real slowest stage and prices it right
    exact = bottleneck(replace(run, stages=tuple(
        replace(s, predicted_forward_ms=s.real_forward_ms, predicted_backward_ms=s.real_backward_ms)
        for s in run.stages)))
    assert (exact.predicted_stage, exact.misplaced, exact.mispriced) == (exact.real_stage, False, False)
    # the other stage priced far slower: the model now calls it the slowest, which is misplaced; the real slowest
    # keeps its price
    slower = bottleneck(replace(run, stages=tuple(
        replace(s, predicted_backward_ms=s.predicted_backward_ms + 10 * rows[run.id].predicted_ms)
        if s.stage == other.stage else s for s in run.stages)))
    assert slower.predicted_stage == other.stage and slower.misplaced
    assert slower.predicted_ms_of_real == rows[run.id].predicted_ms_of_real
    assert slower.mispriced == rows[run.id].mispriced
    # the real slowest stage priced 20 % fast: mispriced, and still found if nothing else is priced above it
    fast = bottleneck(replace(run, stages=tuple(
        replace(s, predicted_forward_ms=s.real_forward_ms * (0.8 if s.stage == exact.real_stage else 1.0),
                predicted_backward_ms=s.real_backward_ms * (0.8 if s.stage == exact.real_stage else 1.0))
        for s in run.stages)))
    assert fast.mispriced and fast.predicted_ms_of_real == pytest.approx(0.8 * fast.real_ms)
    priced = {s.stage: (s.real_forward_ms + s.real_backward_ms) * (0.8 if s.stage == exact.real_stage else 1.0)
              for s in run.stages}
    assert fast.predicted_stage == max(priced, key=priced.get)  # the real slowest, unless 20 % off demotes it
    assert fast.misplaced == (fast.predicted_stage != fast.real_stage
                              and priced[fast.predicted_stage] < (1 - BOTTLENECK_MARGIN) * fast.real_ms)


def test_observe_refuses_the_test_split(shared_fixtures):
    with pytest.raises(ProtectedSplit, match="test split"):
        observe(shared_fixtures, split="test")
    result = CliRunner().invoke(app, ["observe", "--fixtures", str(shared_fixtures), "--split", "test"])
    assert result.exit_code == 2 and "refuses the test split" in result.output


def test_cli_json_and_text(shared_fixtures, model_path, observation):
    result = CliRunner().invoke(app, ["observe", "--fixtures", str(shared_fixtures), "--model", str(model_path),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["split"] == "train" and data["n_fixtures"] == len(observation.runs)
    assert data["steady_throughput_mape_pct"] == pytest.approx(observation.suite.steady_throughput_mape_pct)
    assert [c["contribution_pp"] for c in data["ranked"]] == pytest.approx(
        [c.contribution_pp for c in observation.ranked])
    assert {c["quantity"] for c in data["overall"]} == {"span", "silent", "optimizer", "rest", "forward", "backward"}
    # an agent ties observe to the gate's numbers: the same fixture set, and each run's stall spread
    from hops_calib.loop.suite import load_suite

    assert data["fixture_set_sha256"] == load_suite(shared_fixtures, "train").sha256
    assert [r["stall_noise_ape_pct"] for r in data["runs"]] == pytest.approx(
        [r.score.stall_noise_ape_pct for r in observation.runs])
    run = data["runs"][0]
    assert sum(run["real_parts"][f"{p}_ms"] for p in ("span", "silent", "optimizer", "rest")) == pytest.approx(
        run["real_parts"]["iteration_ms"])
    from hops_calib.cli.render.observe import observation_text

    text = observation_text(observation, top=5)
    assert "steady throughput MAPE" in text and observation.ranked[0].sentence() in text
    assert [b["run_id"] for b in data["bottlenecks"]] == [b.run_id for b in observation.bottlenecks]
    assert f"Slowest stage (forward + backward per microbatch, which paces the steady state), " \
           f"{len(observation.bottlenecks)} runs" in text
    flagged = [b for b in observation.bottlenecks if b.misplaced or b.mispriced]
    assert flagged and all(b.run_id in text for b in flagged[:5])  # the table shows `top` of them


def test_measured_replay_depends_on_what_no_event_times_and_on_nothing_measured(shared_fixtures, shared_store,
                                                                                  observation):
    from hops_calib.research.observe import measured_replay_error_pct

    replay = observation.measured_replay
    with_optimizer = [r for r in observation.runs if r.real_parts.optimizer_traced]
    assert replay["n_runs"] == len(with_optimizer) > 0
    assert replay["throughput_mape_pct"] == pytest.approx(
        np.mean([abs(r.measured_replay_error_pct) for r in with_optimizer]))
    assert all(r.measured_replay_error_pct is None for r in observation.runs if not r.real_parts.optimizer_traced)

    run = with_optimizer[0]
    fixture = shared_store.load(run.id)
    pipeline = run.prediction.pipeline
    # Anything the trace measures is replaced: doubling the model's stage and optimizer costs changes nothing ...
    costly = replace(pipeline, stages=tuple(replace(c, forward_ms=2 * c.forward_ms, backward_ms=2 * c.backward_ms,
                                                    weight_grad_ms=2 * c.weight_grad_ms) for c in pipeline.stages),
                     optimizer_ms=tuple(2 * v for v in pipeline.optimizer_ms), pre_optimizer_ms=500.0)
    assert measured_replay_error_pct(fixture, costly) == pytest.approx(run.measured_replay_error_pct, abs=1e-9)
    # ... while what no event times (the hops) moves it: slower hops, slower replay.
    slow_hops = replace(pipeline, forward_transfer_ms=tuple(3 * t + 1 for t in pipeline.forward_transfer_ms),
                        backward_transfer_ms=tuple(3 * t + 1 for t in pipeline.backward_transfer_ms))
    assert measured_replay_error_pct(fixture, slow_hops) < run.measured_replay_error_pct
    text = CliRunner().invoke(app, ["observe", "--fixtures", str(shared_fixtures), "--model",
                                    str(observation.model_path), "--top", "2"]).stdout
    assert f"measured replay ({replay['n_runs']} runs" in text


def test_observe_runs_on_the_repositorys_cpu_captures_whose_ranks_step_without_a_barrier():
    # The shipped CPU captures run --untie-embeddings-and-output-weights --clip-grad 0.0: no collective before
    # the optimizer, so each rank steps after its own last backward and the silent stretch, measured from the
    # last rank's backward, is negative. The measured replay has no barrier to put it before and skips those
    # runs; observe still works (it crashed on them before).
    repo_fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    result = CliRunner().invoke(app, ["observe", "--fixtures", str(repo_fixtures), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_fixtures"] >= 6
    assert all(run["measured_replay_error_pct"] is None for run in data["runs"])
    assert data["measured_replay"] is None


def test_stall_free_error_takes_the_random_stall_count_out_of_both_sides(shared_store):
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.score import stall_free_error_pct
    from hops_calib.metrics import timeline_iteration_part_series
    from hops_calib.model.predict import Prediction, predict
    from hops_calib.research.observe import observe_run
    from hops_calib.sim import simulate

    model = load_model(None)  # the shipped model realizes its stalls
    by_ends: dict[bool, list] = {True: [], False: []}
    for fixture_id in shared_store.ids("train"):
        fixture = shared_store.load(fixture_id)
        by_ends["a10g" in (fixture.spec.devices[0], fixture.spec.devices[-1])].append(fixture)
    # NIC-paced runs (an A10G end) neither stall nor get stalls placed: the stall-free error is the error.
    checked = 0
    for fixture in by_ends[True][:4]:
        row = observe_run(fixture, model)
        assert row.prediction.pipeline.stall_probability == 0
        if row.stall_free_error_pct is None:  # no traced optimizer step: no silent stretch to read
            assert not row.real_parts.optimizer_traced
            continue
        checked += 1
        assert row.stall_free_error_pct == pytest.approx(row.score.throughput_error_pct, abs=1e-9)
    assert checked >= 2
    # At the TCP ceiling the stalls come out of both windows: placing more or longer stalls changes the error,
    # not the stall-free error.
    fixture = by_ends[False][0]
    row = observe_run(fixture, model)
    pipeline = row.prediction.pipeline
    assert pipeline.stall_probability > 0 and pipeline.stall_ms > 0
    series = timeline_iteration_part_series(fixture.timeline())

    for probability, stall_ms in ((0.3, 200.0), (0.146, 350.0)):
        other = replace(pipeline, stall_probability=probability, stall_ms=stall_ms)
        result = simulate(other, fixture.spec.schedule)
        moved = Prediction(run_id=fixture.id, schedule=result.schedule, model_sha256="-", pipeline=other,
                           result=result, metrics=result.metrics())
        error = (moved.metrics.throughput_per_s - fixture.truth.metrics.throughput_per_s) \
            / fixture.truth.metrics.throughput_per_s * 100
        assert abs(error - row.score.throughput_error_pct) > 1.0
        assert stall_free_error_pct(moved, fixture.truth.metrics, series) == pytest.approx(
            row.stall_free_error_pct, abs=1e-6)
    assert predict(fixture.spec, model).metrics.throughput_per_s == pytest.approx(
        row.prediction.metrics.throughput_per_s)


def test_hop_gaps_read_back_the_simulators_own_hops_and_measure_the_traces(shared_store, observation):
    from hops_calib.loop.model_files import load_model
    from hops_calib.model.predict import predict
    from hops_calib.cli.render.observe import observation_text
    from hops_calib.research.observe import hop_gaps

    model = load_model(None)
    checked = 0
    for fixture_id in shared_store.ids("train")[:6]:
        fixture = shared_store.load(fixture_id)
        spec = fixture.spec
        if spec.vp != 1:
            assert hop_gaps(spec, fixture.timeline()) == ()
            continue
        prediction = predict(spec, model)
        pipeline = prediction.pipeline
        prices: dict[str, list[float]] = {}
        for k in range(spec.pp - 1):
            pair = "-".join(sorted(spec.devices[k:k + 2]))
            prices.setdefault(pair, []).extend([pipeline.forward_transfer_ms[k] + pipeline.stages[k + 1].host_ms,
                                                pipeline.backward_transfer_ms[k] + pipeline.stages[k].host_ms])
        # On a simulated timeline no hop whose consumer waited is faster than its transfer + host time, and
        # the fastest takes exactly that (a slower one also waited on a blocking call).
        simulated = hop_gaps(spec, prediction.result.timeline)
        assert simulated and {devices for devices, _, _ in simulated} <= set(prices)
        for pair, priced in prices.items():
            gaps = [gap for devices, _, gap in simulated if devices == pair]
            if gaps:
                assert min(gaps) == pytest.approx(min(priced), abs=1e-6)
        real = hop_gaps(spec, fixture.timeline())
        assert real and all(gap > 0 for _, _, gap in real)
        checked += 1
    assert checked
    # The observation groups them by device types and message size, real against simulated, and prints them.
    rows = observation.hops
    assert rows and all(r.n_hops >= r.n_runs >= 1 for r in rows)
    assert sum(r.n_hops for r in rows) == sum(len(run.hops) for run in observation.runs)
    assert rows[0].to_dict()["residual_ms"] == pytest.approx(rows[0].predicted_ms - rows[0].real_ms)
    assert "Hops whose consumer waited" in observation_text(observation)


def test_contributors_separate_bias_from_noise_name_their_terms_and_merge_groupings_of_the_same_runs(observation):
    from hops_calib.store.split import group_of

    ranked = observation.ranked
    for c in ranked:  # the repeat noise's share of the contribution; the bias's removal priced by scoring again
        assert abs(c.noise_mape_pp) <= abs(c.contribution_pp) + 1e-12 and math.isfinite(c.fixable_mape_pp)
        assert c.residual_spread_ms >= 0 and (c.noise_ms is None or c.noise_ms >= 0)
    # where the bias is the whole residual (one run, one value), taking it out is predicting exactly
    single = [c for c in ranked if c.level == "run" and c.n_runs == 1]
    assert single and all(c.fixable_mape_pp == pytest.approx(c.contribution_pp, abs=1e-9) for c in single)
    # where the members' residuals spread, taking out their mean is not predicting each exactly
    assert any(abs(c.fixable_mape_pp - c.contribution_pp) > 1e-3 for c in ranked if c.residual_spread_ms > 1.0)
    # one finding per quantity and set of runs carrying it: the other slicings are named, not repeated
    keys = [(c.quantity, frozenset(c.carriers) if c.carriers else frozenset(c.members)) for c in ranked]
    assert len(keys) == len(set(keys)) and any(c.same_runs for c in ranked)
    for c in ranked:  # the carriers hold at least 80 % of the contribution, and they are the group's own runs
        assert set(c.carriers) <= {r for r, _ in c.members}
    # a group without repeats of its own takes the suite's relative repeat spread of its quantity
    assert {c.noise_from for c in ranked} >= {"repeats in the group", "the suite's repeats (relative)"}
    # noise is the real quantity's spread between repeats of one configuration: recomputed for a contributor
    c = next(c for c in ranked if c.noise_from == "repeats in the group" and c.level == "stage")
    runs = {r.id: r for r in observation.runs}
    values: dict = {}
    for run_id, stage in c.members:
        row = next(s for s in runs[run_id].stages if s.stage == stage)
        values.setdefault((group_of(run_id), stage), []).append(row.real(c.quantity))
    groups = [np.array(v) for v in values.values() if len(v) > 1]
    pooled = sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)
    assert c.noise_ms == pytest.approx(float(np.sqrt(pooled)))
    # terms: every contributor names the parameters pricing its quantity (found by perturbing them), and a
    # per-device value of a device type none of its runs use does not apply to it
    assert all(c.terms for c in ranked if c.quantity in ("forward", "backward"))
    for c in ranked:
        devices = {d for run_id, _ in c.members for d in runs[run_id].spec.devices}
        for t in c.terms:
            if "@" in t["param"] and t["param"].partition("@")[2] not in devices:
                assert not t["applies"], (c.where, t)
    assert any(not t["applies"] for c in ranked for t in c.terms)  # inert parameters are flagged


def test_a_suggested_parameter_says_whether_it_may_be_judged_on_this_store():
    """observe marks each suggested parameter with what tune and evaluate will say of a change of it on this store
    (the ledger's calibration record): judged here, or the stores its value was calibrated on."""
    from hops_calib.loop import calibration
    from hops_calib.loop.ledger import default_ledger
    from hops_calib.loop.suite import load_suite
    from hops_calib.research.observe import observe

    store = Path(__file__).resolve().parents[2] / "fixtures"
    found = observe(store)
    suite = load_suite(store, "train")
    record = calibration.read_record(default_ledger())
    marked = 0
    for contributor in found.ranked:
        for row in contributor.terms:
            if not row.get("suggested"):
                assert "judged_here" not in row
                continue
            check = calibration.check_store(record, calibration.scope_of_params(row["term"], [row["param"]]),
                                            suite, "test", off_record=True)
            assert row["judged_here"] is check.holds  # as tune and evaluate judge it on the real suite
            if not check.holds:
                assert row["judge_on"] and "judge a change of it with --fixtures" in contributor.sentence()
            marked += 1
    assert marked
