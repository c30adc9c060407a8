"""The planner's search over every lever together (hops_calib.whatif.job_plan): recomputation, the layout,
sequence parallelism, the distributed optimizer, the schedule; Megatron-runnable launches first; each pick within
its GPUs' memory less the headroom; and the launches that once crashed it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.whatif.job_plan import JobPlanner, Launch, plan_job
from hops_calib.whatif.perturbations import Perturbations
from hops_calib.sim.perturb import RandomStragglers

REPO = Path(__file__).resolve().parent.parent
TP2_JOB = REPO / "traces" / "cpu_1f1b_t2d2_l4_h256_s128_m4_run1"


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_a_virtual_stage_without_decoder_layers_prices_under_tensor_parallelism(model):
    """Interleaved v=3 with the embedding and the loss counted as layers leaves the first and last virtual stages
    with no decoder layer: its tensor-parallel collectives are the embedding's and the loss's alone (this launch
    raised KeyError('all_reduce', ...) in the pricing of the backward's overlapped collectives)."""
    planner = JobPlanner(TP2_JOB, model)
    own = planner.current()
    launch = Launch(own.order, None, None, "interleaved_1f1b", 3, own.micro_batch_size, (True, True))
    spec, pipeline = planner.priced(launch)
    assert spec.tp == 2 and 0 in spec.layers_per_virtual_stage
    assert all(stage.forward_ms > 0 and stage.backward_ms > 0 for stage in pipeline.stages)
    assert planner.evaluate(launch).samples_per_s > 0


def test_plan_with_stragglers_on_a_tensor_parallel_capture(model):
    """`plan --job traces/cpu_1f1b_t2d2_... --stragglers 0.05:1.05:1.3` ranks by draws instead of crashing."""
    perturbations = Perturbations(stragglers=RandomStragglers(0.05, 1.05, 1.3), samples=8, seed=0)
    plan = plan_job(TP2_JOB, model, top=3, perturbations=perturbations, rank_by="expected")
    assert plan.status == "ok" and len(plan.best) == 3
    expected = [o.expected_samples_per_s for o in plan.best]
    assert expected == sorted(expected, reverse=True)
    assert all(o.expected_samples_per_s <= o.samples_per_s for o in plan.best)
