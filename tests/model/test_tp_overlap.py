"""TP communication overlap (issue #28, section 3): under --tp-comm-overlap the layers' sequence-parallel
collectives run under their GEMMs, chunked as TE's userbuffers overlap does, and only the closed form's exposed part
stays on the critical path."""

from __future__ import annotations

import pytest
from test_kernels import GPT3_175B

from hops_calib.loop.model_files import load_model
from hops_calib.model.collectives import collective_ms
from hops_calib.model.terms import TERMS
from hops_calib.model.terms.base import Context, layout_of
from hops_calib.model.terms.parallel import (
    BULK,
    PIPELINE,
    RING,
    TP_OVERLAP_PIPELINE_SPLITS,
    _rates,
    hidden_bytes,
    overlap_exposed_ms,
    tp_overlap_pairs,
)
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError


def h100_spec(args: dict):
    return spec_from_args(args, "test", run_id="ub", iterations=2, hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))


def test_the_exposed_part_of_an_overlapped_collective() -> None:
    # the GEMM longer than the collective: only the pipeline's last chunk is exposed
    assert overlap_exposed_ms(1.0, 3.0, RING, 8) == 0.0
    assert overlap_exposed_ms(1.0, 3.0, PIPELINE, 8) == pytest.approx(1.0 / TP_OVERLAP_PIPELINE_SPLITS)
    assert overlap_exposed_ms(1.0, 3.0, BULK, 8) == 0.0
    # the collective longer: what each chunk's transfer outlasts its GEMM chunk
    assert overlap_exposed_ms(4.0, 2.0, RING, 8) == pytest.approx(7 * 2.0 / 8)
    assert overlap_exposed_ms(4.0, 2.0, PIPELINE, 8) == pytest.approx(1.0 + 3 * 2.0 / 4)
    assert overlap_exposed_ms(4.0, 2.0, BULK, 8) == pytest.approx(2.0)


def test_tp_comm_overlap_prices_each_layer_collective_against_its_gemm() -> None:
    args = {**GPT3_175B, "transformer_impl": "transformer_engine"}
    plain, overlapped = h100_spec(args), h100_spec({**args, "tp_comm_overlap": True})
    term = TERMS["tensor_parallel_comm"]
    params = term.defaults()
    device = load_model().device("h100_dgx")

    def part(spec):
        context = Context(spec=spec, layout=layout_of(spec), devices=(device,) * spec.pp)
        return term.contribute(context, params)

    before, after = part(plain), part(overlapped)
    hidden, layers = hidden_bytes(plain), plain.layers_per_stage[1]
    rates = _rates(Context(spec=plain, layout=layout_of(plain), devices=(device,) * plain.pp), params, device.type)
    ms = {op: collective_ms(plain, device, op, hidden, "tp", stage=1, **rates)
          for op in ("all_gather", "reduce_scatter")}
    flops_per_ms = device.peak_bf16_flops_per_s / 1e3
    pairs = tp_overlap_pairs(overlapped)
    assert [m for _, _, m in pairs["FORWARD"]] == [RING, RING, PIPELINE, PIPELINE]
    exposed = {phase: sum(overlap_exposed_ms(ms[op], flops / flops_per_ms, method, 8)
                          for op, flops, method in pairs[phase]) for phase in pairs}
    # a middle stage holds only layers: its forward is the layers' exposed parts, its backward likewise
    assert after.forward_ms[1] == pytest.approx(layers * exposed["FORWARD"])
    assert after.backward_ms[1] == pytest.approx(layers * exposed["BACKWARD"])
    assert after.forward_ms[1] < before.forward_ms[1] and after.backward_ms[1] < before.backward_ms[1]
    # without the all-gather overlap those block again
    no_ag = h100_spec({**args, "tp_comm_overlap": True, "tp_comm_overlap_ag": False})
    assert part(no_ag).forward_ms[1] == pytest.approx(
        layers * (2 * ms["all_gather"] + sum(overlap_exposed_ms(ms[op], f / flops_per_ms, m, 8)
                                             for op, f, m in pairs["FORWARD"] if m == PIPELINE)))
    # Megatron allows the overlap only with sequence parallelism
    with pytest.raises(TraceError) as caught:
        h100_spec({**args, "tp_comm_overlap": True, "sequence_parallel": False})
    assert caught.value.field == "--tp-comm-overlap"


def test_a_chunk_without_decoder_layers_under_tp_overlap_blocks_only_its_ends_collectives() -> None:
    """The 30-layer Llama 3.1 405B proxy (t 8, p 4, vp 8, the embedding and loss counted as a layer each): its
    first and last chunk hold the embedding or the loss alone, so under --tp-comm-overlap they have no layer
    collective to overlap, and price as they do without the overlap (the ends' collectives block either way)."""
    args = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "context_parallel_size": 2,
            "world_size": 64, "num_layers": 30, "hidden_size": 16384, "ffn_hidden_size": 53248,
            "num_attention_heads": 128, "group_query_attention": True, "num_query_groups": 8, "seq_length": 8192,
            "max_position_embeddings": 8192, "micro_batch_size": 1, "global_batch_size": 64, "vocab_size": 128256,
            "bf16": True, "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
            "disable_bias_linear": True, "untie_embeddings_and_output_weights": True, "sequence_parallel": True,
            "virtual_pipeline_model_parallel_size": 8, "overlap_p2p_comm": True,
            "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
    model, term = load_model(), TERMS["tensor_parallel_comm"]
    priced = {}
    for overlap in (True, False):
        spec = h100_spec({**args, "tp_comm_overlap": overlap})
        layout = layout_of(spec)
        assert layout.layers[0] == layout.layers[-1] == 0 and set(layout.layers[1:-1]) == {1}
        context = Context(spec, layout, tuple(model.device(d) for d in spec.devices))
        priced[overlap] = term.contribute(context, model.active("tensor_parallel_comm").params())
    for k in (0, -1):
        assert priced[True].forward_ms[k] == pytest.approx(priced[False].forward_ms[k])
        assert priced[True].backward_ms[k] == pytest.approx(priced[False].backward_ms[k])
    assert priced[True].forward_ms[1] < priced[False].forward_ms[1]  # a chunk with a layer hides its collectives
