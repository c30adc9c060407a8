"""What the public A100 runs need priced: the collective benchmark, p2p by the ring formula, recomputation, fp16.

The all-reduce tables are the published ones (../shared/public-runs/vtrain/allreduce-a100/, read in place).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.model import gpt
from hops_calib.loop.model_files import load_catalog
from hops_calib.model import parse_model
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError
from hops_calib.trace.collective_bench import read_allreduce_table, read_collective_tables, ring_link


def _bus_bandwidth_column(path: Path) -> dict[float, float]:
    """size -> the file's own in-place busbw (GB/s), the last column nccl-tests prints."""
    lines = path.read_text().splitlines()[1:]
    return {float(line.split(",")[0]): float(line.split(",")[6]) for line in lines if line.strip()}


def test_tables_are_read_by_gpu_count_and_their_in_place_times_give_the_printed_bus_bandwidth(allreduce_dir):
    tables = read_collective_tables(allreduce_dir)
    assert [t.gpus for t in tables] == list(range(2, 9))
    for table in tables:
        printed = _bus_bandwidth_column(next(allreduce_dir.glob(f"AR_GPU{table.gpus}_*")))
        assert len(table.points) == len(printed) > 100
        for size, ms in table.points[::97]:
            # nccl-tests: busbw = size / time x 2(n - 1)/n
            bus = size / (ms * 1e-3) * 2 * (table.gpus - 1) / table.gpus / 1e9
            assert bus == pytest.approx(printed[size], rel=0.01, abs=0.01)


def test_ring_formula_gives_one_links_send_time_and_the_tables_agree_on_the_link(allreduce_dir):
    tables = {t.gpus: t for t in read_collective_tables(allreduce_dir)}
    pair = ring_link(tables[2], 0, 1)
    assert pair.intra_node and "ring formula" in pair.source
    size = 2.0**30
    # two GPUs: each sends its half twice (reduce-scatter, all-gather), the whole buffer: the all-reduce's time
    assert pair.measured_ms(size) == pytest.approx(tables[2].measured_ms(size))
    # eight GPUs move 2 x 7/8 of the buffer over each link: the link they imply is within 20 % of the pair's
    eight = ring_link(tables[8], 0, 1)
    assert eight.measured_ms(size) == pytest.approx(pair.measured_ms(size), rel=0.2)
    assert eight.measured_ms(size) < tables[8].measured_ms(size)


def test_beyond_a_tables_largest_size_the_time_grows_at_its_last_doublings_rate(allreduce_dir):
    """A data-parallel all-reduce of a model's gradients without buckets (vTrain: 1.2-2.4 GB) is larger than the
    tables' 1 GiB. Beyond it the time grows at the rate of the table's last doubling (512 MiB to 1 GiB), read from
    the table itself: not at its last MiB's, whose two medians differ by their noise (18 us on 4 GPUs, a 58 GB/s
    "rate" where the table runs at 150)."""
    from hops_calib.trace.link_bench import interpolate_ms

    tables = {t.gpus: t for t in read_collective_tables(allreduce_dir)}
    for gpus, table in tables.items():
        (big, big_ms) = table.points[-1]
        half, half_ms = max(p for p in table.points if p[0] <= big / 2)
        rate = (big_ms - half_ms) / (big - half)
        for nbytes in (1.2e9, 2.4e9, 8 * big):
            assert table.measured_ms(nbytes) == pytest.approx(big_ms + rate * (nbytes - big))
        # bandwidth-bound: twice the largest size takes about twice its time (within the latency the doubling drops)
        assert table.measured_ms(2 * big) == pytest.approx(2 * big_ms, rel=0.05)
    # so more GPUs in a node's ring never reduce the same large buffer faster, as within the tables
    for nbytes in (2.0**29, 2.4e9, 4.8e9):
        times = [tables[g].measured_ms(nbytes) for g in sorted(tables)]
        assert times == sorted(times)
    # a closed form: a noisy last segment does not set the slope; a table of two points extrapolates along them
    noisy = ((1.0, 1.0), (512.0, 512.0), (1023.0, 1023.0), (1024.0, 1030.0))
    assert interpolate_ms(noisy, 2048.0) == pytest.approx(1030.0 + (1030.0 - 512.0) / 512.0 * 1024.0)
    assert interpolate_ms(((10.0, 2.0), (20.0, 3.0)), 40.0) == pytest.approx(5.0)


@pytest.mark.parametrize("edit,line,field", [
    (lambda lines: lines.__setitem__(3, lines[3].replace(lines[3].split(",")[5], "fast")), 4, "time(ns) (in-place)"),
    (lambda lines: lines.__setitem__(0, "size,count"), 1, "header"),
    (lambda lines: lines.__setitem__(2, "1,2,3"), 3, None),
])
def test_a_damaged_table_is_refused_naming_file_line_and_column(allreduce_dir, tmp_path, edit, line, field):
    lines = next(allreduce_dir.glob("AR_GPU4_*")).read_text().splitlines()
    edit(lines)
    path = tmp_path / "AR_GPU4_edited"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as caught:
        read_allreduce_table(path)
    message = str(caught.value)
    assert f"{path}:{line}:" in message and (field is None or field in message)


def _row(pp=4, layers=24, hidden=2048, micro=2, global_batch=16, **more):
    """A vTrain-like pure-pipeline launch: fp16, GPT-2 vocabulary padded to 128, sequence 1024, 16 heads."""
    return {"pipeline_model_parallel_size": pp, "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": 16, "seq_length": 1024, "max_position_embeddings": 1024,
            "micro_batch_size": micro, "global_batch_size": global_batch, "padded_vocab_size": 50304, "fp16": True,
            "transformer_impl": "local", "masked_softmax_fusion": False, "attention_dropout": 0.0, **more}


def _spec(args, tables=()):
    return spec_from_args(args, "runs.csv", run_id="row", iterations=3, hardware=Hardware(gpu="a100", gpus_per_node=8),
                          collectives=tables)


ROOFLINE = parse_model("""
[model]
name = "layers"
[terms.decoder_roofline]
[terms.attention_score_traffic]
[terms.layer_launch_floor]
forward_ms_per_layer = 0.0
backward_ms_per_layer = 0.0
""", origin="test", catalog=load_catalog())


def test_full_recomputation_redoes_each_covered_layers_forward_in_its_backward():
    plain = ROOFLINE.pipeline(_spec(_row()))
    full = ROOFLINE.pipeline(_spec(_row(recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=2)))
    older = ROOFLINE.pipeline(_spec(_row(checkpoint_activations=True)))
    block = ROOFLINE.pipeline(_spec(_row(recompute_granularity="full", recompute_method="block",
                                         recompute_num_layers=2)))
    for before, after, old, some in zip(plain.stages, full.stages, older.stages, block.stages):
        assert after.forward_ms == before.forward_ms
        assert after.backward_ms == pytest.approx(before.backward_ms + before.forward_ms)
        assert old.backward_ms == pytest.approx(after.backward_ms)  # --checkpoint-activations is full, uniform
        assert some.backward_ms == pytest.approx(before.backward_ms + before.forward_ms * 2 / 6)  # 2 of 6 layers
        assert after.weight_grad_ms == before.weight_grad_ms  # the recomputed forward is input-gradient work


def test_selective_recomputation_redoes_only_the_attention_core():
    args = _row()
    plain, selective = (ROOFLINE.pipeline(_spec(a)) for a in (args, {**args, "recompute_activations": True}))
    spec = _spec(args)
    device = load_catalog()["a100"]
    core_flops_ms = gpt.attention_core_flops(spec.model) / (device.peak_bf16_flops_per_s * 0.5 / 1e3)
    score_ms = 6.0 * spec.model.micro_batch_size * 16 * 1024**2 * 2 / device.memory_bandwidth_bytes_per_s * 1e3
    for before, after in zip(plain.stages, selective.stages):
        assert after.backward_ms - before.backward_ms == pytest.approx(6 * (core_flops_ms + score_ms))
        assert 0 < after.backward_ms - before.backward_ms < before.forward_ms / 3


def test_fused_softmax_and_attention_dropout_change_the_passes_over_the_scores():
    from hops_calib.model.terms import TERMS
    from hops_calib.model.terms.base import Context, layout_of

    term = TERMS["attention_score_traffic"]
    params = term.defaults()

    def forward_backward(**changes):
        spec = _spec(_row(**changes))
        context = Context(spec=spec, layout=layout_of(spec), devices=(load_catalog()["a100"],) * spec.pp)
        part = term.contribute(context, params)
        return part.forward_ms[0], part.backward_ms[0]

    unfused = forward_backward()
    fused = forward_backward(masked_softmax_fusion=True)
    dropped = forward_backward(masked_softmax_fusion=True, attention_dropout=0.1)
    megatron_default = forward_backward(masked_softmax_fusion=None, attention_dropout=None)
    pass_ms = unfused[0] / params["passes_forward"]
    assert fused == pytest.approx((4 * pass_ms, 7 * pass_ms))
    assert dropped == pytest.approx((6.5 * pass_ms, 9.5 * pass_ms))
    assert megatron_default == pytest.approx(dropped)  # Megatron fuses the softmax and drops 10 % by default
    fp32 = forward_backward(masked_softmax_fusion=True, fp16=False)  # the fused kernel takes 16-bit inputs only
    assert fp32[0] == pytest.approx(2 * unfused[0])  # 4-byte elements, unfused passes


def test_the_fused_softmax_needs_attention_batches_per_tensor_parallel_partition_in_whole_blocks():
    """Megatron's is_kernel_available counts b x np with np the heads of ONE tensor-parallel partition: 16 heads at
    t = 8 leave 2 per GPU, so micro batch 1 (2 attention batches) falls back to the unfused softmax, micro batch 2
    (4) fuses; at 128 keys or fewer a block takes 8 rows, so 4 attention batches no longer suffice."""
    from hops_calib.model.terms.attention import softmax_fused

    def fused(**changes):
        args = _row(pp=1, micro=changes.pop("micro", 1), masked_softmax_fusion=True, **changes)
        return softmax_fused(_spec({**args, "world_size": args.get("tensor_model_parallel_size", 1)}))

    assert fused() and fused(tensor_model_parallel_size=4)  # 16 and 4 heads per GPU
    assert not fused(tensor_model_parallel_size=8)  # 2 heads x micro batch 1
    assert fused(tensor_model_parallel_size=8, micro=2)  # 2 x 2
    assert not fused(num_attention_heads=4, seq_length=128, max_position_embeddings=128)  # 4 rows, 8 per block
    assert fused(num_attention_heads=8, seq_length=128, max_position_embeddings=128)


def test_the_unfused_fallback_raises_the_launch_floor_only_where_the_fused_kernel_was_asked_for_and_missed():
    from hops_calib.model.terms import TERMS
    from hops_calib.model.terms.base import Context, layout_of

    term = TERMS["attention_score_traffic"]
    params = {**term.defaults(), "fallback_host_ms": 0.4}

    def floors(**changes):
        args = _row(pp=1, micro=1, layers=12, tensor_model_parallel_size=8, world_size=8, **changes)
        spec = _spec(args)
        part = term.contribute(Context(spec=spec, layout=layout_of(spec), devices=(load_catalog()["a100"],)),
                               params)
        return part.forward_floor_ms, part.backward_floor_ms

    assert floors(masked_softmax_fusion=True) == (pytest.approx((12 * 0.4,)), pytest.approx((12 * 0.4,)))
    assert floors(masked_softmax_fusion=True, micro_batch_size=2) == ((), ())  # 2 heads x 2: the kernel fits
    assert floors(masked_softmax_fusion=False) == ((), ())  # unfused by choice: calibrated with those ops
    assert floors(masked_softmax_fusion=True, fp16=False) == ((), ())  # fp32: the kernel was never eligible


@pytest.mark.parametrize("args,field", [
    ({"recompute_granularity": "full"}, "--recompute-method"),
    ({"recompute_granularity": "full", "recompute_method": "block"}, "--recompute-num-layers"),
    ({"recompute_granularity": "selective", "recompute_method": "uniform"}, "--recompute-method"),
    ({"recompute_granularity": "some"}, "--recompute-granularity"),
])
def test_a_recomputation_megatron_refuses_is_refused_by_flag(args, field):
    with pytest.raises(TraceError, match=field):
        _spec(_row(**args))


def test_hops_within_a_node_and_the_embedding_all_reduce_are_priced_from_the_nodes_tables(allreduce_dir):
    tables = read_collective_tables(allreduce_dir)
    spec = _spec(_row(pp=4), tables)
    assert [(f.src_stage, f.dst_stage) for f in spec.links] == [(0, 1), (1, 2), (2, 3)]
    assert all(f.intra_node for f in spec.links)
    model = parse_model("""
[model]
name = "hops"
[terms.link_transfer]
measured_weight = 1.0
burst_mib = 2.5
[terms.embedding_grad_allreduce]
flow_cap_gbit_s = 20.9
""", origin="test", catalog=load_catalog())
    pipeline = model.pipeline(spec)
    hidden_bytes = 1024 * 2 * 2048 * 2  # s x b x h fp16
    assert pipeline.forward_transfer_ms == pytest.approx([tables[0].measured_ms(hidden_bytes)] * 3)
    # fp16 gradient buffers (no fp32 accumulation under --fp16), over NVLink at the 2-GPU table's time
    assert pipeline.pre_optimizer_ms == pytest.approx(tables[0].measured_ms(50304 * 2048 * 2))
    assert pipeline.stall_probability == 0
    # nodes of 2 GPUs: stages 1 and 2 sit on different nodes, a hop no benchmark measured
    apart = spec_from_args(_row(pp=4), "runs.csv", run_id="row", iterations=3,
                           hardware=Hardware(gpu="a100", gpus_per_node=2), collectives=tables)
    assert [(f.src_stage, f.dst_stage) for f in apart.links] == [(0, 1), (2, 3)]


@pytest.fixture(scope="module")
def vtrain_store(allreduce_dir, tmp_path_factory):
    """The published vTrain table's 160 pure-pipeline rows (t = d = 1) ingested once, with the publishers'
    all-reduce tables beside them (a link to allreduce-a100/): the runs whose layers the launch floors bound."""
    import pandas as pd

    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    root = tmp_path_factory.mktemp("vtrain")
    table = pd.read_csv(allreduce_dir.parent / "ground_truth_single.csv")
    pure = table[(table["tensor parallelism"] == 1) & (table["data parallelism"] == 1)]
    assert len(pure) == 160
    pure.to_csv(root / "ground_truth_single.csv", index=False)
    (root / allreduce_dir.name).symlink_to(allreduce_dir)
    store = FixtureStore(root / "fixtures")
    assert ingest([root / "ground_truth_single.csv"], store, split="auto").ok
    return store.root


def test_tune_on_runs_measured_at_iteration_level_minimizes_the_throughput_mape_alone(vtrain_store, tmp_path):
    from hops_calib.loop.candidate import read_candidate
    from hops_calib.cli.render.research import tune_text
    from hops_calib.research.tune import tune

    from conftest import PLAIN_MODEL_TOML

    # The plain model (GEMMs at half of peak, nothing else) misprices the A100 runs: other efficiencies do better.
    model_path = tmp_path / "plain.toml"
    model_path.write_text(PLAIN_MODEL_TOML)
    out = tmp_path / "roofline.toml"
    only = ("compute_efficiency@a100",)
    # a ledger of its own: the plain model has no calibration record (the project's ledger records the A100
    # values on the whole vTrain store, and would refuse this pure-pipeline subset as off the record)
    result = tune("decoder_roofline", vtrain_store, model_path=model_path, trials=6, seed=1, out=out, only=only,
                  ledger_path=tmp_path / "ledger.jsonl")
    assert result.objectives == ("throughput_mape_pct",) and result.current.bubble_mae_pp is None
    mapes = [p.score["throughput_mape_pct"] for p in result.front]
    assert mapes == sorted(mapes) and mapes[0] < result.current.throughput_mape_pct
    assert "n/a" in tune_text(result)
    if result.chosen is None:  # the gate refused every better point (a run's error grew): it says why
        assert result.verdict is not None and not result.verdict.accepted and not out.exists()
        return
    candidate = read_candidate(out)  # the placeholder texts are refused by evaluate, not by the reader
    assert set(candidate.change.params) == set(only) and "bubble_mae_pp" not in out.read_text()


def test_terms_lists_the_optional_nvlink_constant_and_a_candidate_may_correct_it(tmp_path):
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app
    from hops_calib.loop.candidate import read_candidate

    shown = CliRunner().invoke(app, ["terms", "--json"])
    assert shown.exit_code == 0, shown.output
    devices = {d["type"]: d for d in json.loads(shown.stdout)["devices"]}
    assert devices["a100"]["intra_node_bandwidth_bytes_per_s"]["value"] == 300e9
    assert "intra_node_bandwidth_bytes_per_s" not in devices["h100"]
    path = tmp_path / "nvlink.toml"
    path.write_text('id = "nvlink"\nhypothesis = "h"\ngrounding = "g"\n[change]\naction = "set_device"\n'
                    'device = "a100"\nconstant = "intra_node_bandwidth_bytes_per_s"\nvalue = 2.5e11\n'
                    'source = "a measured figure"\n')
    assert read_candidate(path).change.constant == "intra_node_bandwidth_bytes_per_s"


def test_device_only_changes_calibrate_their_device_types_and_not_the_shared_values():
    """The project's ledger holds the cluster campaign, then the A100 move (NAME@a100 values only, judged on the
    vTrain runs, committed whole by a compare written before compares recorded their scope), then the TP/DP terms on
    all three stores: the shared values and the whole model stay calibrated on the cluster runs, the A100's values on
    the vTrain runs."""
    from hops_calib.loop import calibration
    from hops_calib.loop.model_files import DEFAULT_MODEL, load_model

    record = calibration.read_record(Path(__file__).resolve().parents[2] / "ledger" / "ledger.jsonl")
    cluster = ("a10g", "h100", "l4")
    for scope in (calibration.Scope(term="elementwise_traffic"), calibration.Scope(whole_model=True),
                  calibration.Scope(term="decoder_roofline"), calibration.Scope(devices=("l4",))):
        # (judged since on several stores at once, e.g. cpu-11 on the CPU, cluster, vTrain and dgxc stores: the
        # cluster runs' set is one of them, never the A100's alone)
        sets, _ = record.calibrated_sets(scope)
        assert cluster in [fixture_set.devices for fixture_set in sets], scope
        assert ("a100",) not in [fixture_set.devices for fixture_set in sets] or len(sets) > 1, scope
    a100, why = record.calibrated_on(calibration.Scope(devices=("a100",)))
    # since the data- and tensor-parallel terms were committed on every vTrain train run (entries 146 and 148),
    # the A100's values stand on those 982 runs, no longer on the 111 pure-pipeline ones of the A100 move; since
    # the table is read without recomputation (session 19), on the 982 runs as re-read (entry 196, a100-12)
    assert a100.devices == ("a100",) and a100.n_runs == 982 and 196 in a100.entries
    move = [e for e in record.changes if e.get("kind") == "compare" and "a100" in calibration._named(e)[1]]
    # the A100 move 02-05's compare (entry 130) predates recorded scopes: inferred from the steps it judged whole;
    # the later move 07-09's compare records its scope, the A100 alone
    assert move and "scope_devices" not in move[0] and move[0]["seq"] == 130
    assert move[-1]["seq"] > 130 and move[-1].get("scope_devices") == ["a100"]
    # a whole-model comparison is scoped by what differs: the A100's values alone, or something shared
    model = load_model(DEFAULT_MODEL)
    roofline = model.active("decoder_roofline")
    from hops_calib.model import resolve_params

    def with_values(values):
        return model.with_term(resolve_params("decoder_roofline", values, origin="test", base=roofline.params()))

    assert calibration.scope_of_models(model, with_values({"compute_efficiency@a100": 0.7})).devices == ("a100",)
    assert calibration.scope_of_models(model, with_values({"compute_efficiency": 0.45})).whole_model


def _a100_job(row_args: dict, into: Path, allreduce_dir: Path) -> Path:
    """A job directory launching a vTrain row's configuration on one node's A100s (`node:` named), its
    calibration/allreduce/ the published tables (linked in place): no link benchmark."""
    into.mkdir()
    flags = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
             "num_attention_heads", "seq_length", "max_position_embeddings", "micro_batch_size", "global_batch_size",
             "vocab_size", "recompute_granularity", "recompute_method", "recompute_num_layers", "transformer_impl")
    line = " ".join(f"--{name.replace('_', '-')} {row_args[name]}" for name in flags)
    (into / "megatron_args.txt").write_text(f"pretrain_gpt.py {line} --fp16 --train-iters 20\n")
    ids = [f"a100_node0_gpu{k}" for k in range(row_args["pipeline_model_parallel_size"])]
    (into / "hops_trace_map.json").write_text('{"stages": {%s}}' % ", ".join(f'"{k}": "{d}"' for k, d in
                                                                           enumerate(ids)))
    (into / "hops.base.yaml").write_text("hardware:\n  devices:\n" + "".join(
        f"    - {{id: {d}, gpu: a100, node: dgx0}}\n" for d in ids))
    (into / "calibration").mkdir()
    (into / "calibration" / "allreduce").symlink_to(allreduce_dir, target_is_directory=True)
    return into


def test_a_what_if_on_an_a100_job_is_priced_as_its_iteration_level_run_and_planned(vtrain_store, allreduce_dir,
                                                                                 tmp_path):
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app
    from hops_calib.loop.model_files import load_model
    from hops_calib.model.predict import predict
    from hops_calib.store import FixtureStore
    from hops_calib.whatif.job import what_if

    store = FixtureStore(vtrain_store)
    index = store.index()
    row = index[(index.split == "train") & (index.tp == 1) & (index.dp == 1) & (index.pp == 2)].iloc[-1]
    fixture = store.load(row.id)
    job = _a100_job(fixture.spec.megatron_args, tmp_path / "a100job", allreduce_dir)
    model = load_model()

    result = what_if(job, model)
    # the hop within the node and the tied-embedding all-reduce between its ends, from the node's tables: the
    # job directory is priced as the run table's row of the same launch is
    assert [hop.link.intra_node for hop in result.hops] == [True] and result.spec.same_node(0, 1)
    assert result.hops[0].src_host == result.hops[0].dst_host == "dgx0"
    assert result.predictions[0].metrics.iteration_time_ms == pytest.approx(
        predict(fixture.spec, model).metrics.iteration_time_ms, rel=1e-9)

    out = CliRunner().invoke(app, ["plan", "--job", str(job), "--top", "2", "--keep-order", "--json",
                                   "--fixtures", str(vtrain_store)])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["status"] == "ok" and len(plan["best"]) == 2
    assert plan["current"]["iteration_time_ms"] == pytest.approx(result.predictions[0].metrics.iteration_time_ms,
                                                                 rel=1e-9)
    assert all(max(b["peak_memory_bytes_per_gpu"]) <= min(b["memory_bytes_per_gpu"]) for b in plan["best"])
    # no launch fits in 1 GB: no candidate, exit 1, as every verb's rejection
    out = CliRunner().invoke(app, ["plan", "--job", str(job), "--keep-order", "--device-memory", "a100:1e9",
                                   "--json", "--fixtures", str(vtrain_store)])
    assert out.exit_code == 1 and json.loads(out.stdout)["status"] == "no_candidate" and not json.loads(
        out.stdout)["best"]


def test_recomputed_layers_store_only_their_input_and_selective_recomputation_no_attention_core():
    from dataclasses import replace

    from hops_calib.model.memory import rank_memory_bytes
    from hops_calib.spec import ModelShape

    shape = ModelShape(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                       seq_length=2048, vocab_size=50304, micro_batch_size=2, global_batch_size=16)

    def per_microbatch(s: ModelShape) -> float:  # one more microbatch in flight on a middle rank of 4 layers
        return rank_memory_bytes(s, 4, 1, 4, 3) - rank_memory_bytes(s, 4, 1, 4, 2)

    assert per_microbatch(shape) == pytest.approx(4 * gpt.layer_activation_bytes(shape))
    full = replace(shape, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert per_microbatch(full) == pytest.approx(4 * gpt.boundary_activation_bytes(full))
    block = replace(full, recompute_method="block", recompute_num_layers=3)
    assert per_microbatch(block) == pytest.approx(3 * gpt.boundary_activation_bytes(block)
                                                  + gpt.layer_activation_bytes(block))
    selective = replace(shape, recompute_granularity="selective")
    a, s, b = shape.num_attention_heads, shape.seq_length, shape.micro_batch_size
    assert per_microbatch(selective) == pytest.approx(4 * (gpt.layer_activation_bytes(shape) - 5 * a * s * s * b))


def test_a_measured_run_across_nodes_prices_its_hops_over_the_nics(allreduce_dir):
    """A log's or table's run on nodes of 8 A100s whose pipeline crosses nodes (t 8: each stage a node) has no
    link benchmark: its hops are priced over the sending GPU's share of its node's NICs, as the model's link term
    does (it was refused); a hop inside a node without the node's tables is still refused."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.store.measured_spec import measured_spec

    tables = read_collective_tables(allreduce_dir)
    args = _row(pp=4, micro=1, tensor_model_parallel_size=8, world_size=32)
    spec = measured_spec("row", args, {"gpu": "a100", "gpus_per_node": 8}, collectives=tables)
    assert [spec.same_node(k, k + 1) for k in range(3)] == [False, False, False]
    hop = load_model().active("link_transfer")
    part = hop.term.contribute(load_model().context(spec), hop.params())
    nic = load_catalog()["a100"].network_bandwidth_bytes_per_s / 1e3
    assert part.forward_transfer_ms == pytest.approx((gpt.boundary_activation_bytes(spec.model) / nic,) * 3)
    # two stages on one node (t 4), no tables: nothing measured prices the NVLink hop
    with pytest.raises(ValueError, match="no collective benchmark of the node"):
        measured_spec("row", _row(pp=2, micro=1, tensor_model_parallel_size=4, world_size=8),
                      {"gpu": "a100", "gpus_per_node": 8})


def test_predict_of_an_iteration_level_run_gives_the_same_samples_per_s_in_text_and_json(vtrain_store):
    """`predict ID` of a table's run: the JSON's samples/s are the text's row, both from the throughputs its
    throughput row compares (x micro batch x data parallel)."""
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app
    from hops_calib.store import FixtureStore

    index = FixtureStore(vtrain_store).index()
    for _, row in index[(index.split == "train") & (index.micro_batch_size > 1)].head(3).iterrows():
        run = CliRunner().invoke(app, ["predict", row.id, "--fixtures", str(vtrain_store), "--json"])
        assert run.exit_code == 0, run.output
        data = json.loads(run.output)
        errors, samples = data["errors"], data["samples_per_s"]
        assert samples["predicted"] == pytest.approx(errors["predicted_throughput_per_s"] * row.micro_batch_size)
        assert samples["real"] == pytest.approx(errors["real_throughput_per_s"] * row.micro_batch_size)
        text = CliRunner().invoke(app, ["predict", row.id, "--fixtures", str(vtrain_store)]).output
        [line] = [line for line in text.splitlines() if line.startswith("samples /s")]
        assert line.split()[2:4] == [f"{samples['real']:.2f}", f"{samples['predicted']:.2f}"]
