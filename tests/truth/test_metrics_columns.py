"""The one metrics function, on a hand-built timeline: the frame path and the column path agree."""

import numpy as np
import pytest

from hops_calib import timeline as tl
from hops_calib.metrics import column_metrics, timeline_metrics


def hand_timeline():
    rows = []
    for it, base in ((1, 0.0), (2, 8.0)):
        rows += [
            dict(stage=0, iteration=it, microbatch=0, kind="compute", phase="FORWARD", start_ms=base, end_ms=base + 1),
            dict(stage=0, iteration=it, microbatch=0, kind="transfer", phase="FORWARD", start_ms=base + 1,
                 end_ms=base + 1, peer_stage=1),
            dict(stage=1, iteration=it, microbatch=0, kind="compute", phase="FORWARD", start_ms=base + 1,
                 end_ms=base + 2),
            dict(stage=1, iteration=it, microbatch=0, kind="compute", phase="BACKWARD", start_ms=base + 2,
                 end_ms=base + 3),
            dict(stage=0, iteration=it, microbatch=0, kind="compute", phase="BACKWARD", start_ms=base + 3,
                 end_ms=base + 5),
        ]
    rows.append(dict(stage=0, iteration=1, microbatch=-1, kind="compute", phase="OPTIMIZER", start_ms=6.0, end_ms=7.0))
    return tl.from_records([{"peer_stage": -1, **row} for row in rows])


def test_hand_built_timeline_metrics():
    metrics = timeline_metrics(hand_timeline(), microbatches_per_iteration=1, pp=3)
    assert metrics.makespan_ms == 13.0
    assert metrics.utilization_per_stage == pytest.approx((7 / 13, 4 / 13, 0.0))
    assert metrics.bubble_ratio == pytest.approx(1 - (11 / 13) / 3)
    assert metrics.completed_microbatches == 2 and metrics.window_ms == 13.0
    assert metrics.throughput_per_s == pytest.approx(2 / 0.013)
    assert metrics.iteration_periods_ms == (8.0,) and metrics.steady_throughput_per_s == pytest.approx(125.0)


def test_column_path_equals_frame_path():
    frame = hand_timeline()
    columns = column_metrics(
        stage=frame["stage"].to_numpy(), iteration=frame["iteration"].to_numpy(),
        microbatch=frame["microbatch"].to_numpy(), is_compute=(frame["kind"] == "compute").to_numpy(bool),
        is_backward=frame["phase"].isin(tl.BACKWARD_PHASES).to_numpy(bool),
        start_ms=frame["start_ms"].to_numpy(), end_ms=frame["end_ms"].to_numpy(), microbatches_per_iteration=1,
    )
    assert columns == timeline_metrics(frame, 1)
    with pytest.raises(ValueError, match="empty timeline"):
        column_metrics(*(np.array([]),) * 7, microbatches_per_iteration=1)
