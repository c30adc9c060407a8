"""The model room: device catalog, GPT counts, terms, Model.pipeline, model files and their hash."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Mapping

import pytest
from conftest import PLAIN_MODEL_TOML, plain_model
from hypothesis import given, settings
from hypothesis import strategies as st

from hops_calib.errors import InputError
from hops_calib.model import (CONSTANTS, TERMS, ActiveTerm, Context, Contribution, Model, Param, Term, gpt,
                              layout_of, parse_model)
from hops_calib.loop.model_files import CATALOG_PATH, DEFAULT_MODEL, load_catalog, load_model, write_model
from hops_calib.model.devices import DEVICE_KEYS
from hops_calib.research.components import predicted_components
from hops_calib.sim.pipeline import Pipeline, StageCosts
from hops_calib.spec import LinkFit, ModelShape, Spec


def make_spec(pp: int = 4, vp: int = 1, layers: tuple[int, ...] | None = None, devices: tuple[str, ...] | None = None,
              hidden: int = 1024, seq: int = 1024, links: tuple[LinkFit, ...] | None = None, **shape) -> Spec:
    layers = layers or (2,) * pp
    devices = devices or ("h100", "a10g", "l4", "h100", "a10g", "l4")[:pp]
    if links is None:
        links = tuple(LinkFit(i, i + 1, latency_ms=0.1 * (i + 1), bytes_per_ms=1.0e6 * (i + 1)) for i in range(pp - 1))
    model = ModelShape(num_layers=sum(layers), hidden_size=hidden, ffn_hidden_size=shape.pop("ffn", 4 * hidden),
                       num_attention_heads=shape.pop("heads", 8), seq_length=seq, vocab_size=shape.pop("vocab", 50304),
                       global_batch_size=8, **shape)
    return Spec(run_id="hand-built", pp=pp, vp=vp, microbatches=8, iterations=3, layers_per_stage=layers,
                devices=devices, device_ids=tuple(f"{d}{i}" for i, d in enumerate(devices)), links=links,
                schedule="1f1b" if vp == 1 else "interleaved_1f1b", model=model,
                # as the cluster runs launch: unfused softmax, no dropout (Megatron's defaults are fused, 0.1)
                megatron_args={"masked_softmax_fusion": False, "attention_dropout": 0.0})


# --- device catalog -----------------------------------------------------------------------------

def test_every_catalog_constant_has_a_value_and_a_cited_source():
    raw = tomllib.loads(CATALOG_PATH.read_text())
    catalog = load_catalog()
    assert {"h100", "a10g", "l4", "cpu", "h100_dgx", "h200", "b200", "a100"} <= set(catalog)
    for device_type, device in catalog.items():
        assert set(CONSTANTS) <= set(device.constants())
        table = raw[device_type]
        gpu, node = raw["gpus"].get(table.get("gpu"), {}), raw["nodes"].get(table.get("node"), {})
        for constant in device.constants():
            # given by the device type itself, else its GPU's or its node's, else derived from the node
            stated = table.get(constant) or gpu.get(constant) or node.get(constant)
            if stated is not None:
                assert getattr(device, constant) == float(stated["value"]) > 0, (device_type, constant)
            assert len(device.source(constant)) > 20, (device_type, constant)
        assert set(device.constants()) >= {c for c in table if c not in DEVICE_KEYS}
        assert set(device.constants()) >= set(gpu) - {"name"}


def test_catalog_splits_gpus_from_nodes():
    catalog = load_catalog()
    cloud, dgx = catalog["h100"], catalog["h100_dgx"]
    # one GPU part, two nodes: the same tensor cores and HBM, another network and fabric
    assert cloud.gpu == dgx.gpu == "h100_sxm"
    for constant in ("peak_bf16_flops_per_s", "peak_fp8_flops_per_s", "memory_bandwidth_bytes_per_s",
                     "memory_bytes", "sm_count"):
        assert getattr(cloud, constant) == getattr(dgx, constant)
    # the network constant is the GPU's share of its node's NICs
    for device in catalog.values():
        if device.node is not None:
            assert device.network_bandwidth_bytes_per_s == pytest.approx(
                device.nics_per_node * device.nic_bandwidth_bytes_per_s / device.gpus_per_node)
            assert "node " in device.source("network_bandwidth_bytes_per_s")
    assert cloud.gpus_per_node == 1 and cloud.intra_node_bandwidth_bytes_per_s is None
    assert dgx.gpus_per_node == 8 and dgx.nics_per_node == 8 and dgx.nic_bandwidth_bytes_per_s * 8 == 400e9
    assert dgx.intra_node_bandwidth_bytes_per_s == dgx.nvlink_bandwidth_bytes_per_s > 100 * 1e9
    assert dgx.network_bandwidth_bytes_per_s == 4 * cloud.network_bandwidth_bytes_per_s
    # H200: the H100's tensor cores, more and faster HBM; B200 marked uncalibrated; the A100 a DGX A100 node
    h200 = catalog["h200"]
    assert h200.peak_bf16_flops_per_s == dgx.peak_bf16_flops_per_s and h200.peak_fp8_flops_per_s == dgx.peak_fp8_flops_per_s
    assert h200.memory_bytes == 141e9 and h200.memory_bandwidth_bytes_per_s == 4.8e12
    assert catalog["b200"].uncalibrated and catalog["b200"].peak_bf16_flops_per_s > dgx.peak_bf16_flops_per_s
    assert not dgx.uncalibrated and not catalog["h100"].uncalibrated
    assert catalog["a100"].node == "dgx_a100" and catalog["a100"].gpus_per_node == 8


def test_peaks_per_dtype_fall_back_to_bf16():
    catalog = load_catalog()
    dgx, a100, cpu = catalog["h100_dgx"], catalog["a100"], catalog["cpu"]
    assert dgx.peak_flops_per_s("fp8") == 2 * dgx.peak_flops_per_s("bf16")
    assert dgx.peak_flops_per_s("fp32") == dgx.peak_tf32_flops_per_s == pytest.approx(dgx.peak_bf16_flops_per_s / 2, rel=1e-3)
    assert a100.peak_fp8_flops_per_s is None and a100.peak_flops_per_s("fp8") == a100.peak_bf16_flops_per_s
    assert cpu.peak_flops_per_s("fp16") == cpu.peak_bf16_flops_per_s
    with pytest.raises(ValueError, match="int4"):
        dgx.peak_flops_per_s("int4")


def test_a_model_file_cannot_name_catalog_parts():
    text = '[model]\nname = "m"\n[devices.h100]\ngpu = "h200_sxm"\n[terms.decoder_roofline]\n'
    with pytest.raises(InputError, match="only the catalog"):
        parse_model(text, origin="m.toml", catalog=load_catalog())
    # a constant of a composed device type is overridden as before, its GPU and node kept
    text = ('[model]\nname = "m"\n[devices.h100_dgx]\nnic_bandwidth_bytes_per_s = { value = 25e9, source = '
            '"a cluster with 200 Gb/s NICs, its own sheet" }\n[terms.decoder_roofline]\n')
    device = parse_model(text, origin="m.toml", catalog=load_catalog()).device("h100_dgx")
    assert device.nic_bandwidth_bytes_per_s == 25e9 and device.node == "dgx_h100"


def test_catalog_orders_devices_as_their_datasheets_do():
    catalog = load_catalog()
    # H100 SXM has both more tensor throughput and more bandwidth than the two 24 GB GDDR6 parts.
    for other in ("a10g", "l4"):
        assert catalog["h100"].peak_bf16_flops_per_s > catalog[other].peak_bf16_flops_per_s
        assert catalog["h100"].memory_bandwidth_bytes_per_s > catalog[other].memory_bandwidth_bytes_per_s
    assert catalog["a10g"].memory_bandwidth_bytes_per_s == 2 * catalog["l4"].memory_bandwidth_bytes_per_s
    # The two A100 SXM4 parts share the GA100 chip and its clocks; the 80 GB's HBM2e is the faster memory.
    a100, small = catalog["a100"], catalog["a100_40gb"]
    assert a100.peak_bf16_flops_per_s == small.peak_bf16_flops_per_s < catalog["h100"].peak_bf16_flops_per_s
    assert a100.memory_bandwidth_bytes_per_s > small.memory_bandwidth_bytes_per_s
    assert a100.memory_bytes == 2 * small.memory_bytes
    # Only devices with a GPU peer in their node have an intra-node link.
    assert a100.intra_node_bandwidth_bytes_per_s and catalog["h100"].intra_node_bandwidth_bytes_per_s is None


# --- GPT counts ---------------------------------------------------------------------------------

shapes = st.builds(lambda h, s, a, b: ModelShape(num_layers=4, hidden_size=h * 64, ffn_hidden_size=4 * h * 64,
                                                 num_attention_heads=a, seq_length=s * 128, vocab_size=50304,
                                                 micro_batch_size=b),
                   st.integers(1, 64), st.integers(1, 32), st.integers(1, 32), st.integers(1, 4))


@given(shapes)
def test_layer_flops_and_activations_match_the_published_closed_forms_at_ffn_4h(shape):
    b, s, h, a = shape.micro_batch_size, shape.seq_length, shape.hidden_size, shape.num_attention_heads
    assert gpt.layer_forward_flops(shape) == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    assert gpt.layer_activation_bytes(shape) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    # The weight gradient is the weight matmuls of the forward again: 24bsh^2 of the 24bsh^2 + 4bs^2h.
    assert gpt.layer_weight_grad_flops(shape) == pytest.approx(24 * b * s * h * h)
    assert gpt.layer_parameters(shape) == 12 * h * h + 13 * h


def test_unknown_precision_is_named():
    shape = dataclasses.replace(make_spec().model, precision="fp8")
    with pytest.raises(ValueError, match="fp8"):
        gpt.bytes_per_element(shape)


# --- layout -------------------------------------------------------------------------------------

def test_interleaved_layout_places_chunks_round_robin_like_megatron():
    layout = layout_of(make_spec(pp=3, vp=2, layers=(4, 2, 6), devices=("h100", "a10g", "l4")))
    assert layout.virtual_stages == 6 and layout.hops == 5
    assert layout.layers == (2, 1, 3, 2, 1, 3)
    assert [layout.rank_of(k) for k in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [layout.chunk_of(k) for k in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.layers_on_rank(r) for r in range(3)] == [4, 2, 6]


def test_layers_not_divisible_into_chunks_are_refused():
    with pytest.raises(ValueError, match="rank 1 has 3 layers"):
        layout_of(make_spec(pp=2, vp=2, layers=(2, 3), devices=("h100", "l4")))


# --- terms --------------------------------------------------------------------------------------

def test_every_registered_term_documents_itself_and_bounds_its_parameters():
    for name, term in TERMS.items():
        assert term.name == name
        assert len((type(term).__doc__ or "").split()) > 30, f"{name} needs a docstring with its physics"
        for param in term.params:
            assert param.low <= param.default <= param.high and param.unit and param.doc


def roofline_values(**overrides: float) -> dict[str, float]:
    return {**TERMS["decoder_roofline"].defaults(), **overrides}


def test_roofline_is_compute_bound_for_a_large_layer_and_memory_bound_for_a_tiny_one():
    roofline = TERMS["decoder_roofline"]
    catalog = load_catalog()
    values = roofline_values()
    big = make_spec(pp=2, layers=(3, 1), devices=("h100", "l4"), hidden=8192, seq=4096)
    costs = roofline.contribute(Context(big, layout_of(big), (catalog["h100"], catalog["l4"])), values)
    h100_layer_ms = gpt.layer_forward_flops(big.model) / (catalog["h100"].peak_bf16_flops_per_s * 0.5) * 1e3
    assert costs.forward_ms[0] == pytest.approx(3 * h100_layer_ms)
    assert costs.backward_ms[0] == pytest.approx(2 * costs.forward_ms[0])
    assert costs.weight_grad_ms[0] == pytest.approx(costs.backward_ms[0] * 24 / (2 * (24 + 4 * 4096 / 8192)))

    tiny = make_spec(pp=2, layers=(1, 1), devices=("h100", "l4"), hidden=64, seq=128)
    costs = roofline.contribute(Context(tiny, layout_of(tiny), (catalog["h100"], catalog["l4"])), values)
    nbytes = gpt.layer_parameters(tiny.model) * 2 + gpt.layer_activation_bytes(tiny.model)
    assert costs.forward_ms[1] == pytest.approx(nbytes / (catalog["l4"].memory_bandwidth_bytes_per_s * 0.8) * 1e3)


@settings(max_examples=30)
@given(st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_roofline_time_never_rises_with_efficiency(low, high):
    low, high = sorted((low, high))
    spec = make_spec()
    model = plain_model()
    slow = model.with_term(ActiveTerm(TERMS["decoder_roofline"], tuple(roofline_values(
        compute_efficiency=low, memory_efficiency=low).items()))).pipeline(spec)
    fast = model.with_term(ActiveTerm(TERMS["decoder_roofline"], tuple(roofline_values(
        compute_efficiency=high, memory_efficiency=high).items()))).pipeline(spec)
    for s, f in zip(slow.stages, fast.stages):
        assert f.forward_ms <= s.forward_ms and f.backward_ms <= s.backward_ms


def test_link_transfer_prices_the_hidden_states_with_each_hops_fit():
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), hidden=2048, seq=512)
    pipeline = plain_model().pipeline(spec)
    nbytes = 512 * 2048 * 2
    expected = tuple(fit.latency_ms + nbytes / fit.bytes_per_ms for fit in spec.links)
    assert pipeline.forward_transfer_ms == pytest.approx(expected)
    assert pipeline.backward_transfer_ms == pytest.approx(expected)


def test_link_transfer_measured_weight_reads_the_benchmark_medians_at_the_message_size():
    mb = 1 << 20
    at_2mb, at_64mb = 1.5, 52.0  # made up, convex: small messages cheaper per byte than the line says
    convex = ((1 * mb, 0.3), (2 * mb, at_2mb), (4 * mb, 3.3), (64 * mb, at_64mb))
    links = (LinkFit(0, 1, 0.0, 64 * mb / at_64mb, points=convex), LinkFit(1, 2, 0.0, 2.0e6))
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), hidden=1024, seq=1024, links=links)  # 2 MiB hops
    text = PLAIN_MODEL_TOML.replace("[terms.link_transfer]", "[terms.link_transfer]\nmeasured_weight = {w}")
    fit_only, measured, half = (parse_model(text.format(w=w), origin="m", catalog=load_catalog()).pipeline(spec)
                                for w in (0.0, 1.0, 0.5))
    assert fit_only.forward_transfer_ms[0] == pytest.approx(2 * at_64mb / 64)  # the line through the origin
    assert measured.forward_transfer_ms[0] == pytest.approx(at_2mb)  # the benchmark's own median at 2 MiB
    assert half.forward_transfer_ms[0] == pytest.approx((at_2mb + 2 * at_64mb / 64) / 2)
    # A link without measured points (older fixtures) keeps its fit whatever the weight.
    assert measured.forward_transfer_ms[1] == fit_only.forward_transfer_ms[1] == pytest.approx(2 * mb / 2.0e6)
    assert measured.backward_transfer_ms == measured.forward_transfer_ms
    # burst_mib > 0 reads the benchmark as a burst: the 2 MiB hop at the 1 MiB point's rate, whatever the weight.
    burst = parse_model(PLAIN_MODEL_TOML.replace("[terms.link_transfer]", "[terms.link_transfer]\nmeasured_weight = "
                                                 "1.0\nburst_mib = 2.5"), origin="m", catalog=load_catalog()
                        ).pipeline(spec)
    assert burst.forward_transfer_ms[0] == pytest.approx(2 * 0.3) == pytest.approx(links[0].burst_ms(2 * mb, 2.5 * mb))
    assert burst.forward_transfer_ms[0] < measured.forward_transfer_ms[0]


def test_an_unbenchmarked_hop_takes_the_slowest_fitted_link():
    links = (LinkFit(0, 1, 0.1, 2.0e6), LinkFit(1, 0, 0.1, 2.0e6), LinkFit(1, 2, 0.3, 1.0e6))
    spec = make_spec(pp=3, vp=2, layers=(2, 2, 2), devices=("h100", "a10g", "l4"), links=links)
    transfers = plain_model().pipeline(spec).forward_transfer_ms
    assert len(transfers) == 5
    slow = 0.3 + 1024 * 1024 * 2 / 1.0e6
    assert transfers[2] == pytest.approx(slow)  # rank 2 -> rank 0: not benchmarked
    assert transfers[1] == transfers[4] == pytest.approx(slow)
    assert transfers[0] < slow


def test_link_term_without_any_link_fit_says_what_to_do():
    with pytest.raises(InputError, match="has no link benchmark, and term link_transfer prices its hops.*ingest it again"):
        plain_model().pipeline(make_spec(links=()))


# --- Model.pipeline ---------------------------------------------------------------------------------

class EveryPlace(Term):
    """A test term that adds a known amount everywhere a term can contribute, to check the summing and the switch.

    It has no physics; it stands for the terms the calibration issue adds (optimizer step, barrier work between
    iterations, host overhead, embedding all-reduce, non-blocking p2p). The point is that each place is reachable.
    """

    name = "every_place"
    params = (Param("amount_ms", 1.0, 0.0, 10.0, "ms", "what is added at each place"),)

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        layout, amount = context.layout, params["amount_ms"]
        return Contribution(
            forward_ms=(amount,) * layout.virtual_stages, backward_ms=(2 * amount,) * layout.virtual_stages,
            weight_grad_ms=(amount,) * layout.virtual_stages, forward_transfer_ms=(amount,) * layout.hops,
            backward_transfer_ms=(amount,) * layout.hops, optimizer_ms=tuple(float(r) for r in range(layout.ranks)),
            pre_optimizer_ms=3 * amount, post_optimizer_ms=4 * amount, blocking_p2p=False)


def test_contributions_of_all_terms_add_up_in_every_place():
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"))
    base_model = plain_model()
    base = base_model.pipeline(spec)
    model = base_model.with_term(ActiveTerm(EveryPlace(), (("amount_ms", 0.5),)))
    summed = model.pipeline(spec)
    assert isinstance(summed, Pipeline)
    for b, s in zip(base.stages, summed.stages):
        assert s.forward_ms == pytest.approx(b.forward_ms + 0.5)
        assert s.backward_ms == pytest.approx(b.backward_ms + 1.0)
        assert s.weight_grad_ms == pytest.approx(b.weight_grad_ms + 0.5)
    assert summed.forward_transfer_ms == pytest.approx([t + 0.5 for t in base.forward_transfer_ms])
    assert summed.optimizer_ms == (0.0, 1.0, 2.0) and base.optimizer_ms == ()
    assert (summed.pre_optimizer_ms, summed.post_optimizer_ms) == (1.5, 2.0)
    assert base.blocking_p2p is True and summed.blocking_p2p is False
    assert (summed.microbatches, summed.iterations, summed.chunks) == (spec.microbatches, spec.iterations, spec.vp)


def test_a_term_returning_the_wrong_number_of_values_is_named():
    class Broken(EveryPlace):
        name = "broken"

        def contribute(self, context, params):
            return Contribution(optimizer_ms=(1.0,))

    model = plain_model().with_term(ActiveTerm(Broken(), (("amount_ms", 1.0),)))
    with pytest.raises(ValueError, match="term broken gave 1 values of optimizer_ms.*expected 4"):
        model.pipeline(make_spec())


def test_pipeline_is_pure_and_repeatable():
    spec, model = make_spec(), plain_model()
    assert model.pipeline(spec) == model.pipeline(spec)
    assert model == plain_model()


def test_unknown_device_type_names_the_stage_and_the_fix():
    with pytest.raises(ValueError, match=r"stage 1 runs on device type 'tpu'.*devices.toml"):
        plain_model().pipeline(make_spec(pp=2, devices=("h100", "tpu")))


# --- model files and identity ---------------------------------------------------------------------

@pytest.mark.parametrize("which", ["shipped", "plain"])
def test_models_round_trip_through_their_own_toml(tmp_path, which):
    model = load_model() if which == "shipped" else plain_model()
    assert model.name == ("baseline" if which == "shipped" else "plain") and model.terms
    path = tmp_path / "m.toml"
    write_model(path, model)
    again = load_model(path)
    assert again == model and again.sha256 == model.sha256
    assert not list(tmp_path.glob("*.tmp"))


def test_hash_ignores_term_order_and_explicit_defaults_but_not_values():
    catalog = load_catalog()
    header = '[model]\nname = "m"\n'
    a = parse_model(header + "[terms.link_transfer]\n[terms.decoder_roofline]\n", origin="a", catalog=catalog)
    b = parse_model(header + "[terms.decoder_roofline]\ncompute_efficiency = 0.5\n[terms.link_transfer]\n",
                    origin="b", catalog=catalog)
    c = parse_model(header + "[terms.decoder_roofline]\ncompute_efficiency = 0.4\n[terms.link_transfer]\n",
                    origin="c", catalog=catalog)
    assert a.sha256 == b.sha256 != c.sha256
    d = b.with_device_constant("l4", "memory_bandwidth_bytes_per_s", 2.0e11, "a test")
    assert d.sha256 != b.sha256
    # A device override survives the round trip through the file, with its source.
    e = parse_model(d.to_toml(catalog), origin="e", catalog=catalog)
    assert e.sha256 == d.sha256 and e.device("l4").source("memory_bandwidth_bytes_per_s") == "a test"


@pytest.mark.parametrize("text, line, needle", [
    ('[model]\nname = "m"\n\n[terms.decoder_roofline]\ncompute_efficency = 0.5\n', 5, "has no parameter"),
    ('[model]\nname = "m"\n\n[terms.decoder_roofline]\ncompute_efficiency = 1.5\n', 5, r"outside the plausible range"),
    ('[model]\nname = "m"\n\n[terms.roofline_typo]\n', 4, "unknown term 'roofline_typo'"),
    ('[model]\nname = "m"\n[terms.link_transfer]\n[devices.l4]\nmemory_bytes = 24e9\n', 5, "inline table"),
    ('[model]\nname = "m"\n[terms.link_transfer]\n[devices.l4]\nmemory_bytes = { value = 1, source = "" }\n', 5,
     "source"),
    ('[model]\nname = "m"\n[terms.link_transfer\n', 3, "not valid TOML"),
    ('[model]\nname = "m"\n\n[terms.decoder_roofline]\n"compute_efficiency@tpu" = 0.5\n', 5,
     "device type 'tpu', which the model does not know"),
])
def test_bad_model_files_are_refused_with_file_line_and_field(text, line, needle):
    with pytest.raises(InputError, match=needle) as caught:
        parse_model(text, origin="models/m.toml", catalog=load_catalog())
    assert str(caught.value).startswith(f"models/m.toml:{line}: ")  # the documented file:line: prefix


def test_model_without_terms_is_refused():
    with pytest.raises(InputError, match="no active terms"):
        parse_model('[model]\nname = "m"\n', origin="m.toml", catalog=load_catalog())


def test_default_model_is_the_shipped_file():
    assert DEFAULT_MODEL.name == "baseline.toml" and load_model(DEFAULT_MODEL) == load_model()
    assert isinstance(load_model(), Model)


# --- the inert terms a candidate can activate ------------------------------------------------------

def with_term(name: str, **values: float) -> Model:
    term = TERMS[name]
    return plain_model().with_term(ActiveTerm(term, tuple({**term.defaults(), **values}.items())))


def test_embedding_allreduce_sends_the_padded_fp32_embedding_gradient_over_the_end_to_end_link():
    pair = make_spec(pp=2, devices=("h100", "l4"), hidden=1024, vocab=50000)
    pipeline = with_term("embedding_grad_allreduce").pipeline(pair)
    padded = 50048  # the next multiple of 128
    fit = pair.links[0]
    assert pipeline.pre_optimizer_ms == pytest.approx(fit.latency_ms + padded * 1024 * 4 / fit.bytes_per_ms)
    # Deeper pipelines: the first/last pair was not benchmarked; each end is at least as fast as the fastest
    # link it was benchmarked on, and the pair runs at the slower end.
    links = (LinkFit(0, 1, 0.1, 3.0e6), LinkFit(1, 2, 0.2, 1.0e6), LinkFit(2, 3, 0.3, 2.0e6))
    deep = make_spec(pp=4, links=links)
    expected = 0.3 + 50304 * 1024 * 2 / 2.0e6  # stage 3's only link (2e6 B/ms) is slower than stage 0's (3e6)
    assert with_term("embedding_grad_allreduce", bytes_per_element=2.0).pipeline(deep).pre_optimizer_ms == \
        pytest.approx(expected)
    untied = dataclasses.replace(deep, model=dataclasses.replace(deep.model, untie_embeddings=True))
    assert with_term("embedding_grad_allreduce").pipeline(untied).pre_optimizer_ms == 0.0


def test_optimizer_step_streams_every_parameter_once_across_the_ranks():
    from hops_calib.model.terms.optimizer import rank_parameters

    spec = make_spec(pp=3, layers=(1, 3, 2), devices=("h100", "a10g", "l4"), hidden=512, seq=256)
    model = with_term("optimizer_step", bytes_per_parameter=40.0, memory_efficiency=0.5)
    pipeline = model.pipeline(spec)
    context = Context(spec, layout_of(spec), tuple(model.device(d) for d in spec.devices))
    per_rank = [rank_parameters(context, r) for r in range(3)]
    h, vocab = 512, 50304
    assert sum(per_rank) == 6 * gpt.layer_parameters(spec.model) + 2 * vocab * h + 256 * h + 2 * h
    assert per_rank[1] == 3 * gpt.layer_parameters(spec.model)
    for rank, device in enumerate(context.devices):
        assert pipeline.optimizer_ms[rank] == pytest.approx(
            per_rank[rank] * 40.0 / (device.memory_bandwidth_bytes_per_s * 0.5) * 1e3)


def test_iteration_host_overhead_is_a_per_rank_constant_after_the_optimizer_and_a_barrier():
    pipeline = with_term("iteration_host_overhead", host_ms=7.5).pipeline(make_spec())
    assert pipeline.post_optimizer_ms == 7.5 and pipeline.pre_optimizer_ms == 0.0
    assert pipeline.iteration_barrier and not plain_model().pipeline(make_spec()).iteration_barrier


def test_optimizer_fixed_cost_adds_to_every_rank():
    spec = make_spec(pp=3)
    plain = with_term("optimizer_step").pipeline(spec).optimizer_ms
    fixed = with_term("optimizer_step", fixed_ms=2.5).pipeline(spec).optimizer_ms
    assert [b - a for a, b in zip(plain, fixed)] == pytest.approx([2.5] * 3)


def test_optimizer_per_layer_cost_follows_the_layers_each_rank_holds():
    spec = make_spec(pp=3, layers=(1, 3, 2))
    plain = with_term("optimizer_step").pipeline(spec).optimizer_ms
    per_layer = with_term("optimizer_step", per_layer_ms=0.5).pipeline(spec).optimizer_ms
    assert [b - a for a, b in zip(plain, per_layer)] == pytest.approx([0.5, 1.5, 1.0])


def test_timer_gather_adds_one_ring_step_per_other_rank():
    for pp in (2, 4, 6):
        pipeline = with_term("iteration_host_overhead", host_ms=1.5, per_peer_ms=0.4).pipeline(
            make_spec(pp=pp, layers=(2,) * pp, devices=("h100",) * pp))
        assert pipeline.post_optimizer_ms == pytest.approx(1.5 + 0.4 * (pp - 1))


def added(name: str, spec: Spec, **values: float) -> Pipeline:
    """The pipeline of the shipped model with term `name` added, minus the shipped model's own pipeline."""
    base, more = plain_model().pipeline(spec), with_term(name, **values).pipeline(spec)
    return Pipeline(
        stages=tuple(StageCosts(m.forward_ms - b.forward_ms, m.backward_ms - b.backward_ms,
                                m.weight_grad_ms - b.weight_grad_ms) for b, m in zip(base.stages, more.stages)),
        microbatches=spec.microbatches)


def test_dispatch_floor_scales_with_layers_and_its_step_time_is_untraced_host_time():
    spec = make_spec(pp=3, layers=(1, 3, 2))
    delta = added("layer_dispatch_floor", spec, forward_ms_per_layer=1.2, backward_ms_per_layer=2.0, step_ms=0.5)
    assert [s.forward_ms for s in delta.stages] == pytest.approx([1.2, 3.6, 2.4])
    assert [s.backward_ms for s in delta.stages] == pytest.approx([2.0, 6.0, 4.0])
    pipeline = with_term("layer_dispatch_floor", step_ms=0.5).pipeline(spec)
    assert [s.host_ms for s in pipeline.stages] == pytest.approx([0.5, 0.5, 0.5])
    assert with_term("layer_dispatch_floor", step_ms=0.5, step_after_receive_only=0.0).pipeline(
        spec).host_after_receive_only is False
    assert with_term("layer_dispatch_floor", step_ms=0.5, step_after_receive_only=1.0).pipeline(
        spec).host_after_receive_only is True


def test_chunk_call_host_adds_one_call_per_chunk_whatever_its_layers_and_only_on_its_device():
    # Closed form: every virtual stage's forward (backward) grows by exactly one call's host time, so a rank of v
    # chunks pays v calls per microbatch and direction where one chunk of the same layers pays one.
    values = {"forward_ms_per_call@cpu": 0.3, "backward_ms_per_call@cpu": 0.4}
    interleaved = make_spec(pp=2, vp=2, layers=(2, 2), devices=("cpu", "cpu"), hidden=384, seq=128)
    delta = added("chunk_call_host", interleaved, **values)
    assert [s.forward_ms for s in delta.stages] == pytest.approx([0.3] * 4)
    assert [s.backward_ms for s in delta.stages] == pytest.approx([0.4] * 4)
    assert [s.weight_grad_ms for s in delta.stages] == pytest.approx([0.0] * 4)
    one_chunk = added("chunk_call_host", make_spec(pp=2, layers=(2, 2), devices=("cpu", "cpu"), hidden=384, seq=128),
                      **values)
    assert [s.forward_ms for s in one_chunk.stages] == pytest.approx([0.3, 0.3])
    # A GPU rank takes the shared value, 0: its runs do not move.
    mixed = added("chunk_call_host", make_spec(pp=3, layers=(1, 3, 2), devices=("h100", "cpu", "l4")), **values)
    assert [s.forward_ms for s in mixed.stages] == pytest.approx([0.0, 0.3, 0.0])
    assert [s.backward_ms for s in mixed.stages] == pytest.approx([0.0, 0.4, 0.0])


def test_output_layer_loss_lands_on_the_last_stage_and_grows_with_the_vocabulary():
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"))
    delta = added("output_layer_loss", spec)
    assert [s.forward_ms for s in delta.stages[:-1]] == [0.0, 0.0]
    last = delta.stages[-1]
    assert last.forward_ms > 0 and last.backward_ms > last.weight_grad_ms > 0
    bigger = added("output_layer_loss", make_spec(pp=3, devices=("h100", "a10g", "l4"), vocab=2 * 50304))
    assert bigger.stages[-1].forward_ms == pytest.approx(2 * last.forward_ms, rel=1e-3)
    # Memory-bound logits: the same run on a device with twice the bandwidth spends half as long in the passes.
    gemm_free = added("output_layer_loss", spec, compute_efficiency=1.0, logit_passes_forward=0.0)
    passes = last.forward_ms - added("output_layer_loss", spec, logit_passes_forward=0.0).stages[-1].forward_ms
    l4, a10g = plain_model().device("l4"), plain_model().device("a10g")
    on_a10g = added("output_layer_loss", make_spec(pp=3, devices=("h100", "l4", "a10g")))
    passes_a10g = on_a10g.stages[-1].forward_ms - added(
        "output_layer_loss", make_spec(pp=3, devices=("h100", "l4", "a10g")), logit_passes_forward=0.0).stages[-1].forward_ms
    assert passes_a10g / passes == pytest.approx(l4.memory_bandwidth_bytes_per_s / a10g.memory_bandwidth_bytes_per_s)
    assert gemm_free.stages[-1].forward_ms < last.forward_ms


def test_output_layer_host_time_is_per_microbatch_on_the_last_stages_forward_and_per_device():
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"))
    without = added("output_layer_loss", spec)
    with_host = added("output_layer_loss", spec, host_ms=1.5)
    assert [w.forward_ms - o.forward_ms for o, w in zip(without.stages, with_host.stages)] == pytest.approx(
        [0.0, 0.0, 1.5])
    assert [w.backward_ms for w in with_host.stages] == pytest.approx([o.backward_ms for o in without.stages])
    on_l4 = added("output_layer_loss", spec, **{"host_ms": 1.5, "host_ms@l4": 0.5})
    assert on_l4.stages[-1].forward_ms - without.stages[-1].forward_ms == pytest.approx(0.5)


def test_input_embedding_lands_on_the_first_stage_only():
    spec = make_spec(pp=3)
    delta = added("input_embedding", spec, forward_ms=1.5, backward_ms=0.5, grad_passes=0.0)
    assert [s.forward_ms for s in delta.stages] == pytest.approx([1.5, 0.0, 0.0])
    assert [s.backward_ms for s in delta.stages] == pytest.approx([0.5, 0.0, 0.0])
    with_grad = added("input_embedding", spec, forward_ms=0.0, backward_ms=0.0, grad_passes=2.0)
    h100 = plain_model().device("h100")
    assert with_grad.stages[0].backward_ms == pytest.approx(2 * 50304 * 1024 * 4 / h100.memory_bandwidth_bytes_per_s * 1e3)


def test_attention_traffic_grows_with_the_square_of_the_sequence():
    short = added("attention_score_traffic", make_spec(pp=2, seq=1024))
    long = added("attention_score_traffic", make_spec(pp=2, seq=4096))
    for a, b in zip(short.stages, long.stages):
        assert b.forward_ms == pytest.approx(16 * a.forward_ms) and b.backward_ms == pytest.approx(16 * a.backward_ms)


def test_attention_traffic_is_passes_over_achieved_bandwidth():
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), seq=2048, heads=12)
    full = added("attention_score_traffic", spec, passes_forward=6.0, passes_backward=18.0)
    score_bytes = 12 * 2048 ** 2 * 2  # b x a x s x s bf16 elements
    for k, device in enumerate(("h100", "a10g", "l4")):
        pass_ms = score_bytes / plain_model().device(device).memory_bandwidth_bytes_per_s * 1e3
        assert full.stages[k].forward_ms == pytest.approx(2 * 6.0 * pass_ms)  # two layers per stage
        assert full.stages[k].backward_ms == pytest.approx(2 * 18.0 * pass_ms)
    slower = added("attention_score_traffic", spec, passes_forward=6.0, passes_backward=18.0, memory_efficiency=0.8)
    for a, b in zip(full.stages, slower.stages):
        assert b.forward_ms == pytest.approx(a.forward_ms / 0.8) and b.backward_ms == pytest.approx(a.backward_ms / 0.8)


def test_elementwise_traffic_is_counted_passes_plus_unfused_gradient_accumulation_over_bandwidth():
    from dataclasses import replace

    from hops_calib.model import gpt

    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), hidden=1536, seq=2048, heads=12)
    fused = added("elementwise_traffic", spec, memory_efficiency=1.0)  # Megatron's default: accumulation fused
    unfused_spec = replace(spec, megatron_args={"no_gradient_accumulation_fusion": True})
    unfused = added("elementwise_traffic", unfused_spec, memory_efficiency=1.0)
    hidden_pass, ffn_pass = 2048 * 1536 * 2, 2048 * 4 * 1536 * 2  # one 16-bit pass over s x b x h, s x b x f
    for k, device in enumerate(("h100", "a10g", "l4")):
        per_byte_ms = 1e3 / plain_model().device(device).memory_bandwidth_bytes_per_s
        # two layers per stage, each with the counted passes (the term's defaults)
        assert fused.stages[k].forward_ms == pytest.approx(2 * (22.1 * hidden_pass + 4 * ffn_pass) * per_byte_ms)
        assert fused.stages[k].backward_ms == pytest.approx(2 * (27.1 * hidden_pass + 4 * ffn_pass) * per_byte_ms)
        # unfused: each weight's bf16 gradient is added into its fp32 main_grad after every backward (2 + 4 + 4 B)
        assert unfused.stages[k].forward_ms == pytest.approx(fused.stages[k].forward_ms)
        assert unfused.stages[k].backward_ms - fused.stages[k].backward_ms == pytest.approx(
            2 * 10.0 * gpt.layer_parameters(spec.model) * per_byte_ms)
    # the GDDR6 parts pay in proportion to their bandwidth: the L4 (300 GB/s) twice the A10G (600 GB/s)
    assert unfused.stages[2].backward_ms == pytest.approx(2 * unfused.stages[1].backward_ms)
    # a rank log's arguments block says it in Megatron's own name
    logged = added("elementwise_traffic", replace(spec, megatron_args={"gradient_accumulation_fusion": False}),
                   memory_efficiency=1.0)
    assert [s.backward_ms for s in logged.stages] == pytest.approx([s.backward_ms for s in unfused.stages])
    logged_fused = added("elementwise_traffic", replace(spec, megatron_args={"gradient_accumulation_fusion": True}),
                         memory_efficiency=1.0)
    assert [s.backward_ms for s in logged_fused.stages] == pytest.approx([s.backward_ms for s in fused.stages])


def test_end_to_end_link_uses_each_ends_nic_and_caps_one_tcp_flow():
    # h100 first stage benchmarked only against a slow neighbour, l4 last stage against a fast one.
    links = (LinkFit(0, 1, 0.0, 1.0e6), LinkFit(1, 2, 0.0, 1.0e6), LinkFit(2, 3, 0.0, 2.4e6))
    spec = make_spec(pp=4, devices=("h100", "a10g", "a10g", "l4"), links=links)
    nbytes = 50304 * 1024 * 4
    links_only = with_term("embedding_grad_allreduce").pipeline(spec).pre_optimizer_ms
    assert links_only == pytest.approx(nbytes / 1.0e6)  # the h100's only measured link bounds it
    nics = with_term("embedding_grad_allreduce", nic_efficiency=0.5).pipeline(spec).pre_optimizer_ms
    l4_nic = plain_model().device("l4").network_bandwidth_bytes_per_s * 0.5 / 1e3
    assert nics == pytest.approx(nbytes / max(l4_nic, 2.4e6))  # now the l4 end is the slower one
    capped = with_term("embedding_grad_allreduce", nic_efficiency=0.5, flow_cap_gbit_s=8.0).pipeline(spec)
    assert capped.pre_optimizer_ms == pytest.approx(nbytes / (8e9 / 8 / 1e3))
    # A benchmarked pair (pp = 2) is used as measured, and capped by one flow's ceiling too.
    pair = make_spec(pp=2, devices=("h100", "h100"), links=(LinkFit(0, 1, 0.0, 3.4e6),))
    assert with_term("embedding_grad_allreduce", nic_efficiency=1.0).pipeline(pair).pre_optimizer_ms == \
        pytest.approx(nbytes / 3.4e6)
    assert with_term("embedding_grad_allreduce", flow_cap_gbit_s=20.0).pipeline(pair).pre_optimizer_ms == \
        pytest.approx(nbytes / 2.5e6)


def test_flows_at_the_tcp_ceiling_add_the_expected_retransmission_stall_and_nic_paced_ones_do_not():
    links = (LinkFit(0, 1, 0.0, 3.4e6), LinkFit(1, 2, 0.0, 1.2e6))
    fast = make_spec(pp=3, devices=("h100", "a10g", "l4"), links=(LinkFit(0, 1, 0.0, 3.4e6), LinkFit(1, 2, 0.0, 3.4e6)))
    slow_end = make_spec(pp=3, devices=("h100", "l4", "a10g"), links=links)
    params = dict(nic_efficiency=0.95, flow_cap_gbit_s=20.0)
    for spec, stalls in ((fast, True), (slow_end, False)):
        plain = with_term("embedding_grad_allreduce", **params).pipeline(spec).pre_optimizer_ms
        stalled = with_term("embedding_grad_allreduce", **params, stall_probability=0.25).pipeline(spec)
        assert stalled.pre_optimizer_ms - plain == pytest.approx(0.25 * 200.0 if stalls else 0.0)
        # Realized: the stall goes to the simulator as an occasional delay; the average iteration is the same.
        realized = with_term("embedding_grad_allreduce", **params, stall_probability=0.25,
                             realize_stalls=1.0).pipeline(spec)
        assert realized.pre_optimizer_ms == pytest.approx(plain)
        assert (realized.stall_ms, realized.stall_probability) == ((200.0, 0.25) if stalls else (0.0, 0.0))
        assert realized.expected_pre_optimizer_ms == pytest.approx(stalled.pre_optimizer_ms)
        assert predicted_components(realized).values["silent"] == pytest.approx(stalled.pre_optimizer_ms)


def test_only_one_term_may_price_a_stall():
    class OtherStall(Term):
        name = "other_stall"
        params = ()

        def contribute(self, context, params):
            return Contribution(stall_ms=50.0, stall_probability=0.1)

    model = with_term("embedding_grad_allreduce", nic_efficiency=0.95, flow_cap_gbit_s=20.0, stall_probability=0.25,
                      realize_stalls=1.0)
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), links=(LinkFit(0, 1, 0.0, 3.4e6), LinkFit(1, 2, 0.0, 3.4e6)))
    assert model.pipeline(spec).stall_probability == 0.25
    doubled = dataclasses.replace(model, terms=model.terms + (ActiveTerm(OtherStall(), ()),))
    with pytest.raises(ValueError, match="both price a pre-optimizer stall"):
        doubled.pipeline(spec)


def test_a_capped_flow_loses_goodput_with_the_slower_ends_nic_overrun_of_the_ceiling():
    nbytes = 50304 * 1024 * 4
    capped = dict(nic_efficiency=0.95, flow_cap_gbit_s=20.0)
    h100_pair = make_spec(pp=2, devices=("h100", "h100"), links=(LinkFit(0, 1, 0.0, 3.4e6),))
    h100_l4 = make_spec(pp=2, devices=("h100", "l4"), links=(LinkFit(0, 1, 0.0, 3.4e6),))
    a10g_end = make_spec(pp=2, devices=("h100", "a10g"), links=(LinkFit(0, 1, 0.0, 1.2e6),))  # NIC-paced
    ceiling_ms = nbytes / (20e9 / 8 / 1e3)
    for spec, overrun in ((h100_pair, 100 / 20), (h100_l4, 25 / 20)):
        assert with_term("embedding_grad_allreduce", **capped).pipeline(spec).pre_optimizer_ms == \
            pytest.approx(ceiling_ms)
        lossy = with_term("embedding_grad_allreduce", **capped, overrun_loss=0.05).pipeline(spec).pre_optimizer_ms
        assert lossy == pytest.approx(ceiling_ms * (1 + 0.05 * (overrun - 1)))
    paced = [with_term("embedding_grad_allreduce", **capped, overrun_loss=v).pipeline(a10g_end).pre_optimizer_ms
             for v in (0.0, 0.05)]
    assert paced[0] == paced[1] == pytest.approx(nbytes / 1.2e6)  # below the ceiling: nothing to overrun


def test_launch_floor_bounds_the_layers_gpu_work_from_below_and_stage_terms_add_on_top():
    spec = make_spec(pp=2, devices=("h100", "l4"), layers=(2, 2))
    gpu = plain_model().pipeline(spec)  # roofline (a "layers" term) + links
    floor = 3.0  # ms for two layers: above the H100's GEMM time, below nothing the L4 does at h=4096
    model = with_term("layer_launch_floor", forward_ms_per_layer=1.5, backward_ms_per_layer=1.5)
    bounded = model.pipeline(spec)
    for g, b in zip(gpu.stages, bounded.stages):
        assert b.forward_ms == pytest.approx(max(g.forward_ms, floor))
        assert b.backward_ms == pytest.approx(max(g.backward_ms, floor))
    big = make_spec(pp=2, devices=("h100", "l4"), layers=(2, 2), hidden=4096)
    gpu_big, bounded_big = plain_model().pipeline(big), model.pipeline(big)
    assert bounded_big.stages[1].forward_ms == pytest.approx(gpu_big.stages[1].forward_ms)  # GPU-bound: no change
    # A stage-scope term (the output layer) adds on top of the bounded layers.
    both = model.with_term(ActiveTerm(TERMS["output_layer_loss"], tuple(TERMS["output_layer_loss"].defaults().items())))
    head = both.pipeline(spec).stages[1].forward_ms - bounded.stages[1].forward_ms
    assert head > 0 and head == pytest.approx(added("output_layer_loss", spec).stages[1].forward_ms)


def test_a_per_device_override_prices_only_that_device_and_round_trips(tmp_path):
    text = PLAIN_MODEL_TOML.replace("[terms.link_transfer]", '[terms.link_transfer]\n\n[terms.layer_launch_floor]\n'
                                    'forward_ms_per_layer = 1.0\n"forward_ms_per_layer@a10g" = 2.0\n')
    model = parse_model(text, origin="m.toml", catalog=load_catalog())
    spec = make_spec(pp=3, devices=("h100", "a10g", "l4"), layers=(2, 2, 2))
    forwards = [s.forward_ms for s in model.pipeline(spec).stages]
    assert forwards[1] == pytest.approx(4.0) and forwards[0] == pytest.approx(2.0)
    assert forwards[2] == pytest.approx(max(2.0, plain_model().pipeline(spec).stages[2].forward_ms))
    path = tmp_path / "m.toml"
    write_model(path, model)
    assert load_model(path) == model and '"forward_ms_per_layer@a10g" = 2.0' in path.read_text()
    # The additive dispatch time per layer is the software stack's and its host's: a per-device value prices only
    # that device's stages (the A100 runs' Megatron-DeepSpeed on a DGX host), the others keep the shared one.
    dispatch = parse_model(text.replace("[terms.layer_launch_floor]", "[terms.layer_dispatch_floor]"),
                           origin="m.toml", catalog=load_catalog())
    shared = parse_model(text.replace("[terms.layer_launch_floor]", "[terms.layer_dispatch_floor]").replace(
        '"forward_ms_per_layer@a10g" = 2.0\n', ""), origin="m.toml", catalog=load_catalog())
    deltas = [a.forward_ms - b.forward_ms for a, b in zip(dispatch.pipeline(spec).stages, shared.pipeline(spec).stages)]
    assert deltas == pytest.approx([0.0, 2 * (2.0 - 1.0), 0.0])


def test_collective_efficiency_scales_the_all_reduce_bandwidth():
    pair = make_spec(pp=2, devices=("a10g", "l4"), links=(LinkFit(0, 1, 0.0, 1.2e6),))
    full = with_term("embedding_grad_allreduce").pipeline(pair).pre_optimizer_ms
    slower = with_term("embedding_grad_allreduce", collective_efficiency=0.8).pipeline(pair).pre_optimizer_ms
    assert slower == pytest.approx(full / 0.8)
