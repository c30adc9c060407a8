"""Two memory terms (issue #28): the gradient buffer in bf16 under --grad-reduce-in-bf16 (and its data-parallel
reduction halved), and no dropout mask kept where a dropout's probability is 0."""

from __future__ import annotations

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.model import gpt
from hops_calib.model.collectives import collective_ms
from hops_calib.model.memory import bf16_gradients, dropout_mask_saving, gradient_bytes, stage_memory
from hops_calib.model.terms import TERMS
from hops_calib.model.terms.base import Context, layout_of
from hops_calib.model.terms.parallel import _rates, dp_buckets
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace.megatron_args import parse_command_line

# Llama 2 7B (Meta: 32 layers, h 4096, FFN 11008, 32 heads) on 16 H100 DGX: t 2 inside a node, p 2, d 4
LLAMA2_7B = (
    "pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 32 "
    "--hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 64 --sequence-parallel --bf16 "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --vocab-size 32000 --train-iters 10 "
    "--use-distributed-optimizer --overlap-grad-reduce"
)


def _spec(flags: str = "", launch: str = LLAMA2_7B):
    args = {**parse_command_line(f"{launch} {flags}"), "world_size": 16}
    return spec_from_args(args, "megatron_args.txt", run_id="l7", iterations=1,
                          hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))


PEAK = [2.0, 1.0]  # 1F1B's peak on two stages: two microbatches held on the first, one on the last


def test_grad_reduce_in_bf16_halves_the_gradient_buffer_and_the_dp_reduction():
    fp32, bf16 = _spec(), _spec("--grad-reduce-in-bf16")
    assert not bf16_gradients(fp32) and bf16_gradients(bf16)
    assert (gradient_bytes(fp32), gradient_bytes(bf16)) == (4, 2)
    before, after = stage_memory(fp32, [80e9] * 2, PEAK), stage_memory(bf16, [80e9] * 2, PEAK)
    for a, b in zip(before, after, strict=True):
        assert b.gradients_bytes == pytest.approx(a.gradients_bytes / 2)
        assert (b.weights_bytes, b.optimizer_bytes, b.activations_bytes) == (
            a.weights_bytes, a.optimizer_bytes, a.activations_bytes)
    # the reduce-scatter of the distributed optimizer moves 2 bytes a gradient instead of 4
    term = TERMS["data_parallel_grad_reduce"]
    device = load_model().device("h100_dgx")

    def reduced(spec):
        context = Context(spec=spec, layout=layout_of(spec), devices=(device,) * spec.pp)
        return term.contribute(context, term.defaults()), _rates(context, term.defaults(), device.type)

    (fp32_part, rates), (bf16_part, _) = reduced(fp32), reduced(bf16)
    parameters = gpt.stage_parameters(fp32.model, 16, False, True, 2)
    bucket = parameters / dp_buckets(fp32, parameters, 1)  # --overlap-grad-reduce: the last bucket is exposed
    assert bf16_part.grad_reduce_tail_ms[1] == pytest.approx(
        collective_ms(bf16, device, "reduce_scatter", bucket * 2, "dp", stage=1, **rates))
    assert fp32_part.grad_reduce_tail_ms[1] == pytest.approx(
        collective_ms(fp32, device, "reduce_scatter", bucket * 4, "dp", stage=1, **rates))
    assert bf16_part.grad_reduce_ms[1] < fp32_part.grad_reduce_ms[1]


def test_a_rank_logs_arguments_block_and_an_fp32_run_read_alike():
    block = _spec("--grad-reduce-in-bf16")
    block.megatron_args["accumulate_allreduce_grads_in_fp32"] = False  # what Megatron-LM prints with the flag
    assert gradient_bytes(block) == 2
    fp32 = _spec("--grad-reduce-in-bf16", LLAMA2_7B.replace("--bf16 ", ""))  # fp32 parameters: fp32 gradients
    assert fp32.model.precision == "fp32"
    assert not bf16_gradients(fp32) and gradient_bytes(fp32) == 4


def test_no_hidden_dropout_keeps_no_residual_masks():
    with_masks, without = _spec("--hidden-dropout 0.1"), _spec("--hidden-dropout 0.0")
    shape = with_masks.model
    s, b, h, t = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.tensor_parallel
    # two 1-byte masks of s x b x h per layer, split t ways under sequence parallelism
    assert dropout_mask_saving(shape, False, True) == pytest.approx(2 * s * b * h / t)
    before, after = stage_memory(with_masks, [80e9] * 2, PEAK), stage_memory(without, [80e9] * 2, PEAK)
    for rank, (a, c) in enumerate(zip(before, after, strict=True)):
        layers = with_masks.layers_per_stage[rank]
        assert a.activations_bytes - c.activations_bytes == pytest.approx(PEAK[rank] * layers * 2 * s * b * h / t)


def test_no_attention_dropout_keeps_no_score_mask_in_unfused_attention_and_flash_keeps_none_anyway():
    unfused = "--transformer-impl local --hidden-dropout 0.1"
    with_mask, without = _spec(f"{unfused} --attention-dropout 0.1"), _spec(f"{unfused} --attention-dropout 0.0")
    shape = with_mask.model
    assert shape.attention_kernel == "unfused"
    a, s, b, t = shape.num_attention_heads, shape.seq_length, shape.micro_batch_size, shape.tensor_parallel
    first = with_mask.layers_per_stage[0]
    saved = (stage_memory(with_mask, [80e9] * 2, PEAK)[0].activations_bytes
             - stage_memory(without, [80e9] * 2, PEAK)[0].activations_bytes)
    # the 1-byte mask and the 2-byte dropout output of the a x s x s x b scores, split t ways
    assert saved == pytest.approx(PEAK[0] * first * 3 * a * s * s * b / t)
    flash = [stage_memory(_spec(f"--attention-dropout {p}"), [80e9] * 2, PEAK)[0] for p in ("0.1", "0.0")]
    assert flash[0].activations_bytes == flash[1].activations_bytes


def test_bf16_gradients_halve_the_tied_embedding_all_reduce():
    from hops_calib.whatif.job import end_collective_of

    tied_fp32, tied_bf16 = _spec(), _spec("--grad-reduce-in-bf16")  # pp 2, embeddings tied (Megatron's default)
    assert not tied_fp32.model.untie_embeddings
    fp32_end, bf16_end = (end_collective_of(s, load_model()) for s in (tied_fp32, tied_bf16))
    assert bf16_end.nbytes == pytest.approx(fp32_end.nbytes / 2)
    assert bf16_end.nbytes == gpt.vocab_per_gpu(tied_fp32.model) * tied_fp32.model.hidden_size * 2
