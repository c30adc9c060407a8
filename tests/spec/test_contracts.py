"""The two contracts every room relies on: the timeline table and the spec."""

import pytest

from hops_calib import timeline
from hops_calib.spec import LinkFit, ModelShape, Spec


def _spec(**overrides):
    base = dict(
        run_id="r", pp=2, vp=1, microbatches=4, iterations=3, layers_per_stage=(6, 6),
        devices=("h100", "l4"), device_ids=("a", "b"),
        links=(LinkFit(0, 1, latency_ms=0.05, bytes_per_ms=2.5e6),), schedule="1f1b",
        model=ModelShape(12, 1024, 4096, 8, 1024, 50304),
    )
    base.update(overrides)
    return Spec(**base)


def test_spec_round_trips_through_json():
    spec = _spec(megatron_args={"num_layers": 12})
    assert Spec.from_json(spec.to_json()) == spec


def test_spec_rejects_inconsistent_stage_counts():
    with pytest.raises(ValueError, match="3 layer counts for pp=2"):
        _spec(layers_per_stage=(4, 4, 4))


def test_link_cost_is_latency_plus_bytes_over_bandwidth():
    fit = LinkFit(0, 1, latency_ms=0.1, bytes_per_ms=1e6)
    assert fit.transfer_ms(2e6) == pytest.approx(2.1)
    assert fit.bandwidth_gbit_s == pytest.approx(8.0)
    assert _spec().link(1, 0) is not None


def test_timeline_rejects_unknown_phase_and_reversed_interval():
    rows = [dict(stage=0, iteration=1, microbatch=0, kind="compute", phase="FORWARD", start_ms=0.0, end_ms=1.0)]
    assert list(timeline.from_records(rows).columns) == list(timeline.COLUMNS)
    with pytest.raises(ValueError, match="unknown phase 'SIDEWAYS'"):
        timeline.from_records([{**rows[0], "phase": "SIDEWAYS"}])
    with pytest.raises(ValueError, match="ends before it starts"):
        timeline.from_records([{**rows[0], "end_ms": -1.0}])
