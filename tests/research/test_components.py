"""Component errors: model per-task costs against what each trace measures directly."""

import pytest

from hops_calib.research.components import (Components, component_errors_pct, mispriced_time_pct, predicted_components,
                                   real_components)
from hops_calib.sim.pipeline import Pipeline, StageCosts


def test_predicted_components_read_the_pipeline_per_rank():
    pipeline = Pipeline(stages=(StageCosts(1.0, 2.0), StageCosts(3.0, 4.0), StageCosts(5.0, 6.0), StageCosts(7.0, 8.0)),
                        microbatches=4, chunks=2, optimizer_ms=(9.0, 10.0), pre_optimizer_ms=11.0,
                        post_optimizer_ms=12.0)
    values = predicted_components(pipeline).values
    # rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3 (Megatron's round robin)
    assert values["forward/0"] == 3.0 and values["forward/1"] == 5.0 and values["backward/1"] == 6.0
    assert values["optimizer/1"] == 10.0 and values["silent"] == 11.0 and values["rest"] == 12.0


def test_errors_cover_what_the_trace_measured_and_unpriced_quantities_count_as_zero():
    real = Components({"forward/0": 10.0, "silent": 100.0, "rest": 4.0})
    predicted = Components({"forward/0": 12.0, "silent": 50.0, "optimizer/0": 7.0})
    assert component_errors_pct(real, predicted) == pytest.approx({"forward/0": 20.0, "silent": -50.0, "rest": -100.0})
    # 4 microbatches on 2 ranks: forward counts 4 times, silent and rest once per rank
    measured = 4 * 10.0 + 2 * 100.0 + 2 * 4.0
    mispriced = 4 * 2.0 + 2 * 50.0 + 2 * 4.0
    assert mispriced_time_pct([real], [predicted], [4], [2]) == pytest.approx(mispriced / measured * 100)


def test_real_components_of_a_shared_run_are_the_truths_medians_and_parts(shared_store):
    for fixture_id in shared_store.ids("train")[:3]:
        fixture = shared_store.load(fixture_id)
        values = real_components(fixture).values
        for stage in range(fixture.spec.pp):
            assert values[f"forward/{stage}"] == fixture.truth.phase_median_ms(stage, "FORWARD")
        timeline = fixture.timeline()
        compute = timeline[timeline["kind"] == "compute"]
        optimizer = compute[compute["phase"] == "OPTIMIZER"]
        if optimizer.empty:
            assert "silent" not in values
            continue
        last_backward = compute[compute["phase"] == "BACKWARD"].groupby("iteration")["end_ms"].max()
        silent = optimizer.groupby("iteration")["start_ms"].min() - last_backward
        # every traced iteration but the last (whose next iteration is not traced)
        assert values["silent"] == pytest.approx(silent.iloc[:-1].mean())
