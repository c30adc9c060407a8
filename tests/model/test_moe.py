"""A mixture of experts (issue #28): the spec reads Megatron-core's MoE flags and checks them as megatron-core does,
the layer's kernels add up to Megatron-LM's own FLOP count, the shipped model's terms price the experts' FLOPs,
all-to-alls and gradient reduction, memory splits the experts over the expert-parallel GPUs, and `predict --job`
prices a Mixtral-like launch on 64 H100 DGX."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model
from hops_calib.model import TERMS, Context, gpt
from hops_calib.model import kernels as K
from hops_calib.model.collectives import collective_ms
from hops_calib.model.memory import stage_memory
from hops_calib.model.terms.base import layout_of
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.model.terms.optimizer import optimizer_parameters
from hops_calib.model.terms.parallel import expert_collectives, tp_collectives_per_layer
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError

# Mixtral 8x7B's shape (Jiang et al. 2024, table 1; Megatron-LM examples/mixtral): 32 layers, h 4096, 32 heads in 8
# query groups, SwiGLU experts of 14336, 8 experts, top-2, RMSNorm, RoPE, no biases; here on 64 GPUs at p 4, EP 8
MIXTRAL = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4, "world_size": 64, "num_layers": 32,
           "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32, "group_query_attention": True,
           "num_query_groups": 8, "seq_length": 4096, "max_position_embeddings": 32768, "micro_batch_size": 1,
           "global_batch_size": 256, "vocab_size": 32000, "bf16": True, "swiglu": True, "normalization": "RMSNorm",
           "position_embedding_type": "rope", "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
           "sequence_parallel": True, "num_experts": 8, "moe_router_topk": 2, "expert_model_parallel_size": 8,
           "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True, "use_distributed_optimizer": True}
# DeepSeek-V2-Lite's MoE shape (DeepSeek-AI 2024, its config.json: h 2048, 64 routed experts of 1408, top-6, two shared
# experts, 2816 together), with grouped-query attention in place of its multi-latent attention (not priced) and
# every layer MoE (its first dense layer is a --moe-layer-freq pattern, not priced)
DEEPSEEK = {**MIXTRAL, "num_layers": 26, "hidden_size": 2048, "ffn_hidden_size": 10944, "num_attention_heads": 16,
            "num_query_groups": 16, "num_experts": 64, "moe_router_topk": 6, "moe_ffn_hidden_size": 1408,
            "moe_shared_expert_intermediate_size": 2816, "vocab_size": 102400, "pipeline_model_parallel_size": 2,
            "global_batch_size": 128}
DGX = Hardware(gpu="h100_dgx", gpus_per_node=8)


def moe_spec(args: dict, run_id: str = "moe"):
    return spec_from_args(args, "test", run_id=run_id, iterations=2, hardware=DGX)


def iteration_model_flops(spec, settings=None) -> float:
    """Megatron-counted FLOPs of one iteration from the kernels: every virtual stage's per microbatch, times the
    microbatches and the GPUs of a stage (each kernel is one GPU's share)."""
    layout, settings = layout_of(spec), settings or kernel_settings(spec)
    per_microbatch = sum(K.total_model_flops(K.stage_kernels(spec.model, settings, layers, first=k == 0,
                                                             last=k == layout.virtual_stages - 1).rows())
                         for k, layers in enumerate(layout.layers))
    return per_microbatch * spec.microbatches * spec.dp * spec.tp * spec.cp


@pytest.mark.parametrize("change", [
    {}, {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
    {"moe_token_dispatcher_type": "allgather"}, {"moe_grouped_gemm": False},
    {"tensor_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 4},
    {"recompute_granularity": "full", "recompute_method": "uniform"}, {"moe_router_dtype": "fp32"},
    {"context_parallel_size": 2}, {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
])
@pytest.mark.parametrize("launch", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek"])
def test_the_kernels_flops_add_up_to_megatrons_moe_count(launch: dict, change: dict) -> None:
    args = {**launch, **change}
    spec = moe_spec(args)
    assert spec.model.moe and spec.model.local_experts == args["num_experts"] // args["expert_model_parallel_size"]
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(args, args["global_batch_size"]), rel=1e-12)


def test_megatrons_moe_count_is_the_closed_form_of_routed_and_shared_experts() -> None:
    """Per token and layer the forward's MLP is topk experts of 3 h f_moe multiply-adds (SwiGLU) plus the shared
    expert's 3 h f_shared, the step three times it (forward, two gradients), 2 FLOPs a multiply-add: written out
    here, not through the function's own expansion factor."""
    args = DEEPSEEK
    s, h, layers, batch = 4096, 2048, 26, 128
    dense = K.megatron_flops({**args, "num_experts": None, "moe_shared_expert_intermediate_size": None,
                              "moe_ffn_hidden_size": None, "ffn_hidden_size": 6 * 1408 + 2816}, batch)
    moe = K.megatron_flops(args, batch)
    # the same MLP FLOPs as a dense MLP of topk x f_moe + f_shared: the MoE count differs from it by nothing
    assert moe == pytest.approx(dense, rel=1e-12)
    routed = batch * s * layers * 3 * 2 * (3 * h * 1408 * 6)
    shared = batch * s * layers * 3 * 2 * (3 * h * 2816)
    no_shared = K.megatron_flops({**args, "moe_shared_expert_intermediate_size": None}, batch)
    assert moe - no_shared == pytest.approx(shared, rel=1e-12)
    one = K.megatron_flops({**args, "moe_router_topk": 1, "moe_shared_expert_intermediate_size": None}, batch)
    assert no_shared - one == pytest.approx(routed * 5 / 6, rel=1e-12)
    # a pattern of dense and MoE layers counts each kind on its layers (Megatron-LM's moe_layer_pattern)
    every_other = K.megatron_flops({**args, "moe_layer_freq": 2}, batch)
    pattern = K.megatron_flops({**args, "moe_layer_freq": "([1]*1+[0]*1)*13"}, batch)
    assert every_other == pytest.approx(pattern, rel=1e-12)
    assert every_other == pytest.approx((moe + K.megatron_flops({**args, "num_experts": None}, batch)) / 2, rel=1e-12)


def test_the_busiest_expert_executes_more_than_megatron_counts_and_the_router_is_not_counted() -> None:
    spec = moe_spec(MIXTRAL)
    settings = kernel_settings(spec, {"expert_load_imbalance": 1.5})
    balanced = {k.name: k for k in K.layer_forward(spec.model, kernel_settings(spec))}
    busy = {k.name: k for k in K.layer_forward(spec.model, settings)}
    fc1 = busy["mlp.experts.linear_fc1"]
    # T = 4096 tokens, top-2, one local expert (8 / EP 8): 8192 rows balanced, 12288 on the busiest GPU
    assert (balanced["mlp.experts.linear_fc1"].m, fc1.m, fc1.n, fc1.k) == (8192, 12288, 2 * 14336, 4096)
    assert fc1.flops == pytest.approx(1.5 * fc1.model_flops) and fc1.model_flops == balanced[fc1.name].model_flops
    assert busy["mlp.router"].model_flops == 0 and busy["mlp.router"].flops == 2.0 * 4096 * 8 * 4096
    assert iteration_model_flops(spec, settings) == pytest.approx(K.megatron_flops(MIXTRAL, 256), rel=1e-12)
    # a capacity factor caps what the busiest expert takes; padding to it makes every expert take it
    capped = moe_spec({**MIXTRAL, "moe_expert_capacity_factor": 1.25})
    assert gpt.expert_token_scale(capped.model, 1.5) == 1.25 and gpt.expert_token_scale(capped.model, 1.1) == 1.1
    padded = moe_spec({**MIXTRAL, "moe_expert_capacity_factor": 1.25, "moe_pad_expert_input_to_capacity": True})
    assert gpt.expert_token_scale(padded.model, 1.0) == 1.25


def test_sequential_experts_launch_one_gemm_each_and_the_dispatcher_its_own_collectives() -> None:
    spec = moe_spec({**DEEPSEEK, "moe_grouped_gemm": False})
    forward = K.layer_forward(spec.model, kernel_settings(spec))
    fc1 = [k for k in forward if k.name.startswith("mlp.experts.linear_fc1")]
    assert len(fc1) == 64 // 8 and all(k.batch == 1 for k in fc1)
    grouped = [k for k in K.layer_forward(moe_spec(DEEPSEEK).model, kernel_settings(spec))
               if k.name.startswith("mlp.experts.linear_fc1")]
    assert len(grouped) == 1 and grouped[0].batch == 8
    assert grouped[0].model_flops == pytest.approx(sum(k.model_flops for k in fc1))
    # alltoall: the routed rows and their probabilities, out and back, over the EP group; T x k x h x 2 B each way
    a2a = [(k.name, k.bytes) for k in forward if k.kind == "all_to_all"]
    rows = 4096 * 6
    assert a2a == [("mlp.dispatch_all_to_all", rows * 2048 * 2), ("mlp.dispatch_probs_all_to_all", rows * 4),
                   ("mlp.combine_all_to_all", rows * 2048 * 2)]
    assert all(k.group == "ep" for k in forward if k.kind == "all_to_all")
    # allgather: the tokens gathered over the etp x ep group, reduce-scattered back in fp32
    gathered = moe_spec({**DEEPSEEK, "moe_token_dispatcher_type": "allgather"})
    found = expert_collectives(gathered)
    assert ("all_gather", "tp_ep", 8 * 4096 * 2048 * 2) in found["FORWARD"]
    assert ("reduce_scatter", "tp_ep", 8 * 4096 * 2048 * 4) in found["FORWARD"]
    # the shared expert is a dense MLP over the tensor-parallel group: its own all-gather and reduce-scatter
    tp2 = moe_spec({**DEEPSEEK, "tensor_model_parallel_size": 2})
    assert tp_collectives_per_layer(tp2) == {"all_gather": 2, "reduce_scatter": 2}
    assert tp_collectives_per_layer(moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2})) == {
        "all_gather": 1, "reduce_scatter": 1}


def test_the_expert_groups_follow_megatrons_expert_rank_generator() -> None:
    """Expert ranks: RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp) in tp-cp-ep-dp-pp order (parallel_state)."""
    spec = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2})  # etp defaults to tp: 2 x 8 x 4 = 64, edp 1
    assert (spec.etp, spec.ep, spec.edp, spec.dp) == (2, 8, 1, 8)
    assert spec.group_ranks("ep") == list(range(0, 16, 2)) and spec.group_ranks("etp") == [0, 1]
    assert spec.group_nodes("ep") == (2, 4)
    one = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1})
    assert (one.etp, one.edp) == (1, 2) and one.group_ranks("ep") == list(range(8))
    assert one.group_nodes("ep") == (1, 8) and one.group_ranks("edp") == [0, 8]
    # an all-to-all whose group spans two nodes sends half its off-node share over the NICs: slower than in one
    device = load_model().device("h100_dgx")
    inside = collective_ms(one, device, "all_to_all", 64e6, "ep")
    across = collective_ms(spec, device, "all_to_all", 64e6, "ep")
    nic, nvlink = device.network_bandwidth_bytes_per_s / 1e3, device.intra_node_bandwidth_bytes_per_s / 1e3
    assert inside == pytest.approx(64e6 * 7 / 8 / nvlink)
    assert across == pytest.approx(max(64e6 * 3 / 8 / nvlink, 64e6 * 4 / 8 / nic))
    assert across > inside


def test_expert_parameters_split_over_ep_and_etp_and_their_state_over_the_expert_data_parallel_group() -> None:
    spec = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1})
    h, f = 4096, 14336
    # one local expert, with the biases the layer count carries (fc1's 2f, fc2's h)
    assert gpt.expert_parameters(spec.model) == 1 * (3 * h * f + 2 * f + h)
    wide = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2, "expert_model_parallel_size": 4})
    assert gpt.expert_parameters(wide.model) == 2 * ((3 * h * f + 2 * f) / 2 + h)  # two local experts, etp 2
    layout = layout_of(spec)
    context = Context(spec, layout, (load_model().device("h100_dgx"),) * spec.pp)
    layer, experts = gpt.layer_parameters(spec.model), gpt.expert_parameters(spec.model)
    rank = 1  # no embedding: 8 layers
    expected = 8 * ((layer - experts) / spec.dp + experts / spec.edp)
    assert optimizer_parameters(context, rank) == pytest.approx(expected)
    memory = stage_memory(spec, [80e9] * spec.pp, [1.0] * spec.pp)[rank]
    assert memory.optimizer_bytes == pytest.approx(12 * expected)
    assert memory.weights_bytes == pytest.approx(2 * 8 * layer)
    # the routed rows' activations: T x k of them, each fc1 input (h), fc1 output (2f) and activation (f)
    rows = 2048 * 2
    assert gpt.expert_activation_bytes(spec.model) == pytest.approx(
        2048 * 8 * (2 + 4) + rows * (12 + (h + 2 * f + f) * 2))


def test_the_shipped_terms_price_the_experts_flops_and_all_to_alls() -> None:
    model = load_model()
    spec = moe_spec(MIXTRAL)
    device = model.device("h100_dgx")
    context = Context(spec, layout_of(spec), (device,) * spec.pp)
    roofline = TERMS["decoder_roofline"]
    values = {**roofline.defaults(), "compute_efficiency": 0.5, "backward_factor": 2.0}
    # forward FLOPs of one layer on one GPU: attention, the routed experts at 2 of 8 (4096 tokens, one expert
    # each), the router
    s, h, f = 4096, 4096, 14336
    attention = 2 * s * h * (h + 2 * h * 8 / 32) + 2 * s * h * h + 4 * s * s * h
    experts = 3 * 2 * s * h * f * 2
    router = 2 * s * 8 * h
    per_ms = device.peak_bf16_flops_per_s * 0.5 / 1e3
    costs = roofline.contribute(context, values)
    assert costs.forward_ms[1] == pytest.approx(8 * (attention + experts + router) / per_ms, rel=1e-12)
    busy = roofline.contribute(context, {**values, "expert_load_imbalance": 1.5})
    assert busy.forward_ms[1] == pytest.approx(8 * (attention + 1.5 * experts + router) / per_ms, rel=1e-12)
    # a device type's own imbalance prices that type's GPUs only
    elsewhere = roofline.contribute(context, {**values, "expert_load_imbalance@cpu": 1.5})
    assert elsewhere.forward_ms == costs.forward_ms
    own = roofline.contribute(context, {**values, "expert_load_imbalance@h100_dgx": 1.5})
    assert own.forward_ms == busy.forward_ms
    # the all-to-alls: two forward and two backward per layer (and the probabilities'), over the EP group of 8
    comm = TERMS["tensor_parallel_comm"]
    params = comm.defaults()
    priced = comm.contribute(context, params)
    a2a = collective_ms(spec, device, "all_to_all", s * 2 * h * 2, "ep", step_latency_ms=0.005)
    probs = collective_ms(spec, device, "all_to_all", s * 2 * 4, "ep", step_latency_ms=0.005)
    splits = collective_ms(spec, device, "all_gather", 8 * 8 * 8, "tp_ep", step_latency_ms=0.005)  # E int64 x 8
    assert priced.forward_ms[1] == pytest.approx(8 * (2 * a2a + probs + splits), rel=1e-12)
    assert priced.backward_ms[1] == pytest.approx(8 * (2 * a2a + probs), rel=1e-12)
    # at t 1 they are all the term prices, and all of it is the breakdown's ep_comm
    assert priced.expert_comm_ms[1] == pytest.approx(priced.forward_ms[1] + priced.backward_ms[1], rel=1e-12)
    # the gradients: the dense ones over dp 16, the experts' over the expert data-parallel group of 2
    reduce = TERMS["data_parallel_grad_reduce"].contribute(context, TERMS["data_parallel_grad_reduce"].defaults())
    dense = 8 * (gpt.layer_parameters(spec.model) - gpt.expert_parameters(spec.model))
    expert = 8 * gpt.expert_parameters(spec.model)
    expected = (collective_ms(spec, device, "reduce_scatter", dense * 4, "dp", step_latency_ms=0.005)
                + collective_ms(spec, device, "reduce_scatter", expert * 4, "edp", step_latency_ms=0.005))
    assert reduce.grad_reduce_ms[1] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("changes,field", [
    ({"num_experts": 6}, "--expert-model-parallel-size"),
    ({"expert_model_parallel_size": 16, "num_experts": 16, "pipeline_model_parallel_size": 8},
     "--expert-model-parallel-size"),
    ({"num_experts": None}, "--expert-model-parallel-size"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": False}, "--sequence-parallel"),
    ({"moe_router_topk": 9}, "--moe-router-topk"),
    ({"moe_ffn_hidden_size": 14335, "expert_tensor_parallel_size": 2, "expert_model_parallel_size": 4},
     "--moe-ffn-hidden-size"),
    ({"disable_bias_linear": False, "expert_tensor_parallel_size": 2, "expert_model_parallel_size": 4},
     "--expert-tensor-parallel-size"),
    ({"moe_pad_expert_input_to_capacity": True}, "--moe-pad-expert-input-to-capacity"),
    ({"rank_order": "tp-cp-dp-pp"}, "--rank-order"),
    ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type"),
    ({"moe_layer_freq": 2}, "--moe-layer-freq"),
    ({"moe_layer_recompute": True}, "--moe-layer-recompute"),
    ({"moe_router_dtype": "fp64"}, "--moe-router-dtype"),
    ({"use_megatron_fsdp": True}, "--use-megatron-fsdp"),
    ({"fp8_format": "hybrid"}, "--fp8-format"),
])
def test_what_megatron_refuses_or_the_model_does_not_price_is_refused_naming_the_flag(changes, field) -> None:
    with pytest.raises(TraceError) as caught:
        moe_spec({**MIXTRAL, **changes})
    assert caught.value.field == field


def test_every_layer_moe_patterns_are_accepted_and_dense_launches_keep_their_spec() -> None:
    assert moe_spec({**MIXTRAL, "moe_layer_freq": "([1]*32)"}).model.moe
    assert moe_spec({**MIXTRAL, "moe_layer_freq": [1] * 32}).model.moe
    dense = moe_spec({**MIXTRAL, "num_experts": None, "expert_model_parallel_size": 1})
    assert not dense.model.moe and dense.etp == dense.tp and dense.edp == dense.dp
    shape = json.loads(dense.to_json())["model"]  # old specs stay as they were: the new fields only when set
    assert not {"num_experts", "expert_parallel", "moe_dispatcher"} & set(shape)
    spec = moe_spec(MIXTRAL)
    assert type(spec).from_json(spec.to_json()) == spec


def _mixtral_job(root: Path, args: str = "") -> Path:
    """A job directory of a Mixtral-like launch on 8 DGX H100 nodes (64 GPUs): t 1, p 4, EP 8, as docs/kernels.md
    lays one out (megatron_args.txt, hops_trace_map.json, hops.base.yaml)."""
    job = root / "mixtral"
    job.mkdir(parents=True)
    (job / "megatron_args.txt").write_text(
        "torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 1 "
        "--pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --num-experts 8 --moe-router-topk 2 "
        "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 1e-2 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
        "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 4096 "
        "--max-position-embeddings 32768 --micro-batch-size 1 --global-batch-size 256 --swiglu --normalization "
        "RMSNorm --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16 --transformer-impl "
        f"transformer_engine --vocab-size 32000 --train-iters 20 {args}\n")
    (job / "hops_trace_map.json").write_text(json.dumps({"stages": {str(k): f"gpu{k}" for k in range(4)}}))
    (job / "hops.base.yaml").write_text(
        "hardware:\n  devices:\n" + "".join(f"  - {{id: gpu{k}, gpu: h100_dgx}}\n" for k in range(4)))
    return job


def test_predict_job_prices_a_mixtral_launch_on_64_h100s(tmp_path: Path) -> None:
    job = _mixtral_job(tmp_path)
    result = CliRunner().invoke(app, ["predict", "--job", str(job), "--json", "--kernels"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    prediction = data["predictions"][0]
    assert math.isfinite(prediction["iteration_time_ms"]) and prediction["iteration_time_ms"] > 0
    assert 0.20 <= prediction["mfu"] <= 0.60, prediction["mfu"]
    # MFU counts the routed experts as Megatron does: topk of them per token, as a dense MLP of topk x f_moe
    spec = moe_spec(MIXTRAL)
    dense = moe_spec({**MIXTRAL, "num_experts": None, "expert_model_parallel_size": 1, "ffn_hidden_size": 2 * 14336})
    assert gpt.model_flops_per_sample(spec.model) == pytest.approx(gpt.model_flops_per_sample(dense.model), rel=1e-12)
    peak = load_model().device("h100_dgx").peak_bf16_flops_per_s
    assert prediction["mfu"] == pytest.approx(
        prediction["samples_per_s"] * gpt.model_flops_per_sample(spec.model) / 64 / peak, rel=1e-9)
    names = {k["kernel"] for k in data["kernels"]["kernels"]}
    assert {"mlp.router", "mlp.experts.linear_fc1", "mlp.dispatch_all_to_all", "mlp.combine_all_to_all"} <= names
    # the expert all-to-alls are priced with the stages' collectives (shown apart: at t 1 they are all of them),
    # the expert gradients with the reduction
    for stage in data["breakdown_ms_per_iteration"]:
        assert stage["ep_comm"] > 0 and stage["tp_comm"] == 0 and stage["dp_reduce"] > 0
    # with the expert-parallel group across two nodes (t 2: etp 2 x ep 8 = 16 GPUs) the all-to-alls take longer
    wide = _mixtral_job(tmp_path / "wide", "--sequence-parallel").parent / "mixtral"
    text = (wide / "megatron_args.txt").read_text()
    (wide / "megatron_args.txt").write_text(text.replace("--tensor-model-parallel-size 1",
                                                         "--tensor-model-parallel-size 2"))
    result = CliRunner().invoke(app, ["predict", "--job", str(wide), "--json"])
    assert result.exit_code == 0, result.output
    across = json.loads(result.output)["breakdown_ms_per_iteration"]
    assert all(a["ep_comm"] > 1.5 * b["ep_comm"] for a, b in zip(across, data["breakdown_ms_per_iteration"]))


# the breakdown's categories that together are a rank's work (recompute, dp_reduce_exposed, dp_param_gather: parts)
WORK = ("compute", "tp_comm", "ep_comm", "p2p", "dp_reduce", "ends_allreduce", "optimizer", "host")


@pytest.mark.parametrize("args", [MIXTRAL, {**MIXTRAL, "tensor_model_parallel_size": 2}, DEEPSEEK],
                         ids=["mixtral", "mixtral-t2", "deepseek"])
def test_the_breakdown_shows_the_expert_collectives_apart_and_its_total_stays(args: dict, monkeypatch) -> None:
    """ep_comm is the dispatcher's collectives taken out of tp_comm: the same model without the split (the term's
    expert_comm_ms dropped) gives the same work per rank, its tp_comm being tp_comm + ep_comm; ep_comm is the
    microbatches times each virtual stage's layers' expert collectives (forward, and backward), priced alone."""
    model, spec = load_model(), moe_spec(args)
    split = model.breakdown(spec)
    comm = TERMS["tensor_parallel_comm"]
    contribute = type(comm).contribute
    monkeypatch.setattr(type(comm), "contribute", lambda self, context, params: replace(
        contribute(self, context, params), expert_comm_ms=()))
    whole = model.breakdown(spec)
    monkeypatch.undo()
    for after, before in zip(split, whole):
        assert before["ep_comm"] == 0 and after["ep_comm"] > 0
        assert sum(after[k] for k in WORK) == pytest.approx(sum(before[k] for k in WORK), rel=1e-12)
        assert after["tp_comm"] + after["ep_comm"] == pytest.approx(before["tp_comm"], rel=1e-12)
        assert {k: v for k, v in after.items() if k not in ("tp_comm", "ep_comm")} == {
            k: v for k, v in before.items() if k not in ("tp_comm", "ep_comm")}
    context = model.context(spec)
    params = model.term_params(model.active("tensor_parallel_comm"))
    rates = {k: comm.value(params, k, "h100_dgx") for k in ("efficiency", "step_latency_ms", "contention_step_ms")}
    device = context.devices[0]
    per_layer = sum(collective_ms(spec, device, op, nbytes, group, stage=0, **rates,
                                  connection_cap_bytes_per_ms=context.connection_cap_bytes_per_ms)
                    for phase in ("FORWARD", "BACKWARD") for op, group, nbytes in expert_collectives(spec)[phase])
    assert split[0]["ep_comm"] == pytest.approx(
        spec.microbatches * spec.layers_per_stage[0] * per_layer, rel=1e-12)
    if spec.tp == 1:
        assert all(part["tp_comm"] == 0 for part in split)


def test_a_rank_logs_printed_defaults_read_as_megatrons_defaults() -> None:
    """Megatron-LM's arguments block prints None for the MoE settings left at their defaults: etp = t, f_moe = f,
    no shared expert, dropless."""
    printed = {**MIXTRAL, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": None,
               "moe_ffn_hidden_size": None, "moe_shared_expert_intermediate_size": None,
               "moe_expert_capacity_factor": None, "moe_layer_freq": 1, "moe_router_dtype": None,
               "moe_shared_expert_overlap": False, "moe_layer_recompute": False, "moe_router_topk": 2}
    spec = moe_spec(printed)
    assert spec.model == moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2}).model
    assert (spec.etp, spec.model.expert_ffn, spec.model.moe_shared_expert_ffn) == (2, 14336, 0)
    assert spec.model.moe_capacity_factor is None and spec.model.moe_dispatcher == "alltoall"


CAPTURE = Path(__file__).resolve().parents[2] / "traces" / "cpu_moe_e2_ep2_k1_l4_h256_s128_m4_run1"


def test_the_expert_collectives_are_those_the_shipped_moe_capture_records() -> None:
    """The CPU capture of megatron-core's MoE layer (2 experts on 2 expert-parallel ranks, top-1, alltoall, fp32;
    tests/capture/test_moe_capture.py) records every collective of its token dispatcher with its bytes: per layer
    and microbatch, the kernel list's (`expert_collectives`) are its calls one for one, their bytes the ranks' mean
    (a rank's combine carries the rows its expert got, the balanced share on average)."""
    from collections import defaultdict

    from hops_calib.spec.job_dir import build_spec

    spec = build_spec(CAPTURE)
    assert spec.model.moe and (spec.ep, spec.edp, spec.model.moe_router_topk) == (2, 1, 1)
    listed = expert_collectives(spec)
    recorded: dict[tuple, list[float]] = defaultdict(list)
    calls: dict[tuple, int] = defaultdict(int)
    for rank in (0, 1):
        for line in (CAPTURE / "megatron_trace" / f"rank{rank}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("event_type") == "collective" and event.get("group") == "ep":
                key = (event["iteration"], event["microbatch"], event["layer"], event["phase"])
                recorded[(*key, event["collective"])].append(event["bytes"])
                calls[(*key, event["collective"], rank)] += 1
    assert recorded
    for (iteration, microbatch, layer, phase, kind), found in recorded.items():
        mine = [nbytes for op, _, nbytes in listed[phase] if op == kind]
        assert calls[(iteration, microbatch, layer, phase, kind, 0)] == len(mine), (phase, kind)
        assert sum(found) / 2 == pytest.approx(sum(mine)), (phase, kind)
    assert {op for op, _, _ in listed["FORWARD"]} == {"all_gather", "all_to_all"}


def combine_loads(capture: Path) -> dict[tuple, tuple[float, ...]]:
    """Per (iteration, microbatch, layer), the tokens each rank's expert computed: its forward combine all-to-all
    returns one h-wide fp32 row per token it computed (the capture's hidden size)."""
    from hops_calib.spec.job_dir import build_spec

    row = build_spec(capture).model.hidden_size * 4
    loads: dict[tuple, dict[int, float]] = {}
    for rank in (0, 1):
        for line in (capture / "megatron_trace" / f"rank{rank}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("moe_step") == "combine" and event.get("phase") == "FORWARD":
                key = (event["iteration"], event["microbatch"], event["layer"])
                loads.setdefault(key, {})[rank] = event["bytes"] / row
    return {key: tuple(v[r] for r in sorted(v)) for key, v in loads.items()}


def test_the_captures_untrained_router_is_measured_from_its_combine_bytes() -> None:
    """What `expert_load_imbalance` prices, measured: the busiest rank's tokens over the balanced share, per layer
    (both ranks' tokens add up to all the tokens routed once, top-1), the quantity the @cpu value is read from."""
    loads = combine_loads(CAPTURE)
    spec_tokens = 2 * 128 * 1  # two ranks' microbatches of s 128 x micro batch 1, each token to one expert
    assert loads and all(sum(v) == spec_tokens for v in loads.values())
    imbalance = [max(v) / (sum(v) / len(v)) for v in loads.values()]
    assert all(1.0 <= x <= 2.0 for x in imbalance) and max(imbalance) > 1.5  # one layer routes nearly all to one


def test_the_routers_losses_add_their_kernels_only_when_their_coefficients_are_set() -> None:
    plain = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2})
    assert not plain.model.moe_aux_loss and not any("aux" in k.name for k in K.layer_forward(plain.model,
                                                                                         kernel_settings(plain)))
    spec = moe_spec({**MIXTRAL, "tensor_model_parallel_size": 2, "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3})
    forward = {k.name: k for k in K.layer_forward(spec.model, kernel_settings(spec))}
    backward = {k.name for k in K.layer_backward(spec.model, kernel_settings(spec))}
    reduce = forward["mlp.router.aux_tokens_all_reduce"]
    assert (reduce.kind, reduce.group, reduce.bytes) == ("all_reduce", "tp_cp", 8 * 8)  # E int64 counts
    assert {"mlp.router.aux_scores", "mlp.router.aux_loss", "mlp.router.z_loss"} <= set(forward)
    assert {"mlp.router.aux_loss.backward", "mlp.router.z_loss.backward"} <= backward
    assert spec.group_ranks("tp_cp") == [0, 1]
    sinkhorn = moe_spec({**MIXTRAL, "moe_aux_loss_coeff": 1e-2, "moe_router_load_balancing_type": "sinkhorn"})
    assert not sinkhorn.model.moe_aux_loss
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(spec.megatron_args, 256), rel=1e-12)


def test_a_deepseek_like_launch_is_priced_with_its_shared_expert() -> None:
    from hops_calib.model.predict import predict
    from hops_calib.whatif.job import model_rates

    model = load_model()
    peak = model.device("h100_dgx").peak_bf16_flops_per_s
    with_shared = predict(moe_spec(DEEPSEEK), model)
    without = predict(moe_spec({**DEEPSEEK, "moe_shared_expert_intermediate_size": None}), model)
    rates = model_rates(with_shared, moe_spec(DEEPSEEK), peak)
    assert 0.1 <= rates["mfu"] <= 0.6 and math.isfinite(with_shared.metrics.throughput_per_s)
    assert with_shared.metrics.throughput_per_s <= without.metrics.throughput_per_s
    # the shared expert (2 x 1408 wide, on every token) adds a third of the routed experts' 6 x 1408 to the MLP's
    # FLOPs: the roofline's layer time grows by that much (the stage may still sit on the layers' launch floor)
    roofline = TERMS["decoder_roofline"]
    device = model.device("h100_dgx")

    def layer_ms(args: dict) -> float:
        spec = moe_spec(args)
        return roofline.contribute(Context(spec, layout_of(spec), (device,) * spec.pp),
                                   load_model().term_params(load_model().active("decoder_roofline"))).forward_ms[0]

    grown = layer_ms(DEEPSEEK) - layer_ms({**DEEPSEEK, "moe_shared_expert_intermediate_size": None})
    per_ms = device.peak_bf16_flops_per_s * model.term_params(model.active("decoder_roofline"))[
        "compute_efficiency@h100_dgx"] / 1e3
    assert grown == pytest.approx(13 * 3 * 2 * 4096 * 2048 * 2816 / per_ms, rel=1e-9)
