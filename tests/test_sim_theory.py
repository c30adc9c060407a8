"""The simulator reproduces the closed forms of pipeline theory on balanced stages."""

import pytest

from hops_calib.metrics import timeline_metrics
from hops_calib.sim import Pipeline, StageCosts, simulate

BLOCKING = pytest.mark.parametrize("blocking", [True, False], ids=["blocking-p2p", "fire-and-forget"])


def balanced(stages, microbatches, forward=1.0, backward=2.0, weight_grad=0.0, chunks=1, **extra):
    """p stages (p * chunks virtual stages) that each cost the same; a chunk does 1/chunks of a stage's work."""
    cost = StageCosts(forward / chunks, backward / chunks, weight_grad / chunks)
    return Pipeline(stages=(cost,) * (stages * chunks), microbatches=microbatches, chunks=chunks, **extra)


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
    assert bubble(simulate(balanced(4, 4, forward=1.0, backward=1.0), "1f1b")) == pytest.approx(0.4286, abs=5e-5)


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
    pipeline = balanced(8, 64, forward=1.0, backward=2.0, blocking_p2p=blocking)
    gpipe = simulate(pipeline, "gpipe", gpipe_flush=8)
    one_f_one_b = simulate(pipeline, "1f1b")
    assert max(gpipe.peak_activations) == max(one_f_one_b.peak_activations) == 8
    assert gpipe.makespan_ms == pytest.approx(360.0)
    assert one_f_one_b.makespan_ms == pytest.approx(213.0)
    assert 1 - bubble(gpipe) == pytest.approx(0.533, abs=5e-4)
    assert 1 - bubble(one_f_one_b) == pytest.approx(0.901, abs=5e-4)
    assert gpipe.makespan_ms / one_f_one_b.makespan_ms == pytest.approx(1.69, abs=5e-3)
