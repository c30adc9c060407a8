"""The simulator reproduces the closed forms of pipeline theory on balanced stages."""

import pytest

from hops_calib.metrics import timeline_metrics
from hops_calib.sim import simulate
from hops_calib.sim.theory import (balanced_makespan, balanced_pipeline as balanced, bubble_fraction,
                                   microbatches_for_bubble, peak_activations)

BLOCKING = pytest.mark.parametrize("blocking", [True, False], ids=["blocking-p2p", "fire-and-forget"])


def bubble(result):
    return timeline_metrics(result.timeline, result.microbatches, result.ranks).bubble_ratio


@BLOCKING
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 7), (4, 4), (4, 16), (6, 24), (8, 64), (5, 3)])
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(schedule, stages, microbatches, blocking):
    result = simulate(balanced(stages, microbatches, blocking_p2p=blocking), schedule)
    assert bubble(result) == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert result.makespan_ms == pytest.approx((microbatches + stages - 1) * 3.0)


def test_mlsysim_walkthrough_four_stages_four_microbatches():
    assert bubble(simulate(balanced(4, 4, forward_ms=1.0, backward_ms=1.0), "1f1b")) == pytest.approx(0.4286, abs=5e-5)


@pytest.mark.parametrize("microbatches", [1, 3, 8, 32])
def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p(microbatches):
    stages = 4
    gpipe = simulate(balanced(stages, microbatches), "gpipe")
    one_f_one_b = simulate(balanced(stages, microbatches), "1f1b")
    assert gpipe.peak_activations == (microbatches,) * stages
    assert one_f_one_b.peak_activations[0] == min(stages, microbatches)
    assert one_f_one_b.peak_activations == tuple(min(stages - s, microbatches) for s in range(stages))


@BLOCKING
def test_pipebubble_case_gpipe_flushes_versus_1f1b(blocking):
    """8 stages, 64 microbatches, 8 activation slots, forward 1, backward 2."""
    pipeline = balanced(8, 64, forward_ms=1.0, backward_ms=2.0, blocking_p2p=blocking)
    gpipe = simulate(pipeline, "gpipe", gpipe_flush=8)
    one_f_one_b = simulate(pipeline, "1f1b")
    assert max(gpipe.peak_activations) == max(one_f_one_b.peak_activations) == 8
    assert gpipe.makespan_ms == pytest.approx(360.0)
    assert one_f_one_b.makespan_ms == pytest.approx(213.0)
    assert 1 - bubble(gpipe) == pytest.approx(0.533, abs=5e-4)
    assert 1 - bubble(one_f_one_b) == pytest.approx(0.901, abs=5e-4)
    assert gpipe.makespan_ms / one_f_one_b.makespan_ms == pytest.approx(1.69, abs=5e-3)


SHAPES = [("1f1b", 1, None), ("gpipe", 1, None), ("gpipe", 1, 3), ("interleaved_1f1b", 2, None),
          ("interleaved_1f1b", 3, None), ("zb_h1", 1, None)]


@BLOCKING
@pytest.mark.parametrize("schedule,chunks,flush", SHAPES)
@pytest.mark.parametrize("stages,microbatches", [(3, 3), (3, 9), (4, 8), (5, 10)])
@pytest.mark.parametrize("costs", [(1.0, 2.0, 0.5), (2.0, 3.0, 1.0), (1.0, 1.0, 0.0)], ids=["1-2-.5", "2-3-1", "1-1-0"])
def test_simulation_matches_the_closed_forms(schedule, chunks, flush, stages, microbatches, costs, blocking):
    forward, backward, weight_grad = costs
    pipeline = balanced(stages, microbatches, forward, backward, weight_grad, chunks=chunks, blocking_p2p=blocking)
    result = simulate(pipeline, schedule, gpipe_flush=flush)
    expected = balanced_makespan(schedule, stages, microbatches, forward, backward, weight_grad, chunks, flush)
    assert result.makespan_ms == pytest.approx(expected)
    assert result.peak_activations == peak_activations(schedule, stages, microbatches, chunks, flush)
    if schedule in ("1f1b", "interleaved_1f1b") or (schedule == "gpipe" and flush is None):
        assert bubble(result) == pytest.approx(bubble_fraction(stages, microbatches, chunks))


@pytest.mark.parametrize("stages,target", [(8, 0.1), (4, 0.5), (6, 0.2), (2, 0.01), (16, 0.05), (3, 0.3)])
def test_microbatches_for_a_target_bubble_is_the_fewest_that_reach_it(stages, target):
    needed = microbatches_for_bubble(stages, target)
    assert bubble(simulate(balanced(stages, needed), "1f1b")) <= target + 1e-12
    if needed > 1:
        assert bubble(simulate(balanced(stages, needed - 1), "1f1b")) > target + 1e-12


def test_closed_form_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="between 0 and 1"):
        microbatches_for_bubble(4, 1.0)
    with pytest.raises(ValueError, match="stages must be at least 1"):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError, match=r"assumes W <= min\(F, B\)"):
        balanced_makespan("zb_h1", 4, 8, forward_ms=1.0, backward_ms=2.0, weight_grad_ms=1.5)


def test_the_closed_forms_hold_where_they_say_they_do():
    """Where `closed_form_holds`, the simulation of one balanced iteration has the closed forms' makespan and peak
    activations (the abstract planner takes them on shapes too large to simulate quickly)."""
    import itertools

    from hops_calib.sim.theory import closed_form_holds, peak_activations

    checked = 0
    for p, m, v, (f, b, w) in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 8, 12, 16), (1, 2, 4),
                                                ((1, 2, 0), (1, 2, 1), (1, 2, 0.5), (2, 3, 1), (3, 5, 2))):
        for schedule in ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b"):
            if (schedule == "interleaved_1f1b") != (v > 1) or (schedule == "interleaved_1f1b" and m % p) \
                    or (schedule == "zb_h1" and w == 0):
                continue
            if not closed_form_holds(schedule, p, m, f, b, w, v):
                continue
            result = simulate(balanced(p, m, f, b, w, chunks=v), schedule)
            assert result.makespan_ms == pytest.approx(balanced_makespan(schedule, p, m, f, b, w, v)), (schedule, p, m)
            assert result.peak_activations == peak_activations(schedule, p, m, v)
            checked += 1
    assert checked > 300


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (6, 12)])
def test_each_schedules_own_bubble_is_the_simulated_one_on_balanced_stages(schedule, chunks, stages, microbatches):
    """`pipeline_schedule_bubble` (what plan and predict print as the schedule bubble) is the bubble the simulator
    gives that schedule on balanced stages with free transfers: ZB-H1's below 1F1B's, not the 1F1B form."""
    from hops_calib.sim.theory import pipeline_schedule_bubble

    pipeline = balanced(stages, microbatches, 1.0, 2.0, 1.0 if schedule == "zb_h1" else 0.0, chunks=chunks)
    result = simulate(pipeline, schedule)
    assert pipeline_schedule_bubble(pipeline, schedule) == pytest.approx(bubble(result), abs=1e-9)
    if schedule == "zb_h1":
        assert pipeline_schedule_bubble(pipeline, schedule) < bubble_fraction(stages, microbatches)
