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
    arguments_block, legacy_timers_line, megatron_deepspeed_iteration, megatron_lm_iteration, padded_vocab_line,
    timers_block, timestamps, write_log,
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
    lines = [f"[rank1]: {line}" for line in arguments_block(args)]  # torchrun --tee prefixes every line
    for k, seconds in enumerate(_series(6, seed=5)):
        lines.append("[rank1]: " + megatron_deepspeed_iteration((k + 1) * 5, 100, (k + 1) * 80, seconds,
                                                                 batch_size=16, seq_length=1024,
                                                                 samples_per_sec=16 / seconds, tflops=90.0 + k))
        lines.append("[rank1]: " + legacy_timers_line({"forward-compute": 400.0 + k, "backward-compute": 800.0 + k,
                                                         "optimizer": 30.0}))
    write_log(path, lines)
    run = read_megatron_log(path, hardware=A100)
    assert len(run.iteration_times_ms) == 5  # first interval (1-5) holds the warm-up
    assert run.args["pipeline_model_parallel_size"] == 2
    assert run.reported["samples_per_s"] == pytest.approx(np.median(16 / _series(6, seed=5)[1:]), rel=1e-3)
    assert run.timing_log_option == "legacy"
    assert run.timers_ms["forward-compute"] == {"rank": pytest.approx(np.median(400.0 + np.arange(1, 6)))}


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
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx2")  # the command: the good rows in, exit 6 (partial)
    assert result.exit_code == 6 and f"{path}:4:" in result.stderr and "3 new" in result.stdout


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
    with pytest.raises(TraceError) as err:  # no hardware anywhere: one error for the table, not one per row
        read_run_table(path)
    assert err.value.field == "gpu" and "t.yaml" in str(err.value)
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
    report = ingest([table], store, split="auto")
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
    # the held-out guard's memory of the test split: every test group, each run digested by its row's content
    held_groups = store.group_digests("test")
    test_rows = index[index["split"] == "test"]
    assert set(held_groups) == set(test_rows["group"])
    assert sorted(d for g in held_groups.values() for d in g["digests"]) == sorted(test_rows["content_hash"])
    # a held-out run is listed and shown with its configuration only
    listed = json.loads(_cli("fixtures", "list", "--fixtures", store.root, "--json").stdout)["fixtures"]
    assert len(listed) == 1440 and {r["kind"] for r in listed} == {"iteration"}
    held = next(r for r in listed if r["split"] == "test")
    assert held["iteration_time_ms"] is None and held["held_out"] and held["configuration"]["pp"] >= 1
    shown = json.loads(_cli("fixtures", "show", held["id"], "--fixtures", store.root, "--json").stdout)
    assert "held_out" in shown and not {"iteration_time_ms", "iteration_periods_ms", "throughput_per_s"} & set(shown)


def _cli(*args):
    from typer.testing import CliRunner

    from hops_calib.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _allreduce_tables(folder, gpus=(2, 4, 8), latency_ns=9000.0, bus_gb_s=220.0):
    """nccl-tests all-reduce tables (trace/collective_bench.py's columns, out-of-place then in-place) of a node whose
    ring moves `bus_gb_s` GB/s of bus bandwidth after a fixed latency, 1 MiB to 64 MiB."""
    folder.mkdir(parents=True)
    for n in gpus:
        rows = ["size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)"]
        for size in (2 ** k for k in range(20, 27)):
            time_ns = latency_ns + size * 2 * (n - 1) / n / bus_gb_s
            busbw = size / time_ns * 2 * (n - 1) / n
            rows.append(f"{size},{size // 2},half,{time_ns:.0f},{busbw:.2f},{time_ns:.0f},{busbw:.2f}")
        (folder / f"AR_GPU{n}_1M_64M_LUT").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory, repo_root):
    """The shipped CPU captures (events) beside a run table of A100 pipelines in one node (iteration level), whose
    all-reduce tables sit in calibration/allreduce/ beside it: three priced runs and one that needs context
    parallelism (which the model does not price), all in train."""
    root = tmp_path_factory.mktemp("mixed")
    store = FixtureStore(root / "fx")
    shipped = FixtureStore(repo_root / "fixtures")
    for split in ("train", "test"):  # each capture in the split the shipped store gives it
        runs = [repo_root / "traces" / run for run in shipped.ids(split)]
        assert ingest(runs, store, split=split).ok
    _allreduce_tables(root / "calibration" / "allreduce")
    table = root / "a100_sweep.csv"
    _table([{"pipeline_model_parallel_size": 2, "num_layers": 24, "micro_batch_size": 4, "global_batch_size": 16,
             "fp16": True, "transformer_impl": "local", "iteration_time_ms": 310.0},
            {"pipeline_model_parallel_size": 4, "num_layers": 24, "micro_batch_size": 4, "global_batch_size": 16,
             "fp16": True, "transformer_impl": "local", "iteration_time_ms": 240.0},
            {"pipeline_model_parallel_size": 4, "num_layers": 24, "micro_batch_size": 2, "global_batch_size": 32,
             "fp16": True, "transformer_impl": "local", "iteration_time_ms": 520.0},
            {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "world_size": 4, "num_layers": 24, "global_batch_size": 16,
             "padded_vocab_size": 50432, "fp16": True, "transformer_impl": "local", "iteration_time_ms": 400.0}],
           ).to_csv(table, index=False)
    assert ingest([table], store, split="train").ok
    return store


def test_evaluate_scores_each_metric_on_the_runs_that_have_it(mixed_store, repo_root):
    events_only = json.loads(_cli("evaluate", "--fixtures", repo_root / "fixtures", "--json").stdout)
    result = _cli("evaluate", "--fixtures", mixed_store.root, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    kinds = {i: mixed_store.load(i).kind for i in mixed_store.ids("train")}
    events = sum(k == "events" for k in kinds.values())
    assert data["n_fixtures"] == len(kinds) - 1 == events + 3
    assert data["counts"] == {"throughput": events + 3, "steady_throughput": events + 3, "bubble": events,
                              "utilization": events}
    # bubble and rho come from the runs with events alone: the CPU captures' own numbers
    assert data["bubble_mae_pp"] == pytest.approx(events_only["bubble_mae_pp"])
    assert data["util_spearman_mean"] == pytest.approx(events_only["util_spearman_mean"])
    assert data["throughput_mape_pct"] == pytest.approx(np.mean([abs(r["throughput_error_pct"])
                                                                 for r in data["runs"]]))
    (reason,) = data["left_out"]["reasons"]
    assert data["left_out"]["count"] == 1 and "--context-parallel-size 2" in reason["reason"]
    measured = [r for r in data["runs"] if kinds[r["run_id"]] == "iteration"]
    for run in measured:  # measured over steady iterations: throughput is the steady one, on both sides
        assert run["bubble_error_pp"] is None and run["util_spearman_rho"] is None
        assert run["throughput_error_pct"] == pytest.approx(run["steady_throughput_error_pct"])
        real = mixed_store.load(run["run_id"]).truth.metrics
        assert run["real_throughput_per_s"] == pytest.approx(real.microbatches_per_iteration
                                                            / real.iteration_time_ms * 1e3)
    text = _cli("evaluate", "--fixtures", mixed_store.root)
    assert "left out 1 run(s) the model does not price" in text.stdout
    assert f"(on {events} runs with events)" in text.stdout


def test_verbs_that_predict_refuse_an_unpriced_run_by_name(mixed_store):
    (unpriced,) = [i for i in mixed_store.ids() if i.startswith("a100_sweep_t2")]
    result = _cli("predict", unpriced, "--fixtures", mixed_store.root, "--json")
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert unpriced in error["message"] and "context parallel" in error["message"]
    listed = json.loads(_cli("fixtures", "list", "--fixtures", mixed_store.root, "--json").stdout)["fixtures"]
    row = next(r for r in listed if r["id"] == unpriced)
    assert row["kind"] == "iteration" and row["configuration"]["tp"] == 2
    observed = json.loads(_cli("observe", "--fixtures", mixed_store.root, "--json").stdout)
    assert observed["left_out"]["count"] == 1 and observed["iteration_level_runs"] == 3
    assert {r["run_id"] for r in observed["runs"]} == set(mixed_store.ids("train")) - {unpriced}


def test_a_store_without_events_scores_throughput_only(tmp_path):
    path = tmp_path / "pp.csv"
    (tmp_path / "pp.yaml").write_text("hardware: {collective_tables: node_bench}\n", encoding="utf-8")
    _allreduce_tables(tmp_path / "node_bench")
    _table([{"pipeline_model_parallel_size": p, "num_layers": 24, "micro_batch_size": 2, "global_batch_size": 16,
             "transformer_impl": "local", "bf16": True, "iteration_time_ms": t} for p, t in ((2, 400.0), (4, 330.0))]
           ).to_csv(path, index=False)
    store = FixtureStore(tmp_path / "fx")
    assert ingest([path], store, split="train").ok
    data = json.loads(_cli("evaluate", "--fixtures", store.root, "--json").stdout)
    assert data["n_fixtures"] == 2 and data["bubble_mae_pp"] is None and data["util_spearman_mean"] is None
    assert data["counts"]["bubble"] == 0 and data["counts"]["throughput"] == 2
    (tmp_path / "pp.yaml").unlink()  # without the node's benchmark nothing prices the hops: not priced, said so
    assert ingest([path], store).ok
    result = _cli("evaluate", "--fixtures", store.root, "--json")
    assert result.exit_code == 2 and "none of the 2 train fixtures is priced" in json.loads(result.stdout)["error"][
        "message"] and "collective benchmark" in result.stdout


def test_sources_never_take_each_others_places(tmp_path, repo_root):
    first, second = tmp_path / "a" / "sweep.csv", tmp_path / "b" / "sweep.csv"
    for path, time_ms in ((first, 100.0), (second, 200.0)):
        path.parent.mkdir()
        _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": time_ms}]).to_csv(path, index=False)
    store = FixtureStore(tmp_path / "fx")
    assert ingest([first], store).ok
    before = {i: store.load(i).truth.metrics.iteration_time_ms for i in store.ids()}
    again = ingest([second], FixtureStore(store.root))
    (refused,) = again.rejected
    assert "another file of the same name" in refused.error and str(first.resolve()) in refused.error
    kept = FixtureStore(store.root)
    assert {i: kept.load(i).truth.metrics.iteration_time_ms for i in kept.ids()} == before
    # a job directory named like a log's run does not replace it, and a file that is no source is named
    log = tmp_path / "cpu_1f1b_l4_h512_s256_m4_run1.log"
    _lm_log(log)
    assert ingest([log], kept, hardware=A100).ok
    job = repo_root / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1"
    report = ingest([job], FixtureStore(store.root))
    (refused,) = report.rejected
    assert "training log or run table" in refused.error
    assert FixtureStore(store.root).load("cpu_1f1b_l4_h512_s256_m4_run1").kind == "iteration"
    stray = tmp_path / "notes.txt"
    stray.write_text("nothing Megatron printed\n")
    (refused,) = ingest([stray], FixtureStore(store.root)).rejected
    assert "not a source ingest reads" in refused.error


def test_a_table_folder_missing_its_runs_is_refused_and_written_again(tmp_path):
    path = tmp_path / "sweep.csv"
    _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 100.0}]).to_csv(path, index=False)
    store = FixtureStore(tmp_path / "fx")
    assert ingest([path], store).ok
    (run_id,) = store.ids()
    (store.root / "sweep" / RUNS_FILE).unlink()
    with pytest.raises(FixtureFileError, match=RUNS_FILE):
        FixtureStore(store.root).load(run_id)
    report = ingest([path], FixtureStore(store.root))
    assert report.ok and [o.status for o in report.outcomes] == ["updated"]
    assert FixtureStore(store.root).load(run_id).truth.metrics.iteration_time_ms == 100.0
