"""Truth metrics: equal to the HOPS importer's megatron_summary.json on every real run; schedule from event order."""

from __future__ import annotations

import json

import pytest

from hops_calib import timeline as tl
from hops_calib.truth import Truth, compute_truth, infer_schedule, megatron_interleaved_order

REL = 1e-6


def test_truth_matches_megatron_summary_on_every_run(shared_runs, shared_store):
    ids = shared_store.ids()
    assert len(ids) == len(list(shared_runs.iterdir()))
    for fixture_id in ids:
        truth = shared_store.load(fixture_id).truth
        summary = json.loads((shared_runs / fixture_id / "megatron_summary.json").read_text())
        metrics = truth.metrics
        assert metrics.throughput_per_s == pytest.approx(summary["throughput"]["per_s"], rel=REL), fixture_id
        assert metrics.bubble_ratio == pytest.approx(summary["bubble_ratio"], rel=REL), fixture_id
        per_stage = summary["utilization"]["per_stage"]
        assert len(metrics.utilization_per_stage) == len(per_stage), fixture_id
        for stage, value in per_stage.items():
            assert metrics.utilization_per_stage[int(stage)] == pytest.approx(value, rel=REL), (fixture_id, stage)
        assert metrics.completed_microbatches == summary["completed_microbatches"], fixture_id
        assert metrics.makespan_ms == pytest.approx(summary["time_ms"]["makespan_ms"], rel=REL), fixture_id


def test_stored_truth_is_what_the_events_give(shared_store):
    """The truth summary read on load is exactly a recomputation from the stored events."""
    for fixture_id in shared_store.ids()[::7]:
        fixture = shared_store.load(fixture_id)
        again = compute_truth(fixture.timeline(), fixture.spec.pp, fixture.truth.t0_ns)
        assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(fixture.truth.to_dict(), sort_keys=True)
        assert Truth.from_dict(json.loads(json.dumps(again.to_dict()))) == again


def test_per_stage_statistics_and_idle_stretch_are_consistent(shared_store):
    for fixture_id in shared_store.ids()[::5]:
        fixture = shared_store.load(fixture_id)
        truth, timeline = fixture.truth, fixture.timeline()
        compute = timeline[timeline["kind"] == tl.COMPUTE]
        for stats in truth.phase_stats:
            durations = compute[(compute["stage"] == stats.stage) & (compute["phase"] == stats.phase)]
            durations = durations["end_ms"] - durations["start_ms"]
            assert stats.count == len(durations)
            assert stats.p10_ms <= stats.median_ms <= stats.p90_ms
            assert stats.median_ms == pytest.approx(float(durations.median()))
        phases = {s.phase for s in truth.phase_stats if s.stage == 0}
        assert {tl.FORWARD, tl.BACKWARD} <= phases
        assert len(truth.idle_ms_per_iteration) == len(truth.iterations)
        # The idle stretch lies inside one iteration period, and no rank logs anything in it.
        for iteration, idle, period in zip(truth.iterations, truth.idle_ms_per_iteration,
                                           truth.metrics.iteration_periods_ms):
            if idle is None:
                continue
            assert 0 < idle < period
            events = timeline[timeline["iteration"] == iteration]
            backward_end = events[events["phase"].isin(tl.BACKWARD_PHASES) & (events["kind"] == tl.COMPUTE)]
            silence_from = backward_end["end_ms"].max()
            inside = timeline[(timeline["start_ms"] > silence_from) & (timeline["start_ms"] < silence_from + idle)]
            assert inside.empty, inside


def test_run_without_optimizer_events_has_no_idle_or_optimizer_time(shared_store):
    """exp1_1_all_nodes_run15 logged no OPTIMIZER events; its truth says so instead of inventing numbers."""
    index = shared_store.index()
    missing = [i for i in index["id"] if shared_store.load(i).quality["missing_optimizer_stages"]]
    assert missing, "expected at least one shared run without OPTIMIZER events"
    for fixture_id in missing:
        truth = shared_store.load(fixture_id).truth
        assert all(v is None for v in truth.optimizer_ms_per_stage)
        assert truth.idle_ms is None and truth.metrics.throughput_per_s > 0


# -- schedule inference on synthetic event orders -----------------------------------------------------------

def _timeline(orders: dict[int, list[tuple[str, int]]], iterations=(3, 4), phase_ms=1.0):
    """Back-to-back compute intervals per stage in the given (phase, chunk) order, iteration after iteration."""
    rows = []
    for iteration in iterations:
        for stage, order in orders.items():
            clock = iteration * 1000.0
            counters: dict[tuple[str, int], int] = {}
            for phase, chunk in order:
                microbatch = counters.get((phase, chunk), 0)
                counters[(phase, chunk)] = microbatch + 1
                rows.append(dict(stage=stage, chunk=chunk, iteration=iteration, microbatch=microbatch,
                                 kind=tl.COMPUTE, phase=phase, start_ms=clock, end_ms=clock + phase_ms))
                clock += phase_ms + 0.5
            rows.append(dict(stage=stage, chunk=0, iteration=iteration, microbatch=-1, kind=tl.COMPUTE,
                             phase=tl.OPTIMIZER, start_ms=clock + 50, end_ms=clock + 52))
    return tl.from_records(rows)


def _one_f_one_b(p: int, s: int, m: int) -> list[tuple[str, int]]:
    warmup = min(p - s - 1, m)
    order = ["FORWARD"] * warmup
    for _ in range(m - warmup):
        order += ["FORWARD", "BACKWARD"]
    order += ["BACKWARD"] * warmup
    return [(phase, 0) for phase in order]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (6, 6), (3, 2)])
def test_megatron_1f1b_order_is_recognised(p, m):
    timeline = _timeline({s: _one_f_one_b(p, s, m) for s in range(p)})
    assert infer_schedule(timeline, p) == ("1f1b", 1.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (6, 12)])
def test_gpipe_order_is_recognised(p, m):
    order = [("FORWARD", 0)] * m + [("BACKWARD", 0)] * m
    timeline = _timeline({s: order for s in range(p)})
    assert infer_schedule(timeline, p) == ("gpipe", 1.0)


def test_orders_that_1f1b_and_gpipe_share_count_as_1f1b():
    # With m <= p - 1 - s on every stage but the last, and m = 1 on the last, both orders coincide.
    p = 3  # and m = 1 microbatch on every stage
    timeline = _timeline({s: [("FORWARD", 0), ("BACKWARD", 0)] for s in range(p)})
    assert infer_schedule(timeline, p) == ("1f1b", 1.0)


def test_a_stray_order_lowers_the_agreement():
    p, m = 4, 8
    orders = {s: _one_f_one_b(p, s, m) for s in range(p)}
    orders[2] = orders[2][:3] + [orders[2][4], orders[2][3]] + orders[2][5:]  # swap two events on one stage
    schedule, agreement = infer_schedule(_timeline(orders, iterations=(3,)), p)
    assert schedule == "1f1b" and agreement == pytest.approx(3 / 4)


def test_split_backward_means_zero_bubble_and_second_chunk_means_interleaved():
    zb = {s: [("FORWARD", 0), ("BACKWARD_B", 0), ("BACKWARD_W", 0)] for s in range(2)}
    assert infer_schedule(_timeline(zb), 2)[0] == "zb_h1"
    interleaved = {s: [("FORWARD", 0), ("FORWARD", 1), ("BACKWARD", 1), ("BACKWARD", 0)] for s in range(2)}
    timeline = _timeline(interleaved)
    assert infer_schedule(timeline, 2)[0] == "interleaved_1f1b"
    truth = compute_truth(timeline, 2)
    assert truth.observed_schedule == "interleaved_1f1b"
    assert truth.idle_ms_per_iteration == pytest.approx((50.5, 50.5))  # 0.5 ms gap + 50 ms before the optimizer


def test_megatron_interleaved_order_matches_hand_written_rank_orders():
    # p=2, v=2, m=4 (group size p=2), read off Megatron-core's interleaved schedule by hand.
    rank0 = "F0 F0 F1 F1 F0 B1 F0 B1 F1 B0 F1 B0 B1 B1 B0 B0".split()
    rank1 = "F0 F0 F1 B1 F1 B1 F0 B0 F0 B0 F1 B1 F1 B1 B0 B0".split()
    for stage, written in ((0, rank0), (1, rank1)):
        order = megatron_interleaved_order(2, stage, 4, 2)
        assert [("F" if forward else "B") + str(chunk) for forward, chunk in order] == written


def test_interleaved_agreement_checks_the_order_of_chunks():
    def orders(shuffle: bool):
        out = {}
        for stage in range(2):
            passes = [("FORWARD" if forward else "BACKWARD", chunk)
                      for forward, chunk in megatron_interleaved_order(2, stage, 4, 2)]
            if shuffle and stage == 1:
                passes[0], passes[2] = passes[2], passes[0]
            out[stage] = passes
        return out

    assert infer_schedule(_timeline(orders(False)), 2) == ("interleaved_1f1b", 1.0)
    assert infer_schedule(_timeline(orders(True)), 2) == ("interleaved_1f1b", 0.5)
