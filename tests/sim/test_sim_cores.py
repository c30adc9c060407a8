"""Ranks time-sharing a core: processor-sharing service against its closed forms, and the shipped captures."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from hops_calib.sim import Pipeline, StageCosts, simulate
from hops_calib.sim.cores import Cores

REPO = Path(__file__).resolve().parents[2]
SHARED = ((1.0, 1.0), (1.0, 1.0))  # two ranks on one core (a t 2 capture: each core runs one rank of each stage)


def served(load, jobs):
    """Submit (rank, start, items) and serve everything: {rank: [start, end, ...] of each item}."""
    cores = Cores(load)
    for rank, start, items in jobs:
        cores.submit(rank, start, items)
    out = {}
    while cores.active:
        out.update(dict(cores.advance()))
    return out


def test_a_task_alone_runs_at_full_speed_and_two_equal_ones_together_at_half():
    assert served(SHARED, [(0, 3.0, [10.0])]) == {0: [3.0, 13.0]}
    assert served(SHARED, [(0, 0.0, [10.0]), (1, 0.0, [10.0])]) == {0: [0.0, 20.0], 1: [0.0, 20.0]}
    # k processes of rank 1's stage and of rank 0's on the core (t 2 x d 2 on 2 cores: 2 of each)
    assert served(((2.0, 2.0), (2.0, 2.0)), [(0, 0.0, [10.0]), (1, 0.0, [10.0])])[0] == [0.0, 40.0]
    assert served(((2.0, 2.0), (2.0, 2.0)), [(0, 0.0, [10.0])])[0] == [0.0, 20.0]


def test_staggered_overlap_is_piecewise():
    # A: 10 ms of work from 0, B: 10 from 4. A alone for 4 (4 done), both at 1/2 until A's 6 left take 12 (A ends
    # 16, B has done 6), B alone for its last 4: ends 20.
    out = served(SHARED, [(0, 0.0, [10.0]), (1, 4.0, [10.0])])
    assert out[0] == pytest.approx([0.0, 16.0]) and out[1] == pytest.approx([4.0, 20.0])
    # unequal shares: the core also holds another copy of rank 0's stage (3 processes while both compute)
    out = served(((2.0, 1.0), (2.0, 1.0)), [(0, 0.0, [6.0]), (1, 0.0, [4.0])])
    # rank 1 at 1/3 finishes its 4 at 12; rank 0 has done 4 of 6 at 1/3, its last 2 at 1/2: 16
    assert out[1] == pytest.approx([0.0, 12.0]) and out[0] == pytest.approx([0.0, 16.0])


def test_a_chain_runs_its_items_back_to_back_and_zero_work_takes_no_time():
    out = served(SHARED, [(0, 0.0, [2.0, 0.0, 3.0]), (1, 1.0, [1.0])])
    # rank 0: 1 alone, then 1 of its first item and rank 1's 1 at half (2 ms): first item ends 3 (1 + 1 done),
    # an empty one at 3, then 3 alone: 6
    assert out[0] == pytest.approx([0.0, 3.0, 3.0, 3.0, 3.0, 6.0])
    assert out[1] == pytest.approx([1.0, 3.0])


def _pipeline(**kw):
    stages = (StageCosts(10.0, 21.0, 9.0, 1.0), StageCosts(13.0, 24.0, 11.0, 1.5))
    return Pipeline(stages=stages, microbatches=4, iterations=3, forward_transfer_ms=(0.5,),
                    backward_transfer_ms=(0.7,), optimizer_ms=(5.0, 6.0), grad_reduce_ms=(2.0, 3.0),
                    grad_reduce_tail_ms=(2.0, 3.0), post_optimizer_ms=1.0, **kw)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
@pytest.mark.parametrize("optimizer_barrier", [True, False])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_flat_share_is_every_core_cost_times_k(schedule, optimizer_barrier, blocking):
    """k copies of each rank's own stage on its core and nothing else: every task, host time, reduction and step
    takes k times as long (the transfers, on the links, do not)."""
    k = 3.0
    base = _pipeline(optimizer_barrier=optimizer_barrier, blocking_p2p=blocking, iteration_barrier=True)
    scaled = dataclasses.replace(
        base, stages=tuple(StageCosts(k * s.forward_ms, k * s.backward_ms, k * s.weight_grad_ms, k * s.host_ms)
                           for s in base.stages),
        optimizer_ms=tuple(k * v for v in base.optimizer_ms), grad_reduce_ms=tuple(k * v for v in base.grad_reduce_ms),
        grad_reduce_tail_ms=tuple(k * v for v in base.grad_reduce_tail_ms))
    flat = dataclasses.replace(base, core_load=((k, 0.0), (0.0, k)))
    a, b = simulate(scaled, schedule).timeline, simulate(flat, schedule).timeline
    assert len(a) == len(b)
    np.testing.assert_allclose(b.start_ms, a.start_ms, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(b.end_ms, a.end_ms, rtol=1e-12, atol=1e-9)


def test_one_rank_per_core_is_the_unshared_pipeline():
    base = _pipeline(iteration_barrier=True, optimizer_barrier=False)
    own = dataclasses.replace(base, core_load=((1.0, 0.0), (0.0, 1.0)))
    assert not own.shares_cores
    assert simulate(own, "1f1b").timeline.equals(simulate(base, "1f1b").timeline)


def test_two_stages_sharing_a_core_overlap_at_half_speed():
    """Stage 0's second forward and stage 1's first start together at f (free links, no host time): both
    take 2 f, so both end at 3 f; the first forward, alone, at f."""
    f = 10.0
    pipe = Pipeline(stages=(StageCosts(f, 0.0), StageCosts(f, 0.0)), microbatches=2, core_load=SHARED,
                    blocking_p2p=False)
    timeline = simulate(pipe, "gpipe").timeline
    forwards = timeline[(timeline.kind == "compute") & (timeline.phase == "FORWARD")]
    rows = {(int(r.stage), int(r.microbatch)): (r.start_ms, r.end_ms) for r in forwards.itertuples()}
    assert rows[(0, 0)] == (0.0, f)
    assert rows[(0, 1)] == pytest.approx((f, 3 * f)) and rows[(1, 0)] == pytest.approx((f, 3 * f))
    assert rows[(1, 1)] == pytest.approx((3 * f, 4 * f))  # alone again


def test_bad_core_load_is_refused():
    with pytest.raises(ValueError, match="core_load must be 2 x 2"):
        _pipeline(core_load=((1.0,),))
    with pytest.raises(ValueError, match="own entry >= 1"):
        _pipeline(core_load=((0.5, 0.0), (0.0, 1.0)))


def test_the_captures_cores_give_each_stage_its_core_mates():
    """manifest.yaml's cores and Megatron's rank order: which ranks of which stage share each stage's core."""
    from hops_calib.spec import build_spec

    tp = build_spec(REPO / "traces" / "cpu_1f1b_t2_l4_h384_s128_m4_run1")  # 4 ranks, cores 0 1 0 1
    assert tp.cores == (0, 1, 0, 1) and tp.core_load() == SHARED
    both = build_spec(REPO / "traces" / "cpu_1f1b_t2d2_l2_h384_s128_m3_run1")  # 8 ranks on 2 cores
    assert both.core_load() == ((2.0, 2.0), (2.0, 2.0))
    alone = build_spec(REPO / "traces" / "cpu_1f1b_l4_h384_s128_m4_run1")  # one core per rank
    assert alone.cores == () and alone.core_load() == ()
    # a spec without the cores (an older store's) keeps the flat share of ranks_per_device
    legacy = type(both).from_dict({k: v for k, v in both.to_dict().items() if k != "cores"})
    assert legacy.core_load() == ((4.0, 0.0), (0.0, 4.0))


def test_sharing_prices_a_capture_between_its_own_cores_and_the_flat_share():
    """Processor sharing charges a rank for its core mates only while they compute: the t 2 x d 2 train capture
    (4 ranks per core) comes out faster than at a flat 1/4 and slower than with a core per rank."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.model.predict import predict
    from hops_calib.spec import build_spec

    spec = build_spec(REPO / "traces" / "cpu_1f1b_t2d2_l2_h384_s128_m3_run1")
    model = load_model()
    rate = {name: predict(s, model).metrics.throughput_per_s for name, s in (
        ("shared", spec), ("flat", dataclasses.replace(spec, cores=())),
        ("alone", dataclasses.replace(spec, cores=(), ranks_per_device=1.0)))}
    assert rate["flat"] < rate["shared"] < rate["alone"]


def test_phase_times_of_ranks_sharing_cores_are_what_the_simulation_served():
    """What observe, tune's components and evaluate's moved phases compare with a trace: on shared cores the
    served time (a flat k: k x the cost), not the cost alone; without sharing, the cost."""
    from hops_calib.model.predict import stage_phase_ms
    from hops_calib.research.components import predicted_components

    base = _pipeline(iteration_barrier=True, optimizer_barrier=False)
    flat = dataclasses.replace(base, core_load=((2.0, 0.0), (0.0, 2.0)))
    rows = stage_phase_ms(flat, ["cpu", "cpu"], simulate(flat, "1f1b"))
    assert [r.forward_ms for r in rows] == pytest.approx([2 * s.forward_ms for s in base.stages])
    assert [r.backward_ms for r in rows] == pytest.approx([2 * s.backward_ms for s in base.stages])
    assert [r.optimizer_ms for r in rows] == pytest.approx([2 * v for v in base.optimizer_ms])
    assert predicted_components(flat, "1f1b").values["forward/1"] == pytest.approx(2 * base.stages[1].forward_ms)
    assert [r.forward_ms for r in stage_phase_ms(base, ["cpu", "cpu"])] == [s.forward_ms for s in base.stages]
    with pytest.raises(ValueError, match="name its schedule"):
        predicted_components(flat)
