"""The published dgxc-benchmarking DGX H100 runs (../shared/public-runs/dgxc-h100/) ingested through their mapping."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
from conftest import need_public_runs

from hops_calib.store.fixture_store import FixtureStore
from hops_calib.store.ingest import ingest
from hops_calib.trace.dgxc import read_dgxc_table
from hops_calib.trace.errors import TraceError


@pytest.fixture(scope="module")
def dgxc_dir():
    return need_public_runs("dgxc-h100")


def _published(folder):
    with (folder / "runs.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_every_row_reads_as_published(dgxc_dir):
    read = read_dgxc_table(dgxc_dir / "runs.csv")
    rows = _published(dgxc_dir)
    assert not read.errors and len(read.runs) == len(rows) == 68
    by_id = {run.run_id: run for run in read.runs}
    for row in rows:
        run = by_id[f"dgxc_h100_{row['model']}_{row['precision']}_g{row['gpus']}"]
        args = run.args
        assert run.iteration_times_ms == (pytest.approx(float(row["step_time_s"]) * 1e3),)
        assert args["world_size"] == int(row["gpus"]) and run.hardware.gpu == "h100_dgx"
        assert run.hardware.gpus_per_node == 8
        for column, name in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                             ("cp", "context_parallel_size"), ("dp", "data_parallel_size"),
                             ("mbs", "micro_batch_size"), ("gbs", "global_batch_size"), ("num_layers", "num_layers"),
                             ("seq_length", "seq_length")):
            assert args[name] == int(row[column]), (run.run_id, column)
        assert (args.get("fp8_format") is not None) == (row["precision"] == "fp8") and args["bf16"]
        # the printed throughput is kept as the row's own samples/s
        assert run.reported["samples_per_s"] == pytest.approx(float(row["tokens_per_s_reported"])
                                                              / int(row["seq_length"]))
        # each weak-scaling sweep (model, precision) is one group
        assert run.group == f"dgxc_h100_{row['model']}_{row['precision']}"
    # the architecture from models.csv: GQA, SwiGLU and RoPE for Llama, MHA, GeLU, learned positions for GPT-3
    llama, gpt = by_id["dgxc_h100_llama3.1-70b_bf16_g64"].args, by_id["dgxc_h100_gpt3-175b_bf16_g128"].args
    assert llama["swiglu"] and llama["num_query_groups"] == 8 and llama["position_embedding_type"] == "rope"
    assert llama["normalization"] == "RMSNorm" and llama["untie_embeddings_and_output_weights"]
    assert not gpt.get("swiglu") and "num_query_groups" not in gpt and gpt["hidden_size"] == 12288
    assert gpt["padded_vocab_size"] == 51200 and not gpt["untie_embeddings_and_output_weights"]
    # settings.csv: stated where it states them; the launch file's VP where the README table prints NA
    assert gpt["tp_comm_overlap"] and gpt["overlap_p2p_comm"] and gpt["attention_dropout"] == 0.1
    assert not by_id["dgxc_h100_llama3.1-8b_bf16_g8"].args["tp_comm_overlap"]
    assert by_id["dgxc_h100_nemotron4-340b_bf16_g256"].args["virtual_pipeline_model_parallel_size"] == 12
    # settings.csv's fp8_recipe says grad_reduce_in_fp32 = False for the Llama 3.1 FP8 runs (NeMo's
    # bf16_with_fp8_mixed): their gradients are kept and reduced in bf16; no other row's are
    for run in read.runs:
        stated = "llama3.1" in run.run_id and "_fp8_" in run.run_id
        assert bool(run.args.get("grad_reduce_in_bf16")) == stated, run.run_id
    # the 405B rows and its pipelined proxies (126, 62, 30 layers over pp x vp 64, 32, 32: uneven, not stated) count
    # the embedding and the loss as a layer each; no other row does, nor the 8-layer proxy on one stage
    flags = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    for run in read.runs:
        counted = "405b" in run.run_id and run.args["pipeline_model_parallel_size"] > 1
        assert all(bool(run.args.get(flag)) == counted for flag in flags), run.run_id


def test_ingest_stores_every_row_and_names_what_the_model_does_not_price(dgxc_dir, tmp_path):
    store = FixtureStore(tmp_path / "fx")
    report = ingest([dgxc_dir], store, split="auto")  # the folder: its runs.csv with models.csv and settings.csv
    assert report.ok and report.count("new") == 68
    index = store.index()
    assert len(index) == 68 and set(index["kind"]) == {"iteration"}
    # a sweep never straddles the split
    assert index.groupby("group")["split"].nunique().max() == 1 and index["group"].nunique() == 14
    fixtures = {f.id: f for f in store.load_all("train")}
    reasons = {run_id: f.not_priced for run_id, f in fixtures.items()}
    # FP8, context parallelism, TP overlap, overlapped p2p and the 405B runs' split (the embedding and the loss
    # counted as a layer each) are priced: every train run
    assert not any(reasons.values()), reasons
    priced = list(reasons)
    assert any("_fp8_" in r for r in priced) and any("llama3.1-8b" in r for r in priced)  # FP8 and CP 2
    assert any("gpt3-175b" in r for r in priced)  # TP overlap and overlapped p2p with virtual stages
    # the 405B split as megatron-core's get_num_layers_to_build builds it with both account-for flags: each rank
    # holds (layers + 2) / pp pieces, vp chunks of equal pieces, the first chunk one decoder layer fewer (the
    # embedding), the last one fewer (the loss)
    for run_id, fixture in fixtures.items():
        if "405b" not in run_id or fixture.spec.pp == 1:
            continue
        spec = fixture.spec
        chunk = (spec.model.num_layers + 2) // (spec.pp * spec.vp)
        assert (spec.model.num_layers + 2) % (spec.pp * spec.vp) == 0 and spec.vp == 8
        expected = [chunk] * (spec.pp * spec.vp)
        expected[0] -= 1
        expected[-1] -= 1
        assert list(spec.layers_per_virtual_stage) == expected, run_id
    # ingesting again changes nothing
    again = ingest([dgxc_dir / "runs.csv"], FixtureStore(store.root), split="auto")
    assert again.ok and again.count("unchanged") == 68


def test_a_setting_the_mapping_cannot_read_names_its_line(dgxc_dir, tmp_path):
    folder = tmp_path / "dgxc"
    shutil.copytree(dgxc_dir, folder)
    settings = folder / "settings.csv"
    lines = settings.read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("nemotron4-15b,tp_comm_overlap,"))
    lines[k] = "nemotron4-15b,tp_comm_overlap,sometimes,nemotron/gsw_nemo.patch"
    settings.write_text("\n".join(lines) + "\n")
    read = read_dgxc_table(folder / "runs.csv")
    bad = [err for err in read.errors if "sometimes" in str(err)]
    # each Nemotron-4 15B row is rejected naming settings.csv's line and the setting; the other rows are read
    assert len(bad) == 16 and f"settings.csv:{k + 1}" in str(bad[0]) and "tp_comm_overlap" in str(bad[0])
    assert len(read.runs) == 68 - 16
    (folder / "models.csv").unlink()
    with pytest.raises(TraceError, match="models.csv.*missing"):
        read_dgxc_table(folder / "runs.csv")


def test_fixtures_show_names_the_mapping(dgxc_dir, tmp_path):
    from typer.testing import CliRunner

    from hops_calib.cli import app

    store = FixtureStore(tmp_path / "fx")
    ingest([dgxc_dir / "runs.csv"], store)
    train = store.load_all("train")[0]
    shown = CliRunner().invoke(app, ["fixtures", "show", train.id, "--fixtures", str(store.root), "--json"])
    assert shown.exit_code == 0, shown.stdout
    data = json.loads(shown.stdout)
    assert data["mapping"].startswith("dgxc-benchmarking v25.04.02") and data["hardware"]["gpu"] == "h100_dgx"
    assert data["not_priced"] == train.not_priced and data["iteration_time_ms"] > 0
