"""Context parallelism (issue #28, section 2): the sequence split s / cp for every kernel but attention's keys, the
load-balanced causal attention of TE's context-parallel attention, its KV exchanges, the gradient group dp x cp and
memory, checked against closed forms on a Llama-shaped launch."""

from __future__ import annotations

import dataclasses

import pytest
from test_kernels import LLAMA_70B, iteration_model_flops

from hops_calib.loop.model_files import load_model
from hops_calib.model import gpt, memory
from hops_calib.model import kernels as K
from hops_calib.model.collectives import collective_ms, group_size, ring_bandwidth_bytes_per_ms
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError

# Llama 3 70B at t 8, p 4, cp 2 on 512 GPUs: dp 8
CP2 = {**LLAMA_70B, "context_parallel_size": 2, "world_size": 512}


def h100_spec(args: dict):
    return spec_from_args(args, "test", run_id="cp", iterations=2, hardware=Hardware(gpu="h100", gpus_per_node=8))


def layer(spec, **settings) -> tuple[K.Kernel, ...]:
    s = dataclasses.replace(kernel_settings(spec), **settings)
    return K.layer_forward(spec.model, s) + K.layer_backward(spec.model, s)


def is_attention(kernel: K.Kernel) -> bool:
    return kernel.op == K.ATTENTION or ".cp_" in kernel.name or "core_flash" in kernel.name


def test_cp_splits_the_gpus_and_every_non_attention_kernel_sees_s_over_cp_tokens() -> None:
    spec = h100_spec(CP2)
    assert (spec.tp, spec.cp, spec.pp, spec.dp, spec.gpus) == (8, 2, 4, 8, 512)
    assert group_size(spec, "dp_cp") == 16 and group_size(spec, "cp") == 2
    # Megatron's default order tp-cp-ep-dp-pp: the cp group's two GPUs sit t ranks apart
    assert spec.group_ranks("cp") == [0, 8] and spec.group_ranks("dp_cp")[:3] == [0, 16, 32]
    # the same launch with half the sequence and no CP: every kernel outside attention is the same
    half = h100_spec({**LLAMA_70B, "seq_length": LLAMA_70B["seq_length"] // 2})
    split = [k for k in layer(spec) if not is_attention(k)]
    assert split == [k for k in layer(half) if not is_attention(k)]
    qkv = next(k for k in split if k.name == "attention.linear_qkv")
    assert qkv.m == LLAMA_70B["seq_length"] // 2 * LLAMA_70B["micro_batch_size"]
    # the whole launch still counts Megatron's FLOPs (the kernels per GPU x tp x cp x dp)
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(CP2, 128), rel=1e-12)
    # each GPU does 1/cp of the causal attention work
    plain = h100_spec(LLAMA_70B)
    attention = sum(k.model_flops for k in layer(spec) if k.op == K.ATTENTION)
    assert attention == pytest.approx(sum(k.model_flops for k in layer(plain) if k.op == K.ATTENTION) / 2)
    # CP needs TE's fused attention, and 2 cp chunks of each sequence
    with pytest.raises(TraceError) as caught:
        h100_spec({**CP2, "transformer_impl": "local"})
    assert "--context-parallel-size" in str(caught.value)
    with pytest.raises(TraceError, match="2 x --context-parallel-size"):
        h100_spec({**CP2, "seq_length": 8190})


@pytest.mark.parametrize("cp", [2, 4])
def test_the_p2p_ring_runs_cp_balanced_steps_with_cp_minus_1_kv_exchanges(cp: int) -> None:
    """p2p: cp flash steps of 2 c^2 score entries each (c = s / 2cp), step 0 with its causal diagonal blocks; cp - 1
    exchanges of the GPU's k and v (2 x s/cp x b x g/t x head x 2 B) forward, twice that backward, each overlapped."""
    spec = h100_spec({**LLAMA_70B, "context_parallel_size": cp, "world_size": 256 * cp})
    d = K._dims(spec.model)
    c = d.s // (2 * cp)
    entries = 4.0 * d.b * d.heads * d.head
    kernels = layer(spec)
    steps = [k for k in kernels if k.op == K.ATTENTION and k.phase == K.FORWARD]
    assert len(steps) == cp and all(k.model_flops == 2 * c * c * entries for k in steps)
    assert steps[0].flops == 2 * c * c * entries + min(K.FLASH_BLOCK, c) * c * entries
    exchanges = [k for k in kernels if k.kind == "send_recv"]
    kv = 2 * d.tokens * d.kv * 2
    assert [k.bytes for k in exchanges if k.phase == K.FORWARD] == [kv] * (cp - 1)
    assert [k.bytes for k in exchanges if k.phase == K.DGRAD] == [2 * kv] * (cp - 1)
    assert all(k.overlapped and k.group == "cp" for k in exchanges)
    # a2a: q, k, v and the output all-to-all'd, one kernel on a / (t cp) heads over the whole sequence
    a2a = layer(spec, cp_comm_type="a2a")
    core = [k for k in a2a if k.op == K.ATTENTION and k.phase == K.FORWARD]
    assert len(core) == 1 and core[0].batch == d.b * d.heads // cp and core[0].m == d.s
    assert core[0].model_flops == pytest.approx(sum(k.model_flops for k in steps))
    assert [k.kind for k in a2a if k.group == "cp"] == ["all_to_all"] * 4
    # allgather: the KV of the whole group gathered, its gradient reduce-scattered
    gathered = [k for k in layer(spec, cp_comm_type="allgather") if k.group == "cp"]
    assert [(k.kind, k.bytes) for k in gathered] == [("all_gather", kv * cp), ("reduce_scatter", kv * cp)]


def test_cp_exchanges_are_priced_over_the_cp_hop_and_memory_follows_the_split() -> None:
    spec = h100_spec(CP2)
    device = load_model().device("h100")
    hop = ring_bandwidth_bytes_per_ms(spec, device, "cp")
    assert collective_ms(spec, device, "send_recv", 1e8, "cp") == pytest.approx(1e8 / hop)
    assert collective_ms(spec, device, "all_to_all", 1e8, "cp") == pytest.approx(0.5e8 / hop)
    # the stored activations and the logits per GPU are those of s / cp tokens; the optimizer state is sharded
    # over dp x cp under the distributed optimizer
    half = dataclasses.replace(spec.model, seq_length=spec.model.seq_length // 2, context_parallel=1)
    assert gpt.layer_activation_bytes(spec.model) == gpt.layer_activation_bytes(half)
    assert gpt.local_tokens(spec.model) == half.seq_length * half.micro_batch_size
    sharded = h100_spec({**CP2, "use_distributed_optimizer": True})
    whole = memory.stage_memory(h100_spec(CP2), [80e9] * 4, [4.0] * 4)
    split = memory.stage_memory(sharded, [80e9] * 4, [4.0] * 4)
    assert split[0].optimizer_bytes == pytest.approx(whole[0].optimizer_bytes / 16)


def test_the_kernel_table_prices_the_ring_and_says_what_stays_exposed() -> None:
    from hops_calib.model.kernel_table import cp_ring_exposed_ms, kernel_table

    spec = h100_spec(CP2)
    table = kernel_table(load_model(), spec, 0)
    exchanges = [r for r in table.rows if r.kind == "send_recv"]
    assert exchanges and all(r.ms > 0 and r.bound == "overlapped collective" for r in exchanges)
    step = next(r for r in table.rows if r.name == "attention.core_flash.cp_step0")
    forward = next(r for r in exchanges if r.phase == K.FORWARD)
    assert cp_ring_exposed_ms(table.rows, K.FORWARD) == pytest.approx(max(0.0, forward.ms - step.ms))
    assert any("context parallelism (forward)" in note for note in table.notes)
