"""Megatron's logged timers scored against the simulation's (hops_calib/loop/timers.py), on logs written in
Megatron's exact formats (tests/megatron_log_text.py cites each) for an A100 pipeline priced by the published
all-reduce tables (../shared/public-runs/vtrain/allreduce-a100/, read in place)."""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.loop.timers import PREDICTED_TIMERS, predicted_timers_ms
from hops_calib.model.predict import predict
from hops_calib.store import FixtureStore
from hops_calib.store.ingest import ingest
from hops_calib.trace.measured import RunHardware
from tests.megatron_log_text import arguments_block, megatron_lm_iteration, timers_block, timestamps, write_log

ARGS = {
    "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
    "max_position_embeddings": 1024, "micro_batch_size": 2, "global_batch_size": 16,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "data_parallel_size": 1, "world_size": 2,
    "fp16": True, "bf16": False, "train_iters": 100, "log_interval": 10, "transformer_impl": "local",
    "padded_vocab_size": 50304, "timing_log_level": 2,
}
# The measured run, relative to the model's prediction: each predicted timer's per-rank value x its factor
FACTORS = {"forward-backward": 1.05, "forward-compute": 1.10, "backward-compute": 0.95, "optimizer": 1.25}
# Each log interval's times relative to the steady ones: the first holds the warm-up (ingest drops it), then noise
JITTER = np.concatenate([[1.6], 1.0 + np.random.default_rng(1).normal(0.0, 0.002, 9)])


def _write(path, option: str, predicted: dict[str, tuple[float, ...]], iteration_ms: float) -> None:
    """A Megatron-LM log whose timers are the prediction x FACTORS per rank, with two p2p timers the simulation
    has no counterpart of (rank 0 receives no forward activations: 0, not printed) and seeded noise between
    intervals."""
    args = {**ARGS, "timing_log_option": option}
    lines = [*arguments_block(args)]
    clock = timestamps(datetime(2025, 3, 2, 10, 14, 7), 18.4)
    for k, jitter in enumerate(JITTER):
        iteration = (k + 1) * args["log_interval"]
        lines.append(megatron_lm_iteration(iteration, args["train_iters"], iteration * args["global_batch_size"],
                                           iteration_ms * jitter / 1e3, batch_size=args["global_batch_size"],
                                           when=next(clock)))
        times = {name: [v * FACTORS[name] * jitter for v in predicted[name]] for name in PREDICTED_TIMERS}
        times["forward-recv"] = [0.0, 3.0 * jitter]
        times["backward-send-forward-recv"] = [4.0 * jitter, 2.0 * jitter]
        lines += timers_block(option, times)
    write_log(path, lines)


@pytest.fixture(scope="module")
def timed_store(allreduce_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("timers")
    (root / "calibration").mkdir()
    (root / "calibration" / "allreduce").symlink_to(allreduce_dir)
    hardware = RunHardware(gpu="a100", gpus_per_node=8)
    # the model's own prediction of this launch (no log needed for it: the launch alone is priced)
    probe = root / "probe.log"
    write_log(probe, [*arguments_block({**ARGS, "timing_log_option": "max"}),
                      *(megatron_lm_iteration(k, 100, 16 * k, 0.4, batch_size=16) for k in (10, 20))])
    store = FixtureStore(root / "probe_fx")
    assert ingest([probe], store, hardware=hardware, split="train").ok
    prediction = predict(store.load_all()[0].spec, load_model(None))
    predicted = predicted_timers_ms(prediction.result.columns)
    for n, option in enumerate(("max", "minmax", "all")):  # three runs of one launch, each its own measurement
        _write(root / f"gpt_{option}.log", option, predicted, prediction.metrics.iteration_time_ms * (1 + 0.01 * n))
    store = FixtureStore(root / "fx")
    assert ingest([root / f"gpt_{o}.log" for o in ("max", "minmax", "all")], store, hardware=hardware,
                  split="train").ok
    return store, predicted, prediction


def test_predicted_timers_are_the_simulated_ranks_parts_of_an_iteration(timed_store):
    _, predicted, prediction = timed_store
    assert set(predicted) == set(PREDICTED_TIMERS)
    period = prediction.metrics.iteration_time_ms
    for rank in range(2):
        # forward-backward runs from the iteration's start to the rank's optimizer step; with the slowest rank's
        # optimizer step and the time after it (outside every timer: Megatron's train-step bookkeeping) they make
        # the period
        after = prediction.pipeline.post_optimizer_ms
        assert after > 0 and predicted["forward-backward"][rank] + max(predicted["optimizer"]) + after == (
            pytest.approx(period, rel=1e-9))
        # the compute inside it, waits and p2p aside
        busy = predicted["forward-compute"][rank] + predicted["backward-compute"][rank]
        assert 0 < busy < predicted["forward-backward"][rank]
    # the compute timers are the rank's per-microbatch passes times the microbatches of an iteration
    microbatches = ARGS["global_batch_size"] // ARGS["micro_batch_size"]
    for row in prediction.stage_phase_ms(_probe_spec(timed_store)):
        assert predicted["forward-compute"][row.stage] == pytest.approx(row.forward_ms * microbatches, rel=1e-6)
        assert predicted["backward-compute"][row.stage] == pytest.approx(row.backward_ms * microbatches, rel=1e-6)


def _probe_spec(timed_store):
    store, _, _ = timed_store
    return FixtureStore(store.root.parent / "probe_fx").load_all()[0].spec


@pytest.mark.parametrize("option", ["max", "minmax", "all"])
def test_each_logged_timer_is_scored_by_its_largest_value_over_ranks(timed_store, option):
    from hops_calib.loop.suite import load_suite, score_model

    store, _, _ = timed_store
    suite = load_suite(store.root, "train")
    scored = {r.run_id: r for r in score_model(suite, load_model(None), origin="test").runs}
    run = scored[f"gpt_{option}"]
    errors = run.timer_errors_pct
    steady = float(np.median(JITTER[1:]))  # a run's timers: the median over its kept intervals
    for name, factor in FACTORS.items():  # logged = predicted x factor on every rank: error 1/factor - 1
        assert errors[name] == pytest.approx((1.0 / (factor * steady) - 1.0) * 100.0, abs=0.1), name  # printed to 0.01 ms
    assert errors["forward-recv"] is None and errors["backward-send-forward-recv"] is None


def test_evaluate_and_observe_report_per_timer_errors_with_counts(timed_store, repo_root):
    from typer.testing import CliRunner

    from hops_calib.cli import app

    store, _, _ = timed_store
    data = json.loads(CliRunner().invoke(app, ["evaluate", "--fixtures", str(store.root), "--json"]).stdout)
    timers = data["timers"]
    assert timers["forward-compute"]["runs"] == timers["forward-compute"]["scored"] == 3
    steady = float(np.median(JITTER[1:]))
    assert timers["forward-compute"]["mape_pct"] == pytest.approx((1 - 1 / (1.10 * steady)) * 100.0, abs=0.01)
    assert timers["forward-recv"] == {"runs": 3, "scored": 0, "mape_pct": None, "predicted": False}
    text = CliRunner().invoke(app, ["evaluate", "--fixtures", str(store.root)]).stdout
    assert "logged timers, MAPE of the largest over ranks: backward-compute" in text
    assert "no predicted counterpart: backward-send-forward-recv (3 runs), forward-recv (3 runs)" in text
    observed = CliRunner().invoke(app, ["observe", "--fixtures", str(store.root), "--json"])
    assert json.loads(observed.stdout)["timers"] == timers
    # a suite of runs with events logs no timers: its record is as before
    shipped = json.loads(CliRunner().invoke(app, ["evaluate", "--fixtures", str(repo_root / "fixtures"),
                                                  "--json"]).stdout)
    assert shipped["timers"] is None
