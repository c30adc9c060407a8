"""Megatron-FSDP (issue #28): what each --data-parallel-sharding-strategy shards and gathers, priced against the
compute it overlaps, on a realistic launch: Llama 3 70B on 64 H100 DGX (8 nodes, t 8 inside a node, d 8 across)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model
from hops_calib.model import fsdp, gpt
from hops_calib.model.collectives import collective_ms
from hops_calib.model.memory import gradient_bytes, stage_memory
from hops_calib.model.terms import TERMS
from hops_calib.model.terms.base import Context, layout_of
from hops_calib.model.terms.parallel import _rates
from hops_calib.spec import FSDP_STRATEGIES, Hardware, spec_from_args

# Llama 3 70B (Meta's model card: 80 layers, h 8192, FFN 28672, 64 heads, 8 KV heads, 128256 tokens), as NeMo and
# Megatron-LM's examples launch it, without dropout
LLAMA3_70B = (
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 --num-layers 80 --hidden-size 8192 "
    "--ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --seq-length 8192 "
    "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 --sequence-parallel --bf16 "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--transformer-impl transformer_engine --vocab-size 128256 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--train-iters 10"
)
DDP = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
ZERO3 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"


def _job(root: Path, flags: str) -> Path:
    root.mkdir(parents=True)
    (root / "megatron_args.txt").write_text(
        f"torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py {LLAMA3_70B} {flags}\n"
    )
    (root / "hops_trace_map.json").write_text(json.dumps({"stages": {"0": "gpu0"}}))
    (root / "hops.base.yaml").write_text("hardware:\n  devices:\n  - {id: gpu0, gpu: h100_dgx}\n")
    return root


def _predict(job: Path) -> dict:
    result = CliRunner().invoke(app, ["predict", "--job", str(job), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _args(flags: str) -> dict:
    from hops_calib.trace.megatron_args import parse_command_line

    return parse_command_line(f"pretrain_gpt.py {LLAMA3_70B} {flags}")


def _spec(flags: str):
    args = {**_args(flags), "world_size": 64}
    return spec_from_args(args, "megatron_args.txt", run_id="l70", iterations=1,
                          hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))


def test_zero3_on_64_h100_takes_less_memory_and_more_time_than_ddp_with_the_distributed_optimizer(tmp_path):
    ddp = _predict(_job(tmp_path / "ddp", DDP))
    zero3 = _predict(_job(tmp_path / "zero3", ZERO3))
    assert not [note for note in zero3["notes"] if "ignored" in note]  # the flags are known, not dropped
    # and no calibration run shards so: the prediction says it extrapolates
    assert {"feature": "Megatron-FSDP sharding", "value": "optim_grads_params", "calibrated": "none"} in zero3[
        "extrapolations"]
    plain, sharded = ddp["memory"][0], zero3["memory"][0]
    spec = _spec(ZERO3)
    d, parameters = spec.dp, gpt.stage_parameters(spec.model, 80, True, True, 1)
    # the weights and gradients sharded 8 ways, plus the gathered units and the gradients awaiting their
    # reduce-scatter; the optimizer state sharded as the distributed optimizer shards it; activations alike
    assert plain["weights_bytes"] == pytest.approx(parameters * 2)
    assert parameters * 2 / d < sharded["weights_bytes"] < plain["weights_bytes"] / 2
    assert parameters * 4 / d < sharded["gradients_bytes"] < plain["gradients_bytes"] / 2
    assert sharded["optimizer_bytes"] == pytest.approx(plain["optimizer_bytes"])
    assert sharded["activations_bytes"] == pytest.approx(plain["activations_bytes"])
    # on 80 GB H100s the launch fits only sharded (DDP's bf16 weights and fp32 gradients: 52 GB by themselves)
    assert sharded["fits"] and not plain["fits"]
    # ZeRO-3 gathers every layer twice and reduce-scatters its gradients on every microbatch, over the NICs (the
    # data-parallel group spans the 8 nodes): an iteration takes longer than DDP's one reduction per iteration
    ddp_ms = ddp["predictions"][0]["iteration_time_ms"]
    zero3_ms = zero3["predictions"][0]["iteration_time_ms"]
    assert zero3_ms > ddp_ms
    ddp_parts, zero3_parts = ddp["breakdown_ms_per_iteration"][0], zero3["breakdown_ms_per_iteration"][0]
    assert zero3_parts["dp_reduce"] > ddp_parts["dp_reduce"]
    assert zero3_parts["compute"] == pytest.approx(ddp_parts["compute"])
    # the difference is at most the collectives themselves: three per layer per microbatch
    device = load_model().device("h100_dgx")
    term = TERMS["data_parallel_grad_reduce"]
    rates = _rates(Context(spec=spec, layout=layout_of(spec), devices=(device,)), term.defaults(), device.type)
    unit = fsdp.unit_parameters(spec)
    per_layer = (2 * collective_ms(spec, device, "all_gather", unit * 2, "dp", **rates)
                 + collective_ms(spec, device, "reduce_scatter", unit * gradient_bytes(spec), "dp", **rates))
    assert zero3_ms - ddp_ms < 1.05 * spec.microbatches * 80 * per_layer


def test_each_strategy_shards_more_and_holds_less():
    device_bytes, peak = [80e9], [1.0]
    totals = {}
    for strategy in FSDP_STRATEGIES:
        spec = _spec(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} --ddp-bucket-size 40000000")
        totals[strategy] = stage_memory(spec, device_bytes, peak)[0]
    ddp = stage_memory(_spec(""), device_bytes, peak)[0]
    dist_opt = stage_memory(_spec("--use-distributed-optimizer"), device_bytes, peak)[0]
    # ZeRO-0 is DDP, ZeRO-1 the distributed optimizer
    assert totals["no_shard"].total_bytes == pytest.approx(ddp.total_bytes)
    assert totals["optim"].total_bytes == pytest.approx(dist_opt.total_bytes)
    # ZeRO-2 shards the gradients (40M-parameter buckets held unsharded until reduced), ZeRO-3 the weights as well
    assert totals["optim_grads"].gradients_bytes < totals["optim"].gradients_bytes
    assert totals["optim_grads"].weights_bytes == totals["optim"].weights_bytes
    assert totals["optim_grads_params"].weights_bytes < totals["optim_grads"].weights_bytes
    assert (totals["no_shard"].total_bytes > totals["optim"].total_bytes > totals["optim_grads"].total_bytes
            > totals["optim_grads_params"].total_bytes)


def test_without_a_bucket_size_zero2_holds_the_chunks_whole_gradient_bucket_until_its_reduce_scatter():
    """BucketingPolicy with no --ddp-bucket-size puts a chunk's gradients outside FSDP units in one bucket, the
    temporary unsharded bucket the backward accumulates into before the reduce-scatter."""
    spec = _spec("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads")
    parameters = gpt.stage_parameters(spec.model, 80, True, True, 1)
    memory = stage_memory(spec, [80e9], [1.0])[0]
    assert memory.gradients_bytes == pytest.approx(parameters * 4 / spec.dp + parameters * 4)


def test_the_gathered_units_follow_the_communication_unit():
    spec = _spec(ZERO3)
    unit = fsdp.unit_parameters(spec)
    # 2 x unit < 1e9: the floor; the gather prefetches ceil(0.5e9 / unit) units ahead, the queue floor(1e9 / unit)
    assert fsdp.communication_unit(spec) == fsdp.COMMUNICATION_UNIT_FLOOR
    assert fsdp.gathered_units(spec, 80) == 1 + -(-500_000_000 // int(unit))
    assert fsdp.reducing_units(spec, 80) == int(1e9 // unit) + 2
    assert fsdp.gathered_units(spec, 2) == 2  # at most the chunk's layers
    bigger = _spec(ZERO3 + " --suggested-communication-unit-size 4000000000")
    assert fsdp.gathered_units(bigger, 80) > fsdp.gathered_units(spec, 80)
    assert stage_memory(bigger, [80e9], [1.0])[0].weights_bytes > stage_memory(spec, [80e9], [1.0])[0].weights_bytes


def test_the_exposed_part_of_the_gathers_and_reduce_scatters():
    slow = fsdp.Unit(gather_ms=3.0, reduce_ms=4.0, forward_ms=2.0, backward_ms=4.0)
    forward, backward, tail = fsdp.exposed_ms([slow] * 5)
    # forward: the first gather, then what each gather outlasts the previous unit's forward
    assert forward == pytest.approx(3.0 + 4 * (3.0 - 2.0))
    # backward: the first gather, then the next gather and the previous reduce-scatter against a unit's backward
    assert backward == pytest.approx(3.0 + 4 * (3.0 + 4.0 - 4.0))
    assert tail == 4.0
    fast = fsdp.Unit(gather_ms=1.0, reduce_ms=1.0, forward_ms=2.0, backward_ms=4.0)
    assert fsdp.exposed_ms([fast] * 5) == (1.0, 1.0, 1.0)  # only the first gather and the last reduce show
    assert fsdp.exposed_ms([]) == (0.0, 0.0, 0.0)


def test_bf16_gradients_halve_the_zero3_reduce_scatters():
    spec, bf16 = _spec(ZERO3), _spec(ZERO3 + " --grad-reduce-in-bf16")
    device = load_model().device("h100_dgx")
    term = TERMS["data_parallel_grad_reduce"]

    def part(s):
        return term.contribute(Context(spec=s, layout=layout_of(s), devices=(device,)), term.defaults())

    fp32_part, bf16_part = part(spec), part(bf16)
    assert bf16_part.backward_ms[0] < fp32_part.backward_ms[0]
    assert bf16_part.forward_ms[0] == pytest.approx(fp32_part.forward_ms[0])  # the gathers move 16-bit weights
    rates = _rates(Context(spec=spec, layout=layout_of(spec), devices=(device,)), term.defaults(), device.type)
    # the last reduce-scatter after the backward: the embedding's gradients, 2 bytes each instead of 4
    embedding = gpt.stage_parameters(spec.model, 0, True, False, 1)
    assert bf16_part.grad_reduce_ms[0] == pytest.approx(
        collective_ms(bf16, device, "reduce_scatter", embedding * 2, "dp", **rates))
    assert fp32_part.grad_reduce_ms[0] == pytest.approx(
        collective_ms(spec, device, "reduce_scatter", embedding * 4, "dp", **rates))


def test_zero2_reduce_scatters_every_microbatch_and_gathers_the_weights_after_the_step():
    device = load_model().device("h100_dgx")
    term = TERMS["data_parallel_grad_reduce"]

    def part(flags):
        spec = _spec(f"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads {flags}")
        context = Context(spec=spec, layout=layout_of(spec), devices=(device,))
        return spec, term.contribute(context, term.defaults()), _rates(context, term.defaults(), device.type)

    spec, after_step, rates = part("")
    parameters = gpt.stage_parameters(spec.model, 80, True, True, 1)
    reduce = collective_ms(spec, device, "reduce_scatter", parameters * 4, "dp", **rates)
    # one bucket of the chunk's gradients: its reduce-scatter after each backward, the whole of it the last tail
    assert after_step.grad_reduce_ms == after_step.grad_reduce_tail_ms == (pytest.approx(reduce),)
    assert after_step.forward_ms == (0.0,)  # the weights are whole: no gather before a forward
    flops_per_ms = device.peak_bf16_flops_per_s / 1e3
    head = 2.0 * gpt.local_tokens(spec.model) * spec.model.hidden_size * gpt.vocab_per_gpu(spec.model)
    compute = 3 * (80 * gpt.layer_forward_flops(spec.model) + head) / flops_per_ms
    assert after_step.backward_ms[0] == pytest.approx(max(0.0, reduce - compute))
    # the updated weights gathered from their shards after the step, unless the next forward overlaps them
    assert after_step.optimizer_ms == (pytest.approx(
        collective_ms(spec, device, "all_gather", parameters * 2, "dp", **rates)),)
    assert part("--overlap-param-gather")[1].optimizer_ms == ()


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_the_breakdowns_exposed_reduction_counts_what_fsdps_forwards_and_backwards_expose(strategy):
    """Megatron-FSDP prices only what its collectives expose: the gathers and reduce-scatters its forwards and
    backwards do not hide (per microbatch), the reduce-scatter after the last backward and the gathers after the
    step; the breakdown's exposed column is all of them, as it is the distributed optimizer's tail and gather."""
    model = load_model()
    spec = _spec(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}")
    term = model.active("data_parallel_grad_reduce")
    part = term.term.contribute(model.context(spec), model.term_params(term))
    in_stage = spec.microbatches * (part.forward_ms[0] + part.backward_ms[0])
    assert in_stage > 0
    gather = part.optimizer_ms[0] if part.optimizer_ms else 0.0
    parts = model.breakdown(spec)[0]
    assert parts["dp_reduce_exposed"] == pytest.approx(in_stage + part.grad_reduce_tail_ms[0] + gather, rel=1e-12)
    assert parts["dp_reduce_exposed"] == pytest.approx(parts["dp_reduce"], rel=1e-12)
    assert parts["dp_param_gather"] == pytest.approx(gather, rel=1e-12)
