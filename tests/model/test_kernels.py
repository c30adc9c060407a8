"""The layer as its kernels (hops_calib/model/kernels.py): FLOPs against Megatron's own count, the structure of
forward, backward and recomputation, and the bytes against the ATen ops a CPU run of megatron-core's layer issues."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import need_public_runs
from test_layer_traffic import count

from hops_calib.model import kernels as K
from hops_calib.model.terms.base import layout_of
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.model.terms.parallel import tp_collectives_per_layer
from hops_calib.spec import Hardware, ModelShape, spec_from_args
from hops_calib.store.fixture_store import FixtureStore
from hops_calib.trace import TraceError

REPO = Path(__file__).resolve().parents[2]

# GPT-3 175B as Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh launches it (96 layers, h 12288, 96 heads,
# s 2048), on 1,536 GPUs at t 8, p 16, with sequence parallelism and the distributed optimizer
GPT3_175B = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 16, "world_size": 1536,
             "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
             "max_position_embeddings": 2048, "micro_batch_size": 1, "global_batch_size": 1536, "vocab_size": 50257,
             "bf16": True, "sequence_parallel": True, "use_distributed_optimizer": True}
# Llama 3 70B's shape (80 layers, h 8192, 64 heads in 8 query groups, SwiGLU f 28672, RMSNorm, RoPE, no biases)
LLAMA_70B = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "world_size": 256, "num_layers": 80,
             "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64, "group_query_attention": True,
             "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 8192, "micro_batch_size": 1,
             "global_batch_size": 128, "vocab_size": 128256, "bf16": True, "swiglu": True, "normalization": "RMSNorm",
             "position_embedding_type": "rope", "disable_bias_linear": True, "untie_embeddings_and_output_weights":
             True, "sequence_parallel": True}


def iteration_model_flops(spec) -> float:
    """The Megatron-counted FLOPs of one iteration of the whole launch, from the kernels: every virtual stage's per
    microbatch, times the microbatches, the data-parallel replicas and the tensor-parallel GPUs (each kernel is one
    GPU's share)."""
    layout, settings = layout_of(spec), kernel_settings(spec)
    per_microbatch = sum(K.total_model_flops(K.stage_kernels(spec.model, settings, layers, first=k == 0,
                                                             last=k == layout.virtual_stages - 1).rows())
                         for k, layers in enumerate(layout.layers))
    return per_microbatch * spec.microbatches * spec.dp * spec.tp * spec.cp


def launch_spec(args: dict, run_id: str = "launch"):
    return spec_from_args(args, "test", run_id=run_id, iterations=2, hardware=Hardware(gpu="a100", gpus_per_node=8))


def test_megatron_flops_is_the_closed_form_of_a_gpt_layer() -> None:
    """At f = 4h with as many key/value heads as heads: 72 B s L h^2 (1 + s / 12h + V / 12Lh), Narayanan et al.'s
    eq. 3 without the recomputed forward (3/4 of 96) and with the causal half of the attention products."""
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    assert K.megatron_flops({**GPT3_175B, "vocab_size": V}, B) == pytest.approx(
        72 * B * s * L * h ** 2 * (1 + s / (12 * h) + V / (12 * L * h)), rel=1e-12)
    with pytest.raises(ValueError, match="multi-latent-attention"):
        K.megatron_flops({**GPT3_175B, "multi_latent_attention": True}, B)


@pytest.mark.parametrize("change", [
    {}, {"sequence_parallel": False}, {"transformer_impl": "local"},
    {"transformer_impl": "local", "masked_softmax_fusion": False, "attention_dropout": 0.0, "hidden_dropout": 0.0},
    {"recompute_granularity": "selective"}, {"recompute_granularity": "full", "recompute_method": "uniform"},
    {"micro_batch_size": 2, "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8},
])
def test_the_kernels_flops_add_up_to_megatrons_count_on_a_175b_launch(change: dict) -> None:
    args = {**GPT3_175B, **change}
    spec = launch_spec(args)
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(args, spec.model.global_batch_size),
                                                        rel=1e-12)


def test_the_kernels_flops_add_up_to_megatrons_count_with_gqa_swiglu_and_rope() -> None:
    spec = launch_spec(LLAMA_70B)
    assert spec.model.swiglu and spec.model.kv_heads == 8 and spec.model.position_embedding == "rope"
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(LLAMA_70B, 128), rel=1e-12)


def test_the_kernels_flops_add_up_to_megatrons_count_on_the_shipped_store() -> None:
    store = FixtureStore(REPO / "fixtures")
    ids = store.ids()
    assert len(ids) >= 10
    for fixture_id in ids:
        spec = store.load(fixture_id).spec
        args = spec.megatron_args
        assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(args, spec.model.global_batch_size),
                                                            rel=1e-12), fixture_id


def test_the_kernels_flops_add_up_to_megatrons_count_on_the_vtrain_launches() -> None:
    from hops_calib.trace.vtrain import read_vtrain_table

    runs = read_vtrain_table(need_public_runs("vtrain", "ground_truth_single.csv")).runs
    checked = 0
    for run in runs[::7]:
        try:
            spec = launch_spec(run.args, run.run_id)
        except TraceError:
            continue
        assert iteration_model_flops(spec) == pytest.approx(
            K.megatron_flops(run.args, spec.model.global_batch_size), rel=1e-12), run.run_id
        checked += 1
    assert checked > 100


def test_executed_flops_differ_from_the_count_only_in_the_attention_core() -> None:
    """Unfused attention multiplies the whole s x s score matrix (twice Megatron's causal half); flash attention
    runs the diagonal blocks whole and its backward recomputes the scores (2.5 x its forward's products)."""
    for impl in ("local", "transformer_engine"):
        spec = launch_spec({**GPT3_175B, "transformer_impl": impl})
        for kernel in K.layer_forward(spec.model, kernel_settings(spec)) + K.layer_backward(spec.model,
                                                                                              kernel_settings(spec)):
            if kernel.op == K.GEMM and not kernel.name.startswith("attention.scores") and not \
                    kernel.name.startswith("attention.context"):
                assert kernel.flops == kernel.model_flops == 2.0 * kernel.m * kernel.n * kernel.k, kernel.name
            elif kernel.op == K.GEMM:
                assert kernel.flops == 2 * kernel.model_flops
            elif kernel.op == K.ATTENTION and kernel.phase == K.FORWARD:
                assert kernel.flops == pytest.approx(kernel.model_flops * (1 + 128 / 2048))
            elif kernel.op == K.ATTENTION:
                assert kernel.flops == pytest.approx(kernel.model_flops * 1.25 * (1 + 128 / 2048))


def test_every_weight_gemm_has_its_input_and_weight_gradient() -> None:
    spec = launch_spec(GPT3_175B)
    settings = kernel_settings(spec)
    forward = {k.name: k for k in K.layer_forward(spec.model, settings) if k.op == K.GEMM}
    backward = {k.name: k for k in K.layer_backward(spec.model, settings) if k.op == K.GEMM}
    assert sorted(forward) == ["attention.linear_proj", "attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"]
    h, t = 12288, 8
    assert (forward["attention.linear_qkv"].m, forward["attention.linear_qkv"].n, forward["attention.linear_qkv"].k) \
        == (2048, 3 * h // t, h)
    for name, gemm in forward.items():
        dgrad, wgrad = backward[f"{name}.dgrad"], backward[f"{name}.wgrad"]
        assert (dgrad.phase, wgrad.phase) == (K.DGRAD, K.WGRAD)
        assert (dgrad.m, dgrad.n, dgrad.k) == (gemm.m, gemm.k, gemm.n)
        assert (wgrad.m, wgrad.n, wgrad.k) == (gemm.n, gemm.k, gemm.m)
        assert dgrad.flops == wgrad.flops == gemm.flops
        # gradient-accumulation fusion (Megatron's default): the weight gradient reads and writes fp32 main_grad
        assert wgrad.bytes == (gemm.n * gemm.m + gemm.m * gemm.k) * 2 + gemm.n * gemm.k * 8


def test_gqa_and_swiglu_shape_the_gemms() -> None:
    spec = launch_spec(LLAMA_70B)
    forward = {k.name: k for k in K.layer_forward(spec.model, kernel_settings(spec))}
    t, head = 8, 128
    assert forward["attention.linear_qkv"].n == (64 + 2 * 8) * head // t
    assert forward["mlp.linear_fc1"].n == 2 * 28672 // t and forward["mlp.linear_fc2"].k == 28672 // t
    assert forward["attention.core_flash"].batch == 64 // t
    assert {k.kind for k in forward.values() if k.op == K.MEMORY} >= {"rmsnorm", "swiglu", "rope"}
    assert not any(name.endswith("bias_add") for name in forward)  # --disable-bias-linear


def test_recomputation_reruns_what_megatron_reruns() -> None:
    selective = launch_spec({**GPT3_175B, "recompute_granularity": "selective"})
    rows = K.recomputed(selective.model, kernel_settings(selective), 6)
    assert [k.name for k, _ in rows] == ["attention.core_flash"] and rows[0][1] == 6
    unfused = launch_spec({**GPT3_175B, "recompute_granularity": "selective", "transformer_impl": "local"})
    names = [k.name for k, _ in K.recomputed(unfused.model, kernel_settings(unfused), 6)]
    assert names == ["attention.scores", "attention.softmax", "attention.dropout", "attention.context",
                     "attention.context_layout"]
    full = launch_spec({**GPT3_175B, "recompute_granularity": "full", "recompute_method": "block",
                        "recompute_num_layers": 2})
    rows = K.recomputed(full.model, kernel_settings(full), 6)
    assert [k.name for k, _ in rows] == [k.name for k in K.layer_forward(full.model, kernel_settings(full))]
    assert {n for _, n in rows} == {2} and {k.phase for k, _ in rows} == {K.RECOMPUTE}
    assert K.recomputed(launch_spec(GPT3_175B).model, kernel_settings(launch_spec(GPT3_175B)), 6) == ()


def test_tensor_parallel_collectives_and_their_sizes() -> None:
    """Forward: the collectives the TP term counts; backward under sequence parallelism also the all-gathers of the
    column-parallel inputs for their weight gradients (`LinearWithGradAccumulationAndAsyncCommunication.backward`)."""
    for sp in (False, True):
        spec = launch_spec({**GPT3_175B, "sequence_parallel": sp})
        settings = kernel_settings(spec)
        forward = [k for k in K.layer_forward(spec.model, settings) if k.op == K.COLLECTIVE]
        counted = {op: sum(1 for k in forward if k.kind == op) for op in {k.kind for k in forward}}
        assert counted == tp_collectives_per_layer(spec)
        assert {k.bytes for k in forward} == {2048 * 12288 * 2}
        backward = [k for k in K.layer_backward(spec.model, settings) if k.op == K.COLLECTIVE]
        kinds = sorted(k.kind for k in backward)
        assert kinds == (["all_gather"] * 4 + ["reduce_scatter"] * 2 if sp else ["all_reduce"] * 2)
        assert sum(k.overlapped for k in backward) == (4 if sp else 2)
    single = launch_spec({**GPT3_175B, "tensor_model_parallel_size": 1, "sequence_parallel": False,
                          "pipeline_model_parallel_size": 96, "world_size": 1536})
    assert not any(k.op == K.COLLECTIVE for k in K.layer_forward(single.model, kernel_settings(single)))


def test_sequence_parallelism_splits_the_norms_and_dropouts() -> None:
    kernels = {}
    for sp in (False, True):
        spec = launch_spec({**GPT3_175B, "sequence_parallel": sp})
        kernels[sp] = {k.name: k for k in K.layer_forward(spec.model, kernel_settings(spec))}
    for name in ("attention.input_norm", "mlp.pre_norm", "attention.bias_dropout_add"):
        assert kernels[True][name].bytes == pytest.approx(kernels[False][name].bytes / 8)
    assert kernels[True]["mlp.bias_gelu"].bytes == kernels[False]["mlp.bias_gelu"].bytes


def test_the_stage_ends_and_the_optimizer() -> None:
    spec = launch_spec({**GPT3_175B, "tensor_model_parallel_size": 1, "sequence_parallel": False,
                        "pipeline_model_parallel_size": 96, "world_size": 1536})
    settings = kernel_settings(spec)
    output = {k.name: k for k in K.output_kernels(spec.model, settings)}
    vocab, tokens = 50304, 2048
    assert (output["output.logits"].m, output["output.logits"].n, output["output.logits"].k) == (tokens, vocab, 12288)
    # the cross entropy's fp32 passes over the T x V logits: 9.5 forward, 3.5 backward (besides the GEMMs)
    logit = tokens * vocab * 4
    forward_passes = sum(k.bytes for k in output.values() if k.name.startswith("loss.") and k.phase == K.FORWARD
                         and k.op == K.MEMORY and k.bytes > logit / 10) / logit
    backward_passes = sum(k.bytes for k in output.values() if k.name.startswith("loss.grad")
                          and k.bytes > logit / 10) / logit
    assert (forward_passes, backward_passes) == (pytest.approx(9.5), pytest.approx(3.5))
    embedding = {k.name: k for k in K.embedding_kernels(spec.model, settings)}
    assert embedding["embedding.word_main_grad_add"].bytes == vocab * 12288 * 10
    optimizer = K.optimizer_kernels(spec.model, 1e9, 1, distributed=False)
    assert sum(k.bytes for k in optimizer) == pytest.approx(42e9)  # the optimizer term's 42 bytes per parameter
    assert sum(k.bytes for k in K.optimizer_kernels(spec.model, 1e9, 4, distributed=True)) == pytest.approx(
        4e9 + 38e9 / 4)


@pytest.mark.parametrize("hidden,seq,heads,ffn", [(192, 320, 3, 768), (128, 448, 2, 1024)])
def test_the_local_layers_kernels_move_the_bytes_its_aten_ops_move(hidden: int, seq: int, heads: int,
                                                                     ffn: int) -> None:
    """megatron-core's local layer with the cluster runs' flags (fusions off, dropout 0), run on the CPU under a
    dispatch mode (experiments/scripts/layer_traffic.py): every ATen op's reads and writes add up to the kernel
    list's bytes, forward and backward, and its GEMM FLOPs to the list's (the DDP hook's main_grad accumulation is
    outside the layer the script runs)."""
    out = count("--hidden", str(hidden), "--seq", str(seq), "--heads", str(heads), "--ffn", str(ffn))
    shape = ModelShape(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                       seq_length=seq, vocab_size=1024, precision="bf16")
    settings = K.KernelSettings(transformer_engine=False, softmax_fused=False, bias_activation_fusion=False,
                                bias_dropout_fusion=False, rope_fusion=False, gradient_accumulation_fusion=False,
                                hidden_dropout=0.0, attention_dropout=0.0)
    scores, hidden_pass, ffn_pass = heads * seq * seq * 2, seq * hidden * 2, seq * ffn * 2
    for phase, kernels in (("forward", K.layer_forward(shape, settings)), ("backward", K.layer_backward(shape, settings))):
        counted = out[phase]
        aten = (counted["score_passes"] * scores + counted["gemm_operand_bytes"]
                + counted["elementwise_hidden_passes"] * hidden_pass + counted["elementwise_ffn_passes"] * ffn_pass)
        listed = sum(k.bytes for k in kernels if not k.name.endswith("main_grad_add"))
        assert listed == pytest.approx(aten, rel=0.005), phase
        assert sum(k.flops for k in kernels if k.op == K.GEMM) == counted["gemm_flops"]
