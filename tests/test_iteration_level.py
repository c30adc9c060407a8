"""Iteration-level sources: Megatron training logs (every timer option), run tables, the published vTrain table,
and the store's table folders that hold them.

Log text is written with the format strings of the code that prints it (tests/megatron_log_text.py cites each).
"""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pandas as pd
import pytest

from hops_calib.store import FixtureStore
from hops_calib.store.fixture_store import RUNS_FILE, FixtureFileError
from hops_calib.store.ingest import ingest
from hops_calib.trace.errors import TraceError
from hops_calib.trace.measured import RunHardware, model_flops_per_iteration
from hops_calib.trace.megatron_log import read_megatron_log
from hops_calib.trace.run_table import read_run_table
from tests.megatron_log_text import (
    arguments_block, megatron_deepspeed_iteration, megatron_lm_iteration, padded_vocab_line, timers_block,
    timestamps, write_log,
)

ARGS = {
    "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
    "max_position_embeddings": 1024, "micro_batch_size": 2, "global_batch_size": 16,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "data_parallel_size": 1, "world_size": 2,
    "fp16": True, "bf16": False, "train_iters": 100, "log_interval": 10, "transformer_impl": "local",
    "recompute_granularity": None, "padded_vocab_size": None, "timing_log_level": 1, "timing_log_option": "max",
}
A100 = RunHardware(gpu="a100", gpus_per_node=8)
TIMERS = ("forward-backward", "forward-compute", "backward-compute", "forward-recv", "backward-send-forward-recv",
          "embedding-grads-all-reduce", "all-grads-sync", "optimizer")


def _series(n: int, seed: int = 0) -> np.ndarray:
    """Per-interval mean iteration times (s): a slow first interval (warm-up), then steady with noise."""
    rng = np.random.default_rng(seed)
    times = 1.8432 + rng.normal(0.0, 0.02, n)
    times[0] *= 1.7
    return times


def _timer_values(k: int, ranks: int = 2) -> dict[str, list[float]]:
    """Per-rank timer values (ms per iteration) of interval k; the first stage runs no forward-recv."""
    base = {name: 10.0 * (j + 1) + k for j, name in enumerate(TIMERS)}
    values = {name: [v * (1 + 0.1 * r) for r in range(ranks)] for name, v in base.items()}
    values["forward-recv"][0] = 0.0
    return values


def _lm_log(path, option: str = "max", n: int = 10, throughput: bool = True, timestamp: bool = True, args=None):
    args = {**ARGS, "timing_log_option": option, **(args or {})}
    lines = ["using world size: 2, data-parallel size: 1, tensor-model-parallel size: 1, pipeline-model-parallel "
             "size: 2", *arguments_block(args), padded_vocab_line(50257, 50304)]
    clock = timestamps(datetime(2025, 3, 2, 10, 14, 7), 18.4)
    for k, seconds in enumerate(_series(n)):
        iteration = (k + 1) * args["log_interval"]
        lines.append(megatron_lm_iteration(iteration, args["train_iters"], iteration * args["global_batch_size"],
                                           seconds, throughput=171.3 + k if throughput else None,
                                           batch_size=args["global_batch_size"],
                                           when=next(clock) if timestamp else None))
        lines += timers_block(option, _timer_values(k))
    write_log(path, lines)
    return _series(n)


@pytest.mark.parametrize("option", ["max", "minmax", "all"])
def test_megatron_lm_log_in_every_timer_option(tmp_path, option):
    path = tmp_path / "gpt_run1.log"
    series = _lm_log(path, option)
    run = read_megatron_log(path, hardware=A100)
    # the first interval (iterations 1-10) holds the warm-up iterations 1-2: dropped; the others kept as they are
    assert run.iteration_times_ms == pytest.approx(tuple(np.round(series[1:] * 1000, 1)))
    assert run.interval_iterations == (10,) * 9 and run.last_iterations == tuple(range(20, 101, 10))
    assert run.args["pipeline_model_parallel_size"] == 2 and run.args["fp16"] is True
    assert run.timing_log_option == option and set(run.timers_ms) == set(TIMERS)
    kept = [_timer_values(k) for k in range(1, 10)]
    for name in TIMERS:
        ran = [[v for v in values[name] if v > 0] for values in kept]
        if option == "max":  # Megatron's per-iteration value (normalised by --log-interval): not divided again
            assert run.timers_ms[name] == {"max": pytest.approx(np.median([max(r) for r in ran]), abs=0.006)}
        elif option == "minmax":
            assert run.timers_ms[name]["min"] == pytest.approx(np.median([min(r) for r in ran]), abs=0.006)
            assert run.timers_ms[name]["max"] == pytest.approx(np.median([max(r) for r in ran]), abs=0.006)
        else:
            ranks = {f"rank {r}" for r in range(2) if kept[0][name][r] > 0}
            assert set(run.timers_ms[name]) == ranks
    assert run.reported["tflops_per_gpu"] == pytest.approx(np.median(171.3 + np.arange(1, 10)), abs=0.05)


def test_older_log_without_throughput_timestamp_or_timers_with_cuts(tmp_path):
    path = tmp_path / "old.log"
    lines = arguments_block({**ARGS, "log_interval": 1, "padded_vocab_size": 50304})
    series = _series(8, seed=3)
    for k, seconds in enumerate(series):
        line = megatron_lm_iteration(k + 1, 100, (k + 1) * 16, seconds)
        if k == 5:  # the log was cut inside this line
            line = line[:line.index("elapsed")] + "..."
        if k == 6:  # fields reordered, one added
            parts = [p for p in line.split("|") if p.strip()]
            line = " | ".join([parts[0], " my extra field: 3 "] + parts[1:][::-1]) + " |"
        lines.append(line)
        if k == 3:
            lines.append("...")
    write_log(path, lines)
    run = read_megatron_log(path, hardware=A100)
    expected = [round(s * 1000, 1) for k, s in enumerate(series) if k >= 2 and k != 5]  # warm-up 1-2 and the cut
    assert run.iteration_times_ms == pytest.approx(tuple(expected))
    assert run.timers_ms == {} and run.timing_log_option is None and run.reported == {}
    assert any(":" in w and "iteration 6" in w for w in run.warnings)
    assert read_megatron_log(path, hardware=A100, warmup_iterations=0).iteration_times_ms[0] == \
        pytest.approx(round(series[0] * 1000, 1))


def test_megatron_deepspeed_log_reports_its_own_figures(tmp_path):
    path = tmp_path / "ds.log"
    args = {**ARGS, "log_interval": 5}
    lines = arguments_block(args)
    for k, seconds in enumerate(_series(6, seed=5)):
        lines.append(megatron_deepspeed_iteration((k + 1) * 5, 100, (k + 1) * 80, seconds, batch_size=16,
                                                  seq_length=1024, samples_per_sec=16 / seconds, tflops=90.0 + k))
    write_log(path, lines)
    run = read_megatron_log(path, hardware=A100)
    assert len(run.iteration_times_ms) == 5  # first interval (1-5) holds the warm-up
    assert run.reported["samples_per_s"] == pytest.approx(np.median(16 / _series(6, seed=5)[1:]), rel=1e-3)


def test_bad_log_lines_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.log"
    lines = arguments_block(ARGS) + [megatron_lm_iteration(10, 100, 160, 1.8),
                                     megatron_lm_iteration(20, 100, 320, 1.8).replace("1800.0", "18oo.0")]
    write_log(path, lines)
    with pytest.raises(TraceError) as err:
        read_megatron_log(path, hardware=A100)
    assert err.value.line == len(lines) and err.value.field == "elapsed time per iteration (ms)"
    assert str(path) in str(err.value)
    write_log(path, [megatron_lm_iteration(10, 100, 160, 1.8)])
    with pytest.raises(TraceError, match="no arguments block"):
        read_megatron_log(path, hardware=A100)


def test_log_hardware_from_the_yaml_beside_it_or_the_command_line(tmp_path):
    path = tmp_path / "run.log"
    _lm_log(path)
    with pytest.raises(TraceError, match="--gpu TYPE --gpus-per-node N"):
        read_megatron_log(path)
    (tmp_path / "hops.base.yaml").write_text("hardware:\n  gpu: A100\n  gpus_per_node: 8\n", encoding="utf-8")
    assert read_megatron_log(path).hardware == A100
    with pytest.raises(TraceError) as err:
        read_megatron_log(path, hardware=RunHardware(gpu="h100", gpus_per_node=8))
    assert err.value.field == "hardware"


def test_log_ingests_as_an_iteration_level_fixture(tmp_path):
    path = tmp_path / "gpt_run1.log"
    series = _lm_log(path, "minmax")
    store = FixtureStore(tmp_path / "fx")
    report = ingest([path], store, hardware=A100)
    assert report.ok and [o.run_id for o in report.outcomes] == ["gpt_run1"]
    fixture = store.load("gpt_run1")
    assert fixture.kind == "iteration" and fixture.group == "gpt"
    assert fixture.launch["padded_vocab_size"] == 50304  # from the tokenizer's line, after the block
    metrics = fixture.truth.metrics
    kept = np.round(series[1:] * 1000, 1)
    assert metrics.iteration_time_ms == pytest.approx(np.median(kept))
    assert metrics.microbatches_per_iteration == 8
    assert metrics.throughput_per_s == pytest.approx(8 / (kept.mean() / 1e3))  # equal intervals: the mean
    assert metrics.bubble_ratio is None and metrics.utilization_per_stage == ()
    assert fixture.truth.timers_ms["forward-backward"]["min"] > 0
    again = ingest([path], store, hardware=A100)
    assert [o.status for o in again.outcomes] == ["unchanged"]


def _table(rows: list[dict]) -> pd.DataFrame:
    base = {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
            "padded_vocab_size": 50304, "micro_batch_size": 1, "global_batch_size": 8, "gpu": "a100",
            "gpus_per_node": 8}
    return pd.DataFrame([{**base, **row} for row in rows])


def test_run_table_with_a_bad_row_ingests_the_others(tmp_path):
    frame = _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 120.5},
                    {"pipeline_model_parallel_size": 2, "iteration_time_ms": 121.5},  # a repeat of row 1
                    {"pipeline_model_parallel_size": 4, "iteration_time_ms": "fast"},
                    {"pipeline_model_parallel_size": 4, "num_layers": 24, "samples_per_s": 50.0}])
    path = tmp_path / "sweep.csv"
    frame.to_csv(path, index=False)
    store = FixtureStore(tmp_path / "fx")
    report = ingest([path], store)
    assert not report.ok
    (bad,) = report.rejected
    assert f"{path}:4:" in bad.error and "iteration_time_ms" in bad.error and "'fast'" in bad.error
    ids = store.ids()
    assert len(ids) == 3
    repeats = [store.load(i) for i in ids if "p2" in i]
    assert sorted(f.id[-5:] for f in repeats) == ["_run1", "_run2"]
    assert repeats[0].group == repeats[1].group and repeats[0].split == repeats[1].split
    (converted,) = [store.load(i) for i in ids if "l24" in i]
    assert converted.truth.metrics.iteration_time_ms == pytest.approx(8 / 50.0 * 1e3)
    assert converted.launch["tensor_model_parallel_size"] == 1 and converted.launch["fp16"] is False  # defaults


def test_run_table_conversions_agree(tmp_path):
    args = {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
            "padded_vocab_size": 50304, "global_batch_size": 8, "pipeline_model_parallel_size": 2}
    time_ms = 250.0
    tflops = model_flops_per_iteration(args) / (time_ms / 1e3 * 2) / 1e12
    frame = _table([{**args, "iteration_time_ms": time_ms, "run_id": "a"},
                    {**args, "tflops_per_gpu": tflops, "run_id": "b"},
                    {**args, "samples_per_s": 8 / (time_ms / 1e3), "run_id": "c"}])
    path = tmp_path / "runs.parquet"
    frame.to_parquet(path)
    read = read_run_table(path)
    assert not read.errors
    assert [r.iteration_times_ms[0] for r in read.runs] == pytest.approx([time_ms] * 3)
    assert len({r.group for r in read.runs}) == 1  # one configuration, three measurements: one group


def test_parquet_row_errors_name_the_row_and_the_sidecar_fills_shared_settings(tmp_path):
    frame = _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 100.0},
                    {"pipeline_model_parallel_size": 2, "iteration_time_ms": 100.0, "num_layers": 0}])
    frame = frame.drop(columns=["gpu", "gpus_per_node"])
    path = tmp_path / "t.parquet"
    frame.to_parquet(path)
    read = read_run_table(path)
    assert [e.field for e in read.errors] == ["gpu", "num_layers"]  # row 2: the first problem found
    (tmp_path / "t.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8}\nargs: {fp16: true}\n")
    read = read_run_table(path)
    (error,) = read.errors
    assert error.field == "num_layers" and error.line == 2 and "row 2" in str(error)
    assert read.runs[0].hardware == A100 and read.runs[0].args["fp16"] is True


def test_table_folder_is_what_ingest_wrote(tmp_path):
    path = tmp_path / "sweep.csv"
    _table([{"pipeline_model_parallel_size": p, "num_layers": 12 * p, "iteration_time_ms": 100.0 * p}
            for p in (1, 2, 4)]).to_csv(path, index=False)
    store = FixtureStore(tmp_path / "fx")
    assert ingest([path], store).ok
    splits = {i: store.load(i).split for i in store.ids()}
    runs_file = store.root / "sweep" / RUNS_FILE
    frame = pd.read_parquet(runs_file)
    frame.loc[0, "truth"] = frame.loc[0, "truth"].replace("100.0", "50.0")
    frame.to_parquet(runs_file)
    with pytest.raises(FixtureFileError, match="changed after ingest"):
        FixtureStore(store.root).load(store.ids()[0])
    report = ingest([path], FixtureStore(store.root))
    assert report.ok and {o.status for o in report.outcomes} == {"updated"}
    fresh = FixtureStore(store.root)
    assert {i: fresh.load(i).split for i in fresh.ids()} == splits


def test_vtrain_table_ingests_as_published(tmp_path):
    from hops_calib.shared import shared_root

    table = shared_root() / "public-runs" / "vtrain" / "ground_truth_single.csv"
    if not table.is_file():
        from hops_calib.shared import shared_required

        if shared_required():
            pytest.fail(f"{table} is missing and HOPS_CALIB_REQUIRE_SHARED=1 requires it")
        pytest.skip(f"the vTrain table is not at {table} (shared/ is not in the repository)")
    store = FixtureStore(tmp_path / "fx")
    report = ingest([table], store)
    assert report.ok and report.count("new") == 1440
    published = pd.read_csv(table)
    index = store.index()
    assert len(index) == 1440 and set(index["kind"]) == {"iteration"}
    assert set(index["split"]) == {"train", "test"} and index["group"].nunique() == len(
        published.drop(columns=["iteration time (ms)"]).drop_duplicates())
    # the published times are the truth, row for row
    by_config = index.set_index(["tp", "dp", "pp", "num_layers", "hidden_size", "micro_batch_size",
                                 "global_batch_size"])["iteration_time_ms"]
    for _, row in published.sample(20, random_state=0).iterrows():
        key = (row["tensor parallelism"], row["data parallelism"], row["pipeline parallelism"], row["# layers"],
               row["hidden size"], row["micro batch"], row["global batch"])
        assert by_config.loc[key] == pytest.approx(row["iteration time (ms)"])
    # tensor- and data-parallel runs are priced too (issue #19): every run has a spec
    fixtures = store.load_all("train")
    parallel = [f for f in fixtures if f.launch["tensor_model_parallel_size"] > 1 or f.launch["data_parallel_size"] > 1]
    assert parallel and all(f.not_priced is None for f in fixtures)
    assert {(f.spec.tp, f.spec.dp) for f in parallel} >= {(2, 1), (1, 2), (2, 2), (4, 2), (8, 1)}
