"""Interleaved 1F1B, ZB-H1 and the auto rule: Megatron's order, theory, and refusals."""

import pytest

from hops_calib.metrics import timeline_metrics
from hops_calib.sim import Pipeline, StageCosts, auto_schedule, simulate
from hops_calib.sim.theory import balanced_pipeline as balanced

BLOCKING = pytest.mark.parametrize("blocking", [True, False], ids=["blocking-p2p", "fire-and-forget"])


def compute_order(result, stage):
    frame = result.timeline
    rows = frame[(frame["stage"] == stage) & (frame["kind"] == "compute") & (frame["iteration"] == 1)]
    rows = rows.sort_values("start_ms", kind="stable")
    return [(r.phase, int(r.chunk), int(r.microbatch)) for r in rows.itertuples()]


def idle_ms(result, work_per_stage):
    """Idle time of one stage: makespan minus its work (all stages balanced)."""
    return result.makespan_ms - work_per_stage


# --- interleaved 1F1B ------------------------------------------------------------------------

@BLOCKING
@pytest.mark.parametrize("stages,microbatches,chunks", [(3, 6, 2), (4, 8, 2), (4, 16, 4), (4, 4, 2), (6, 12, 3)])
def test_interleaving_shrinks_the_bubble_by_the_number_of_chunks(stages, microbatches, chunks, blocking):
    plain = simulate(balanced(stages, microbatches, blocking_p2p=blocking), "1f1b")
    interleaved = simulate(balanced(stages, microbatches, chunks=chunks, blocking_p2p=blocking), "interleaved_1f1b")
    work = microbatches * 3.0
    assert idle_ms(interleaved, work) == pytest.approx(idle_ms(plain, work) / chunks)
    metrics = timeline_metrics(interleaved.timeline, microbatches, stages)
    assert metrics.bubble_ratio == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1))


def test_interleaved_order_is_megatrons_groups_of_p_through_the_chunks():
    result = simulate(balanced(4, 8, chunks=2), "interleaved_1f1b")
    forwards = [(chunk, mb) for phase, chunk, mb in compute_order(result, 0) if phase == "FORWARD"]
    assert forwards == ([(0, mb) for mb in range(4)] + [(1, mb) for mb in range(4)]
                        + [(0, mb) for mb in range(4, 8)] + [(1, mb) for mb in range(4, 8)])
    backwards = [(chunk, mb) for phase, chunk, mb in compute_order(result, 0) if phase == "BACKWARD"]
    assert backwards == ([(1, mb) for mb in range(4)] + [(0, mb) for mb in range(4)]
                         + [(1, mb) for mb in range(4, 8)] + [(0, mb) for mb in range(4, 8)])


@pytest.mark.parametrize("stages,microbatches,chunks", [(4, 8, 2), (4, 12, 3), (3, 9, 2), (4, 4, 2)])
def test_interleaved_warm_up_count_and_peak_memory_follow_megatron(stages, microbatches, chunks):
    result = simulate(balanced(stages, microbatches, chunks=chunks), "interleaved_1f1b")
    total = microbatches * chunks
    for rank in range(stages):
        warmup = total if microbatches == stages else min((stages - rank - 1) * 2 + (chunks - 1) * stages, total)
        phases = [phase for phase, _, _ in compute_order(result, rank)]
        forwards_before_first_backward = phases.index("BACKWARD")
        # A steady step runs its forward before its backward, so one more forward precedes the first backward.
        assert forwards_before_first_backward == min(warmup + 1, total)
        assert result.peak_activations[rank] == min(warmup + 1, total)


def test_interleaved_refuses_what_megatron_refuses():
    with pytest.raises(ValueError, match=r"microbatches \(6\) is not divisible by the pipeline-model-parallel "
                                         r"size \(4\)"):
        simulate(balanced(4, 6, chunks=2), "interleaved_1f1b")
    # Megatron-core runs pp = 2 interleaved (the shipped captures do), so the simulator does too.
    assert simulate(balanced(2, 4, chunks=2), "interleaved_1f1b").schedule == "interleaved_1f1b"
    with pytest.raises(ValueError, match="at least 2 model chunks per rank"):
        simulate(balanced(4, 8), "interleaved_1f1b")
    with pytest.raises(ValueError, match="one model chunk per rank.*chunks=2"):
        simulate(balanced(4, 8, chunks=2), "1f1b")


# --- ZB-H1 -----------------------------------------------------------------------------------

@BLOCKING
@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 4), (4, 12), (6, 24), (8, 64)])
def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_b_w_cost_the_same(stages, microbatches, blocking):
    # forward 1, input gradient 1, weight gradient 1 (backward_ms = 2 of which weight_grad_ms = 1)
    pipeline = balanced(stages, microbatches, forward_ms=1.0, backward_ms=2.0, weight_grad_ms=1.0,
                        blocking_p2p=blocking)
    one_f_one_b = simulate(pipeline, "1f1b")
    zero_bubble = simulate(pipeline, "zb_h1")
    work = microbatches * 3.0
    assert idle_ms(zero_bubble, work) == pytest.approx(idle_ms(one_f_one_b, work) / 3)
    assert max(zero_bubble.peak_activations) == max(one_f_one_b.peak_activations)


def test_zb_h1_splits_the_backward_and_defers_weight_gradients_on_later_stages():
    result = simulate(balanced(4, 8, forward_ms=1.0, backward_ms=2.0, weight_grad_ms=1.0), "zb_h1")
    frame = result.timeline
    assert "BACKWARD" not in set(frame.loc[frame["kind"] == "compute", "phase"])
    for stage in range(4):
        order = compute_order(result, stage)
        b_rows = [mb for phase, _, mb in order if phase == "BACKWARD_B"]
        w_rows = [mb for phase, _, mb in order if phase == "BACKWARD_W"]
        assert b_rows == w_rows == list(range(8))
        # Stage s runs W of microbatch j only after B of microbatch j + s (or at the end).
        position = {(phase, mb): i for i, (phase, _, mb) in enumerate(order)}
        for mb in range(8 - stage):
            assert position[("BACKWARD_W", mb)] > position[("BACKWARD_B", mb + stage)]
    durations = frame[frame["phase"] == "BACKWARD_W"].eval("end_ms - start_ms")
    assert durations.to_numpy() == pytest.approx(1.0)


# --- auto (HopsHetero) -----------------------------------------------------------------------

def test_auto_picks_zb_h1_when_the_last_stage_has_room_for_its_weight_gradients():
    # f+b+w per stage: 6, 4, 3; last stage: 3 with w = 1; 6 - 3 >= 1 -> ZB-H1
    light_last = Pipeline(stages=(StageCosts(2.0, 4.0, 1.5), StageCosts(1.0, 3.0, 1.0), StageCosts(1.0, 2.0, 1.0)),
                          microbatches=4)
    assert auto_schedule(light_last) == "zb_h1"
    assert simulate(light_last, "auto").schedule == "zb_h1"
    # the last stage is the heaviest: max - last = 0 < w -> 1F1B
    heavy_last = Pipeline(stages=(StageCosts(1.0, 2.0, 1.0), StageCosts(2.0, 4.0, 1.5)), microbatches=4)
    assert simulate(heavy_last, "auto").schedule == "1f1b"
    # on the boundary (max - last == w) the rule says ZeroBubble
    boundary = Pipeline(stages=(StageCosts(2.0, 3.0, 1.0), StageCosts(1.0, 3.0, 1.0)), microbatches=4)
    assert auto_schedule(boundary) == "zb_h1"


def test_auto_refuses_interleaved_pipelines():
    with pytest.raises(ValueError, match="'auto' chooses between 1f1b and zb_h1"):
        simulate(balanced(4, 8, chunks=2), "auto")
