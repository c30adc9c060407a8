"""Tensor x pipeline x data parallelism and modern layers (issue #19): the spec reads them, the counts and
collectives match their closed forms, the simulator places the gradient reduction, and `predict --job` prices a 3D
what-if on a copy of a shipped capture with its breakdown and memory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model, write_model
from hops_calib.model import gpt
from hops_calib.model.collectives import collective_ms
from hops_calib.model.memory import stage_memory
from hops_calib.model.model import resolve_params
from hops_calib.model.predict import predict
from hops_calib.model.terms.optimizer import rank_parameters
from hops_calib.sim.pipeline import Pipeline, StageCosts
from hops_calib.sim.simulate import simulate
from hops_calib.spec import Hardware, coordinates_of, global_rank, spec_from_args
from hops_calib.timeline import OPTIMIZER, PHASES
from hops_calib.trace import TraceError
from hops_calib.trace.collective_bench import CollectiveTable

REPO = Path(__file__).resolve().parents[2]
RUN = "cpu_1f1b_l4_h512_s256_m4_run1"
A100 = Hardware(gpu="a100", gpus_per_node=8)


def _launch(**changes):
    args = {"pipeline_model_parallel_size": 2, "num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16,
            "seq_length": 1024, "max_position_embeddings": 1024, "micro_batch_size": 2, "global_batch_size": 64,
            "vocab_size": 50257, "bf16": True, "transformer_impl": "local"}
    args.update(changes)
    return args


def _spec(hardware=A100, collectives=(), **changes):
    return spec_from_args(_launch(**changes), "launch.txt", run_id="r", iterations=3, hardware=hardware,
                          collectives=collectives)


def _model_3d():
    model = load_model()
    for name in ("tensor_parallel_comm", "data_parallel_grad_reduce"):
        model = model.with_term(resolve_params(name, {}, origin="test"))
    return model


# --- spec --------------------------------------------------------------------------------------------------------

def test_megatron_lm_and_megatron_deepspeed_spellings_give_the_same_layer():
    lm = _spec(tensor_model_parallel_size=2, world_size=8, sequence_parallel=True, swiglu=True,
               group_query_attention=True, num_query_groups=4, position_embedding_type="rope",
               normalization="RMSNorm", use_distributed_optimizer=True, overlap_grad_reduce=True,
               transformer_impl="local", use_flash_attn=True)
    ds = _spec(tensor_model_parallel_size=2, world_size=8, sequence_parallel=True, swiglu=True,
               num_key_value_heads=4, use_rotary_position_embeddings=True, normalization="rmsnorm",
               zero_stage=1, overlap_grad_reduce=True, transformer_impl="local", use_flash_attn_v2=True)
    assert lm.model == ds.model
    assert (lm.tp, lm.dp, lm.gpus) == (ds.tp, ds.dp, ds.gpus) == (2, 2, 8)
    assert lm.distributed_optimizer and ds.distributed_optimizer and lm.overlap_grad_reduce
    shape = lm.model
    assert (shape.swiglu, shape.kv_heads, shape.normalization, shape.position_embedding, shape.attention_kernel) == (
        True, 4, "RMSNorm", "rope", "flash")
    # Transformer Engine's layer runs its fused attention unless the backend says otherwise; sequence parallelism is
    # off at t = 1, as Megatron turns it off
    assert _spec(transformer_impl="transformer_engine").model.attention_kernel == "flash"
    assert _spec(transformer_impl="transformer_engine", attention_backend="unfused").model.attention_kernel == \
        "unfused"
    assert _spec(sequence_parallel=True).model.sequence_parallel is False
    # old specs stay byte-identical: the new fields are written only when set
    plain = _spec()
    assert "tensor_parallel" not in plain.to_json() and '"dp"' not in plain.to_json()
    assert type(lm).from_json(lm.to_json()) == lm


@pytest.mark.parametrize("changes,flag", [
    ({"context_parallel_size": 2, "world_size": 8}, "--context-parallel-size"),
    ({"ds_sequence_parallel_size": 2}, "--ds-sequence-parallel-size"),
    ({"num_experts": 8, "moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type"),
    ({"num_experts": 8, "moe_layer_freq": 2}, "--moe-layer-freq"),
    ({"num_experts": 8, "moe_layer_freq": "([1]*3+[0])*2"}, "--moe-layer-freq"),
    ({"num_experts": 8, "moe_shared_expert_overlap": True}, "--moe-shared-expert-overlap"),
    ({"num_experts": 8, "fp8_format": "hybrid", "transformer_impl": "transformer_engine"}, "--fp8-format"),
    ({"fp8_format": "hybrid", "transformer_impl": "local"}, "--fp8-format"),
    ({"fp8_format": "hybrid", "transformer_impl": "transformer_engine", "fp8_recipe": "mxfp8"}, "--fp8-recipe"),
    ({"fp8_format": "hybrid", "transformer_impl": "transformer_engine", "fp8_dot_product_attention": True}, "--fp8-dot-product-attention"),
    ({"fp8_format": "hybrid", "transformer_impl": "transformer_engine", "first_last_layers_bf16": True}, "--first-last-layers-bf16"),
    ({"zero_stage": 3}, "--zero-stage"),
    ({"tp_comm_overlap": True, "tensor_model_parallel_size": 2}, "--tp-comm-overlap"),
    ({"multi_latent_attention": True}, "--multi-latent-attention"),
])
def test_what_stays_refused_is_named_precisely(changes, flag):
    with pytest.raises(TraceError, match="does not model") as caught:
        _spec(**changes)
    assert caught.value.field == flag


@pytest.mark.parametrize("changes,flag,said", [
    ({"fp8_format": "hybrid"}, "--fp8-format", "--fp8-format hybrid"),
    ({"fp8_format": "e4m3", "fp8_recipe": "tensorwise"}, "--fp8-format", "--fp8-format e4m3"),
    ({"fp8_hybrid": True}, "--fp8-hybrid", "--fp8-hybrid (the model prices FP8 GEMMs"),
    ({"tp_comm_overlap": True, "tensor_model_parallel_size": 2, "sequence_parallel": True, "world_size": 8},
     "--tp-comm-overlap", "--tp-comm-overlap (the model prices --tp-comm-overlap with a dense MLP only"),
    ({"use_megatron_fsdp": True}, "--use-megatron-fsdp", "--use-megatron-fsdp (the model prices Megatron-FSDP"),
])
def test_experts_with_what_they_are_not_priced_with_are_refused_naming_both_flags(changes, flag, said):
    """A mixture of experts is priced, and FP8 (Transformer Engine's layer), --tp-comm-overlap (with SP) and
    Megatron-FSDP are on a dense MLP; together they are not: refused at the flag that joins the experts (the field a
    user edits), the sentence naming it and --num-experts. Without the experts the same launch is priced; the
    experts alone too."""
    moe = {"num_experts": 8, "transformer_impl": "transformer_engine"}
    with pytest.raises(TraceError, match="does not model") as caught:
        _spec(**moe, **changes)
    assert caught.value.field == flag
    assert said in str(caught.value) and "not with --num-experts" in str(caught.value)
    assert "--num-experts 8" not in str(caught.value)  # the experts alone are priced: not named as the cause
    _spec(transformer_impl="transformer_engine", **changes)
    _spec(**moe)


def test_sizes_tensor_parallelism_cannot_split_are_refused():
    with pytest.raises(TraceError, match="not divisible by --tensor-model-parallel-size 3"):
        _spec(tensor_model_parallel_size=3, world_size=6, num_attention_heads=16)
    with pytest.raises(TraceError, match="does not divide --num-attention-heads"):
        _spec(group_query_attention=True, num_query_groups=5)
    with pytest.raises(TraceError, match="3, but world size 8 / \\(tp 2 x pp 2\\) = 2"):
        _spec(tensor_model_parallel_size=2, world_size=8, data_parallel_size=3)


def test_rank_order_places_stages_and_groups_on_nodes_as_megatron_does():
    sizes = {"tp": 2, "dp": 4, "pp": 2}
    for order in ("tp-cp-ep-dp-pp", "tp-pp-dp"):
        ranks = [global_rank(order, {d: (c[d], sizes[d]) for d in sizes})
                 for c in (coordinates_of(r, order, sizes) for r in range(16))]
        assert ranks == list(range(16))  # one is the other's inverse, over every rank
    # Megatron's default: rank = tp + t * (dp + d * pp); stage 1 starts at rank t*d = 8, on the second node
    spec = _spec(tensor_model_parallel_size=2, world_size=16)
    assert spec.rank(1, 3, 1) == 1 + 2 * (3 + 4 * 1)
    assert spec.device_ids == ("node0_gpu0", "node1_gpu0") and spec.same_node(0, 1) is False
    assert spec.group_nodes("tp") == (1, 2) and spec.group_nodes("dp") == (1, 4)
    # tp-pp-dp: the pipeline's neighbours sit next to each other, the replicas a node apart
    spread = _spec(tensor_model_parallel_size=2, world_size=16, use_tp_pp_dp_mapping=True)
    assert spread.device_ids == ("node0_gpu0", "node0_gpu2") and spread.same_node(0, 1) is True
    assert spread.group_nodes("dp") == (2, 2)
    with pytest.raises(TraceError, match="--rank-order"):
        _spec(rank_order="tp-dp")


# --- counts (closed forms of Korthikanti et al. 2022 and Narayanan et al. 2021) ---------------------------------

@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_per_gpu_counts_split_as_the_papers_say(t):
    whole = _spec().model
    shape = _spec(tensor_model_parallel_size=t, world_size=2 * t).model
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    # activations sbh(10 + 24/t + 5as/(ht)); with sequence parallelism sbh(34/t + 5as/(ht))
    assert gpt.layer_activation_bytes(shape) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = _spec(tensor_model_parallel_size=t, world_size=2 * t, sequence_parallel=True).model
    assert gpt.layer_activation_bytes(sp) == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
    flash = _spec(tensor_model_parallel_size=t, world_size=2 * t, transformer_impl="transformer_engine").model
    assert gpt.layer_activation_bytes(flash) == pytest.approx(s * b * h * (10 + 24 / t))
    # FLOPs: the group's GPUs together do the layer's 24bsh^2 + 4bs^2h
    assert t * gpt.layer_forward_flops(shape) == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    # parameters: the group together holds the layer once, plus t - 1 more copies of what stays whole
    replicated = gpt.norm_parameters(shape) + 2 * h  # the norms, the row-parallel layers' biases
    assert t * gpt.layer_parameters(shape) == pytest.approx(gpt.layer_parameters(whole) + (t - 1) * replicated)


def test_swiglu_and_grouped_query_attention_counts():
    shape = _spec(swiglu=True, ffn_hidden_size=5632, group_query_attention=True, num_query_groups=4).model
    s, b, h, f = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.ffn_hidden_size
    qkv = h + 2 * h * 4 / 16  # queries + keys and values of 4 groups of 128
    assert gpt.layer_weight_grad_flops(shape) == pytest.approx(2 * b * s * h * (qkv + h) + 3 * 2 * b * s * h * f)
    rms = _spec(normalization="RMSNorm").model
    assert gpt.layer_parameters(_spec().model) - gpt.layer_parameters(rms) == 2 * h  # no norm biases


# --- collectives -------------------------------------------------------------------------------------------------

def test_collectives_from_the_nodes_table_else_the_ring_formula():
    model = load_model()
    a100 = model.device("a100")
    table = CollectiveTable("all_reduce", 4, ((2**20, 0.05), (2**30, 5.0)))
    spec = _spec(tensor_model_parallel_size=4, world_size=8, collectives=(table,))
    size = 2**25
    assert collective_ms(spec, a100, "all_reduce", size, "tp") == pytest.approx(table.measured_ms(size))
    assert collective_ms(spec, a100, "reduce_scatter", size, "tp") == pytest.approx(table.measured_ms(size) / 2)
    assert collective_ms(spec, a100, "all_reduce", size, "dp") == 0.0  # d = 1
    # no table: ring over NVLink, 2(n-1)/n S / B + 2(n-1) latencies
    bare = _spec(tensor_model_parallel_size=4, world_size=8)
    nvlink = a100.intra_node_bandwidth_bytes_per_s / 1e3
    assert collective_ms(bare, a100, "all_reduce", size, "tp", step_latency_ms=0.01) == pytest.approx(
        6 * 0.01 + 2 * 3 / 4 * size / nvlink)
    # a data-parallel ring across nodes: t8 fills a node, so each replica's GPU is alone on its node and has one
    # NIC share; with t2 x d8 on 8-GPU nodes, a replica group puts 4 GPUs on each of 2 nodes: 4 NIC shares
    spread = _spec(tensor_model_parallel_size=8, world_size=64, num_attention_heads=16)
    nic = a100.network_bandwidth_bytes_per_s / 1e3
    assert spread.group_nodes("dp") == (4, 1)
    assert collective_ms(spread, a100, "all_reduce", size, "dp") == pytest.approx(2 * 3 / 4 * size / nic)
    pairs = _spec(tensor_model_parallel_size=2, world_size=32)
    assert pairs.group_nodes("dp") == (2, 4)
    assert collective_ms(pairs, a100, "all_reduce", size, "dp") == pytest.approx(2 * 7 / 8 * size / (4 * nic))


# --- simulator: where the data-parallel reduction sits -----------------------------------------------------------

@pytest.mark.parametrize("whole,tail", [(0.0, 0.0), (7.0, 7.0), (7.0, 1.0), (2.5, 1.0)])
def test_gradient_reduction_follows_the_last_backward_or_hides_under_it(whole, tail):
    m, forward, backward, optimizer = 4, 2.0, 4.0, 3.0
    pipeline = Pipeline(stages=(StageCosts(forward, backward),), microbatches=m, iterations=3,
                        optimizer_ms=(optimizer,), grad_reduce_ms=(whole,) if whole else (),
                        grad_reduce_tail_ms=(tail,) if whole else ())
    result = simulate(pipeline, "1f1b")
    columns = result.columns
    first_optimizer = float(columns["start_ms"][(columns["phase"] == PHASES.index(OPTIMIZER)) & (columns["iteration"] == 1)][0])
    # one rank: its last backward ends at m(f + b) and started b before; the step waits for the reduction
    exposed = max(tail, whole - backward) if whole else 0.0
    assert first_optimizer == pytest.approx(m * (forward + backward) + exposed)
    with pytest.raises(ValueError, match="grad_reduce_tail_ms"):
        Pipeline(stages=pipeline.stages, microbatches=m, grad_reduce_ms=(1.0,), grad_reduce_tail_ms=(2.0,))


# --- model ---------------------------------------------------------------------------------------------------------

def test_the_parallel_terms_price_nothing_at_t_and_d_1():
    """Every run calibrated so far (cluster, CPU, vTrain pure pipeline) prices exactly as before with the terms."""
    for spec in (_spec(), _spec(pipeline_model_parallel_size=4)):
        assert load_model().pipeline(spec) == _model_3d().pipeline(spec)


def test_tensor_parallel_comm_is_two_collectives_per_layer_and_direction():
    """Forward: 2 blocking collectives per layer; backward: the QKV's and fc1's input-gradient collectives overlap
    their weight-gradient GEMMs (priced at the device's peak), so each is exposed only by what outlasts it."""
    table = CollectiveTable("all_reduce", 2, ((2**20, 0.1), (2**30, 60.0)))
    model = load_model()
    extra = _model_3d()
    for sp in (False, True):
        spec = _spec(tensor_model_parallel_size=2, world_size=4, sequence_parallel=sp, collectives=(table,))
        shape = spec.model
        tokens = shape.seq_length * shape.micro_batch_size
        message = tokens * shape.hidden_size * 2
        layers = spec.layers_per_stage[0]
        one = table.measured_ms(message) * (0.5 if sp else 1.0)  # a reduce-scatter or all-gather moves half
        peak_per_ms = model.device("a100").peak_bf16_flops_per_s / 1e3
        wgrad_qkv = 2 * tokens * shape.hidden_size * 3 * shape.hidden_size / 2 / peak_per_ms
        wgrad_fc1 = 2 * tokens * shape.hidden_size * shape.ffn_hidden_size / 2 / peak_per_ms
        exposed = max(0.0, one - wgrad_qkv) + max(0.0, one - wgrad_fc1)
        assert 0 < exposed < 2 * one  # at this small shape the GEMMs hide part of each, not all
        blocking_backward = 2 * one if sp else 0.0  # the row-parallel gradients' all-gathers under SP
        term = dict(extra.breakdown(spec)[0])["tp_comm"]
        # forward: 2 all-reduces per layer (or 2 all-gathers + 2 reduce-scatters: the same time) and the
        # vocabulary-parallel embedding's output (an all-reduce, or a reduce-scatter and its all-gather back)
        forward = layers * 2 * (2 * one if sp else one) + (one if sp else one)
        backward = layers * (blocking_backward + exposed) + (one if sp else 0.0)
        assert term == pytest.approx(spec.microbatches * (forward + backward))
        assert model.without_term("tensor_parallel_comm").breakdown(spec)[0]["tp_comm"] == 0.0


def test_tensor_parallel_backward_collectives_hide_under_large_weight_gradients():
    """The asynchronous input-gradient all-reduces: a small layer exposes them, a large one hides them (its
    weight-gradient GEMMs outlast them), so the backward costs only the recomputed forward's collectives."""
    table = CollectiveTable("all_reduce", 8, ((2**20, 0.09), (2**30, 5.3)))
    extra = _model_3d()
    small = _spec(tensor_model_parallel_size=8, world_size=16, collectives=(table,))
    large = _spec(tensor_model_parallel_size=8, world_size=16, hidden_size=8192, ffn_hidden_size=32768,
                  num_attention_heads=64, seq_length=4096, max_position_embeddings=4096,
                  collectives=(table,))
    for spec, hidden in ((small, False), (large, True)):
        term = extra.active("tensor_parallel_comm")
        part = term.term.contribute(extra.context(spec), term.params())
        layers = spec.layers_per_stage[0]
        one = table.measured_ms(spec.model.seq_length * spec.model.micro_batch_size * spec.model.hidden_size * 2)
        recomputed = spec.model.recomputed_layers(layers) * 2 * one
        peak_per_ms = extra.device("a100").peak_bf16_flops_per_s / 1e3
        tokens, h = spec.model.seq_length * spec.model.micro_batch_size, spec.model.hidden_size
        exposed = (max(0.0, one - 2 * tokens * h * 3 * h / 8 / peak_per_ms)
                   + max(0.0, one - 2 * tokens * h * spec.model.ffn_hidden_size / 8 / peak_per_ms))
        assert part.backward_ms[0] == pytest.approx(recomputed + layers * exposed)
        if hidden:
            assert exposed == 0.0
        else:
            assert part.backward_ms[0] - recomputed > layers * one  # most of the two per layer exposed


def test_collective_parameters_are_per_device_type():
    """The collectives' rate, step latency and contention are the machine's (NCCL over NVLink, gloo between
    time-shared CPU cores): a NAME@cpu value prices a CPU capture's collectives and leaves an A100 launch's."""
    from hops_calib.loop.suite import open_store

    cpu = open_store(REPO / "fixtures").load("cpu_1f1b_t2d2_l2_h384_s128_m3_run1").spec
    a100 = _spec(tensor_model_parallel_size=2, world_size=8, collectives=(
        CollectiveTable("all_reduce", 2, ((2**20, 0.04), (2**30, 6.0))),))
    base = _model_3d()
    for term in ("tensor_parallel_comm", "data_parallel_grad_reduce"):
        tuned = base.with_term(resolve_params(term, {"contention_step_ms@cpu": 0.5}, origin="test"))
        category = {"tensor_parallel_comm": "tp_comm", "data_parallel_grad_reduce": "dp_reduce"}[term]
        before, after = base.breakdown(cpu), tuned.breakdown(cpu)
        assert all(new[category] > old[category] for old, new in zip(before, after)), term
        assert tuned.breakdown(a100) == base.breakdown(a100), term


def test_data_parallel_reduction_all_reduce_or_reduce_scatter_and_gather():
    model = _model_3d()
    plain = _spec(world_size=8)  # d = 4
    dist = _spec(world_size=8, use_distributed_optimizer=True)
    a100 = model.device("a100")
    nbytes = rank_parameters(model.context(plain), 0) * 4  # bf16: fp32 gradient reduction
    reduce_plain = model.pipeline(plain).grad_reduce_ms[0]
    assert reduce_plain == pytest.approx(collective_ms(plain, a100, "all_reduce", nbytes, "dp", step_latency_ms=0.005))
    pipeline = model.pipeline(dist)
    assert pipeline.grad_reduce_ms[0] == pytest.approx(reduce_plain / 2, rel=1e-3)
    # the distributed optimizer steps 1/d of the parameters and all-gathers the 16-bit weights after it
    gather = collective_ms(dist, a100, "all_gather", nbytes / 2, "dp", step_latency_ms=0.005)
    base = model.without_term("data_parallel_grad_reduce")
    optimizer_step = base.pipeline(plain).optimizer_ms[0] - base.pipeline(dist).optimizer_ms[0]
    assert optimizer_step > 0 and pipeline.optimizer_ms[0] == pytest.approx(base.pipeline(dist).optimizer_ms[0] + gather)
    # overlapped: only one bucket of 40M parameters is left after the last backward
    overlapped = model.pipeline(_spec(world_size=8, overlap_grad_reduce=True))
    assert overlapped.grad_reduce_tail_ms[0] < overlapped.grad_reduce_ms[0]
    # the breakdown's exposed part: the reduction no backward hides, and the all-gather after the step (not under
    # --overlap-param-gather, which hides it in the next forwards)
    parts = model.breakdown(dist)[0]
    hidden = model.breakdown(_spec(world_size=8, use_distributed_optimizer=True, overlap_param_gather=True))[0]
    assert parts["dp_reduce_exposed"] == pytest.approx(hidden["dp_reduce_exposed"] + gather)
    assert parts["dp_reduce"] == pytest.approx(hidden["dp_reduce"] + gather)


def test_memory_per_gpu_splits_as_the_launch_says():
    plain = _spec(world_size=8)
    dist = _spec(world_size=8, use_distributed_optimizer=True)
    peak = [2, 1]
    a, b = stage_memory(plain, [80e9] * 2, peak), stage_memory(dist, [80e9] * 2, peak)
    assert b[0].optimizer_bytes == pytest.approx(a[0].optimizer_bytes / 4)
    assert (b[0].weights_bytes, b[0].gradients_bytes) == (a[0].weights_bytes, a[0].gradients_bytes)
    assert a[0].gradients_bytes == 2 * a[0].weights_bytes  # bf16 weights, fp32 gradient buffer
    full = stage_memory(_spec(world_size=8, recompute_granularity="full", recompute_method="uniform"), [80e9] * 2,
                        peak)
    shape = plain.model
    layers = plain.layers_per_stage[0]
    inputs = 2 * shape.seq_length * shape.micro_batch_size * shape.hidden_size
    assert full[0].activations_bytes == pytest.approx(2 * layers * inputs + gpt.layer_activation_bytes(shape))
    assert a[0].activations_bytes == pytest.approx(2 * layers * gpt.layer_activation_bytes(shape))


def test_tasks_grow_with_stages_and_microbatches_not_gpus():
    small = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "pipeline_model_parallel_size": 8}
    model = _model_3d()
    wide = spec_from_args(_launch(**small, tensor_model_parallel_size=8, world_size=512, global_batch_size=128),
                          "x", run_id="wide", iterations=3, hardware=A100)
    narrow = spec_from_args(_launch(**small, global_batch_size=16), "x", run_id="narrow", iterations=3,
                            hardware=A100)
    assert wide.gpus == 512 and wide.microbatches == narrow.microbatches == 8
    assert len(predict(wide, model).result.columns["stage"]) == len(predict(narrow, model).result.columns["stage"])


# --- predict --job: a 3D what-if on a copy of a capture -------------------------------------------------------------

def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _capture_copy(job: Path) -> Path:
    """A 2-rank capture's directory copied for a what-if on more ranks: its manifest's `cores` (the capture's two)
    taken out, as the refusal of a stale list asks, so each rank is priced a device of its own."""
    shutil.copytree(REPO / "traces" / RUN, job, ignore=shutil.ignore_patterns("megatron_trace"))
    manifest = job / "manifest.yaml"
    manifest.write_text(re.sub(r"^cores:\n(?:- \d+\n)+", "", manifest.read_text(), flags=re.M))
    return job


def _a100_tp2_copy(job: Path) -> tuple[Path, str]:
    """The capture's copy on A100s (its devices retyped; their NICs are slower than the node's NVLink) at t = 2: its
    megatron_args.txt and the launch's script part, for a test to put a launcher before."""
    _capture_copy(job)
    base = job / "hops.base.yaml"
    base.write_text(base.read_text().replace("gpu: cpu", "gpu: a100"))
    args = job / "megatron_args.txt"
    return args, args.read_text().replace("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 2")


def test_a_3d_what_if_on_a_captures_copy(tmp_path):
    from hops_calib.spec import build_spec

    job = tmp_path / "job"
    _capture_copy(job)
    model_file = tmp_path / "m3d.toml"
    write_model(model_file, _model_3d())
    args = job / "megatron_args.txt"
    base = json.loads(_cli("predict", "--job", job, "--model", model_file, "--json").stdout)
    text = args.read_text()
    args.write_text("torchrun --nproc-per-node 8 " + text.replace(
        "--tensor-model-parallel-size 1", "--tensor-model-parallel-size 2 --sequence-parallel "
        "--use-distributed-optimizer").replace("--global-batch-size 4", "--global-batch-size 8"))
    result = _cli("predict", "--job", job, "--model", model_file, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    config = out["configuration"]
    assert (config["tp"], config["dp"], config["pp"], config["gpus"]) == (2, 2, 2, 8)
    assert config["microbatches"] == base["configuration"]["microbatches"] == 4
    parts = out["breakdown_ms_per_iteration"]
    assert len(parts) == 2 and all(p["tp_comm"] > 0 and p["dp_reduce"] > 0 and p["p2p"] > 0 for p in parts)
    assert all(p["tp_comm"] == 0 and p["dp_reduce"] == 0 for p in base["breakdown_ms_per_iteration"])
    # half the GEMMs per GPU: the stage's compute falls; the memory per GPU falls too, and fits
    assert all(new["compute"] < old["compute"] for new, old in zip(parts, base["breakdown_ms_per_iteration"]))
    assert all(new["total_bytes"] < old["total_bytes"] for new, old in zip(out["memory"], base["memory"]))
    assert out["fits"] is True
    # the whole job's rates: every replica's samples, tokens, and the model FLOP/s per GPU they imply (MFU)
    first = out["predictions"][0]
    samples = first["throughput_per_s"] * 1 * 2  # micro batch 1, d = 2
    assert first["samples_per_s"] == pytest.approx(samples) and first["tokens_per_s"] == pytest.approx(samples * 256)
    shape = build_spec(job).model
    per_sample = 3 * (4 * (24 * 256 * 512 ** 2 + 4 * 256 ** 2 * 512) + 2 * 256 * 512 * gpt.padded_vocab(shape))
    assert first["model_tflops_per_gpu"] == pytest.approx(samples * per_sample / 8 / 1e12)
    assert first["mfu"] == pytest.approx(first["model_tflops_per_gpu"] * 1e12 / load_model().device("cpu").peak_bf16_flops_per_s)
    # the capture runs in fp32: its MFU is said against the fp32 peak (the one peak the CPU host states), not bf16's
    assert build_spec(job).model.precision == "fp32"
    said = _cli("predict", "--job", job, "--model", model_file).stdout
    assert "MFU % of fp32 peak" in said and "of bf16 peak" not in said
    # the capture's own `cores` (2, for its 2 ranks) no longer say how 8 ranks share the cores: refused, not priced
    stale = tmp_path / "stale"
    shutil.copytree(REPO / "traces" / RUN, stale, ignore=shutil.ignore_patterns("megatron_trace"))
    (stale / "megatron_args.txt").write_text(args.read_text())
    refused = _cli("predict", "--job", stale, "--model", model_file)
    assert refused.exit_code == 2 and "manifest.yaml: field 'cores'" in refused.stderr and "8 ranks" in refused.stderr
    text_out = _cli("predict", "--job", job, "--model", model_file).stdout
    # a CPU capture's ranks are processes on a host: ranks and host memory, not GPUs
    assert "tp 2 x dp 2 = 8 ranks" in text_out and "TP comm" in text_out and "peak memory per rank" in text_out
    assert "the host's memory" in text_out and "CUDA context" not in text_out
    # a shape that cannot fit the device is flagged, in JSON and text
    args.write_text(args.read_text().replace("--hidden-size 512", "--hidden-size 16384").replace(
        "--ffn-hidden-size 2048", "--ffn-hidden-size 65536"))
    huge = json.loads(_cli("predict", "--job", job, "--model", model_file, "--json").stdout)
    assert huge["fits"] is False and not huge["memory"][0]["fits"]
    assert "would not fit" in _cli("predict", "--job", job, "--model", model_file).stdout


# --- ingest: a job directory with more ranks than stages ----------------------------------------------------------

def _tensor_parallel_copy(tmp_path: Path, slow_rank: int, order_flag: str = "") -> Path:
    """A shipped 2-stage capture recast as t = 2: each stage's log is written for both ranks of its tensor-parallel
    group (Megatron's rank order: rank = tp + 2 pp, or tp-pp-dp's, which is the same at d = 1), and `slow_rank`'s
    last event ends 5 ms later, as a rank that lags its group would."""
    job = tmp_path / "tp2"
    _capture_copy(job)
    (job / "megatron_trace").mkdir()
    args = job / "megatron_args.txt"
    args.write_text("torchrun --nproc-per-node 4 " + args.read_text().replace(
        "--tensor-model-parallel-size 1", f"--tensor-model-parallel-size 2{order_flag}"))
    source = REPO / "traces" / RUN / "megatron_trace"
    for stage in (0, 1):
        lines = [json.loads(line) for line in (source / f"rank{stage}.jsonl").read_text().splitlines() if line]
        for tp in (0, 1):
            rank = tp + 2 * stage
            events = [dict(event, rank=rank) for event in lines]
            if rank == slow_rank:
                last = max(range(len(events)), key=lambda k: events[k]["end_wall_ns"])
                events[last]["end_wall_ns"] += 5_000_000
                events[last]["duration_ms"] += 5.0
            (job / "megatron_trace" / f"rank{rank}.jsonl").write_text(
                "".join(json.dumps(event) + "\n" for event in events))
    return job


def test_a_stage_is_timed_by_the_rank_that_paces_it(tmp_path):
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(tmp_path / "fx")
    report = ingest([_tensor_parallel_copy(tmp_path, slow_rank=1)], store, split="train")
    assert report.ok, report
    (fixture_id,) = store.ids()
    fixture = store.load(fixture_id)
    events = fixture.events
    # the pacing pipeline is tensor-parallel rank 1's (rank 1 ends last): ranks 1 and 3
    assert sorted(set(zip(events["stage"], events["rank"]))) == [(0, 1), (1, 3)]
    assert any("ranks 1 (stage 0), 3 (stage 1)" in warning for warning in fixture.quality["warnings"])
    assert fixture.spec.tp == 2 and fixture.spec.gpus == 4
    single = open_single()
    assert fixture.truth.metrics.throughput_per_s == pytest.approx(single.truth.metrics.throughput_per_s, rel=0.02)
    # a rank missing from the directory is named
    job = _tensor_parallel_copy(tmp_path / "again", slow_rank=0)
    (job / "megatron_trace" / "rank3.jsonl").unlink()
    bad = ingest([job], FixtureStore(tmp_path / "fx2"), split="train")
    assert not bad.ok and "4 ranks (2 pipeline stages x tp 2 x dp 1: 0..3)" in str(bad.outcomes[0].error)


def open_single():
    from hops_calib.loop.suite import open_store

    return open_store(REPO / "fixtures").load(RUN)


def test_ranks_sharing_a_core_are_served_by_the_simulator():
    """A CPU capture with more ranks than cores (manifest.yaml's cores): the model prices every task at full speed
    and hands the simulator which ranks share each core (processor sharing, tests/sim/test_sim_cores.py)."""
    from hops_calib.loop.suite import open_store

    fixture = open_store(REPO / "fixtures").load("cpu_1f1b_t2d2_l2_h384_s128_m3_run1")
    shared = fixture.spec
    assert shared.ranks_per_device == 4.0  # 8 ranks on 2 cores
    # its spec.json predates Spec.cores: the store completes it from the manifest the fixture kept
    assert "cores" not in json.loads((fixture.path / "spec.json").read_text())
    assert shared.cores == tuple(fixture.meta["manifest"]["cores"]) == (0, 1) * 4
    alone = type(shared).from_dict({**shared.to_dict(), "ranks_per_device": 1.0, "cores": ()})
    model = _model_3d()
    a, b = model.pipeline(alone), model.pipeline(shared)
    assert a.stages == b.stages and a.grad_reduce_ms == b.grad_reduce_ms and a.optimizer_ms == b.optimizer_ms
    assert not a.shares_cores and b.core_load == ((2.0, 2.0), (2.0, 2.0))  # 2 ranks of each stage per core
    assert a.forward_transfer_ms == b.forward_transfer_ms  # the links were measured as they are


def test_a_bad_collective_line_is_named_by_file_line_and_field(tmp_path):
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    run = "cpu_1f1b_t2_l4_h256_s128_m4_run1"
    job = tmp_path / run
    shutil.copytree(REPO / "traces" / run, job)
    log = job / "megatron_trace" / "rank1.jsonl"
    lines = log.read_text().splitlines()
    number = next(k for k, line in enumerate(lines) if '"collective"' in line)
    lines[number] = lines[number].replace('"group": "tp"', '"group": "pp"')
    log.write_text("\n".join(lines) + "\n")
    report = ingest([job], FixtureStore(tmp_path / "fx"), split="train")
    assert not report.ok
    message = str(report.outcomes[0].error)
    assert f"rank1.jsonl:{number + 1}" in message and "field 'group'" in message and "'pp'" in message
    # with --lenient the line is dropped and counted; the timeline is the one without it
    lenient = ingest([job], FixtureStore(tmp_path / "fx2"), split="train", lenient=True)
    assert lenient.ok


def test_a_multi_node_torchrun_launch_prices_a_data_parallel_group_across_nodes_over_the_nics(tmp_path):
    """torchrun --nnodes 4 --nproc-per-node 2 puts global rank r on node r // 2: with t = 2 (rank order tp first)
    each tensor-parallel pair fills a node and each data-parallel pair spans two, so its gradient all-reduce is
    priced by the ring over the nodes' NICs, slower than the one-node launch of the same job."""
    from hops_calib.spec import build_spec
    from hops_calib.trace.megatron_args import ARGS_FILE, _parse_launch

    def launcher_gpus_per_node(text: str) -> int | None:  # what read_launch_file gives as Launch.gpus_per_node
        return _parse_launch(text, ARGS_FILE)[1]

    assert launcher_gpus_per_node("torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py --num-layers 2") == 8
    assert launcher_gpus_per_node("torchrun --nproc-per-node=8 pretrain_gpt.py") is None  # one node: no count needed
    assert launcher_gpus_per_node("torchrun --nnodes 1:4 --nproc-per-node 8 pretrain_gpt.py") is None  # elastic
    assert launcher_gpus_per_node("pretrain_gpt.py --nnodes 2") is None  # not the launcher's

    job = tmp_path / "job"
    args, text = _a100_tp2_copy(job)
    model = _model_3d()

    def spec_and_reduce(launcher: str):
        args.write_text(launcher + text)
        spec = build_spec(job)
        return spec, model.breakdown(spec)[0]["dp_reduce"]

    one_node, reduce_one = spec_and_reduce("torchrun --nproc-per-node 8 ")
    two_nodes, reduce_two = spec_and_reduce("torchrun --nnodes 4 --nproc-per-node 2 ")
    assert one_node.gpus_per_node is None and two_nodes.gpus_per_node == 2
    assert (two_nodes.tp, two_nodes.dp, two_nodes.pp) == (2, 2, 2)
    assert two_nodes.group_nodes("tp") == (1, 2) and two_nodes.group_nodes("dp") == (2, 1)
    assert reduce_two > reduce_one > 0
    # without a link benchmark the placement prices the hops: the job predicts, and says how
    shutil.rmtree(job / "calibration" / "link_bench")
    notes: list[str] = []
    spec = build_spec(job, notes)
    assert spec.links == () and any("NICs across nodes" in note for note in notes)
    predicted = _cli("predict", "--job", job, "--json")
    assert predicted.exit_code == 0, predicted.output
    # a one-node launch without a link benchmark keeps every hop on its node (it was refused for want of one),
    # and its data-parallel reduction is the one-node launch's
    args.write_text("torchrun --nproc-per-node 8 " + text)
    alone = build_spec(job)
    assert alone.links == () and alone.gpus_per_node == 8 and alone.group_nodes("dp")[0] == 1  # one node
    assert model.breakdown(alone)[0]["dp_reduce"] == pytest.approx(reduce_one)
    predicted = _cli("predict", "--job", job, "--json")
    assert predicted.exit_code == 0, predicted.output


def test_build_spec_reads_the_launch_once_for_its_arguments_and_its_node_layout(tmp_path, monkeypatch):
    """build_spec takes Megatron's arguments and torchrun's placement (--nnodes, --nproc-per-node) from one read of
    megatron_args.txt (it read the file twice); the placement comes out as before: global rank r on node r // G."""
    from hops_calib.spec import build_spec
    from hops_calib.trace import reading

    job = tmp_path / "job"
    args, text = _a100_tp2_copy(job)
    read = []
    real = reading.read_config_bytes
    monkeypatch.setattr(reading, "read_config_bytes", lambda path, *rest: read.append(Path(path).name) or real(path,
                                                                                                              *rest))
    for launcher, per_node, tp_nodes, dp_nodes in (("torchrun --nnodes 4 --nproc-per-node 2 ", 2, (1, 2), (2, 1)),
                                                   ("torchrun --nnodes=2 --nproc_per_node=4 ", 4, (1, 2), (1, 2)),
                                                   ("torchrun --nproc-per-node 8 ", None, None, None),
                                                   ("", None, None, None)):
        args.write_text(launcher + text)
        read.clear()
        spec = build_spec(job)
        assert read.count("megatron_args.txt") == 1, (launcher, read)
        assert spec.gpus_per_node == per_node and (spec.tp, spec.dp, spec.pp) == (2, 2 if launcher else 1, 2)
        if per_node:
            assert spec.group_nodes("tp") == tp_nodes and spec.group_nodes("dp") == dp_nodes


def test_the_older_fp8_switches_and_near_miss_typos_are_refused_and_unknown_flags_are_noted(tmp_path):
    """Megatron-LM's older FP8 switches on the local layer and a hybrid (Mamba) layer pattern are refused like
    --fp8-format there; so is a
    near-miss of a flag the project knows (`--sequence-paralel` would silently price no sequence parallelism, and
    Megatron refuses it), naming the flag meant. A flag near nothing the project knows is not refused (its list
    need not hold every Megatron flag) but named in a note. Megatron-DeepSpeed's own spellings pass without one."""
    from hops_calib.spec import require_modelled, unknown_flags_note
    from hops_calib.trace.megatron_args import read_args_file

    def read(flags: str) -> tuple[str | None, str | None]:
        path = tmp_path / "megatron_args.txt"
        path.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 8 --hidden-size 1024 "
                        f"--num-attention-heads 16 --tensor-model-parallel-size 2 {flags}\n")
        args = read_args_file(path)
        try:
            require_modelled(args, path)
        except TraceError as error:
            return str(error), None
        return None, unknown_flags_note(args, path)

    refused, _ = read("--sequence-paralel")
    assert "--sequence-paralel" in refused and "did you mean --sequence-parallel?" in refused
    assert "megatron_args.txt:1: field '--sequence-paralel'" in refused
    refused, _ = read("--tensor-model-paralel-size 2 --frobnicate 3")
    assert "--tensor-model-paralel-size (--tensor-model-parallel-size?)" in refused and "frobnicate" not in refused
    refused, note = read("--frobnicate 3")
    assert refused is None and "ignored: --frobnicate" in note and "megatron_args.txt:1" in note
    assert "did you mean" not in note
    # and why it is only noted: Megatron-LM's own argument list is not there to refuse it against
    assert "not refused" in note and "megatron/training/arguments.py) is not installed, only megatron-core" in note
    for flags in ("--fp8-hybrid --transformer-impl local", "--fp8-e4m3 --transformer-impl local",
                  "--hybrid-override-pattern M*M*"):
        assert flags.split()[0] in read(flags)[0]
    assert read("--fp8-hybrid") == (None, None)  # on the TE layer, priced as --fp8-format hybrid
    for fine in ("--sequence-parallel", "--use-flash-attn-v2", "--no-masked-softmax-fusion",
                 "--no-overlap-p2p-communication", "--num-key-value-heads 4 --group-query-attention"):
        assert read(fine) == (None, None), fine


def test_virtual_stages_by_a_spelling_megatron_core_lacks_are_noted_as_priced_without_them(tmp_path):
    """--num-virtual-stages-per-pipeline-rank 2 is a name megatron-core 0.16.1 does not have (none of its sources
    holds it; its count of chunks per rank is virtual_pipeline_model_parallel_size): the launch is priced on one
    model chunk per rank, as 1F1B, and the note says so, why, and the spelling that prices 2 chunks. The spelling
    that counts builds 2 chunks."""
    from pathlib import Path as P

    import megatron.core

    from hops_calib.spec import build_spec, unknown_flags_note
    from hops_calib.trace.megatron_args import read_args_file

    core = P(megatron.core.__file__).parent
    sources = [path.read_text(errors="replace") for path in core.rglob("*.py")]
    assert not any("num_virtual_stages_per_pipeline_rank" in text for text in sources)
    assert any("virtual_pipeline_model_parallel_size" in text for text in sources)
    job = tmp_path / "job"
    _capture_copy(job)
    manifest = job / "manifest.yaml"  # the capture's own schedule goes: the flags say which Megatron runs
    manifest.write_text(re.sub(r"^configured_schedule:.*\n", "", manifest.read_text(), flags=re.M))
    args_file = job / "megatron_args.txt"
    plain = args_file.read_text()
    assert "virtual" not in plain and "--pipeline-model-parallel-size 2" in plain
    args_file.write_text(plain.replace("pretrain_gpt.py", "pretrain_gpt.py --num-virtual-stages-per-pipeline-rank 2"))
    spec = build_spec(job)
    assert (spec.vp, spec.schedule) == (1, "1f1b")
    note = unknown_flags_note(read_args_file(args_file), args_file)
    assert note.startswith("ignored: --num-virtual-stages-per-pipeline-rank")
    assert "megatron-core 0.16.1 has no setting of that name" in note
    assert "priced without virtual stages, as non-interleaved 1F1B on one model chunk per rank" in note
    assert "give --virtual-pipeline-model-parallel-size 2" in note
    args_file.write_text(plain.replace("pretrain_gpt.py", "pretrain_gpt.py --virtual-pipeline-model-parallel-size 2"))
    counted = build_spec(job)
    assert (counted.vp, counted.schedule) == (2, "interleaved_1f1b")
    assert unknown_flags_note(read_args_file(args_file), args_file) is None


def test_plan_parallel_searches_the_layouts_of_a_jobs_gpus(tmp_path):
    """plan --job DIR --parallel: every t x p x d x micro-batch layout of the job's 8 GPUs that Megatron accepts is
    priced by the calibrated model, the job's own one as predict --job prices it, the best that fit ranked by
    samples/s; mixed device types are refused."""
    from hops_calib.whatif.layouts import candidate_layouts

    job = tmp_path / "job"
    _capture_copy(job)
    base = job / "hops.base.yaml"
    base.write_text(base.read_text().replace("gpu: cpu", "gpu: a100"))
    args = job / "megatron_args.txt"
    # two nodes of 4, no link benchmark: every layout's hops priced from the placement, the job's own too
    args.write_text("torchrun --nnodes 2 --nproc-per-node 4 " + args.read_text().replace("--global-batch-size 4",
                                                                                        "--global-batch-size 16"))
    shutil.rmtree(job / "calibration" / "link_bench")
    # 4 layers, 8 heads, batch 16 on 8 GPUs: t | 8 heads, p | 4 layers, d = 8 / (t p), 16 % (mb d) == 0
    shape = {"num_attention_heads": 8, "num_layers": 4, "global_batch_size": 16}
    layouts = candidate_layouts(shape, 8, 4, (1, 2))  # t at most a node's 4 GPUs
    assert (4, 1, 2, 2) in layouts and (1, 4, 2, 1) in layouts and (2, 2, 2, 2) in layouts
    assert all(t * p * d == 8 and t <= 4 and 4 % p == 0 and 16 % (mb * d) == 0 for t, p, d, mb in layouts)
    assert len(layouts) == len(set(layouts)) == 2 * sum(1 for t in (1, 2, 4) for p in (1, 2, 4) if (8 // t) % p == 0)
    out = _cli("plan", "--job", job, "--parallel", "--top", "50", "--json")
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    own = json.loads(_cli("predict", "--job", job, "--json").stdout)["predictions"][0]
    assert (plan["current"]["tp"], plan["current"]["pp"], plan["current"]["dp"]) == (1, 2, 4)
    assert plan["current"]["samples_per_s"] == pytest.approx(own["samples_per_s"])
    rates = [b["samples_per_s"] for b in plan["best"]]
    assert rates == sorted(rates, reverse=True) and all(b["fits"] for b in plan["best"]) and len(rates) > 5
    text = _cli("plan", "--job", job, "--parallel").stdout
    assert "layouts priced" in text and "MFU %" in text and "\njob " in text
    # two device types: the search needs one
    base.write_text(base.read_text().replace("gpu: a100", "gpu: h100", 1))
    mixed = _cli("plan", "--job", job, "--parallel")
    assert mixed.exit_code == 2 and "one GPU type" in mixed.stderr


def test_the_whatif_pages_gpu_job_recipe_predicts_and_plans(tmp_path):
    """docs/whatif.md's "A job on GPU nodes, before it runs" block, as written (its hops-calib calls through the CLI here):
    the 512-A100 job predicts, fits, and plan ranks its layouts (plan --job, and the layout-only --parallel), the
    launch's own among them."""
    from job_copies import readme_gpu_job

    _, calls = readme_gpu_job(tmp_path)
    assert calls == "hops-calib predict --job gpt175b && hops-calib plan --job gpt175b"
    predicted = _cli("predict", "--job", tmp_path / "gpt175b", "--json")
    assert predicted.exit_code == 0, predicted.output
    out = json.loads(predicted.stdout)
    assert out["fits"] and (out["configuration"]["tp"], out["configuration"]["pp"], out["configuration"]["dp"]) == (8, 8, 8)
    assert 0.2 < out["predictions"][0]["mfu"] < 0.7  # a plausible share of the A100's peak
    plan = json.loads(_cli("plan", "--job", tmp_path / "gpt175b", "--parallel", "--json").stdout)
    assert plan["gpus"] == 512 and plan["gpus_per_node"] == 8 and plan["best"]
    assert plan["current"]["samples_per_s"] == pytest.approx(out["predictions"][0]["samples_per_s"])
    planned = json.loads(_cli("plan", "--job", tmp_path / "gpt175b", "--json").stdout)
    # every launch uses the 512 GPUs: t x p x cp x d (the planner searches context parallelism too)
    assert planned["status"] == "ok" and {b["tp"] * b["pp"] * b["cp"] * b["dp"] for b in planned["best"]} == {512}
    assert planned["current"]["throughput_samples_per_s"] == pytest.approx(out["predictions"][0]["samples_per_s"])


def test_the_launchs_transport_prices_the_readmes_gpu_job_without_a_link_benchmark(tmp_path):
    """docs/whatif.md's 512-A100 job has no link benchmark: its hops, collectives and ends' all-reduce across nodes are
    priced from the NIC share. NCCL_NET=Socket or NCCL_IB_DISABLE=1 before its launch holds every connection across
    nodes under one TCP flow's ceiling (the model's flow_cap_gbit_s) and gives the ends' all-reduce its stall
    expectation; NCCL_NET=IB prices the NICs as when nothing is said, and then a note says so."""
    from job_copies import readme_gpu_job

    from hops_calib.model.collectives import ring_bandwidth_bytes_per_ms
    from hops_calib.spec import build_spec

    job, _ = readme_gpu_job(tmp_path)
    launch = (job / "megatron_args.txt").read_text()

    def what_if(name: str, environment: str) -> tuple[dict, str, Path]:
        copy = tmp_path / name
        shutil.copytree(job, copy)
        (copy / "megatron_args.txt").write_text(environment + launch)
        out = _cli("predict", "--job", copy, "--json")
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout), _cli("predict", "--job", copy).stdout, copy

    (unsaid, unsaid_text, _), (ib, _, _) = what_if("unsaid", ""), what_if("ib", "NCCL_NET=IB ")
    (sockets, sockets_text, sockets_job), (disabled, _, _) = (what_if("socket", "NCCL_NET=Socket "),
                                                             what_if("disabled", "NCCL_IB_DISABLE=1 "))
    assert ib["predictions"] == unsaid["predictions"] and ib["end_collective"] == unsaid["end_collective"]
    assert sockets["predictions"] == disabled["predictions"]
    assert sockets["end_collective"] == disabled["end_collective"]
    said = [any("transport between nodes is not said" in note for note in d["notes"])
            for d in (unsaid, ib, sockets, disabled)]
    assert said == [True, False, False, False]
    model = load_model(REPO / "hops_calib" / "model" / "models" / "baseline.toml")
    ends = dict(next(t for t in model.terms if t.name == "embedding_grad_allreduce").values)
    flow = ends["flow_cap_gbit_s"]
    tcp, nic = sockets["end_collective"], unsaid["end_collective"]
    assert not nic["capped_at_one_tcp_flow"] and nic["stall_probability"] == 0 and nic["bandwidth_gbit_s"] > flow
    assert tcp["capped_at_one_tcp_flow"] and tcp["stall_probability"] >= ends["stall_probability"] > 0
    assert tcp["bandwidth_gbit_s"] <= flow * ends["collective_efficiency"] and tcp["ms"] > nic["ms"]
    # the data-parallel rings crossing nodes (one GPU of each group per node at t 8) and the hops between nodes
    spec = build_spec(sockets_job)
    context = model.context(spec)
    bandwidth = ring_bandwidth_bytes_per_ms(spec, context.devices[0], "dp", 0, context.connection_cap_bytes_per_ms)
    assert bandwidth * 8 / 1e6 == pytest.approx(flow)  # bytes/ms -> Gbit/s
    for over_tcp, over_nic in zip(sockets["breakdown_ms_per_iteration"], unsaid["breakdown_ms_per_iteration"]):
        assert over_tcp["dp_reduce"] > over_nic["dp_reduce"] and over_tcp["p2p"] > over_nic["p2p"]
        assert over_tcp["compute"] == over_nic["compute"]
    assert sockets["predictions"][0]["samples_per_s"] < unsaid["predictions"][0]["samples_per_s"]
    # the text names the ceiling after what it caps
    assert "priced by the end GPU's share of its node's NICs, capped at one TCP flow's ceiling" in sockets_text
    assert "priced by capped" not in sockets_text and "expected retransmission stall" in sockets_text
    assert "transport between nodes is not said" in unsaid_text
    # plan --job --parallel prices the launch's own layout as predict --job does, over the same transport
    for priced, copy in ((sockets, sockets_job), (unsaid, tmp_path / "unsaid")):
        plan = json.loads(_cli("plan", "--job", copy, "--parallel", "--json").stdout)
        assert plan["current"]["samples_per_s"] == pytest.approx(priced["predictions"][0]["samples_per_s"], rel=1e-12)
        assert any("transport between nodes is not said" in note for note in plan["notes"]) == (priced is unsaid)


def test_predict_jobs_per_stage_optimizer_phase_reconciles_with_the_breakdown(tmp_path):
    """The per-stage 'opt ms' is the rank's optimizer phase: its step (the breakdown's optimizer) plus, with the
    distributed optimizer and no --overlap-param-gather, the all-gather of the updated weights after it
    (`dp_param_gather`, inside DP reduce); the legend says so. Hidden under the forwards, the phase is the step."""
    from job_copies import readme_gpu_job

    job, _ = readme_gpu_job(tmp_path)
    out = json.loads(_cli("predict", "--job", job, "--json").stdout)
    text = _cli("predict", "--job", job).stdout
    stages, parts = out["predictions"][0]["stages"], out["breakdown_ms_per_iteration"]
    for row, part in zip(stages, parts):
        assert part["dp_param_gather"] > 10 * part["optimizer"]  # 512 GPUs: the gather outweighs the step
        assert row["optimizer_ms"] == pytest.approx(part["optimizer"] + part["dp_param_gather"], rel=1e-9)
        assert part["dp_param_gather"] < part["dp_reduce_exposed"] <= part["dp_reduce"]
    assert (f"the distributed optimizer's all-gather of the updated weights after it, "
            f"{parts[0]['dp_param_gather']:.2f} ms on stage 0") in text
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().replace(" --train-iters", " --overlap-param-gather --overlap-grad-reduce --train-iters"))
    hidden = json.loads(_cli("predict", "--job", job, "--json").stdout)
    for row, part in zip(hidden["predictions"][0]["stages"], hidden["breakdown_ms_per_iteration"]):
        assert part["dp_param_gather"] == 0 and row["optimizer_ms"] == pytest.approx(part["optimizer"], rel=1e-9)
    assert "all-gather of the updated weights" not in _cli("predict", "--job", job).stdout


def test_predict_of_a_data_parallel_capture_counts_every_replicas_samples():
    out = _cli("predict", "cpu_1f1b_d2_l4_h384_s128_m4_run1", "--fixtures", REPO / "fixtures", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    for side, key in (("real", "real"), ("predicted", "predicted")):
        assert data["samples_per_s"][side] == pytest.approx(data[key]["throughput_per_s"] * 1 * 2)  # mb 1, d 2


def test_ranks_share_cores_that_disagrees_with_cores_is_named_and_cores_is_priced(tmp_path):
    """The capture writes `ranks_share_cores` from `cores` and only `cores` is priced: a manifest whose flag denies
    the sharing its cores list (a hand edit of one of them) is predicted and ingested as `cores` says, with a note
    (a warning) naming the file, line and field; the shipped captures, whose two agree, get none."""
    from hops_calib.spec import build_spec, core_sharing_note
    from hops_calib.trace.job import find_job_dirs, read_manifest

    for job in find_job_dirs(REPO / "traces"):
        assert core_sharing_note(read_manifest(job), job / "manifest.yaml") is None, job
    shared = "cpu_1f1b_d2_l4_h384_s128_m4_run1"  # 4 ranks on 2 cores
    job = tmp_path / shared
    shutil.copytree(REPO / "traces" / shared, job)
    manifest = job / "manifest.yaml"
    lines = manifest.read_text().splitlines()
    line = next(k for k, text in enumerate(lines, start=1) if text == "ranks_share_cores: true")
    lines[line - 1] = "ranks_share_cores: false"
    manifest.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    spec = build_spec(job, notes)
    assert spec.cores == tuple(read_manifest(job)["cores"]) and len(set(spec.cores)) < len(spec.cores)
    [note] = [n for n in notes if "ranks_share_cores" in n]
    assert f"manifest.yaml:{line}: field 'ranks_share_cores' says false" in note and "share core 0" in note
    predicted = _cli("predict", "--job", job)
    assert predicted.exit_code == 0 and "field 'ranks_share_cores'" in predicted.stdout
    ingested = _cli("ingest", job, "--fixtures", tmp_path / "fx")
    assert ingested.exit_code == 0 and "field 'ranks_share_cores'" in ingested.stderr
