"""Stragglers and failures (hops_calib.sim.perturb) on real fixtures: a slowed device or link costs what the
simulation's own critical path says it holds; random stragglers are seeded; failures cost lost work + recovery."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.sim import simulate
from hops_calib.sim.critical import critical_share
from hops_calib.sim.perturb import (
    Failure, RandomStragglers, SlowDevice, SlowLink, expected_failure_wall_ms, failure_run_ms, perturbed,
    straggler_factors,
)
from hops_calib.store import FixtureStore

REPO = Path(__file__).resolve().parents[2]
SLOWER = 1.1  # a 10 % slower device: thermal throttling, a degraded HBM stack


def _pipelines(store: FixtureStore):
    model = load_model()
    for fixture_id in store.ids("train"):
        spec = store.load(fixture_id).spec
        yield fixture_id, spec.schedule, model.pipeline(spec)


def _check_slow_bottleneck(store: FixtureStore) -> int:
    """For every train run: slow the rank holding most of the critical path by 10 %. A makespan is a maximum over
    dependency paths, so the run grows by at least 10 % of what the rank holds on the nominal path and by at most
    10 % of what it holds on the slowed run's path (unstretched); where the path stays, exactly the first.
    Ranks sharing a core (processor sharing) hold their tasks' served time, which a 10 % larger work stretches by
    less where the rank ends up computing alone: there the run grows, by less than 10 % of what the rank holds
    and of the whole run."""
    exact = 0
    checked = 0
    for fixture_id, schedule, pipeline in _pipelines(store):
        nominal = simulate(pipeline, schedule)
        held = critical_share(nominal, pipeline).compute_ms
        bottleneck = max(range(len(held)), key=held.__getitem__)
        slowed_pipeline = perturbed(pipeline, [SlowDevice(bottleneck, SLOWER)])
        slowed = simulate(slowed_pipeline, schedule)
        grown = slowed.makespan_ms - nominal.makespan_ms
        if pipeline.shares_cores:
            assert 0 < grown < (SLOWER - 1) * min(held[bottleneck], nominal.makespan_ms), (fixture_id, grown)
            checked += 1
            continue
        at_least = (SLOWER - 1) * held[bottleneck]
        at_most = (SLOWER - 1) * critical_share(slowed, slowed_pipeline).compute_ms[bottleneck] / SLOWER
        assert at_least * (1 - 1e-9) <= grown <= at_most * (1 + 1e-9), (fixture_id, at_least, grown, at_most)
        exact += math.isclose(grown, at_least, rel_tol=1e-9)
        checked += 1
    assert checked
    return exact


def test_slow_bottleneck_costs_its_critical_share_on_the_shipped_cpu_store():
    exact = _check_slow_bottleneck(FixtureStore(REPO / "fixtures"))
    assert exact >= 1  # the 1F1B captures keep their path: the cost is exactly the share


def test_slow_bottleneck_costs_its_critical_share_on_the_shared_runs(shared_store):
    exact = _check_slow_bottleneck(shared_store)
    assert exact >= 30  # of 36: on the others a second path through the slowed GPU overtakes


def test_slow_link_costs_at_least_its_critical_transfers(shared_store):
    fixture_id = "exp2_26_g_only_l4_front_pp4_run173"  # L4 -> A10G over the cross-family link
    spec = shared_store.load(fixture_id).spec
    pipeline = load_model().pipeline(spec)
    nominal = simulate(pipeline, spec.schedule)
    share = critical_share(nominal, pipeline).transfer_ms
    pair = max(share, key=share.get)
    slowed = simulate(perturbed(pipeline, links=[SlowLink(*pair, 3.0)]), spec.schedule)
    assert share[pair] > 0
    assert slowed.makespan_ms - nominal.makespan_ms >= 2.0 * share[pair] * (1 - 1e-9)


def test_transient_stragglers_on_every_rank_equal_a_uniformly_slow_pipeline():
    store = FixtureStore(REPO / "fixtures")
    fixture_id, schedule, pipeline = next(_pipelines(store))
    always = RandomStragglers(probability=1.0, low=SLOWER, high=SLOWER)
    factors = straggler_factors(always, pipeline.iterations, pipeline.ranks, np.random.default_rng(0))
    drawn = simulate(pipeline, schedule, compute_factors=factors)
    everywhere = perturbed(pipeline, [SlowDevice(rank, SLOWER) for rank in range(pipeline.ranks)])
    assert drawn.makespan_ms == pytest.approx(simulate(everywhere, schedule).makespan_ms, rel=1e-12)
    never = straggler_factors(RandomStragglers(0.0), pipeline.iterations, pipeline.ranks, np.random.default_rng(0))
    assert simulate(pipeline, schedule, compute_factors=never).makespan_ms == pytest.approx(
        simulate(pipeline, schedule).makespan_ms, rel=1e-12)


def test_random_stragglers_are_seeded_and_slow_the_run():
    store = FixtureStore(REPO / "fixtures")
    _, schedule, pipeline = next(_pipelines(store))
    stragglers = RandomStragglers(probability=0.3, low=1.05, high=1.5)

    def run(seed: int) -> float:
        factors = straggler_factors(stragglers, pipeline.iterations, pipeline.ranks, np.random.default_rng(seed))
        return simulate(pipeline, schedule, compute_factors=factors).makespan_ms

    nominal = simulate(pipeline, schedule).makespan_ms
    runs = [run(seed) for seed in range(8)]
    assert run(3) == runs[3]  # the same seed, the same run
    assert len(set(runs)) > 1 and min(runs) >= nominal * (1 - 1e-12) and max(runs) > nominal


def test_compute_factors_of_the_wrong_shape_are_refused():
    _, schedule, pipeline = next(_pipelines(FixtureStore(REPO / "fixtures")))
    with pytest.raises(ValueError, match="shape"):
        simulate(pipeline, schedule, compute_factors=np.ones((pipeline.iterations + 1, pipeline.ranks)))


def test_failures_cost_lost_work_and_recovery_as_the_closed_form_expects():
    period_ms, iterations = 6_000.0, 500
    failures = [Failure("device 3", rate_per_hour=0.5, recovery_s=120.0), Failure("link 2-3", 0.25, 60.0)]
    assert failure_run_ms(period_ms, iterations, [], np.random.default_rng(1)).wall_ms == period_ms * iterations
    for checkpoint_every in (1, 50):
        runs = [failure_run_ms(period_ms, iterations, failures, np.random.default_rng(seed), checkpoint_every)
                for seed in range(400)]
        walls = np.array([run.wall_ms for run in runs])
        for run in runs:  # the wall time is the work, the work lost and the recoveries
            assert run.wall_ms == pytest.approx(period_ms * iterations + run.lost_ms + run.recovery_ms)
        expected = expected_failure_wall_ms(period_ms, iterations, failures, checkpoint_every)
        assert abs(walls.mean() - expected) <= 4 * walls.std() / math.sqrt(len(walls)), (checkpoint_every,)
    assert expected_failure_wall_ms(period_ms, iterations, failures, 50) > expected_failure_wall_ms(
        period_ms, iterations, failures, 1)  # rarer checkpoints lose more


def test_perturbations_name_what_is_wrong():
    _, _, pipeline = next(_pipelines(FixtureStore(REPO / "fixtures")))
    with pytest.raises(ValueError, match="factor"):
        SlowDevice(0, 0.9)
    with pytest.raises(ValueError, match="not in a pipeline"):
        perturbed(pipeline, [SlowDevice(pipeline.ranks, 1.1)])
    with pytest.raises(ValueError, match="never finish"):
        failure_run_ms(1000.0, 3, [Failure("device 0", rate_per_hour=3.6e7, recovery_s=0.0)],
                       np.random.default_rng(0))
