"""The context_parallel_comm term: what of context parallelism's KV exchanges (p2p ring, a2a, allgather) the
attention does not hide, per decoder layer and microbatch, checked against closed forms priced by `collective_ms`
on a Llama-shaped launch at cp 2 and 4 (the cp group's GPUs t ranks apart, across nodes of 8 GPUs)."""

from __future__ import annotations

import pytest
from test_context_parallel import CP2, h100_spec
from test_kernels import LLAMA_70B

from hops_calib.loop.candidate import parse_candidate
from hops_calib.loop.model_files import load_model
from hops_calib.model import kernels as K
from hops_calib.model.collectives import collective_ms
from hops_calib.model.kernel_pricing import peak_flops_per_s
from hops_calib.model.model import ActiveTerm, Model
from hops_calib.model.terms import TERMS

TERM = TERMS["context_parallel_comm"]


def with_cp(**values: float) -> Model:
    return load_model().with_term(ActiveTerm(TERM, tuple({**TERM.defaults(), **values}.items())))


def contribution(spec, **values: float):
    return TERM.contribute(with_cp(**values).context(spec), {**TERM.defaults(), **values})


def cp_spec(cp: int, seq: int, **args):
    return h100_spec({**LLAMA_70B, "context_parallel_size": cp, "world_size": 256 * cp, "seq_length": seq,
                      "max_position_embeddings": max(seq, 8192), **args})


def price(spec, op: str, nbytes: float, rank: int = 0) -> float:
    """One collective over the cp group at the term's default rates (step latency 5 us, full efficiency)."""
    model = with_cp()
    return collective_ms(spec, model.device("h100"), op, nbytes, "cp", stage=rank, step_latency_ms=0.005,
                         connection_cap_bytes_per_ms=model.context(spec).connection_cap_bytes_per_ms)


def sizes(spec) -> tuple[float, float, float, float]:
    """(k and v of the GPU's s / cp tokens in bytes, FLOPs of one ring step's 2 c^2 score entries, of step 0's
    diagonal blocks on top, q's bytes), from the shape (c = s / 2cp, 4 b (a / t) head FLOPs an entry)."""
    shape = spec.model
    head = shape.hidden_size // shape.num_attention_heads
    tokens = shape.seq_length // spec.cp * shape.micro_batch_size
    c = shape.seq_length // (2 * spec.cp)
    per_entry = 4.0 * shape.micro_batch_size * shape.num_attention_heads // spec.tp * head
    kv = 2 * tokens * (shape.kv_heads // spec.tp) * head * 2
    q = tokens * (shape.num_attention_heads // spec.tp) * head * 2
    return kv, 2.0 * c * c * per_entry, min(K.FLASH_BLOCK, c) * c * per_entry, q


def test_without_context_parallelism_the_term_adds_nothing() -> None:
    spec = h100_spec(LLAMA_70B)
    assert spec.cp == 1
    empty = contribution(spec)
    assert empty.forward_ms == () and empty.backward_ms == ()


@pytest.mark.parametrize("cp", [2, 4])
def test_a_short_sequence_exposes_each_ring_exchange_past_its_step(cp: int) -> None:
    """At s 1024 the steps are far shorter than the exchanges across nodes: exposed per layer and stage, forward
    sum_k (exchange - step_k) over the cp - 1 exchanges, backward the same at twice the bytes against the
    backward's steps (`FLASH_BACKWARD_PRODUCTS` x the FLOPs)."""
    spec = cp_spec(cp, 1024)
    assert spec.group_nodes("cp") == (cp, 1)  # t ranks apart: one GPU of the group on each node
    kv, step, diagonal, _ = sizes(spec)
    peak = peak_flops_per_s(load_model().device("h100"), "bf16") / 1e3
    forward_x, backward_x = price(spec, "send_recv", kv), price(spec, "send_recv", 2 * kv)
    steps = [(step + diagonal) / peak] + [step / peak] * (cp - 2)
    assert forward_x > steps[0] * K.FLASH_BACKWARD_PRODUCTS  # every step shorter than its exchange
    forward = sum(forward_x - s for s in steps)
    backward = sum(backward_x - s * K.FLASH_BACKWARD_PRODUCTS for s in steps)
    part = contribution(spec)
    layers = spec.layers_per_stage
    assert part.forward_ms == pytest.approx([n * forward for n in layers], rel=1e-12)
    assert part.backward_ms == pytest.approx([n * backward for n in layers], rel=1e-12)
    # a slower attention hides more: at half the peak each step takes twice as long
    slower = contribution(spec, attention_efficiency=0.5)
    assert slower.forward_ms[0] == pytest.approx(layers[0] * sum(forward_x - 2 * s for s in steps), rel=1e-12)


def test_a_long_sequence_hides_the_ring_under_its_attention() -> None:
    """At s 128k a step's 2 c^2 entries take milliseconds, its exchange (k and v of 64k tokens) less: none exposed."""
    spec = cp_spec(2, 131072)
    kv, step, _, _ = sizes(spec)
    assert price(spec, "send_recv", 2 * kv) < step / (peak_flops_per_s(load_model().device("h100"), "bf16") / 1e3)
    part = contribution(spec)
    assert part.forward_ms == (0.0,) * 4 and part.backward_ms == (0.0,) * 4


def test_a2a_and_allgather_block_on_every_collective() -> None:
    """a2a: forward q, k, v all-to-all'd in, the output out; backward the output gradient in, the q, k, v gradients
    out. allgather: the group's KV all-gathered forward, its gradient reduce-scattered backward. All exposed."""
    spec = cp_spec(2, 8192, cp_comm_type="a2a")
    kv, _, _, q = sizes(spec)
    both = price(spec, "all_to_all", q + kv) + price(spec, "all_to_all", q)
    part = contribution(spec)
    assert part.forward_ms == pytest.approx([n * both for n in spec.layers_per_stage], rel=1e-12)
    assert part.backward_ms == pytest.approx(part.forward_ms, rel=1e-12)
    spec = cp_spec(2, 8192, cp_comm_type="allgather")
    part = contribution(spec)
    assert part.forward_ms == pytest.approx([n * price(spec, "all_gather", 2 * kv) for n in spec.layers_per_stage])
    assert part.backward_ms == pytest.approx([n * price(spec, "reduce_scatter", 2 * kv) for n in spec.layers_per_stage])


def test_full_recomputation_runs_the_recomputed_layers_exchanges_again() -> None:
    plain = contribution(cp_spec(4, 1024))
    per_layer = plain.forward_ms[0] / 20
    uniform = contribution(cp_spec(4, 1024, recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1))
    assert uniform.forward_ms == pytest.approx(plain.forward_ms, rel=1e-12)
    assert uniform.backward_ms[0] == pytest.approx(plain.backward_ms[0] + 20 * per_layer, rel=1e-12)
    block = contribution(cp_spec(4, 1024, recompute_granularity="full", recompute_method="block",
                                 recompute_num_layers=3))
    assert block.backward_ms[0] == pytest.approx(plain.backward_ms[0] + 3 * per_layer, rel=1e-12)


def test_the_breakdown_shows_the_exchanges_as_cp_comm_and_a_candidate_adds_the_term() -> None:
    spec = h100_spec(CP2)
    assert all(parts["cp_comm"] == 0.0 for parts in load_model().breakdown(spec))  # the shipped model: none
    candidate = parse_candidate(
        'id = "cp-comm"\nhypothesis = "h"\ngrounding = "g"\n\n[change]\naction = "add"\n'
        'term = "context_parallel_comm"\n',
        origin="test",
    )
    model = candidate.apply(load_model())
    part = contribution(spec)
    for rank, parts in enumerate(model.breakdown(spec)):
        assert parts["cp_comm"] == pytest.approx(spec.microbatches * (part.forward_ms[rank] + part.backward_ms[rank]))
        assert parts["cp_comm"] > 0
