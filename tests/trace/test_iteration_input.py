"""What a new user's own iteration-level sources get wrong, and what ingest says about it: a log cut inside a
value, a log without its vocabulary, a device type the catalog does not know, misspelled table columns, a bad row
ingested again, one configuration from two sources, and what ingest says of each new run (split, priced).

Log text is written with Megatron's format strings (tests/megatron_log_text.py cites each).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from hops_calib.store import FixtureStore
from hops_calib.store.ingest import ingest
from hops_calib.trace.errors import TraceError
from hops_calib.trace.megatron_log import read_megatron_log
from tests.megatron_log_text import arguments_block, megatron_lm_iteration
from tests.trace.test_iteration_level import A100, ARGS, _lm_log, _series


def _cut_log(path, cut_at: str) -> list[float]:
    """A Megatron-LM log of 6 intervals whose last iteration line is cut inside its elapsed time at `cut_at`
    characters after the field's colon (no newline after it: the file ends there)."""
    args = {**ARGS, "log_interval": 1, "padded_vocab_size": 50304}
    series = _series(6, seed=7)
    lines = arguments_block(args) + [megatron_lm_iteration(k + 1, 100, (k + 1) * 16, s) for k, s in enumerate(series)]
    last = lines[-1]
    lines[-1] = last[:last.index(cut_at) + len(cut_at)]
    path.write_text("\n".join(lines), encoding="utf-8")  # the file ends inside the line
    return [round(s * 1000, 1) for s in series]


def test_a_log_cut_inside_a_number_drops_its_last_line_with_a_warning(tmp_path):
    path = tmp_path / "cut_run1.log"
    full = _cut_log(path, "elapsed time per iteration (ms): 1")  # '1' of e.g. '1843.2'
    run = read_megatron_log(path, hardware=A100)
    assert run.iteration_times_ms == pytest.approx(tuple(full[2:5]))  # warm-up 1-2 dropped, and the cut line 6
    warned = [w for w in run.warnings if f"{path}:" in w and "cut" in w]
    assert warned and f"{path}:{len(arguments_block(ARGS)) + 6}:" in warned[0]


def test_a_line_without_its_closing_bar_loses_only_its_cut_field(tmp_path):
    path = tmp_path / "bar.log"
    args = {**ARGS, "log_interval": 1, "padded_vocab_size": 50304}
    series = _series(5, seed=2)
    lines = arguments_block(args)
    for k, seconds in enumerate(series):
        line = megatron_lm_iteration(k + 1, 100, (k + 1) * 16, seconds, throughput=150.0 + k)
        if k == 3:  # cut inside the throughput value, the next line goes on (two writers interleaved)
            line = line[:line.index("(TFLOP/s/GPU): ") + len("(TFLOP/s/GPU): ") + 1]
        lines.append(line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = read_megatron_log(path, hardware=A100)
    assert run.iteration_times_ms == pytest.approx(tuple(round(s * 1000, 1) for s in series[2:]))
    # the cut figure ('1' of 153.0) is not among the printed throughputs: the median of 152.0 and 154.0
    assert run.reported["tflops_per_gpu"] == pytest.approx(153.0)
    assert any(f"{path}:{len(arguments_block(args)) + 4}:" in w and "last field" in w for w in run.warnings)


def _lm_log_without_vocab(path) -> None:
    """A Megatron-LM log whose arguments block prints no padded_vocab_size (Megatron sets it after printing the
    block) and which holds no tokenizer line: only the block and the iteration lines were kept."""
    _lm_log(path)
    text = path.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join(line for line in text if "padded vocab" not in line and "padded_vocab_size" not in line)
                    + "\n", encoding="utf-8")


def test_a_log_without_vocabulary_is_refused_until_its_sidecar_gives_it(tmp_path):
    path = tmp_path / "novocab_run1.log"
    _lm_log_without_vocab(path)
    result = _cli("ingest", path, "--gpu", "a100", "--gpus-per-node", "8", "--fixtures", tmp_path / "fx")
    assert result.exit_code == 2, result.output  # nothing stored: bad input
    assert f"{path}: field 'padded_vocab_size'" in result.stderr and "novocab_run1.yaml" in result.stderr
    assert not (tmp_path / "fx").exists()  # no empty store left behind
    (tmp_path / "novocab_run1.yaml").write_text("args:\n  padded_vocab_size: 50304\n", encoding="utf-8")
    result = _cli("ingest", path, "--gpu", "a100", "--gpus-per-node", "8", "--fixtures", tmp_path / "fx")
    assert result.exit_code == 0, result.output
    assert FixtureStore(tmp_path / "fx").load("novocab_run1").launch["padded_vocab_size"] == 50304
    # a sidecar that says otherwise than the log is refused, not silently preferred
    (tmp_path / "novocab_run1.yaml").write_text("args:\n  num_layers: 12\n  padded_vocab_size: 50304\n")
    result = _cli("ingest", path, "--gpu", "a100", "--gpus-per-node", "8", "--fixtures", tmp_path / "fx")
    assert result.exit_code == 2 and "field 'args.num_layers'" in result.stderr and "24" in result.stderr


def _cli(*args):
    from typer.testing import CliRunner

    from hops_calib.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _catalog() -> set[str]:
    from hops_calib.loop.model_files import device_types

    return set(device_types())


def test_a_device_type_outside_the_catalog_is_refused_at_ingest_and_left_out_by_the_loaders(tmp_path, repo_root):
    path = tmp_path / "gpt_run1.log"
    _lm_log(path)
    result = _cli("ingest", path, "--gpu", "v100", "--gpus-per-node", "8", "--fixtures", tmp_path / "fx")
    assert result.exit_code == 2 and "'v100'" in result.stderr
    assert all(t in result.stderr for t in _catalog())  # the catalog's types are named
    (tmp_path / "hops.base.yaml").write_text("hardware:\n  gpu: mi300x\n  gpus_per_node: 8\n", encoding="utf-8")
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx", "--json")
    assert result.exit_code == 2
    [run] = json.loads(result.stdout)["runs"]
    assert run["status"] == "rejected" and f"{tmp_path / 'hops.base.yaml'}: field 'hardware.gpu'" in run["error"]
    # a store written before ingest checked the type (or by hand through the library): the run is left out with
    # its reason, the others are scored; predict of it is bad input (2), not a crash (3)
    # the shipped store as it is (ingesting traces/ afresh would hash the captures the project holds out into
    # train, which evaluate refuses now that the ledger remembers them)
    shutil.copytree(repo_root / "fixtures", tmp_path / "mixed")
    store = FixtureStore(tmp_path / "mixed")
    assert ingest([path], store, split="train").ok  # no device_types: not checked
    evaluated = _cli("evaluate", "--fixtures", store.root, "--json")
    assert evaluated.exit_code == 0, evaluated.output
    left = json.loads(evaluated.stdout)["left_out"]
    assert left["count"] == 1 and "'mi300x' is not in the catalog" in left["reasons"][0]["reason"]
    predicted = _cli("predict", "gpt_run1", "--fixtures", store.root)
    assert predicted.exit_code == 2 and "'mi300x'" in predicted.stderr


def _sweep(rows: list[dict]) -> pd.DataFrame:
    """A sweep of A100 pipelines as a user writes it: Megatron's argument names, the measured iteration time."""
    base = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
            "padded_vocab_size": 50304, "micro_batch_size": 2, "global_batch_size": 32, "bf16": True,
            "transformer_impl": "local", "gpu": "a100", "gpus_per_node": 8}
    return pd.DataFrame([{**base, **row} for row in rows])


def test_unknown_columns_and_sidecar_keys_are_refused_naming_the_closest_known_names(tmp_path):
    path = tmp_path / "typo.csv"
    frame = _sweep([{"pipeline_parallel_size": 4, "iteration_time_ms": 620.0}])
    frame.rename(columns={"micro_batch_size": "micro_batch"}).to_csv(path, index=False)
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx")
    assert result.exit_code == 2 and not (tmp_path / "fx").exists()
    assert f"{path}:1: field '" in result.stderr and "'pipeline_parallel_size'" in result.stderr
    assert "did you mean pipeline_model_parallel_size" in result.stderr and "did you mean micro_batch_size" in \
        result.stderr
    # a column of one's own: declared, it is kept out of the launch
    _sweep([{"pipeline_model_parallel_size": 4, "iteration_time_ms": 620.0, "x_date": "2025-03-02",
             "node": "gpu17"}]).to_csv(path, index=False)
    (tmp_path / "typo.yaml").write_text("extra_columns: [node]\n", encoding="utf-8")
    assert _cli("ingest", path, "--fixtures", tmp_path / "fx").exit_code == 0
    [fixture] = FixtureStore(tmp_path / "fx").load_all()
    assert not {"x_date", "node"} & set(fixture.launch) and fixture.launch["pipeline_model_parallel_size"] == 4
    (tmp_path / "typo.yaml").write_text("args:\n  fp61: true\nhardwre: {gpu: a100}\n", encoding="utf-8")
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx2")
    assert result.exit_code == 2 and "typo.yaml:3: field 'hardwre'" in result.stderr and "hardware" in result.stderr
    (tmp_path / "typo.yaml").write_text("args:\n  fp61: true\n", encoding="utf-8")
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx2")
    assert "typo.yaml:2: field 'args.fp61'" in result.stderr and "fp16" in result.stderr


def test_known_arguments_cover_what_the_spec_reads_and_refuses():
    from hops_calib.spec import ASSUMPTIONS
    from hops_calib.trace.measured import KNOWN_ARGS

    assert {key for assumption in ASSUMPTIONS for key in assumption.keys} <= KNOWN_ARGS


def test_a_table_with_a_bad_row_is_partial_on_every_ingest(tmp_path):
    path = tmp_path / "sweep.csv"
    _sweep([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 520.3},
            {"pipeline_model_parallel_size": 4, "iteration_time_ms": "abc"},
            {"pipeline_model_parallel_size": 4, "global_batch_size": 64, "iteration_time_ms": 980.0}]
           ).to_csv(path, index=False)
    for _ in range(2):  # the second ingest finds the table unchanged: the bad row is still bad
        result = _cli("ingest", path, "--fixtures", tmp_path / "fx")
        assert result.exit_code == 6 and "1 rejected" in result.stdout
        assert f"{path}:3: field 'iteration_time_ms': is 'abc'" in result.stderr and "line 3" not in result.stderr


def test_a_run_table_is_read_within_bounds(tmp_path):
    """A table of more rows than a run table may hold is refused whole, before a row is priced or a rejection per row
    printed (10^6 garbage rows took 87 s and 5.1 GB); a FIFO named as a table is refused without blocking."""
    import os

    from hops_calib.trace.reading import MAX_TABLE_ROWS

    path = tmp_path / "huge.csv"
    rows = _sweep([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 520.3}])
    pd.concat([rows] * (MAX_TABLE_ROWS + 1), ignore_index=True).to_csv(path, index=False)
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx")
    assert result.exit_code == 2, result.output
    assert f"holds {MAX_TABLE_ROWS + 1:,} rows, more than a run table may ({MAX_TABLE_ROWS:,})" in result.stderr
    assert "split the table into several files" in result.stderr
    assert not (tmp_path / "fx").exists()
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    result = _cli("ingest", fifo, "--fixtures", tmp_path / "fx2")
    assert result.exit_code == 2 and f"rejected: {fifo}" in result.stderr  # not read as a table (nor waited on)


def test_an_iteration_longer_than_a_day_is_refused_in_a_table_and_a_log(tmp_path):
    """1e308 ms was stored and overflowed the metrics to a throughput of 0; a samples/s that converts to more than a
    day is refused the same way (its unit?)."""
    path = tmp_path / "sweep.csv"
    _sweep([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 520.3},
            {"pipeline_model_parallel_size": 4, "iteration_time_ms": 1e308},
            {"pipeline_model_parallel_size": 4, "global_batch_size": 64, "samples_per_s": 1e-6}]).to_csv(path, index=False)
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx")
    assert result.exit_code == 6 and "2 rejected" in result.stdout, result.output
    assert f"{path}:3: field 'iteration_time_ms': is 1e+308: an iteration of 1e+308 ms, more than a day" in result.stderr
    assert f"{path}:4: field 'samples_per_s'" in result.stderr and "more than a day" in result.stderr
    log = tmp_path / "gpt_run1.log"
    _lm_log(log)
    text = log.read_text(encoding="utf-8")
    marker = "elapsed time per iteration (ms): "
    start = text.index(marker) + len(marker)
    end = text.index(" |", start)
    log.write_text(text[:start] + "1e308" + text[end:], encoding="utf-8")
    with pytest.raises(TraceError, match="more than a day for one iteration"):
        read_megatron_log(log, hardware=A100)


def test_one_configuration_from_two_sources_shares_a_group_and_a_copy_is_a_duplicate(tmp_path):
    rows = [{"pipeline_model_parallel_size": p, "global_batch_size": gb, "iteration_time_ms": ms}
            for p, gb, ms in ((2, 16, 270.1), (2, 32, 520.3), (4, 16, 160.2), (4, 32, 290.7), (4, 64, 560.9))]
    _sweep(rows).to_csv(tmp_path / "sweep.csv", index=False)
    _sweep(rows).to_parquet(tmp_path / "sweep_copy.parquet")
    # the same configurations measured again another day: repeats, not copies
    again = [{**row, "iteration_time_ms": row["iteration_time_ms"] * 1.01} for row in rows]
    _sweep(again).to_csv(tmp_path / "monday.csv", index=False)
    store = FixtureStore(tmp_path / "fx")
    first = ingest([tmp_path / "sweep.csv", tmp_path / "monday.csv"], store, split="auto")
    assert first.ok
    copy = ingest([tmp_path / "sweep_copy.parquet"], store)
    assert copy.count("rejected") == len(rows) and all("a duplicate of run sweep_" in o.error for o in copy.rejected)
    fixtures = store.load_all("train") + store.load_all("test")
    by_config = {}
    for fixture in fixtures:
        key = (fixture.launch["pipeline_model_parallel_size"], fixture.launch["global_batch_size"])
        by_config.setdefault(key, set()).add((fixture.group, fixture.split))
    assert len(fixtures) == 2 * len(rows) and all(len(v) == 1 for v in by_config.values())
    assert {s for v in by_config.values() for _, s in v} == {"train", "test"}  # both splits are used


def test_a_source_listed_twice_however_spelled_is_read_once(tmp_path, monkeypatch):
    """The same table given as a relative path, an absolute one and through a `..`: its runs are ingested once, and
    no spelling of it is rejected as a source ingest does not read (the other spellings were sent to the job
    directory search, which called the table 'not a source ingest reads')."""
    rows = [{"pipeline_model_parallel_size": p, "iteration_time_ms": ms} for p, ms in ((2, 270.1), (4, 160.2))]
    (tmp_path / "sub").mkdir()
    _sweep(rows).to_csv(tmp_path / "sweep.csv", index=False)
    monkeypatch.chdir(tmp_path)
    report = ingest(["sweep.csv", tmp_path / "sweep.csv", "sub/../sweep.csv"], FixtureStore(tmp_path / "fx"))
    assert report.ok, [o.error for o in report.rejected]
    assert sorted(o.status for o in report.outcomes) == ["new", "new"]


def test_ingest_says_each_runs_split_and_whether_it_is_priced(tmp_path):
    from tests.trace.test_iteration_level import _allreduce_tables

    _allreduce_tables(tmp_path / "calibration" / "allreduce")  # the node's collective benchmark, beside the table
    path = tmp_path / "mine.csv"
    _sweep([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 520.3},
            {"pipeline_model_parallel_size": 4, "multi_latent_attention": True, "iteration_time_ms": 300.0}]
           ).to_csv(path, index=False)
    result = _cli("ingest", path, "--fixtures", tmp_path / "fx", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    runs = {r["run_id"]: r for r in data["runs"]}
    assert all(r["split"] in ("train", "test") and r["kind"] == "iteration" for r in runs.values())
    local = next(r for i, r in runs.items() if "_t1p2" in i)
    latent = next(r for i, r in runs.items() if "_t1p4" in i)
    assert local["priced"] is True and local["not_priced"] is None
    assert latent["priced"] is False and "--multi-latent-attention" in latent["not_priced"]
    notes = "\n".join(data["notes"])
    assert "priced by the cost model: 1 of the 2" in notes
    assert ("--split train" in notes) == any(r["split"] == "test" for r in runs.values())
    text = _cli("ingest", path, "--fixtures", tmp_path / "fx2").stdout
    for run_id, run in runs.items():
        assert run_id in text.split(f"to {run['split']}: ")[1].splitlines()[0]
    assert "not priced (1): --multi-latent-attention" in text


def test_throughput_is_labelled_and_samples_per_second_derived(tmp_path):
    path = tmp_path / "sweep.csv"
    _sweep([{"pipeline_model_parallel_size": 2, "micro_batch_size": 1, "global_batch_size": 16,
             "iteration_time_ms": 270.0},
            {"pipeline_model_parallel_size": 2, "micro_batch_size": 8, "global_batch_size": 16,
             "iteration_time_ms": 240.0}]).to_csv(path, index=False)
    assert ingest([path], FixtureStore(tmp_path / "fx"), split="train").ok
    listed = json.loads(_cli("fixtures", "list", "--fixtures", tmp_path / "fx", "--json").stdout)["fixtures"]
    for row in listed:
        # samples/s is the global batch over the iteration time: what a log's own 'samples per second' counts
        batch, time_ms = row["configuration"]["global_batch_size"], row["iteration_time_ms"]
        assert row["samples_per_s"] == pytest.approx(batch / (time_ms / 1e3))
    text = _cli("fixtures", "list", "--fixtures", tmp_path / "fx").stdout
    assert "samples/s" in text and "microbatches of one pipeline per second" in text
    shown = _cli("fixtures", "show", listed[0]["id"], "--fixtures", tmp_path / "fx").stdout
    assert "samples/s" in shown and "one measured value" in shown


def test_observe_on_runs_without_events_says_so_plainly(tmp_path):
    from tests.trace.test_iteration_level import _allreduce_tables

    _allreduce_tables(tmp_path / "calibration" / "allreduce")
    path = tmp_path / "sweep.csv"
    _sweep([{"pipeline_model_parallel_size": p, "global_batch_size": gb, "iteration_time_ms": ms}
            for p, gb, ms in ((2, 16, 270.1), (2, 32, 520.3), (4, 16, 160.2), (4, 32, 290.7))]).to_csv(path, index=False)
    assert ingest([path], FixtureStore(tmp_path / "fx"), split="train").ok
    result = _cli("observe", "--fixtures", tmp_path / "fx")
    assert result.exit_code == 0, result.output
    # no measured part or stage: the contributors are the terms of the predicted iteration (observe_iteration)
    assert "No run has events" in result.stdout and "Largest contributors (a term within one group)" in result.stdout
    assert "Findings:" in result.stdout and "fitted to the iteration residuals" in result.stdout
    assert "Runs by |throughput error| (4 of 4)" in result.stdout
