"""Interleaved 1F1B with Megatron's overlapped p2p (`overlap_p2p_comm`): closed forms and a case worked by hand."""

import random
from dataclasses import replace

import pytest

from hops_calib.metrics import timeline_metrics
from hops_calib.sim import Pipeline, StageCosts, simulate
from hops_calib.sim.schedules import build_programs
from hops_calib.sim.theory import balanced_pipeline as balanced


def uniform(ranks, microbatches, chunks, forward_ms, backward_ms, transfer_ms, overlap):
    """Every virtual stage costs `forward_ms` / `backward_ms`; every hop `transfer_ms` in each direction."""
    hops = ranks * chunks - 1
    return Pipeline(stages=(StageCosts(forward_ms, backward_ms),) * (ranks * chunks), microbatches=microbatches,
                    chunks=chunks, forward_transfer_ms=(transfer_ms,) * hops, backward_transfer_ms=(transfer_ms,) * hops,
                    overlap_p2p=overlap)


def makespan(pipeline):
    return simulate(pipeline, "interleaved_1f1b").makespan_ms


SHAPES = pytest.mark.parametrize("ranks,chunks", [(2, 2), (4, 2), (3, 3), (4, 4)])


@SHAPES
@pytest.mark.parametrize("forward_ms,backward_ms,transfer_ms", [(1.0, 2.0, 0.5), (1.0, 2.0, 1.0), (1.0, 1.0, 0.25)])
def test_overlap_hides_the_steady_state_transfers(ranks, chunks, forward_ms, backward_ms, transfer_ms):
    # A steady step of the blocking schedule is F, B, then one call that sends both results and receives both
    # inputs: every step exposes one transfer, so each further group of p microbatches (p v steps per rank) adds
    # p v (f + b + c). Overlapped, the calls are posted after F and after B and waited on a task later: with
    # c <= min(f, b) each transfer runs under the next task, and the group adds p v (f + b).
    for overlap, step in ((False, forward_ms + backward_ms + transfer_ms), (True, forward_ms + backward_ms)):
        spans = [makespan(uniform(ranks, groups * ranks, chunks, forward_ms, backward_ms, transfer_ms, overlap))
                 for groups in (2, 3, 4)]
        assert spans[1] - spans[0] == pytest.approx(ranks * chunks * step)
        assert spans[2] - spans[1] == pytest.approx(ranks * chunks * step)


@pytest.mark.parametrize("stages,microbatches,chunks", [(3, 6, 2), (4, 8, 2), (4, 16, 4), (2, 4, 2), (6, 12, 3)])
def test_with_free_transfers_balanced_stages_take_as_long_as_blocking(stages, microbatches, chunks):
    blocking = simulate(balanced(stages, microbatches, chunks=chunks), "interleaved_1f1b")
    overlapped = simulate(balanced(stages, microbatches, chunks=chunks, overlap_p2p=True), "interleaved_1f1b")
    # (single tasks may run at other times: a rank posting earlier lets its peer start a task earlier that then
    # waits elsewhere; the makespan, set by the schedule's own bubble, does not move)
    assert overlapped.makespan_ms == pytest.approx(blocking.makespan_ms)
    metrics = timeline_metrics(overlapped.timeline, microbatches, stages)
    assert metrics.bubble_ratio == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1))


@pytest.mark.parametrize("ranks,chunks", [(2, 2), (3, 2), (4, 3)])
def test_all_microbatches_in_warm_up_block_as_without_overlap(ranks, chunks):
    # m == p: Megatron runs every forward in the warm-up and every backward in the cool-down, whose calls block
    # with or without overlap_p2p_comm (no steady state): the same programs, so the same run on any costs.
    assert build_programs("interleaved_1f1b", ranks, chunks, ranks, None, True).per_rank == \
        build_programs("interleaved_1f1b", ranks, chunks, ranks, None, False).per_rank
    rng = random.Random(ranks * 10 + chunks)
    stages = tuple(StageCosts(rng.uniform(0.5, 2.0), rng.uniform(0.5, 3.0)) for _ in range(ranks * chunks))
    hops = tuple(rng.uniform(0.0, 1.0) for _ in range(ranks * chunks - 1))
    pipeline = Pipeline(stages=stages, microbatches=ranks, chunks=chunks, forward_transfer_ms=hops,
                        backward_transfer_ms=hops)
    assert makespan(replace(pipeline, overlap_p2p=True)) == makespan(pipeline)


def transfer(result, stage, chunk, microbatch, phase):
    frame = result.timeline
    row = frame[(frame["kind"] == "transfer") & (frame["stage"] == stage) & (frame["chunk"] == chunk)
                & (frame["microbatch"] == microbatch) & (frame["phase"] == phase) & (frame["iteration"] == 1)]
    return float(row["start_ms"].iloc[0]), float(row["end_ms"].iloc[0])


def test_zero_compute_worked_by_hand_p2_v2_m4():
    # With zero compute the run is the chain of its transfers (c = 1 here). Worked by hand from Megatron's calls:
    # the warm-ups (rank 0: 4 forwards, rank 1: 2) block and move one activation per c up to t = 4; rank 1 then
    # enters the steady state, posts its first gradient (chunk 1, microbatch 0) at t = 3. Without overlap rank 0
    # posts that gradient's receive with its last warm-up send (send_forward_backward_recv_forward_backward) at
    # t = 3; with overlap that last warm-up call is send_forward_recv_forward, blocking until t = 4, and the
    # receive is posted after it (send_backward_recv_backward, not waited on): the gradient moves 4 -> 5, and
    # every later step of the chain is one c later. Traced on to the end, one transfer is in flight at every
    # moment and the last one (rank 1's gradient of chunk 0, microbatch 3) arrives at 12.
    overlapped = simulate(uniform(2, 4, 2, 0.0, 0.0, 1.0, True), "interleaved_1f1b")
    blocking = simulate(uniform(2, 4, 2, 0.0, 0.0, 1.0, False), "interleaved_1f1b")
    assert transfer(blocking, 1, 1, 0, "BACKWARD") == (3.0, 4.0)
    assert transfer(overlapped, 1, 1, 0, "BACKWARD") == (4.0, 5.0)
    assert transfer(overlapped, 1, 0, 3, "BACKWARD") == (11.0, 12.0)
    assert overlapped.makespan_ms == 12.0
    frame = overlapped.timeline
    moving = frame[(frame["kind"] == "transfer") & (frame["iteration"] == 1)]
    for t in range(12):  # no gap in the chain: some transfer is in flight in every unit of time
        assert ((moving["start_ms"] <= t) & (moving["end_ms"] >= t + 1)).any(), t
    assert overlapped.makespan_ms > blocking.makespan_ms  # the later-posted receive costs what nothing hides


def test_overlap_runs_only_under_the_interleaved_schedule():
    with pytest.raises(ValueError, match="overlap_p2p_comm"):
        simulate(Pipeline(stages=(StageCosts(1.0, 2.0),) * 2, microbatches=4, overlap_p2p=True), "1f1b")


def test_a_posted_send_overlaps_the_senders_next_task():
    # The point of overlap: after F the activation leaves while the rank computes B.
    result = simulate(uniform(2, 4, 2, 1.0, 2.0, 0.5, True), "interleaved_1f1b")
    frame = result.timeline
    sends = frame[(frame["kind"] == "transfer") & (frame["end_ms"] > frame["start_ms"])]
    computes = frame[frame["kind"] == "compute"]
    overlapping = 0
    for send in sends.itertuples():
        own = computes[computes["stage"] == send.stage]
        overlapping += bool(((own["start_ms"] < send.end_ms) & (own["end_ms"] > send.start_ms)).any())
    assert overlapping > len(sends) // 2
