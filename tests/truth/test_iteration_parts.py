"""The iteration cut into span, silent stretch, optimizer and rest: one function for real and simulated timelines."""

import pytest

from hops_calib import timeline as tl
from hops_calib.metrics import IterationParts, timeline_iteration_parts, timeline_metrics
from hops_calib.sim import simulate
from hops_calib.sim.pipeline import Pipeline, StageCosts


def two_stage_iteration(number: int, t: float, silent: float, optimizer: tuple[float, ...] | None, pre: float = 0.0):
    """Forward 0->1, backward 1->0, then (after `silent`) an optimizer row per stage; rows of one iteration."""
    rows = [
        dict(stage=0, iteration=number, microbatch=0, kind="compute", phase="FORWARD", start_ms=t + pre,
             end_ms=t + pre + 1),
        dict(stage=1, iteration=number, microbatch=0, kind="compute", phase="FORWARD", start_ms=t + pre + 1,
             end_ms=t + pre + 2),
        dict(stage=1, iteration=number, microbatch=0, kind="compute", phase="BACKWARD", start_ms=t + pre + 2,
             end_ms=t + pre + 4),
        dict(stage=0, iteration=number, microbatch=0, kind="compute", phase="BACKWARD", start_ms=t + pre + 4,
             end_ms=t + pre + 6),
    ]
    last_backward = t + pre + 6
    for stage, cost in enumerate(optimizer or ()):
        rows.append(dict(stage=stage, iteration=number, microbatch=-1, kind="compute", phase="OPTIMIZER",
                         start_ms=last_backward + silent, end_ms=last_backward + silent + cost))
    return rows


def frame(rows):
    return tl.from_records([{"peer_stage": -1, "chunk": 0, **row} for row in rows])


def test_parts_of_the_median_iteration_add_up_to_the_median_period():
    # Periods: iteration 1 -> 2 is 20 ms, 2 -> 3 is 14 ms, 3 -> 4 is 16 ms: the median iteration is 3.
    rows = (two_stage_iteration(1, 0.0, silent=10.0, optimizer=(2.0, 3.0))
            + two_stage_iteration(2, 20.0, silent=4.0, optimizer=(2.0, 3.0))
            + two_stage_iteration(3, 34.0, silent=5.0, optimizer=(1.0, 4.0))
            + two_stage_iteration(4, 50.0, silent=5.0, optimizer=(1.0, 4.0)))
    timeline = frame(rows)
    parts = timeline_iteration_parts(timeline)
    assert parts.iterations == (3,)
    assert (parts.span_ms, parts.silent_ms, parts.optimizer_ms) == (6.0, 5.0, 4.0)
    assert parts.rest_ms == pytest.approx(16.0 - 15.0)
    assert parts.optimizer_traced
    assert parts.iteration_ms == pytest.approx(timeline_metrics(timeline, 1, pp=2).iteration_time_ms)


def test_even_count_averages_the_two_middle_iterations_and_keeps_the_sum():
    rows = (two_stage_iteration(1, 0.0, silent=2.0, optimizer=(1.0,))
            + two_stage_iteration(2, 12.0, silent=4.0, optimizer=(1.0,))
            + two_stage_iteration(3, 26.0, silent=2.0, optimizer=(1.0,)))
    timeline = frame(rows)
    parts = timeline_iteration_parts(timeline)
    assert parts.iterations == (1, 2)
    assert parts.silent_ms == pytest.approx(3.0)
    assert parts.iteration_ms == pytest.approx(timeline_metrics(timeline, 1, pp=2).iteration_time_ms) == 13.0


def test_untraced_optimizer_puts_the_whole_gap_in_the_silent_stretch():
    rows = two_stage_iteration(1, 0.0, silent=0.0, optimizer=None) + two_stage_iteration(2, 20.0, 0.0, None)
    parts = timeline_iteration_parts(frame(rows))
    assert not parts.optimizer_traced
    assert (parts.span_ms, parts.silent_ms, parts.optimizer_ms, parts.rest_ms) == (6.0, 14.0, 0.0, 0.0)
    assert timeline_iteration_parts(frame(two_stage_iteration(1, 0.0, 1.0, (1.0,)))) is None  # no period


def test_simulated_parts_are_the_pipelines_iteration_knobs_and_both_paths_agree():
    pipeline = Pipeline(stages=(StageCosts(1.0, 2.0), StageCosts(1.5, 3.0), StageCosts(1.0, 2.0)), microbatches=4,
                        iterations=5, forward_transfer_ms=(0.3, 0.3), backward_transfer_ms=(0.3, 0.3),
                        optimizer_ms=(4.0, 4.0, 4.0), pre_optimizer_ms=7.0, post_optimizer_ms=2.0)
    result = simulate(pipeline, "1f1b")
    parts = result.iteration_parts()
    assert parts == timeline_iteration_parts(result.timeline)
    assert isinstance(parts, IterationParts)
    assert parts.silent_ms == pytest.approx(7.0)
    assert parts.optimizer_ms == pytest.approx(4.0)
    assert parts.rest_ms == pytest.approx(2.0)
    assert parts.iteration_ms == pytest.approx(result.metrics().iteration_time_ms)
    # A rank with a shorter optimizer step starts the next iteration before the slowest one ends.
    uneven = simulate(Pipeline(**{**vars(pipeline), "optimizer_ms": (1.0, 4.0, 4.0)}), "1f1b").iteration_parts()
    assert uneven.rest_ms == pytest.approx(2.0 + 1.0 - 4.0)
