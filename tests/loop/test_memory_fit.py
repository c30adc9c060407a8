"""The memory-fit aggregate on the shipped CPU captures: each run's predicted peak memory against its GPU's, counted
where the model says a measured run does not fit, and judged by the gate's memory_fit rule."""

from __future__ import annotations

import pytest

from hops_calib.loop.gate import gate
from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import load_suite, score_model
from hops_calib.model.memory import stage_memory
from hops_calib.model.predict import predict


@pytest.fixture(scope="module")
def cpu_suite(repo_root):
    return load_suite(repo_root / "fixtures", "train")


def test_each_runs_memory_fraction_is_its_fullest_stage_over_its_device(cpu_suite):
    model = load_model(None)
    scored = score_model(cpu_suite, model, origin="test")
    assert scored.suite.runs_predicted_not_to_fit == 0  # every shipped capture ran, and the model says it fits
    for spec, run in zip(cpu_suite.specs, scored.runs):
        stages = stage_memory(
            spec, [model.device(d).memory_bytes for d in spec.devices], predict(spec, model).result.peak_stage_activations
        )
        assert run.predicted_memory_fraction == pytest.approx(max(s.total_bytes / s.device_bytes for s in stages))
        assert 0.0 < run.predicted_memory_fraction < 1.0 and run.predicted_fits


def test_a_smaller_memory_makes_runs_not_fit_and_the_gate_refuses_it(cpu_suite):
    model = load_model(None)
    before = score_model(cpu_suite, model, origin="test")
    levels = sorted({r.predicted_memory_fraction for r in before.runs})
    # a capacity between the two fullest configurations' peaks: the fullest one (and its repeats) stops fitting
    capacity = model.device("cpu").memory_bytes
    smaller = capacity * (levels[-1] + levels[-2]) / 2
    after = score_model(cpu_suite, model.with_device_constant("cpu", "memory_bytes", smaller, "test"), origin="test")
    for old, new in zip(before.runs, after.runs):
        # the bytes are the launch's; only the capacity changed, so each fraction scales by capacity / smaller
        assert new.predicted_memory_fraction == pytest.approx(old.predicted_memory_fraction * capacity / smaller)
        assert new.throughput_error_pct == old.throughput_error_pct
    over = [r.run_id for r in after.runs if r.predicted_memory_fraction > 1.0]
    assert over == [r.run_id for r in before.runs if r.predicted_memory_fraction == levels[-1]]
    assert after.suite.runs_predicted_not_to_fit == len(over)
    verdict = gate(before.runs, after.runs, before.suite, after.suite)
    assert not verdict.accepted and verdict.failed_rules == ("memory_fit",)
    assert verdict.runs_moved == tuple(sorted(over))  # no time moved: the flipped verdicts are what moved
