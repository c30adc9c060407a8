"""simulate(): the timeline it returns, the iteration structure, and the errors it raises."""

from dataclasses import replace

import numpy as np
import pytest

from hops_calib import timeline as tl
from hops_calib.sim import Pipeline, StageCosts, simulate
from hops_calib.sim.simulate import stalled_iterations


def hetero(ranks=3, microbatches=5, **extra):
    stages = tuple(StageCosts(1.0 + 0.5 * s, 2.0 + 0.25 * s, 0.5) for s in range(ranks))
    hops = ranks - 1
    return Pipeline(stages=stages, microbatches=microbatches, forward_transfer_ms=(0.2,) * hops,
                    backward_transfer_ms=(0.3,) * hops, **extra)


def test_timeline_has_the_shared_schema_and_one_row_per_task_and_transfer():
    pipeline = hetero(iterations=3, optimizer_ms=(4.0, 5.0, 6.0))
    result = simulate(pipeline, "1f1b")
    frame = result.timeline
    assert list(frame.columns) == list(tl.COLUMNS)
    pd_valid = tl.validate(frame)
    assert len(pd_valid) == len(frame)
    assert sorted(frame["iteration"].unique()) == [1, 2, 3]
    compute = frame[frame["kind"] == "compute"]
    transfers = frame[frame["kind"] == "transfer"]
    # Per iteration and rank: one forward and one backward per microbatch and one optimizer step.
    per_rank = compute.groupby(["iteration", "stage", "phase"]).size()
    assert (per_rank.xs("FORWARD", level="phase") == 5).all()
    assert (per_rank.xs("BACKWARD", level="phase") == 5).all()
    assert (per_rank.xs("OPTIMIZER", level="phase") == 1).all()
    # One send per microbatch and direction except at the pipeline ends, to the adjacent stage.
    sends = transfers.groupby(["iteration", "stage", "phase"]).size()
    assert len(sends) == 3 * 2 * 2 and (sends == 5).all()
    forward = transfers[transfers["phase"] == "FORWARD"]
    backward = transfers[transfers["phase"] == "BACKWARD"]
    assert (forward["peer_stage"] == forward["stage"] + 1).all()
    assert (backward["peer_stage"] == backward["stage"] - 1).all()
    assert np.allclose(forward["end_ms"] - forward["start_ms"], 0.2)
    assert (compute["peer_stage"] == -1).all()
    assert result.makespan_ms == pytest.approx(frame["end_ms"].max())
    assert result.tasks == len(compute)


@pytest.mark.parametrize("blocking", [True, False])
def test_optimizer_follows_a_barrier_and_the_next_iteration_waits_for_it(blocking):
    pipeline = hetero(iterations=2, optimizer_ms=(4.0, 5.0, 6.0), pre_optimizer_ms=10.0, post_optimizer_ms=1.5,
                      blocking_p2p=blocking)
    frame = simulate(pipeline, "1f1b").timeline
    first = frame[frame["iteration"] == 1]
    last_task_end = first.loc[first["phase"] != "OPTIMIZER", "end_ms"].max()
    optimizer = first[first["phase"] == "OPTIMIZER"].set_index("stage")
    assert list(optimizer["start_ms"]) == pytest.approx([last_task_end + 10.0] * 3)
    assert list(optimizer["end_ms"] - optimizer["start_ms"]) == pytest.approx([4.0, 5.0, 6.0])
    second = frame[frame["iteration"] == 2]
    for stage, group in second.groupby("stage"):
        assert group["start_ms"].min() >= optimizer.loc[stage, "end_ms"] + 1.5 - 1e-9
    # Stage 0 has no input to wait for: it starts exactly post_optimizer_ms after its optimizer.
    assert second.loc[second["stage"] == 0, "start_ms"].min() == pytest.approx(optimizer.loc[0, "end_ms"] + 1.5)


def test_iteration_barrier_holds_every_rank_until_the_slowest_optimizer_ends():
    pipeline = hetero(iterations=3, optimizer_ms=(4.0, 5.0, 9.0), pre_optimizer_ms=10.0, post_optimizer_ms=1.5,
                      iteration_barrier=True)
    frame = simulate(pipeline, "1f1b").timeline
    optimizer = frame[(frame["phase"] == "OPTIMIZER") & (frame["iteration"] == 1)]
    second = frame[frame["iteration"] == 2]
    slowest_end = optimizer["end_ms"].max()
    assert second["start_ms"].min() == pytest.approx(slowest_end + 1.5)
    for _, group in second.groupby("stage"):
        assert group["start_ms"].min() >= slowest_end + 1.5 - 1e-9
    # Without the barrier, stage 0 starts as soon as its own (shorter) optimizer step is done.
    free = simulate(replace(pipeline, iteration_barrier=False), "1f1b").timeline
    assert free.loc[free["iteration"] == 2, "start_ms"].min() < slowest_end


def test_no_optimizer_rows_without_optimizer_costs():
    frame = simulate(hetero(iterations=2), "gpipe").timeline
    assert "OPTIMIZER" not in set(frame["phase"])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
def test_copied_iterations_equal_timed_iterations(schedule):
    pipeline = hetero(iterations=5, optimizer_ms=(4.0, 5.0, 6.0), pre_optimizer_ms=3.0, post_optimizer_ms=0.5)
    copied = simulate(pipeline, schedule).timeline
    timed = simulate(pipeline, schedule, replicate=False).timeline
    assert len(copied) == len(timed)
    for name in ("stage", "iteration", "microbatch", "kind", "phase", "peer_stage"):
        assert list(copied[name]) == list(timed[name])
    assert np.allclose(copied["start_ms"], timed["start_ms"]) and np.allclose(copied["end_ms"], timed["end_ms"])


def test_without_a_barrier_ranks_that_drift_apart_are_timed_until_they_stop():
    """No optimizer step, no barrier: after iteration 2 rank 1 still ends later relative to the others, so copying
    iteration 2 would start its iteration 3 inside its own iteration 2 (a case the property tests found)."""
    pipeline = Pipeline(stages=(StageCosts(0.0, 0.0, 0.0), StageCosts(0.0, 1.0, 0.0), StageCosts(0.0, 2.0, 2.0)),
                        microbatches=2, chunks=1, iterations=4, forward_transfer_ms=(0.0, 0.25),
                        backward_transfer_ms=(0.0, 0.0), optimizer_ms=(), blocking_p2p=False,
                        iteration_barrier=False, optimizer_barrier=False)
    copied = simulate(pipeline, "zb_h1").timeline
    timed = simulate(pipeline, "zb_h1", replicate=False).timeline
    assert np.allclose(copied["start_ms"], timed["start_ms"]) and np.allclose(copied["end_ms"], timed["end_ms"])
    for rank, lane in timed[timed["kind"] == "compute"].groupby("stage"):
        ends = lane.groupby("iteration")["end_ms"].max()
        starts = lane.groupby("iteration")["start_ms"].min()
        assert (starts.iloc[1:].to_numpy() >= ends.iloc[:-1].to_numpy() - 1e-9).all(), rank


@pytest.mark.parametrize("probability,iterations", [(0.146, 17), (0.25, 8), (0.5, 9), (0.9, 12), (0.03, 13)])
def test_stalls_land_in_round_n_p_evenly_spread_iterations(probability, iterations):
    stalled = stalled_iterations(probability, iterations)
    assert len(stalled) == int(np.floor(iterations * probability + 0.5))  # the median of Binomial(N, p), near N p
    assert stalled == sorted(set(stalled)) and all(1 <= i <= iterations for i in stalled)
    if len(stalled) > 2:
        gaps = np.diff(stalled)
        assert gaps.max() - gaps.min() <= 1  # evenly spread
    assert stalled_iterations(0.0, iterations) == [] and stalled_iterations(1.0, iterations) == list(
        range(1, iterations + 1))


@pytest.mark.parametrize("replicate", [True, False])
def test_a_stall_delays_its_iterations_optimizer_and_everything_after_it(replicate):
    base = hetero(iterations=8, optimizer_ms=(4.0, 5.0, 6.0), pre_optimizer_ms=3.0, post_optimizer_ms=0.5)
    stalled = replace(base, stall_ms=40.0, stall_probability=0.25)
    plain = simulate(base, "1f1b", replicate=replicate).timeline
    frame = simulate(stalled, "1f1b", replicate=replicate).timeline
    assert stalled_iterations(0.25, 8) == [2, 6]
    iteration = frame["iteration"].to_numpy(dtype=int)
    is_optimizer = (frame["phase"] == "OPTIMIZER").to_numpy(dtype=bool)
    expected_shift = 40.0 * ((iteration > 2).astype(int) + (iteration > 6)
                             + ((iteration == 2) & is_optimizer) + ((iteration == 6) & is_optimizer))
    assert np.allclose(frame["start_ms"].to_numpy(float) - plain["start_ms"].to_numpy(float), expected_shift)
    assert np.allclose(frame["end_ms"].to_numpy(float) - plain["end_ms"].to_numpy(float), expected_shift)
    # The median iteration has no stall; the window carries both; the mean is the expected stall's.
    stalled_metrics, plain_metrics = simulate(stalled, "1f1b").metrics(), simulate(base, "1f1b").metrics()
    assert stalled_metrics.steady_throughput_per_s == pytest.approx(plain_metrics.steady_throughput_per_s)
    assert stalled_metrics.window_ms == pytest.approx(plain_metrics.window_ms + 2 * 40.0)
    assert stalled.expected_pre_optimizer_ms == pytest.approx(3.0 + 0.25 * 40.0)


def _prediction(pipeline):
    from hops_calib.model.predict import Prediction

    result = simulate(pipeline, "1f1b")
    return Prediction(run_id="r", schedule="1f1b", model_sha256="-", pipeline=pipeline, result=result,
                      metrics=result.metrics())


def test_the_stall_noise_floor_is_the_mean_error_of_random_stalls_against_the_placed_ones():
    from hops_calib.sim.simulate import _delay

    base = hetero(iterations=9, optimizer_ms=(4.0, 5.0, 6.0), pre_optimizer_ms=3.0, post_optimizer_ms=0.5)
    assert _prediction(base).stall_noise_ape_pct == 0.0  # nothing random, nothing to miss
    stalled = replace(base, stall_ms=30.0, stall_probability=0.3)
    prediction = _prediction(stalled)
    floor = prediction.stall_noise_ape_pct
    assert floor > 0
    # Monte Carlo: real runs whose iterations stall at random, scored against the prediction.
    plain = simulate(base, "1f1b")
    rng = np.random.default_rng(7)
    errors = []
    for _ in range(3000):
        columns = {name: values.copy() for name, values in plain.columns.items()}
        _delay(columns, [i for i in range(1, 10) if rng.random() < 0.3], 30.0)
        real = replace(plain, columns=columns).metrics().throughput_per_s
        errors.append(abs(prediction.metrics.throughput_per_s - real) / real * 100.0)
    # The floor is stated against the predicted window (first order in stall / window): within 5 %.
    assert np.mean(errors) == pytest.approx(floor, rel=0.05)


def test_the_stall_range_is_the_central_interval_of_whole_stall_counts_and_holds_its_share_of_random_runs():
    import math

    from hops_calib.sim.simulate import _delay, stalls_in_window

    base = hetero(iterations=12, optimizer_ms=(4.0, 5.0, 6.0), pre_optimizer_ms=3.0, post_optimizer_ms=0.5)
    plain_prediction = _prediction(base)
    assert tuple(plain_prediction.stall_throughput_range()) == (plain_prediction.metrics.throughput_per_s,) * 2 + (1.0,)
    stalled = replace(base, stall_ms=30.0, stall_probability=0.2)
    prediction = _prediction(stalled)
    low, high, share = prediction.stall_throughput_range(0.9)
    plain = simulate(base, "1f1b")

    def real_throughput(stalled_iterations):
        columns = {name: values.copy() for name, values in plain.columns.items()}
        _delay(columns, stalled_iterations, 30.0)
        return replace(plain, columns=columns).metrics().throughput_per_s

    # 11 chances in the window (the last iteration's stall comes after it) at p = 0.2: P(K = 0) = 0.086 > 5 %, so
    # the fast end is a run with no stall; P(K <= 4) = 0.950 < 95 % <= P(K <= 5) = 0.988, so the slow end has five
    pmf = [math.comb(11, k) * 0.2 ** k * 0.8 ** (11 - k) for k in range(12)]
    assert high == pytest.approx(real_throughput([]), rel=1e-12)
    assert low == pytest.approx(real_throughput([1, 2, 3, 4, 5]), rel=1e-12)
    assert share == pytest.approx(sum(pmf[:6]))
    assert low < prediction.metrics.throughput_per_s < high and stalls_in_window(stalled) == 2
    wider = prediction.stall_throughput_range(0.995)
    assert wider.low_per_s < low and wider.high_per_s == high and wider.share > share
    # Monte Carlo: real runs whose iterations stall at random fall in the range as often as its share says
    rng = np.random.default_rng(11)
    inside = [low - 1e-9 <= real_throughput([i for i in range(1, 13) if rng.random() < 0.2]) <= high + 1e-9
              for _ in range(2000)]
    assert np.mean(inside) == pytest.approx(share, abs=0.01)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        prediction.stall_throughput_range(1.0)


def test_pipeline_refuses_an_impossible_stall_probability():
    with pytest.raises(ValueError, match="stall_probability = 1.5"):
        hetero(stall_probability=1.5)


def test_refuses_unknown_schedule_and_misplaced_flush():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*1f1b"):
        simulate(hetero(), "pipedream")
    with pytest.raises(ValueError, match="only applies to the gpipe schedule"):
        simulate(hetero(), "1f1b", gpipe_flush=2)
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        simulate(hetero(), "gpipe", gpipe_flush=0)


def test_engine_reports_a_deadlock_naming_the_stuck_ranks():
    from hops_calib.sim.engine import DeadlockError, Rows, run_iteration
    from hops_calib.sim.schedules import COMPUTE, EXCHANGE, F, Programs

    # Each rank first waits to receive what the other sends only after that receive: a cycle.
    to_rank_1, to_rank_0 = 0, 1  # transfer ids (activation 0 -> 1 and back, one microbatch)
    rank0 = ((EXCHANGE, (), (to_rank_0,)), (COMPUTE, F, 0, 0, -1, -1), (EXCHANGE, (to_rank_1,), ()))
    rank1 = ((EXCHANGE, (), (to_rank_1,)), (COMPUTE, F, 1, 0, -1, -1), (EXCHANGE, (to_rank_0,), ()))
    programs = Programs("handmade", 2, 1, 1, (rank0, rank1), (rank0[1:2], rank1[1:2]), (1, 1))
    with pytest.raises(DeadlockError, match="handmade deadlocks.*rank 0 at operation 0.*rank 1 at operation 0"):
        run_iteration(programs, True, [[1.0, 1.0]] * 5, [0.0], [0.0], [0.0, 0.0], Rows.empty())


@pytest.mark.parametrize("field,value,message", [
    ("forward_transfer_ms", (0.1, -0.2), r"forward_transfer_ms\[1\] = -0.2"),
    ("optimizer_ms", (1.0, float("nan"), 1.0), r"optimizer_ms\[1\] = nan"),
    ("pre_optimizer_ms", -1.0, "pre_optimizer_ms = -1.0"),
    ("stages", (StageCosts(1.0, 2.0), StageCosts(float("inf"), 2.0), StageCosts(1.0, 2.0)), "virtual stage 1"),
])
def test_pipeline_refuses_negative_or_non_finite_times(field, value, message):
    base = dict(stages=(StageCosts(1.0, 2.0),) * 3, microbatches=2)
    with pytest.raises(ValueError, match=message):
        Pipeline(**{**base, field: value})


def test_host_time_holds_the_rank_but_is_not_compute():
    stages = (StageCosts(1.0, 2.0, host_ms=0.5), StageCosts(1.0, 2.0, host_ms=0.5))
    with_host = simulate(Pipeline(stages=stages, microbatches=4), "1f1b")
    without = simulate(Pipeline(stages=tuple(StageCosts(1.0, 2.0) for _ in range(2)), microbatches=4), "1f1b")
    frame = with_host.timeline
    compute = frame[frame["kind"] == "compute"]
    assert ((compute["end_ms"] - compute["start_ms"]) == compute["phase"].map({"FORWARD": 1.0, "BACKWARD": 2.0})).all()
    # Stage 0's first forward waits for nothing but its host time.
    assert compute.iloc[compute["start_ms"].argmin()]["start_ms"] == pytest.approx(0.5)
    assert with_host.makespan_ms > without.makespan_ms
    assert with_host.metrics().bubble_ratio > without.metrics().bubble_ratio


def _starts(result, stage, phase):
    frame = result.timeline
    picked = frame[(frame["kind"] == "compute") & (frame["stage"] == stage) & (frame["phase"] == phase)]
    return dict(zip(picked["microbatch"], picked["start_ms"]))


def _ends(result, stage, phase):
    frame = result.timeline
    picked = frame[(frame["kind"] == "compute") & (frame["stage"] == stage) & (frame["phase"] == phase)]
    return dict(zip(picked["microbatch"], picked["end_ms"]))


def test_host_time_only_after_a_receive_spares_the_steps_whose_input_is_local():
    # Two stages, 1 ms transfers, 0.5 ms of host time per step. Every step but stage 0's forwards and
    # stage 1's backwards receives its input over the link.
    stages = (StageCosts(1.0, 2.0, host_ms=0.5), StageCosts(1.0, 2.0, host_ms=0.5))
    base = dict(stages=stages, microbatches=4, forward_transfer_ms=(1.0,), backward_transfer_ms=(1.0,))
    every = simulate(Pipeline(**base), "1f1b")
    after_receive = simulate(Pipeline(**base, host_after_receive_only=True), "1f1b")
    # The last stage runs its backward right after its forward: host time before it only without the switch.
    for microbatch, end in _ends(after_receive, 1, "FORWARD").items():
        assert _starts(after_receive, 1, "BACKWARD")[microbatch] == pytest.approx(end)
    for microbatch, end in _ends(every, 1, "FORWARD").items():
        assert _starts(every, 1, "BACKWARD")[microbatch] == pytest.approx(end + 0.5)
    # Stage 0's first forward waits for nothing, so no host time either; its backward follows a receive.
    assert _starts(after_receive, 0, "FORWARD")[0] == pytest.approx(0.0)
    arrival = _ends(after_receive, 1, "BACKWARD")[0] + 1.0
    assert _starts(after_receive, 0, "BACKWARD")[0] == pytest.approx(arrival + 0.5)
    # Stage 1's forwards follow a receive: host time before them under both rules.
    assert _starts(after_receive, 1, "FORWARD")[0] == pytest.approx(_ends(after_receive, 0, "FORWARD")[0] + 1.5)
    assert after_receive.makespan_ms < every.makespan_ms
