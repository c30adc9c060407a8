"""Megatron's blocking p2p: a send waits for the receiver to reach the matching receive."""

import pytest

from hops_calib.sim import Pipeline, StageCosts, simulate


def fast_then_slow(blocking):
    """Stage 0 forwards in 1 ms, stage 1 in 5 ms; backwards 1 ms; free transfers."""
    return Pipeline(stages=(StageCosts(1.0, 1.0), StageCosts(5.0, 1.0)), microbatches=2, blocking_p2p=blocking)


def rows(result, stage, phase, kind="compute"):
    frame = result.timeline
    picked = frame[(frame["stage"] == stage) & (frame["phase"] == phase) & (frame["kind"] == kind)]
    return [(int(r.microbatch), r.start_ms, r.end_ms) for r in picked.itertuples()]


def test_blocking_send_waits_for_the_matching_receive():
    # Worked by hand from Megatron's 1F1B calls. Stage 0 warms up with one forward, then runs
    # F1 and send_forward_recv_backward at t=2. Stage 1 runs F0 (1-6), B0 (6-7) and only then
    # posts send_backward_recv_forward, the receive of F1's activation: the transfer of F1
    # happens at t=7, and stage 0 is held in its call from 2 to 7 (it needs gradient 0 anyway).
    result = simulate(fast_then_slow(True), "1f1b")
    assert rows(result, 0, "FORWARD", "transfer") == [(0, 1.0, 1.0), (1, 7.0, 7.0)]
    assert rows(result, 0, "BACKWARD") == [(0, 7.0, 8.0), (1, 13.0, 14.0)]
    assert rows(result, 1, "FORWARD") == [(0, 1.0, 6.0), (1, 7.0, 12.0)]
    assert result.makespan_ms == 14.0


def test_fire_and_forget_send_leaves_when_the_tensor_is_ready():
    result = simulate(fast_then_slow(False), "1f1b")
    assert rows(result, 0, "FORWARD", "transfer") == [(0, 1.0, 1.0), (1, 2.0, 2.0)]
    assert rows(result, 1, "FORWARD") == [(0, 1.0, 6.0), (1, 7.0, 12.0)]
    assert result.makespan_ms == 14.0


def test_blocking_holds_a_fast_first_stage_in_warm_up():
    # Three stages, the middle one slow: with blocking sends stage 0 cannot run its second
    # warm-up forward's send until stage 1 has finished its first forward and posted the receive.
    stages = (StageCosts(1.0, 1.0), StageCosts(4.0, 4.0), StageCosts(1.0, 1.0))
    blocking = simulate(Pipeline(stages=stages, microbatches=4), "1f1b")
    free = simulate(Pipeline(stages=stages, microbatches=4, blocking_p2p=False), "1f1b")
    # Stage 0: F0 (0-1) sent at once; F1 (1-2) waits until stage 1 posts its receive after F0 (1-5)
    # and its own send to stage 2; only then can stage 0 start its steady-state F2.
    assert rows(blocking, 0, "FORWARD")[2][1] == pytest.approx(5.0)
    assert rows(free, 0, "FORWARD")[2][1] == pytest.approx(2.0)
    assert blocking.makespan_ms >= free.makespan_ms
